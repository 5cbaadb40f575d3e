"""The process model: how one step's process is started, what it is asked and how it ends.

The job file a step process reads (`job.py`), how many processes train it and how torchrun starts
them (`launch.py`, `policy.py`), the numerics environment set before torch loads (`numerics.py`,
with MKL's shim `mkl.c` beside `mkl.py`), workers shared by consecutive steps (`processes.py`),
starting them and collecting how they ended (`spawn.py`, `outcome.py`), and the worker itself
(`worker.py`: inputs re-hashed by `inputs.py`, sources found by `step_sources.py`, events in the
shape of `logs.py`, test-only faults from `faults.py`). The engines (`executor/engines/`) place
these processes; the build loop (`executor/loop/`) decides which steps need one.
"""
