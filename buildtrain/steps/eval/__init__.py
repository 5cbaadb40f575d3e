"""The eval kind's computation (`kinds/eval.py`): `step.py` runs it, `cache.py` keys its results,
and each suite kind's scoring (`config/suites/`) is a module here."""
