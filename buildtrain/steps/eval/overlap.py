"""What every suite kind's result says beside its score: how many of its questions the weights
were trained on (`overlap_of`: by n-gram, in the ngrams steps' filters, `ngrams/bloom.py`, and by
whole document, in the data steps' digests, `steps/data/documents.py`), and the score withheld where that
passes the suite's `max_overlap` (`withheld`). The scoring of
each kind is in its own module (`config/suites/` names it); this is what they share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from buildtrain.config.steps import SuiteStep

OVERLAP_EXAMPLES = 3  # questions a result quotes from its overlap with the training documents
EXAMPLE_CHARACTERS = 80


def withheld(suite: SuiteStep, result: dict[str, Any], overlap: dict[str, Any]) -> dict[str, Any]:
    """The suite's result with its overlap, its scores withheld (not hidden) past `max_overlap`."""
    if suite.max_overlap is not None and overlap["count"] > suite.max_overlap:
        why = f"{overlap['count']} questions are in the training data (max_overlap {suite.max_overlap})"
        return {"kind": suite.kind, "questions": result["questions"], "overlap": overlap, "refused": why}
    return {"kind": suite.kind, **result, "overlap": overlap}


def overlap_of(texts: list[str], shown: list[str], inputs: dict[str, Path], n: int) -> dict[str, Any]:
    """The overlap of `texts` with the training data: `count` (and `fraction`, `examples` from
    `shown`) by `n`-grams, `documents` by whole document (`steps/data/documents.py`), and the filters' `n` and
    estimated false-positive rate per n-gram. Data outputs from before n-grams: documents only."""
    import numpy as np

    from buildtrain.steps.data.documents import overlap, read_documents
    from buildtrain.steps.eval.cache import DATA_INPUT, NGRAMS_INPUT
    from buildtrain.steps.ngrams.bloom import read_filter, shared

    trained_on = [path for name, path in sorted(inputs.items()) if name.startswith(DATA_INPUT)]
    recorded = [path for name, path in sorted(inputs.items()) if name.startswith(NGRAMS_INPUT)]
    arrays = [read_documents(path) for path in trained_on]
    trained = np.unique(np.concatenate([a for a in arrays if a is not None] or [np.zeros(0, np.uint64)]))
    whole = overlap(trained, texts)
    filters = [f for f in (read_filter(path, n) for path in recorded) if f is not None]
    found = sorted(set(shared(filters, texts, n)) | set(whole)) if filters else whole
    examples = [shown[i][:EXAMPLE_CHARACTERS] for i in found[:OVERLAP_EXAMPLES]]
    result = {
        "count": len(found),
        "fraction": len(found) / len(texts) if texts else 0.0,
        "examples": examples,
    }
    rate = sum(f.false_positive_rate() for f in filters)  # per n-gram, any filter
    return {
        **result,
        "documents": len(whole),
        "ngram": n if filters else None,
        "false_positive_rate": rate,
    }
