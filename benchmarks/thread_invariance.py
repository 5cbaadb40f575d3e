"""Thread invariance of the portable profile: why it computes on one thread per process, and what
that costs against the alternatives.

Part 1, the op census (candidate "invariant kernels"): each kernel an update uses, on tensors above
ATen's 32,768-element split threshold, computed in one fresh process started with the portable
environment (MKL CNR strict, ATen and oneDNN capped at AVX2), at 1, 2, 3, 4, 8 and 16 intra-op
threads; a kernel is thread-invariant when every count gives the bits of one thread. Keeping
intra-op threads would need every failing kernel replaced (attention included) and every future
one checked.

Part 2, throughput (median tokens/s of the updates as rank 0 logs them, alternated runs, each a
new plan with `--target train:main`), at T = all cores:

  portable, chosen   `bt run --threads T`: a large train step runs as single-threaded ranks (as
                     many as divide its micro-batches), a small one on one process and thread;
                     bits independent of T by construction
  portable, 1 x 1    one process, one thread (what a small step gets)
  native, 1 x T      one process with T intra-op threads: the speed intra-op threading would give,
                     but its bits depend on T (the thread count is in a native plan's hash)

on presets/tiny.toml with four micro-batches and on a 3.0M-parameter variant (width 256, 4 layers).

Run: python benchmarks/thread_invariance.py [--quick] [--threads T]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    TINY,
    WIDE,
    Workspace,
    alternate,
    fmt_ratio,
    fmt_seconds,
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

CENSUS_THREADS = (1, 2, 3, 4, 8, 16)
MICRO_BATCHES = ("train.micro_batch_size=4",)

# Runs in a child whose environment holds the portable settings (read when torch loads).
CENSUS = textwrap.dedent(
    """
    import json, sys
    import torch, torch.nn.functional as F
    import blake3

    torch.use_deterministic_algorithms(True)
    g = torch.Generator().manual_seed(0)
    def randn(*shape): return torch.randn(*shape, generator=g)
    x, big, rows = randn(90112), randn(2_000_000), randn(256, 1024)
    logits, targets = randn(4096, 257), torch.randint(0, 257, (4096,), generator=g)
    q, k, v = (randn(4, 4, 256, 32) for _ in range(3))
    index = torch.randint(0, 257, (64, 128), generator=g)
    table = randn(257, 128)

    def grad(fn, *inputs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        fn(*leaves).sum().backward()
        return torch.cat([t.grad.flatten() for t in leaves])

    OPS = {
        "silu": lambda: F.silu(x),
        "silu backward": lambda: grad(F.silu, x),
        "sigmoid": lambda: torch.sigmoid(x),
        "exp": lambda: x.exp(),
        "gelu": lambda: F.gelu(x),
        "rsqrt": lambda: x.abs().rsqrt(),
        "sum, 90k elements": lambda: x.sum(),
        "sum, 2M elements": lambda: big.sum(),
        "vector norm, 2M": lambda: torch.linalg.vector_norm(big),
        "row mean (RMSNorm)": lambda: rows.pow(2).mean(-1),
        "matmul": lambda: rows @ rows.t(),
        "cross entropy + backward": lambda: grad(lambda a: F.cross_entropy(a, targets), logits),
        "attention (SDPA)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "attention backward": lambda: grad(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v),
        "embedding backward": lambda: grad(lambda w: F.embedding(index, w).pow(2), table),
    }
    found = {}
    for threads in json.loads(sys.argv[1]):
        torch.set_num_threads(threads)
        found[threads] = {name: blake3.blake3(op().detach().contiguous().numpy().tobytes()).hexdigest() for name, op in OPS.items()}
    print(json.dumps(found))
    """
)


def op_census(space: Workspace) -> int:
    """Print which kernels change with the thread count; return how many do."""
    from_env = {k: v for k, v in space.env().items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    sys.path.insert(0, str(space.src or ""))
    from buildtrain.executor.process.numerics import PORTABLE_CPU

    env = {**from_env, **PORTABLE_CPU}
    done = subprocess.run(
        [sys.executable, "-c", CENSUS, json.dumps(CENSUS_THREADS)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    found = {int(k): v for k, v in json.loads(done.stdout).items()}
    rows, failing = [], 0
    for name in found[1]:
        differ = [t for t in CENSUS_THREADS if found[t][name] != found[1][name]]
        failing += bool(differ)
        rows.append([name, "identical" if not differ else "differs at " + ", ".join(map(str, differ))])
    print_table(
        f"op census under the portable environment: bits at {list(CENSUS_THREADS)} intra-op threads vs 1",
        ["kernel", "result"],
        rows,
    )
    return failing


def compare(space: Workspace, n: int, size: str, overrides: list[str], steps: int, threads: int) -> float:
    """Alternate the contenders on one model size; print their table; return chosen / native."""
    seeds = iter(range(1000, 1_000_000))
    walls: dict[str, list[float]] = {}

    def contender(name: str, profile: str, run_threads: int) -> tuple[str, Callable[[], float]]:
        def measure() -> float:
            sets = [f"train.seed={next(seeds)}", f"train.steps={steps}", f"numerics.profile='{profile}'"]
            if profile == "native":
                sets.append(f"numerics.threads={run_threads}")
            flags = [part for value in [*sets, *MICRO_BATCHES, *overrides] for part in ("--set", value)]
            _, planned = space.run_bt("plan", "-q", str(TINY), *flags)
            plan = planned.stdout.strip()
            experiments = space.path("experiments", f"{size}-{profile}-{run_threads}-{plan[:12]}")
            run = ["run", plan, "--target", "train:main", "--progress", "off", "--log-every", "1"]
            if profile == "portable":
                run += ["--threads", str(run_threads)]
            seconds, _ = space.run_bt(*run, experiments=experiments)
            walls.setdefault(name, []).append(seconds)
            return updates_per_second(experiments)

        return name, measure

    contenders = [
        contender(f"portable, chosen (--threads {threads})", "portable", threads),
        contender("portable, 1 process x 1 thread", "portable", 1),
        contender(f"native, 1 process x {threads} threads", "native", threads),
    ]
    note(f"{size}: {n} alternating rounds of {len(contenders)} runs, {steps} updates each")
    results = alternate(contenders, n)
    base = median(results[contenders[2][0]])
    rows = [
        [
            name,
            f"{median(values):,.0f}",
            f"{min(values):,.0f}..{max(values):,.0f}",
            fmt_ratio(ratio(median(values), base)),
            fmt_seconds(median(walls[name][-n:])),
        ]
        for name, values in results.items()
    ]
    print_table(
        f"{size}: training throughput, tokens/s (median of {n} runs)",
        ["contender", "tokens/s", "min..max", "vs native 1 x T", "bt run wall"],
        rows,
    )
    return ratio(median(results[contenders[0][0]]), base)


def main() -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="T: cores to use")
    parser.add_argument("--census-only", action="store_true", help="only part 1")
    args = parser.parse_args()
    n = rounds(args, quick=2, full=5)
    sizes = [("tiny", [], 20 if args.quick else 40)]
    if not args.quick:
        sizes.append(("3.0M parameters", WIDE, 40))  # 8e11 FLOP: large enough for ranks

    with workspace("thread-invariance", args) as space:
        print_header("thread invariance: one thread per process vs intra-op threads", args, space)
        failing = op_census(space)
        if args.census_only:
            return 0
        note("building the data step once")
        warm = space.plan(TINY, "train.steps=1", "train.warmup_steps=0", "train.seed=999999", *MICRO_BATCHES)
        space.run_bt("run", warm, "--progress", "off")
        ratios = [
            (size, compare(space, n, size, overrides, steps, args.threads))
            for size, overrides, steps in sizes
        ]
        print_goals(
            [
                f"  info    {failing} of the census's kernels change their bits with the thread count "
                "under the portable environment",
                *(
                    f"  info    {size}: portable (chosen) / native at {args.threads} threads: {fmt_ratio(value)}"
                    for size, value in ratios
                ),
            ]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
