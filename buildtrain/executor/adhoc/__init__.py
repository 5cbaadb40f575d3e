"""The ad hoc commands on a built plan: `bt eval` (`score.py`: one suite scored on the plan's
weights, or a kept checkpoint's, stored as the eval step's result), `bt export` and `bt sample`
(`deliver.py`), and `bt export --sign` (`signed_export.py`, the OpenSSF model-signing format).
They read what a plan built and ask its kinds; they never build a step.
"""
