"""The build loop: `bt run` over one plan or several, a step at a time or as the DAG allows.

`run.py` runs a plan (`run_plan`), `batch.py` several (a sweep, shared steps built once),
`schedule.py` the DAG order every engine shares, `build.py` one step (a cache hit, a pull from
the remote, or a submission to the engine under the step's lock), `beside.py` evaluation of kept
checkpoints while training goes on; what a run leaves and shows: the run record (`record.py`),
metrics and TensorBoard events (`metrics.py`, `events.py`), the terminal's lines (`progress.py`).
Processes are the process model's (`executor/process/`), placed by an engine
(`executor/engines/`); the team cache is asked through `executor/remote/`.
"""
