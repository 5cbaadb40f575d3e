"""Forward and backward of buildtrain's model against the nanoGPT-shaped one, paired update by update.

What `throughput.py --shape gpt2` measures end to end, narrowed to the model, where 95% of an
update's time goes, and measured so that a noisy host cancels out: every contender lives in one
process (started with the `native` numerics environment, so the allocator behaves as in a step
process), and each round times one update of each, forward and backward over the micro-batches of
`throughput.py --shape gpt2` (width 256, 4 layers, 4 heads, sequence 128, 2 micro-batches of 8,
the byte vocabulary), in CPU time on one thread and in wall time on several (CPU time would count
the OpenMP threads that spin between kernels), the order reversed every other round. A host that slows down
for a second slows one round of every contender, so the ratio of each round's pair is steady
where the times are not (on a shared 2-core VM, single updates here ranged 540-930 ms while
paired ratios stayed within a few percent).

Contenders: buildtrain's Transformer as the shape derives it (RMSNorm, SwiGLU of hidden 688, RoPE,
one q/k/v projection) with the kernels a plan here would use (fused where there is a C compiler,
`steps/train/kernels.c`), the same with torch's eager operations instead, with LayerNorm, with a
GELU MLP of 4 x width, with both (what is left is RoPE and the rest of the layout), with both and
no RoPE (q, k and v taken as views of the projection, as nanoGPT takes them: what is left is
buildtrain's code, its untied output and its lack of learned positions), and the nanoGPT-shaped
GPT of `reference_models.py`.
Prints each contender's median time per update and the median (and quartiles) of its paired
ratio to nanoGPT's time; speed is the inverse. Issue 26's goal: buildtrain >= 1.0x nanoGPT's
speed. It imports the installed buildtrain (one process measures a few seconds of code, so there
is no snapshot to take: `--live` changes nothing).

Run: python benchmarks/model_layout.py [--quick] [--rounds N] [--threads N]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import types
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

SHAPE = {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "ffn_hidden": 688}
BATCH, SEQ, MICRO_BATCHES = 8, 128, 2
VARIANTS = {  # contender: overrides of SHAPE (None: the nanoGPT-shaped GPT)
    "buildtrain": {},
    "buildtrain, eager kernels": {"kernels": "eager"},
    "buildtrain, LayerNorm": {"norm": "layernorm"},
    "buildtrain, GELU 4x": {"mlp": "gelu", "ffn_hidden": 4 * SHAPE["dim"]},
    "buildtrain, LayerNorm + GELU 4x": {"norm": "layernorm", "mlp": "gelu", "ffn_hidden": 4 * SHAPE["dim"]},
    "buildtrain, LayerNorm + GELU 4x, no RoPE": {
        "norm": "layernorm",
        "mlp": "gelu",
        "ffn_hidden": 4 * SHAPE["dim"],
        "rope": False,
    },
    "nanoGPT-shaped": None,
}
NOT_CONFIG = ("kernels", "rope")  # overrides of the measurement, not of the model's config
REFERENCE = "nanoGPT-shaped"
GOAL = 1.0


def build(overrides: dict[str, Any] | None, vocab: int) -> Any:
    import torch
    from reference_models import nanogpt

    from buildtrain.config.schema import ModelConfig
    from buildtrain.steps.train.model import Transformer

    if overrides is None:
        torch.manual_seed(0)
        return nanogpt(SHAPE["dim"], SHAPE["n_layers"], SHAPE["n_heads"], SEQ, vocab)
    settings = {key: value for key, value in overrides.items() if key not in NOT_CONFIG}
    config = ModelConfig(**{**SHAPE, **settings})
    model = Transformer.build(config, vocab, torch.Generator().manual_seed(0))
    return model if overrides.get("rope", True) else without_rope(model)


def without_rope(model: Any) -> Any:
    """`model` with q, k and v taken as views of the fused projection, nanoGPT's way: no rotation
    (a different model, trained by nobody: here only to price RoPE's passes)."""

    def views(attention: Any, x: Any, cos: Any, sin: Any) -> tuple[Any, Any, Any]:
        B, T, _ = x.shape
        heads = (attention.n_heads, attention.n_kv_heads, attention.n_kv_heads)
        q, k, v = attention.wqkv(x).view(B, T, -1, attention.head_dim).split(heads, dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    for block in model.blocks:
        block.attention.qkv = types.MethodType(views, block.attention)
    return model


def child(spec: dict[str, Any]) -> dict[str, list[float]]:
    """Seconds (CPU on one thread, wall on more) of one update of each contender, round by round."""
    import torch
    import torch.nn.functional as F

    from buildtrain.config.schema import BYTE_VOCAB_SIZE
    from buildtrain.steps.train import kernels

    torch.set_num_threads(spec["threads"])
    models = {name: build(overrides, BYTE_VOCAB_SIZE) for name, overrides in VARIANTS.items()}
    fused = kernels.mode()  # what a plan on this machine computes with
    clock = time.process_time if spec["threads"] == 1 else time.perf_counter
    tokens = torch.randint(
        0, BYTE_VOCAB_SIZE, (MICRO_BATCHES, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1)
    )

    def update(name: str) -> float:
        model = models[name]
        kernels.select((VARIANTS[name] or {}).get("kernels", fused))
        started = clock()
        for rows in tokens:
            logits = model(rows[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()) / MICRO_BATCHES
            loss.backward()
        for parameter in model.parameters():
            parameter.grad = None
        return clock() - started

    names = list(models)
    for name in names:  # warm-up: first-call allocations and kernel selection
        for _ in range(2):
            update(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(spec["rounds"]):
        for name in names if round_ % 2 == 0 else reversed(names):
            times[name].append(update(name))
    return times


def quartiles(values: list[float]) -> tuple[float, float]:
    low, _, high = statistics.quantiles(values, n=4)
    return low, high


def report(times: dict[str, list[float]], rounds: int, threads: int) -> float:
    """The table; returns buildtrain's speed against nanoGPT's (median paired ratio, inverted)."""
    reference = times[REFERENCE]
    rows, speed = [], float("nan")
    for name, values in times.items():
        paired = [ours / theirs for ours, theirs in zip(values, reference, strict=True)]
        low, high = quartiles(paired)
        if name == "buildtrain":
            speed = 1 / median(paired)
        rows.append(
            [
                name,
                f"{median(values) * 1000:.1f}",
                f"{min(values) * 1000:.0f}..{max(values) * 1000:.0f}",
                f"{median(paired):.3f} ({low:.3f}..{high:.3f})",
                f"{1 / median(paired):.3f}x",
            ]
        )
    print_table(
        f"forward+backward per update, {'CPU' if threads == 1 else 'wall'} ms ({rounds} paired rounds, "
        f"{threads} threads, float32)",
        ["contender", "median ms", "min..max", "time / nanoGPT's, paired (quartiles)", "speed vs nanoGPT"],
        rows,
    )
    return speed


def main() -> int:
    parser = in_process_parser(__doc__)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    rounds = args.rounds or (10 if args.quick else 40)
    print_header("model layout: forward+backward of buildtrain's model vs the nanoGPT-shaped one", args)
    note(f"{rounds} rounds of {len(VARIANTS)} contenders in one process, {args.threads} threads")
    times = measure_in_child(__file__, args.threads, rounds)
    if times is None:
        return 1
    speed = report(times, rounds, args.threads)
    print_goals(
        [
            goal_line(
                f"buildtrain >= {GOAL} x the nanoGPT-shaped model's speed (issue 26)",
                speed >= GOAL,
                f"{speed:.3f}x",
            )
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
