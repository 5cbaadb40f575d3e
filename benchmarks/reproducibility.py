"""Which results repeat: the guarantee matrix of the numerics profiles, measured on this machine.

Trains the same preset under each profile at 1, 3, 4, 8 and 16 threads (--quick: 1 and 4), each in
its own store, and compares the final weight digests with those of 1 thread. Thread counts above
the core count still cut the work that many ways, which is what can change the bits. Under `portable` the plan hash does not depend on the thread count, so
the two runs share one plan hash and must give the same weights; under `native` the thread count
is part of the hash, and the two plans may (and, for a model large enough for the math libraries to
split their work, do) give different weights: which is why `native` pins it in the hash. A rerun of
one plan in a fresh store must always give the same weights.

Presets: presets/tiny.toml, and a wider variant (dim 256, 4 layers, 40 steps) where the libraries
parallelize their reductions.

Run: python benchmarks/reproducibility.py [--quick]
"""

from __future__ import annotations

import sys

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import TINY, make_parser, note, print_header, print_table, workspace  # noqa: E402

WIDE = (
    "model.dim=256",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.ffn_hidden=688",
    "train.steps=40",
    "train.warmup_steps=4",
    "train.seq_len=128",
    "train.checkpoint_every=40",
)


def train_digest(
    space, preset_overrides: tuple[str, ...], profile: str, threads: int, tag: str
) -> tuple[str, str]:
    """(plan hash, weights digest) of one training run in a store of its own."""
    store = space.path(f"store-{tag}")
    overrides = (*preset_overrides, f"numerics.profile={profile}", f"numerics.threads={threads}")
    planned = space.plan(TINY, *overrides, store=store)
    extra = ["--threads", str(threads)] if profile == "portable" else []
    space.run_bt("run", planned, "--target", "train:main", "--progress", "off", *extra, store=store)
    space.import_buildtrain()
    from buildtrain.plan.stored import load_plan
    from buildtrain.store import objects
    from buildtrain.store.store import Store

    output = Store(store).outputs.path(load_plan(Store(store), planned).by_label("train:main").hash)
    return planned, objects.sealed_digests(output)["weights"]


def main() -> None:
    parser = make_parser(__doc__)
    args = parser.parse_args()
    with workspace("reproducibility", args) as space:
        print_header(
            "reproducibility: weights of the same preset under each profile and thread count", args, space
        )
        variants = [("tiny", ())] if args.quick else [("tiny", ()), ("wide", WIDE)]
        rows = []
        for name, overrides in variants:
            runs = {}
            counts = (1, 4) if args.quick else (1, 3, 4, 8, 16)
            for profile in ("portable", "native"):
                for threads in counts:
                    note(f"{name}: {profile}, {threads} thread(s)")
                    runs[profile, threads] = train_digest(
                        space, overrides, profile, threads, f"{name}-{profile}-{threads}"
                    )
            note(f"{name}: portable, 4 threads, again in a fresh store")
            rerun = train_digest(space, overrides, "portable", 4, f"{name}-portable-4-again")

            def compare(what: str, a: tuple[str, str], b: tuple[str, str], preset: str = name) -> list[str]:
                return [
                    preset,
                    what,
                    "same" if a[0] == b[0] else "different",
                    a[1][:12],
                    b[1][:12],
                    "identical" if a[1] == b[1] else "DIFFERENT",
                ]

            for profile in ("portable", "native"):
                for threads in counts[1:]:
                    rows.append(
                        compare(
                            f"{profile}: 1 vs {threads} threads", runs[profile, 1], runs[profile, threads]
                        )
                    )
            rows.append(compare("portable, 4 threads: rerun in a fresh store", runs["portable", 4], rerun))
            rows.append(compare("portable vs native, 1 thread", runs["portable", 1], runs["native", 1]))
        print_table(
            "final weights of two runs",
            ["preset", "runs compared", "plan hashes", "weights A", "weights B", "result"],
            rows,
        )


if __name__ == "__main__":
    main()
