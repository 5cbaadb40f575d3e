"""Multiple-choice scoring throughput: buildtrain's scorer against lm-evaluation-harness's HF back
end, on the same `hf/` export and the same (context, choice) requests.

Builds presets/tiny.toml with a generated arithmetic suite of 256 questions (768 choices), exports
it, then alternates two fresh processes per round, each timing only its scoring call, after the
model is loaded and one warm-up call: buildtrain's `choice_loglikelihoods` on the export's weights
(what the eval step runs), and the harness's `HFLM.loglikelihood` on the `hf/` folder (transformers'
Llama). Both score in float32 on the CPU, batches of 16, with the same thread count. Reports
requests (choices) per second, medians and the ratio (goal: buildtrain >= 1.0x the harness). The
log-likelihoods of both are compared as a check (max absolute difference).

Run: python benchmarks/eval.py [--quick] [--threads N]    (needs the lm-eval and accelerate extras)
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    TINY,
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
    time_process,
    workspace,
)

GOAL = 1.0
QUESTIONS = 256
BATCH = 16


def write_suite(path: Path, count: int) -> None:
    rng = random.Random(0)
    with path.open("w") as handle:
        for _ in range(count):
            a, b = rng.randrange(10, 999), rng.randrange(10, 999)
            choices = [str(a + b), str(a + b + 1), str(a + b + 10)]
            rng.shuffle(choices)
            handle.write(
                json.dumps({"context": f"{a}+{b}=", "choices": choices, "answer": choices.index(str(a + b))})
                + "\n"
            )


def worker_buildtrain(package: Path, suite: Path, out: Path) -> None:
    import torch

    from buildtrain.config.suite_files import read_multiple_choice
    from buildtrain.steps.eval.choice import choice_loglikelihoods
    from buildtrain.steps.eval.suites import text_codec
    from buildtrain.steps.sample import package_model

    hf = json.loads((package / "hf" / "config.json").read_bytes())
    model = package_model(package, hf["vocab_size"])
    codec = text_codec(None)  # tiny.toml: the byte tokenizer
    questions = read_multiple_choice(suite.read_bytes(), suite)
    window, device = hf["max_position_embeddings"], torch.device("cpu")
    choice_loglikelihoods(model, questions[:BATCH], codec.encode, codec.end, window, BATCH, device)  # warm-up
    started = time.perf_counter()
    scores = choice_loglikelihoods(model, questions, codec.encode, codec.end, window, BATCH, device)
    elapsed = time.perf_counter() - started
    out.write_text(json.dumps({"seconds": elapsed, "scores": [s for q in scores for s in q]}))


def worker_harness(package: Path, suite: Path, out: Path) -> None:
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(package / "hf"), dtype="float32", device="cpu", batch_size=BATCH)
    pairs = []
    for line in suite.read_text().splitlines():
        item = json.loads(line)
        pairs += [(item["context"], choice) for choice in item["choices"]]

    def requests(chosen: list[tuple[str, str]]) -> list[Instance]:
        return [
            Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
            for i, pair in enumerate(chosen)
        ]

    lm.loglikelihood(requests(pairs[: BATCH * 3]), disable_tqdm=True)  # warm-up
    started = time.perf_counter()
    scores = lm.loglikelihood(requests(pairs), disable_tqdm=True)
    elapsed = time.perf_counter() - started
    out.write_text(json.dumps({"seconds": elapsed, "scores": [s for s, _ in scores]}))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, which, package, suite, out = sys.argv
        worker = worker_buildtrain if which == "buildtrain" else worker_harness
        worker(Path(package), Path(suite), Path(out))
        return 0
    parser = make_parser(__doc__)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of both (default 1)")
    args = parser.parse_args()
    n = rounds(args, quick=3, full=7)
    with workspace("eval", args) as space:
        print_header("multiple-choice scoring: buildtrain vs lm-eval's HF back end", args, space)
        suite = space.path("suite.jsonl")
        write_suite(suite, QUESTIONS)
        space.run_bt("run", str(TINY))
        package = space.path("package")
        space.run_bt("export", str(TINY), str(package))
        env = space.env(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        requests = QUESTIONS * 3
        found: dict[str, list[float]] = {}

        def measure(which: str) -> float:
            out = space.path(f"{which}.json")
            argv = [sys.executable, __file__, "--worker", which, str(package), str(suite), str(out)]
            time_process(argv, env=env, cwd=space.root)
            body = json.loads(out.read_text())
            found[which] = body["scores"]
            return requests / body["seconds"]

        results = alternate(
            [("buildtrain", lambda: measure("buildtrain")), ("lm-eval hf", lambda: measure("harness"))], n
        )
        ours, theirs = median(results["buildtrain"]), median(results["lm-eval hf"])
        gap = max(abs(a - b) for a, b in zip(found["buildtrain"], found["harness"], strict=True))
        print_table(
            f"{requests} loglikelihood requests ({QUESTIONS} questions), batch {BATCH}, {args.threads} thread(s); "
            f"median of {n}, alternated",
            ["scorer", "requests/s (median)", "min..max", "vs lm-eval hf"],
            [
                [
                    name,
                    f"{median(v):,.0f}",
                    f"{min(v):,.0f}..{max(v):,.0f}",
                    fmt_ratio(ratio(median(v), theirs)),
                ]
                for name, v in results.items()
            ],
        )
        note(f"largest difference between the two scorers' log-likelihoods: {gap:.2e}")
        print_goals(
            [
                goal_line(
                    f"buildtrain >= {GOAL}x lm-eval hf", ours >= GOAL * theirs, fmt_ratio(ratio(ours, theirs))
                )
            ]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
