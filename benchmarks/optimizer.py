"""One AdamW update of the GPT-2-like CPU model: buildtrain's against torch.optim.AdamW.

The parameters are those of `throughput.py --shape gpt2` (the model of `model_layout.py`: width
256, 4 layers, 3.4M parameters, in the trainer's two groups, decayed matrices and plain vectors),
with random gradients. Contenders, alternated update by update in one process started with the
`native` numerics environment (the order reversed every other round), CPU time on one thread and
wall time on several:

  buildtrain, fused    buildtrain's AdamW as a step computes it where there is a C compiler: one
                       pass of `bt_adamw` (steps/train/kernels.c) per tensor
  buildtrain, eager    the same AdamW written out with torch._foreach_* (a machine without a
                       compiler, or `numerics.kernels = "eager"`)
  torch, single-tensor torch.optim.AdamW(foreach=False): what nanoGPT's train.py runs on a CPU, and
                       the update the eager path reproduces bit for bit
  torch, fused         torch.optim.AdamW(fused=True) (not used by buildtrain: its vectorized body
                       and its scalar tail round differently, see steps/train/optimizer.py)

Prints the median time of each and its paired ratio to torch's single-tensor update; the speed
of buildtrain's fused update against it is the `update` phase of issue 26's CPU goal.

Run: python benchmarks/optimizer.py [--quick] [--rounds N] [--threads N]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    goal_line,
    in_process_parser,
    measure_in_child,
    median,
    note,
    print_goals,
    print_header,
    print_table,
)

REFERENCE = "torch, single-tensor"
CONTENDERS = ("buildtrain, fused", "buildtrain, eager", REFERENCE, "torch, fused")


def optimizers(model: Any) -> dict[str, Any]:
    """Each contender's update function over `model`'s parameters (with their own state)."""
    import torch

    from buildtrain.steps.train import kernels
    from buildtrain.steps.train.optimizer import AdamW
    from buildtrain.steps.train.trainer import param_groups

    def ours(mode: str) -> Any:
        optimizer = AdamW(param_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95), eps=1e-8)

        def update() -> None:
            kernels.select(mode)
            optimizer.update()

        return update

    def theirs(**how: bool) -> Any:
        groups = [{**group, "params": list(group["params"])} for group in param_groups(model, 0.1)]
        return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, **how).step

    updates = (ours("fused"), ours("eager"), theirs(foreach=False), theirs(fused=True))
    return dict(zip(CONTENDERS, updates, strict=True))


def child(spec: dict[str, Any]) -> dict[str, list[float]]:
    """Seconds of one update of each contender, round by round."""
    import torch
    from model_layout import VARIANTS, build

    from buildtrain.config.schema import BYTE_VOCAB_SIZE

    torch.set_num_threads(spec["threads"])
    model = build(VARIANTS["buildtrain"], BYTE_VOCAB_SIZE)
    generator = torch.Generator().manual_seed(0)
    for parameter in model.parameters():
        parameter.grad = torch.randn(parameter.shape, generator=generator) * 1e-3
    updates = optimizers(model)
    clock = time.process_time if spec["threads"] == 1 else time.perf_counter
    for update in updates.values():  # warm-up: the moments are allocated at the first update
        update()
    times: dict[str, list[float]] = {name: [] for name in updates}
    for round_ in range(spec["rounds"]):
        for name in CONTENDERS if round_ % 2 == 0 else reversed(CONTENDERS):
            started = clock()
            updates[name]()
            times[name].append(clock() - started)
    return times


def report(times: dict[str, list[float]], rounds: int, threads: int) -> float:
    """The table; returns buildtrain's fused update's speed against torch's single-tensor one."""
    rows = []
    for name, values in times.items():
        paired = [ours / theirs for ours, theirs in zip(values, times[REFERENCE], strict=True)]
        rows.append(
            [name, f"{median(values) * 1000:.2f}", f"{median(paired):.3f}", f"{1 / median(paired):.2f}x"]
        )
    print_table(
        f"one AdamW update, {'CPU' if threads == 1 else 'wall'} ms ({rounds} paired rounds, {threads} threads)",
        ["contender", "median ms", "time / single-tensor's, paired", "speed vs single-tensor"],
        rows,
    )
    fused = [ours / theirs for ours, theirs in zip(times["buildtrain, fused"], times[REFERENCE], strict=True)]
    return 1 / median(fused)


def main() -> int:
    parser = in_process_parser(__doc__)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    rounds = args.rounds or (20 if args.quick else 100)
    print_header("optimizer: one AdamW update, buildtrain's against torch's", args)
    note(f"{rounds} rounds of {len(CONTENDERS)} contenders in one process, {args.threads} threads")
    times = measure_in_child(__file__, args.threads, rounds)
    if times is None:
        return 1
    speed = report(times, rounds, args.threads)
    print_goals(
        [
            goal_line(
                "buildtrain's update >= 1.0 x torch's single-tensor AdamW (issue 26)",
                speed >= 1.0,
                f"{speed:.2f}x",
            )
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
