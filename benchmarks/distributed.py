"""Distributed training: throughput of the `invariant` reduction against `allreduce`.

Each round trains four contenders, alternated, on presets/tiny.toml with four micro-batches of 4
sequences per update (train.micro_batch_size = 4), and (without --quick) again on a wider model
(width 256, 4 layers, about 3.0M parameters), where the exchange moves more data:

  invariant, 2 processes   the fixed-order tree: micro-batch gradients summed in a tree on each
                           rank, partial sums exchanged by all_to_all, the tree finished shard by
                           shard, shards all_gathered; the weights equal those of 1 process
  allreduce, 2 processes   the micro-batches of a rank accumulated by autograd, then one
                           all-reduce; the world size is part of the plan hash
  invariant, 1 process     the same tree in a single process (no torchrun)
  allreduce, 1 process     plain gradient accumulation, the loop before distributed support

Every contender runs a new plan (a new train.seed, so nothing is cached) with `--target train:main`,
and the measure is the median tokens/s of its updates as rank 0 logs them (train_step events in the
run record), leaving out the first updates, where the processes are still warming up. Start-up
(torchrun, `import torch` on every rank) is reported separately, as the median wall time of the
whole `bt run`.

On this 2-core machine two processes of one thread each do the work one process does with two
threads, so the 2-process rows show the cost of the exchange, not a speed-up.

Run-to-run noise on a shared machine is larger than the tree's own cost in one process, so a last
table measures that in this process: one model, the two reductions alternated update by update
(forward, backward, reduction, clipping, AdamW step), at 2, 4 and 8 micro-batches.

Run: python benchmarks/distributed.py [--quick] [--one-process]
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    TINY,
    WARM_UPDATES,
    WIDE,
    Workspace,
    alternate,
    fmt_ratio,
    fmt_seconds,
    fmt_spread,
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

MICRO_BATCHES = ("train.micro_batch_size=4",)


def compare(space: Workspace, n: int, size: str, overrides: list[str], steps: int) -> float:
    """Alternate the four contenders on one model size; print their table; the invariant/allreduce
    ratio at 2 processes."""
    seeds = iter(range(1000, 1_000_000))
    walls: dict[str, list[float]] = {}

    def contender(reduction: str, nproc: int) -> tuple[str, Callable[[], float]]:
        name = f"{reduction}, {nproc} process{'es' if nproc > 1 else ''}"

        def measure() -> float:
            sets = [f"train.seed={next(seeds)}", f"train.steps={steps}", f"train.reduction='{reduction}'"]
            flags = [part for value in [*sets, *MICRO_BATCHES, *overrides] for part in ("--set", value)]
            _, planned = space.run_bt("plan", "-q", str(TINY), *flags, "--nproc", str(nproc))
            plan = planned.stdout.strip()
            experiments = space.path("experiments", f"{size}-{reduction}-{nproc}-{plan[:12]}")
            seconds, _ = space.run_bt(
                "run",
                plan,
                "--target",
                "train:main",
                "--progress",
                "off",
                "--log-every",
                "1",
                "--nproc",
                str(nproc),
                experiments=experiments,
            )
            walls.setdefault(name, []).append(seconds)
            return updates_per_second(experiments)

        return name, measure

    contenders = [
        contender("invariant", 2),
        contender("allreduce", 2),
        contender("invariant", 1),
        contender("allreduce", 1),
    ]
    note(f"{size}: {n} alternating rounds of {len(contenders)} runs, {steps} updates each")
    results = alternate(contenders, n)
    base = median(results["allreduce, 2 processes"])
    single = median(results["allreduce, 1 process"])
    rows = []
    for name, values in results.items():
        rows.append(
            [
                name,
                f"{median(values):,.0f}",
                f"{min(values):,.0f}..{max(values):,.0f}",
                fmt_ratio(ratio(median(values), base)),
                fmt_ratio(ratio(median(values), single)),
                fmt_seconds(median(walls[name][-n:])),
                fmt_spread(walls[name][-n:]),
            ]
        )
    print_table(
        f"{size}: training throughput, tokens/s (median of {n} runs, each the median of its updates "
        f"{WARM_UPDATES + 1}..{steps})",
        [
            "contender",
            "tokens/s",
            "min..max",
            "vs allreduce x2",
            "vs allreduce x1",
            "bt run wall",
            "min..max",
        ],
        rows,
    )
    return ratio(median(results["invariant, 2 processes"]), base)


def in_one_process(space: Workspace, n: int) -> None:
    """The tree's own cost, without processes or start-up: one model, one process, the two
    reductions alternated update by update (forward, backward, reduction, clip, AdamW step)."""
    space.import_buildtrain()
    from buildtrain.executor.process import numerics

    threads = os.cpu_count() or 1
    os.environ.update(numerics.environment("portable", "cpu", threads))  # before torch loads
    import torch

    from buildtrain.config.schema import BYTE_VOCAB_SIZE, ModelConfig, TrainConfig
    from buildtrain.steps.train.gradient import batch_gradient, seeded
    from buildtrain.steps.train.model import Transformer
    from buildtrain.steps.train.optimizer import AdamW
    from buildtrain.steps.train.ranks import Ranks
    from buildtrain.steps.train.setup import TrainSetup
    from buildtrain.steps.train.trainer import param_groups

    torch.set_num_threads(threads)

    class RandomTokens:
        def micro_batch(self, cursor: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = torch.randint(0, 256, (size, 65), generator=torch.Generator().manual_seed(micro))
            return tokens[:, :-1], tokens[:, 1:]

    rows = []
    updates = 10 * n
    for size, overrides in (("tiny", {}), ("wide", {"dim": 256, "n_layers": 4, "ffn_hidden": 704})):
        model_config = ModelConfig(
            **{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 176, **overrides}
        )
        model = Transformer.build(model_config, BYTE_VOCAB_SIZE, seeded(0, "init"))
        optimizer = AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
        for micro_batches in (2, 4, 8):
            times: dict[str, list[float]] = {"allreduce": [], "invariant": []}
            note(f"  in one process: {size}, {micro_batches} micro-batches, {updates} updates each")
            for update in range(updates):
                for reduction, samples in times.items():
                    train = TrainConfig(
                        batch_size=16, micro_batch_size=16 // micro_batches, seq_len=64, reduction=reduction
                    )
                    job = TrainSetup(
                        model=model_config,
                        train=train,
                        eval=None,
                        device="cpu",
                        dtype="float32",
                        data=Path(),
                        index={},
                        init_weights=None,
                        work=Path(),
                        identity={},
                    )
                    started = time.perf_counter()
                    batch_gradient(
                        model,
                        RandomTokens(),
                        0,
                        update,
                        job,
                        torch.device("cpu"),
                        contextlib.nullcontext(),
                        Ranks(),
                    )  # type: ignore[arg-type]
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.update()
                    optimizer.zero_grad()
                    samples.append(time.perf_counter() - started)
            plain, tree = median(times["allreduce"]), median(times["invariant"])
            rows.append(
                [
                    f"{size}, {micro_batches} micro-batches",
                    fmt_seconds(plain),
                    fmt_seconds(tree),
                    fmt_ratio(ratio(plain, tree)),
                ]
            )
    print_table(
        f"one process, {threads} threads: an update with plain accumulation vs the invariant tree "
        f"(median of {updates}, alternated update by update)",
        ["model", "accumulate", "tree", "tree throughput vs accumulate"],
        rows,
    )


def main() -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--one-process", action="store_true", help="only the in-process measurement")
    args = parser.parse_args()
    n = rounds(args, quick=2, full=5)
    sizes = [("tiny", [], 20 if args.quick else 40)]
    if not args.quick:
        sizes.append(("wide", WIDE, 20))

    with workspace("distributed", args) as space:
        print_header("distributed training: invariant tree reduction vs all-reduce", args, space)
        if args.one_process:
            in_one_process(space, n)
            return 0
        note("building the data step once")
        warm = space.plan(TINY, "train.steps=1", "train.warmup_steps=0", "train.seed=999999", *MICRO_BATCHES)
        space.run_bt("run", warm, "--progress", "off")
        ratios = [(size, compare(space, n, size, overrides, steps)) for size, overrides, steps in sizes]
        in_one_process(space, n)
        print_goals(
            [
                f"  info    {size}: invariant / allreduce at 2 processes: {fmt_ratio(value)} "
                "(the price of weights that do not depend on the world size)"
                for size, value in ratios
            ]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
