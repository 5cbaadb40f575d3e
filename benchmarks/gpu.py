"""GPU training throughput: buildtrain's deterministic train step against plain eager loops.

Contenders, alternated, each in a fresh process, at the GPT-2-small shape (12 layers, width 768,
12 heads, sequence 1024, batch 16, bf16 autocast, byte vocabulary):

  bt run             buildtrain's train step as `bt run` executes it (deterministic algorithms,
                     cuBLAS workspace pinned, per-update checksums, the default digest cadence),
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

With --compile the two loops also run through torch.compile, and `bt run` with
numerics.compile = true.

Without CUDA the script says so and exits 0. `--device cpu` runs the same contenders on the CPU
at a small shape (width 128, 2 layers, sequence 128), to check the script itself anywhere.

Goals (issue 11, H100-class GPU): bt run >= 0.85 x the reference GPT eager; with compile >= 1.0 x.
Issue 26: the plain loop >= 1.0 x the previous layout (the layout change must not cost the GPU).

Run: python benchmarks/gpu.py [--quick] [--compile] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
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
from reference_models import nanogpt, previous_layout  # noqa: E402

GOAL_EAGER, GOAL_COMPILED = 0.85, 1.0
SHAPES = {
    "cuda": {"dim": 768, "layers": 12, "heads": 12, "hidden": 2048, "seq": 1024, "batch": 16},
    "cpu": {"dim": 128, "layers": 2, "heads": 4, "hidden": 352, "seq": 128, "batch": 8},
}
VOCAB = 257


# -- the child processes of the two loops (torch only here) ----------------------------------------


def child(spec: dict[str, Any]) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, spec["src"])
    from buildtrain.config.schema import ModelConfig
    from buildtrain.steps.train.model import Transformer

    shape, device = spec["shape"], torch.device(spec["device"])
    generator = torch.Generator().manual_seed(0)
    config = ModelConfig(
        dim=shape["dim"],
        n_layers=shape["layers"],
        n_heads=shape["heads"],
        n_kv_heads=shape["heads"],
        ffn_hidden=shape["hidden"],
    )
    if spec["model"] == "reference":
        model = nanogpt(shape["dim"], shape["layers"], shape["heads"], shape["seq"], VOCAB)
    elif spec["model"] == "previous":
        model = previous_layout(config, VOCAB, generator)
    else:
        model = Transformer.build(config, VOCAB, generator)
    model.to(device)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **fused)
    forward = torch.compile(model) if spec["compile"] else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    batch, seq = shape["batch"], shape["seq"]
    timings: list[float] = []
    for update in range(spec["warmup"] + spec["steps"]):
        rows = torch.randint(0, VOCAB, (batch, seq + 1), generator=generator)
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
    return {"tokens_per_s": batch * seq / median(timings)}


# -- the parent --------------------------------------------------------------------------------------


def loop_contender(space: Workspace, name: str, spec: dict[str, Any]) -> tuple[str, Callable[[], float]]:
    def measure() -> float:
        done = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            env=space.env(),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        return float(json.loads(done.stdout.splitlines()[-1])["tokens_per_s"])

    return name, measure


def bt_contender(
    space: Workspace, name: str, device: str, shape: dict[str, int], steps: int, compiled: bool
) -> tuple[str, Callable[[], float]]:
    seeds = iter(range(1000, 1_000_000))
    sets = [
        f"model.dim={shape['dim']}",
        f"model.n_layers={shape['layers']}",
        f"model.n_heads={shape['heads']}",
        f"model.n_kv_heads={shape['heads']}",
        f"model.ffn_hidden={shape['hidden']}",
        f"train.seq_len={shape['seq']}",
        f"train.batch_size={shape['batch']}",
        f"train.micro_batch_size={shape['batch']}",
        f"train.steps={steps}",
        f"train.checkpoint_every={steps}",
        "train.warmup_steps=0",
        f"numerics.device='{device}'",
        f"numerics.dtype='{'bfloat16' if device == 'cuda' else 'float32'}'",
        f"eval.seq_len={shape['seq']}",
    ]
    if compiled:
        sets.append("numerics.compile=true")

    def measure() -> float:
        plan = space.plan(TINY, *sets, f"train.seed={next(seeds)}")
        experiments = space.path("experiments", f"{name.replace(' ', '-')}-{plan[:12]}")
        run = ["run", plan, "--target", "train:main", "--progress", "off", "--log-every", "1"]
        space.run_bt(*run, experiments=experiments)
        return updates_per_second(experiments)

    return name, measure


def main() -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--compile", action="store_true", help="also the torch.compile contenders")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one loop contender
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.device == "cuda" and not cuda_available():
        print(
            "gpu.py: skipped: no CUDA device here (torch.cuda.is_available() is False); run it on a "
            "machine with a GPU, or with --device cpu to check the script"
        )
        return 0
    n = rounds(args, quick=1, full=3)
    shape = SHAPES[args.device]
    steps = 10 if args.quick else (60 if args.device == "cuda" else 20)
    warmup = 3
    with workspace("gpu", args) as space:
        print_header(f"training throughput on {args.device}: bt run vs eager loops", args, space)
        src = str(space.src or space.root)
        base = {"device": args.device, "shape": shape, "steps": steps, "warmup": warmup, "src": src}
        contenders = [
            bt_contender(space, "bt run", args.device, shape, steps + warmup, compiled=False),
            loop_contender(space, "plain loop", {**base, "model": "buildtrain", "compile": False}),
            loop_contender(space, "previous layout", {**base, "model": "previous", "compile": False}),
            loop_contender(space, "reference GPT", {**base, "model": "reference", "compile": False}),
        ]
        if args.compile:
            contenders += [
                bt_contender(space, "bt run, compiled", args.device, shape, steps + warmup, compiled=True),
                loop_contender(
                    space, "plain loop, compiled", {**base, "model": "buildtrain", "compile": True}
                ),
                loop_contender(
                    space, "previous layout, compiled", {**base, "model": "previous", "compile": True}
                ),
                loop_contender(
                    space, "reference GPT, compiled", {**base, "model": "reference", "compile": True}
                ),
            ]
        note("building the data step once")
        space.run_bt(
            "run", space.plan(TINY, "train.steps=1", "train.warmup_steps=0"), "--target", "data:main"
        )
        results = alternate(contenders, n)
        reference = median(results["reference GPT"])
        rows = [
            [
                name,
                f"{median(v):,.0f}",
                f"{min(v):,.0f}..{max(v):,.0f}",
                fmt_ratio(ratio(median(v), reference)),
            ]
            for name, v in results.items()
        ]
        print_table(
            f"tokens/s, median of {n} runs ({steps} timed updates each; {json.dumps(shape)})",
            ["contender", "tokens/s", "min..max", "vs reference GPT eager"],
            rows,
        )
        eager = ratio(median(results["bt run"]), reference)
        layout = ratio(median(results["plain loop"]), median(results["previous layout"]))
        goals = [
            goal_line(
                f"bt run >= {GOAL_EAGER}x the reference GPT, eager", eager >= GOAL_EAGER, fmt_ratio(eager)
            ),
            goal_line(
                "the model layout >= 1.0x the previous layout (plain loops, eager)",
                layout >= 1.0,
                fmt_ratio(layout),
            ),
        ]
        if args.compile:
            compiled = ratio(median(results["bt run, compiled"]), reference)
            met = compiled >= GOAL_COMPILED
            goals.append(
                goal_line(
                    f"bt run compiled >= {GOAL_COMPILED}x the reference GPT, eager", met, fmt_ratio(compiled)
                )
            )
        if args.device == "cpu":
            goals.append("  info    on the CPU the goals are not the point: this run checks the script")
        print_goals(goals)
    return 0


def cuda_available() -> bool:
    """Asked in a child process, so that this one never initializes CUDA or imports torch."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


if __name__ == "__main__":
    sys.exit(main())
