"""The engines: where a step's process runs (this machine, a Ray cluster, Slurm).

The seam (`engine.py`: `Engine`, `Submission`, the job written for a step, `ENGINES`), the local
engine (`local.py`, the one caller of `spawn`, with its evaluation worker beside training in
`local_beside.py`), Ray's (`ray_engine.py`, its cluster found or started by `ray_cluster.py`) and
Slurm's (`slurm_engine.py` submits through submitit, `slurm_task.py` runs inside the job,
`slurm_jobs.py` follows it), the node side every cluster engine shares (`on_node.py`), and what an
engine's workers are, asked once and kept (`probes.py`). Ray and submitit are imported only inside
`ray_engine.py`, `slurm_engine.py` and `slurm_task.py`. The processes themselves are the process
model's (`executor/process/`); the DAG order, caches and locks are the build loop's
(`executor/loop/`).
"""
