"""The results of a plan, joined from its card and its steps' outputs and summaries (never torch)."""

from __future__ import annotations

import os
from typing import Any

from buildtrain.config.suites import accuracy
from buildtrain.kinds import KINDS
from buildtrain.plan.card import Card
from buildtrain.plan.plan import Plan
from buildtrain.store.evals import output_result, output_suites
from buildtrain.store.objects import MANIFEST
from buildtrain.store.store import Store


def _built(store: Store, step_hash: str) -> bool:
    """`Outputs.has` on plain strings: the table asks it thousands of times."""
    folder = os.path.join(store.steps, step_hash)
    return not os.path.islink(folder) and os.path.isfile(os.path.join(folder, MANIFEST))


def eval_result(store: Store, step_hash: str) -> dict[str, Any] | None:
    """The held-out result of a built eval step, read from its (small) output file."""
    return output_result(store.outputs.path(step_hash))


def suite_results(store: Store, step_hash: str) -> dict[str, dict[str, Any]]:
    """Each benchmark suite's numbers from a built eval step: `accuracy` (the number its kind
    says stands for it, `SuiteKind.accuracy`), `acc_norm` (where it has one) and how many
    questions were scored."""
    return {
        name: {
            "accuracy": accuracy(result),
            "acc_norm": result.get("acc_norm"),
            "questions": result.get("questions"),
            "overlap": (result.get("overlap") or {}).get("count"),  # questions found in training data
            **({"refused": result["refused"]} if "refused" in result else {}),  # max_overlap exceeded
        }
        for name, result in output_suites(store.outputs.path(step_hash)).items()
    }


def plan_results(store: Store, card: Card) -> dict[str, Any]:
    """The numbers of one plan: final train loss and speed (last stage), held-out loss and bits
    per token, wall time (the sum over the executions that built its steps), build status."""
    built = [_built(store, h) for _, _, h in card.steps]
    summaries = {h: store.results.read_step_metrics(h) for _, _, h in card.steps}
    trains = card.summarizing("training")
    last = summaries.get(trains[-1][2]) if trains else None
    train = (last or {}).get("train") or {}
    evals = card.summarizing("evaluation")
    result = eval_result(store, evals[-1][2]) if evals and built[card.steps.index(evals[-1])] else None
    walls = [s["wall_s"] for s in summaries.values() if s and isinstance(s.get("wall_s"), (int, float))]
    count = sum(built)
    suites = suite_results(store, evals[-1][2]) if evals and built[card.steps.index(evals[-1])] else {}
    return {
        **({"suites": suites} if suites else {}),
        "train_loss": train.get("final_loss"),
        "heldout_loss": (result or {}).get("loss"),
        "bits_per_token": (result or {}).get("bits_per_token"),
        "tokens_per_s": train.get("tokens_per_s"),
        "wall_s": round(sum(walls), 3) if walls else None,
        "status": "built"
        if count == len(built)
        else "not built"
        if count == 0
        else f"partial {count}/{len(built)}",
    }


def suites_text(store: Store, plan: Plan) -> str:
    """What the end of `bt run` prints of the plan's benchmark suites: each suite's accuracy and
    its overlap with the training data (questions sharing an n-gram: count/questions and the
    fraction), or the `max_overlap` refusal; empty when the plan scores no suite."""
    lines = []
    for step in plan.steps:
        if getattr(KINDS.get(step.kind), "summary", None) != "evaluation" or not store.outputs.has(step.hash):
            continue
        suites = output_suites(store.outputs.path(step.hash))
        width = max((len(name) for name in suites), default=0)
        lines += [f"suites of {step.label}:"] if suites else []
        lines += [f"  {name:<{width}}  {_score(r)}; {_overlap(r)}" for name, r in suites.items()]
    return "\n".join(lines)


def _score(result: dict[str, Any]) -> str:
    if "refused" in result:
        return f"refused: {result['refused']}"
    value = accuracy(result)
    text = "accuracy -" if value is None else f"accuracy {value:.4f}"
    if isinstance(result.get("acc_norm"), (int, float)):
        text += f" (acc_norm {result['acc_norm']:.4f})"
    return text


def _overlap(result: dict[str, Any]) -> str:
    overlap = result.get("overlap") or {}
    count, fraction, questions = overlap.get("count"), overlap.get("fraction"), result.get("questions")
    if not isinstance(count, int):
        return "overlap -"
    n = f", {overlap['ngram']}-grams" if overlap.get("ngram") else ", whole documents"
    share = f" ({fraction:.1%})" if isinstance(fraction, (int, float)) else ""
    return f"overlap {count}/{questions}{share}{n}"
