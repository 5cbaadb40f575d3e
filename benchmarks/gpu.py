"""GPU training throughput: buildtrain's deterministic train step against plain eager loops.

Contenders, alternated, each in a fresh process, at the GPT-2-small shape (12 layers, width 768,
12 heads, sequence 1024, batch 16, bf16 autocast, byte vocabulary):

  bt run             buildtrain's train step as `bt run` executes it (deterministic algorithms,
                     cuBLAS workspace as torch requires,
                     per-update fingerprints, the default digest cadence),
                     tokens/s as its log reports them; SwiGLU hidden 2048
  plain loop         buildtrain's Transformer in a hand-written loop: random batches, fused
                     torch AdamW, no determinism settings
  previous layout    the same loop with buildtrain's model as it was before issue 26 (separate
                     q/k/v projections, RoPE on interleaved pairs, F.rms_norm;
                     benchmarks/reference_models.py): the CPU-driven layout change must not cost
                     the GPU what it wins on the CPU
  reference GPT      a nanoGPT-shaped model (benchmarks/reference_models.py: LayerNorm, GELU MLP of 4 x width,
                     learned positions, tied embeddings; about the same FLOPs per token), fused
                     AdamW, no determinism settings: the yardstick of the goals

With --compile the three loops also run through torch.compile, and `bt run` with
numerics.compile = true.

With --sharding, two more contenders train on W processes, W being the GPUs visible (2 processes
on gloo with --device cpu), each rank one micro-batch of batch/W sequences per update (the global
batch stays the same where W divides it), reporting the tokens/s of all ranks together:

  bt run, fsdp       `bt run --nproc W` with train.sharding = "fsdp": FSDP2 with buildtrain's
                     order-invariant gradient exchange in place of its reduce-scatter, the
                     invariant clipping norm, and the rest of bt run's determinism
  plain FSDP2        torchtitan-style: the same Transformer with `fully_shard` on each block and
                     at the root, all FSDP2's defaults (its own reduce-scatter, resharding after
                     forward), torch AdamW (fused on CUDA), clip_grad_norm_, random batches drawn
                     by each rank; started by torchrun (NCCL, one GPU per rank; gloo on the CPU),
                     rank 0 times the updates

Both stay eager with --compile.

With --parts, instead of the contenders, one process times the parts of bt's update apart at the
same shape (benchmarks/gpu_parts.py: forward+backward with determinism off and on, clipping, both
AdamWs, the gradient vector, the per-update record, and the record at GPT-2 small's 124M
parameters against blake3 on the host). It says where `bt run` loses to the plain loop, in about
a minute. With --workspace, forward+backward as bt computes it in fresh processes alternated, with
CUBLAS_WORKSPACE_CONFIG=:4096:8 and without (rounds fitted to --budget).

Every figure is printed the moment it exists (`figure  NAME, round R: VALUE`) and, with
--jsonl FILE, appended to FILE as a JSON line, so a lease that ends mid-run keeps what was
measured. --budget SECONDS plans the rounds to end within that time of the start: a round starts
only if the slowest one so far still fits (the first always runs). Ratios are of the medians of
alternated fresh-process rounds; with fewer than 3 the table says they are indicative, and a
single round is labelled as one sample. --only-compiled runs the compiled contenders with the
eager reference GPT that their goal is measured against. scripts/gpu_check.sh runs the CUDA
tests, --parts, the eager and the compiled contenders in that order within about 8 minutes.

Without CUDA the script says so and exits 0. `--device cpu` runs the same contenders on the CPU
at a small shape (width 128, 2 layers, sequence 128), to check the script itself anywhere.

Goals (issue 11, H100-class GPU): bt run >= 0.85 x the reference GPT eager; with compile >= 1.0 x.
Issue 26: the plain loop >= 1.0 x the previous layout (the layout change must not cost the GPU).
With --sharding, "bt run, fsdp vs plain FSDP2" is reported as a ratio (the issue sets no goal).

Run: python benchmarks/gpu.py [--quick] [--compile | --only-compiled] [--sharding] [--parts]
     [--workspace] [--budget SECONDS] [--jsonl FILE] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    TINY,
    Workspace,
    alternate,
    fmt_ratio,
    goal_line,
    make_parser,
    median,
    note,
    print_goals,
    print_header,
    print_table,
    ratio,
    rounds,
    updates_per_second,
    workspace,
)
from gpu_parts import (  # noqa: E402
    architecture_child,
    parts_child,
    profile_child,
    report_architecture,
    report_parts,
    report_profile,
    report_workspace,
    workspace_child,
)
from reference_models import nanogpt, previous_layout  # noqa: E402

GOAL_EAGER, GOAL_COMPILED = 0.85, 1.0
PAIRED_ROUNDS = 3  # fewest alternated rounds whose median ratio is reported as more than indicative
BUDGET_ROUNDS = 10  # the most rounds --budget plans, unless --rounds says otherwise
CPU_WORLD = 2  # processes of the fsdp contenders with --device cpu (gloo)
SHAPES = {
    "cuda": {"dim": 768, "layers": 12, "heads": 12, "hidden": 2048, "seq": 1024, "batch": 16},
    "cpu": {"dim": 128, "layers": 2, "heads": 4, "hidden": 352, "seq": 128, "batch": 8},
}
VOCAB = 257


# -- the child processes of the loops (torch only here) --------------------------------------------


def child(spec: dict[str, Any]) -> dict[str, float] | None:
    """One loop contender; with spec["world"], plain FSDP2 on that many processes started by
    torchrun, each drawing its own share of the batch. The result is rank 0's (None elsewhere)."""
    import torch

    sys.path.insert(0, spec["src"])
    world = spec.get("world", 0)
    rank, device = join_group(spec["device"]) if world else (0, torch.device(spec["device"]))
    model = build_model(spec).to(device)
    if world:
        shard(model, device, world)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **fused)
    forward = torch.compile(model) if spec["compile"] else model
    sequences = spec["shape"]["batch"] // max(world, 1)  # this process's share of the batch
    data = torch.Generator().manual_seed(1 + rank)  # every rank its own batches
    timings = timed_updates(spec, model, forward, optimizer, device, sequences, data)
    if world:
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank != 0:
        return None
    tokens = sequences * max(world, 1) * spec["shape"]["seq"]  # all ranks' tokens per update
    return {"tokens_per_s": tokens / median(timings)}


def build_model(spec: dict[str, Any]) -> Any:
    """The contender's model on the CPU; buildtrain's layouts draw their weights from seed 0, so
    that every rank of plain FSDP2 starts from the same model before it is sharded."""
    import torch

    from buildtrain.config.schema import ModelConfig
    from buildtrain.steps.train.model import Transformer

    shape = spec["shape"]
    generator = torch.Generator().manual_seed(0)
    config = ModelConfig(
        dim=shape["dim"],
        n_layers=shape["layers"],
        n_heads=shape["heads"],
        n_kv_heads=shape["heads"],
        ffn_hidden=shape["hidden"],
        norm=spec.get("norm", "rmsnorm"),  # --architecture swaps these for the reference's
        mlp=spec.get("mlp", "swiglu"),
    )
    if spec["model"] == "reference":
        return nanogpt(shape["dim"], shape["layers"], shape["heads"], shape["seq"], VOCAB)
    if spec["model"] == "previous":
        return previous_layout(config, VOCAB, generator)
    return Transformer.build(config, VOCAB, generator)


def join_group(device_type: str) -> tuple[int, Any]:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU); (rank, this process's device)."""
    import torch
    import torch.distributed as dist

    device = torch.device(device_type)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), device


def shard(model: Any, device: Any, world: int) -> None:
    """torchtitan's plain FSDP2: each block one unit, the root (embedding, output) another, all
    FSDP2's defaults (its own reduce-scatter, resharding after forward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def timed_updates(
    spec: dict[str, Any],
    model: Any,
    forward: Callable[..., Any],
    optimizer: Any,
    device: Any,
    sequences: int,
    data: Any,
) -> list[float]:
    """Seconds of each update after the warm-up: random batches of `sequences` rows, bf16
    autocast on CUDA, clipping, AdamW, one sync per update."""
    import torch
    import torch.nn.functional as F

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    seq = spec["shape"]["seq"]
    timings: list[float] = []
    for update in range(spec["warmup"] + spec["steps"]):
        rows = torch.randint(0, VOCAB, (sequences, seq + 1), generator=data)
        if device.type == "cuda":
            rows = rows.pin_memory().to(device, non_blocking=True)
        started = time.perf_counter()
        with autocast:
            logits = forward(rows[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # one sync per update, as a logging loop has
        if update >= spec["warmup"]:
            timings.append(time.perf_counter() - started)
    return timings


# -- the parent --------------------------------------------------------------------------------------


def loop_contender(space: Workspace, name: str, spec: dict[str, Any]) -> tuple[str, Callable[[], float]]:
    """A child process of this script; torchrun starts spec["world"] of them where it is set."""
    launch = [sys.executable]
    if spec.get("world"):
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(spec["world"])]

    def measure() -> float:
        done = subprocess.run(
            [*launch, __file__, "--child", json.dumps(spec)],
            env=space.env(),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        # under torchrun the ranks share stdout with torchrun itself: rank 0's result is the JSON line
        results = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not results:
            raise RuntimeError(f"{name} printed no result:\n{done.stdout[-2000:]}")
        return float(json.loads(results[-1])["tokens_per_s"])

    return name, measure


def bt_contender(
    space: Workspace,
    name: str,
    device: str,
    shape: dict[str, int],
    steps: int,
    compiled: bool,
    *,
    world: int = 0,
) -> tuple[str, Callable[[], float]]:
    """`bt run` of a new plan each time; with a world size, train.sharding = "fsdp" on that many
    processes (`--nproc`), each rank one micro-batch of batch/world sequences per update."""
    seeds = iter(range(1000, 1_000_000))
    sets = [
        f"model.dim={shape['dim']}",
        f"model.n_layers={shape['layers']}",
        f"model.n_heads={shape['heads']}",
        f"model.n_kv_heads={shape['heads']}",
        f"model.ffn_hidden={shape['hidden']}",
        f"train.seq_len={shape['seq']}",
        f"train.batch_size={shape['batch']}",
        f"train.micro_batch_size={shape['batch'] // max(world, 1)}",
        f"train.steps={steps}",
        f"train.checkpoint_every={steps}",
        "train.warmup_steps=0",
        f"numerics.device='{device}'",
        f"numerics.dtype='{'bfloat16' if device == 'cuda' else 'float32'}'",
        f"eval.seq_len={shape['seq']}",
    ]
    if compiled:
        sets.append("numerics.compile=true")
    if world:
        sets.append("train.sharding='fsdp'")

    def measure() -> float:
        plan = space.plan(TINY, *sets, f"train.seed={next(seeds)}")
        experiments = space.path("experiments", f"{name.replace(' ', '-')}-{plan[:12]}")
        run = ["run", plan, "--target", "train:main", "--progress", "off", "--log-every", "1"]
        if world:
            run += ["--nproc", str(world)]
        space.run_bt(*run, experiments=experiments)
        return updates_per_second(experiments)

    return name, measure


def main() -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--compile", action="store_true", help="also the torch.compile contenders")
    parser.add_argument(
        "--sharding",
        action="store_true",
        help="also FSDP2 on every GPU here (2 processes with --device cpu): "
        "bt run with train.sharding = 'fsdp' against a plain FSDP2 loop",
    )
    parser.add_argument(
        "--parts",
        action="store_true",
        help="instead of the contenders, time the parts of bt's update apart (about a minute)",
    )
    parser.add_argument(
        "--workspace",
        action="store_true",
        help="instead of the contenders, forward+backward with and without CUBLAS_WORKSPACE_CONFIG=:4096:8, "
        "fresh processes alternated",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of the contenders, torch.profiler's kernel tables of forward+backward: the plain "
        "loop's, bt's loss with torch's defaults, bt's with the step process's settings",
    )
    parser.add_argument(
        "--architecture",
        action="store_true",
        help="instead of the contenders, forward+backward of the reference GPT and of buildtrain's model "
        "with its norm, MLP or RoPE swapped for the reference's: where the plain loop's distance comes from",
    )
    parser.add_argument(
        "--only-compiled",
        action="store_true",
        help="the torch.compile contenders and the eager reference GPT alone (their goal's yardstick)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="plan the rounds to end within SECONDS of the start (at least one round; at most --rounds, default 10)",
    )
    parser.add_argument(
        "--jsonl", metavar="FILE", help="append each figure to FILE as a JSON line, the moment it exists"
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one loop contender
    args = parser.parse_args()
    started = time.monotonic()
    if args.child:
        spec = json.loads(args.child)
        if spec.get("parts"):
            result: dict[str, float] | None = parts_child(spec, build_model)
        elif spec.get("workspace"):
            result = workspace_child(spec, build_model)
        elif spec.get("profile"):
            result = profile_child(spec, build_model)
        elif spec.get("architecture"):
            result = architecture_child(spec, build_model)
        else:
            result = child(spec)
        if result is not None:  # rank 0's, under torchrun
            print(json.dumps(result))
        return 0
    gpus = cuda_devices() if args.device == "cuda" else 0
    if args.device == "cuda" and not gpus:
        print(
            "gpu.py: skipped: no CUDA device here (torch.cuda.is_available() is False); run it on a "
            "machine with a GPU, or with --device cpu to check the script"
        )
        return 0
    world = (gpus if args.device == "cuda" else CPU_WORLD) if args.sharding else 0
    n = (args.rounds or BUDGET_ROUNDS) if args.budget else rounds(args, quick=1, full=3)
    figures = Figures(args.jsonl, args.device)
    steps = 10 if args.quick else (60 if args.device == "cuda" else 20)
    with workspace("gpu", args) as space:
        print_header(f"training throughput on {args.device}: bt run vs eager loops", args, space)
        src = str(space.src or space.root)
        base = {"device": args.device, "shape": SHAPES[args.device], "steps": steps, "warmup": 3, "src": src}
        base["vocab"] = VOCAB
        if args.parts:
            report_parts(__file__, space, base, figures.add)
            return 0
        if args.profile:
            report_profile(__file__, space, base, figures.add)
            return 0
        if args.architecture:
            report_architecture(__file__, space, base, figures.add)
            return 0
        if args.workspace:
            deadline = started + args.budget if args.budget else None
            report_workspace(__file__, space, base, n, deadline, figures.add)
            return 0
        contenders = chosen_contenders(space, base, args)
        if world:
            contenders += sharded_contenders(space, base, world)
        note("building the data step once")
        space.run_bt(
            "run", space.plan(TINY, "train.steps=1", "train.warmup_steps=0"), "--target", "data:main"
        )
        # No warm-up round: every contender times only the updates after its own in-process
        # warm-up, so start-up, compilation and library loading are outside what it measures (a
        # discarded round doubled the time of --compile, past a 15-minute GPU lease).
        deadline = started + args.budget if args.budget else None
        results = alternate(contenders, n, warmup=0, on_value=figures.add, deadline=deadline)
        report(results, base, world)
        goals = goal_lines(results)
        if world:
            fsdp = ratio(median(results["bt run, fsdp"]), median(results["plain FSDP2"]))
            goals.append(f"  info    bt run, fsdp vs plain FSDP2: {fmt_ratio(fsdp)}")
        if args.device == "cpu":
            goals.append("  info    on the CPU the goals are not the point: this run checks the script")
        print_goals(goals)
    return 0


class Figures:
    """Each measurement printed (stdout, flushed) and appended to a JSON-lines file the moment it
    exists, so that a GPU lease that ends mid-run still leaves every figure taken so far."""

    def __init__(self, path: str | None, device: str) -> None:
        self.path, self.device = path, device

    def add(self, name: str, round_: int, value: float, unit: str = "tokens/s") -> None:
        print(f"figure  {name}, round {round_}: {value:,.2f} {unit}", flush=True)
        if self.path is None:
            return
        line = {"contender": name, "round": round_, "value": value, "unit": unit, "device": self.device}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line, sort_keys=True) + "\n")


def chosen_contenders(
    space: Workspace, base: dict[str, Any], args: argparse.Namespace
) -> list[tuple[str, Callable[[], float]]]:
    """Eager (the default), eager and compiled (--compile), or the compiled ones with the eager
    reference GPT that their goal is measured against (--only-compiled)."""
    if args.only_compiled:  # the goal's two first: a lease cut short still yields its ratio
        reference = loop_contender(space, "reference GPT", {**base, "model": "reference", "compile": False})
        bt_run, *loops = eager_contenders(space, base, compiled=True)
        return [bt_run, reference, *loops]
    contenders = eager_contenders(space, base, compiled=False)
    if args.compile:
        contenders += eager_contenders(space, base, compiled=True)
    return contenders


def eager_contenders(
    space: Workspace, base: dict[str, Any], compiled: bool
) -> list[tuple[str, Callable[[], float]]]:
    """bt run and the three loops on one process, eager or (compiled) through torch.compile."""
    suffix = ", compiled" if compiled else ""
    bt_steps = base["steps"] + base["warmup"]
    loops = [("plain loop", "buildtrain"), ("previous layout", "previous"), ("reference GPT", "reference")]
    return [
        bt_contender(space, f"bt run{suffix}", base["device"], base["shape"], bt_steps, compiled),
        *(
            loop_contender(space, f"{name}{suffix}", {**base, "model": model, "compile": compiled})
            for name, model in loops
        ),
    ]


def sharded_contenders(
    space: Workspace, base: dict[str, Any], world: int
) -> list[tuple[str, Callable[[], float]]]:
    """bt run with train.sharding = "fsdp" and plain FSDP2, both on `world` processes with the
    same global batch, each rank one micro-batch of batch/world sequences per update."""
    shape = {**base["shape"], "batch": sharded_batch(base["shape"]["batch"], world)}
    bt_steps = base["steps"] + base["warmup"]
    spec = {**base, "shape": shape, "model": "buildtrain", "compile": False, "world": world}
    return [
        bt_contender(space, "bt run, fsdp", base["device"], shape, bt_steps, compiled=False, world=world),
        loop_contender(space, "plain FSDP2", spec),
    ]


def sharded_batch(batch: int, world: int) -> int:
    """The sharded contenders' global batch: the others' where the world size divides it, else
    the multiple of the world size below it (at least one sequence per rank)."""
    return max(1, batch // world) * world


def report(results: dict[str, list[float]], base: dict[str, Any], world: int) -> None:
    n = min(len(values) for values in results.values())
    reference = median(results["reference GPT"])
    rows = [
        [name, f"{median(v):,.0f}", f"{min(v):,.0f}..{max(v):,.0f}", fmt_ratio(ratio(median(v), reference))]
        for name, v in results.items()
    ]
    shape = base["shape"]
    runs = "a single round: one sample each, no median" if n == 1 else f"median of {n} alternated rounds"
    print_table(
        f"tokens/s, {runs} ({base['steps']} timed updates each; {json.dumps(shape)})",
        ["contender", "tokens/s", "min..max", "vs reference GPT eager"],
        rows,
    )
    if n < PAIRED_ROUNDS:
        print(f"ratios from {n} round(s): indicative; a ratio to rely on takes at least {PAIRED_ROUNDS}")
    if world:
        batch = sharded_batch(shape["batch"], world)
        how = "one per GPU, NCCL" if base["device"] == "cuda" else "gloo"
        print(
            f"fsdp rows: {world} processes ({how}), a global batch of {batch} sequences "
            f"({batch // world} per rank per update); tokens/s of all ranks together"
        )


def goal_lines(results: dict[str, list[float]]) -> list[str]:
    """The goals whose contenders ran (--only-compiled has no eager bt run or layout pair)."""
    reference = median(results["reference GPT"])
    goals = []
    if "bt run" in results:
        eager = ratio(median(results["bt run"]), reference)
        goals.append(
            goal_line(
                f"bt run >= {GOAL_EAGER}x the reference GPT, eager", eager >= GOAL_EAGER, fmt_ratio(eager)
            )
        )
    if "plain loop" in results:
        layout = ratio(median(results["plain loop"]), median(results["previous layout"]))
        goals.append(
            goal_line(
                "the model layout >= 1.0x the previous layout (plain loops, eager)",
                layout >= 1.0,
                fmt_ratio(layout),
            )
        )
    if "bt run, compiled" in results:
        compiled = ratio(median(results["bt run, compiled"]), reference)
        goals.append(
            goal_line(
                f"bt run compiled >= {GOAL_COMPILED}x the reference GPT, eager",
                compiled >= GOAL_COMPILED,
                fmt_ratio(compiled),
            )
        )
    return goals


def cuda_devices() -> int:
    """How many CUDA devices torch sees (0: none). Asked in a child process, so that this one
    never initializes CUDA or imports torch."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    lines = done.stdout.split()
    return int(lines[-1]) if done.returncode == 0 and lines and lines[-1].isdigit() else 0


if __name__ == "__main__":
    sys.exit(main())
