"""The executor, in rooms by job: the build loop (`loop/`: bt run over a plan or several, the DAG
order, one step's build, the run record), the process model (`process/`: job files, numerics,
spawn, the worker), the engines (`engines/`: the seam, local, Ray, Slurm), the team cache's client
(`remote/`) and the ad hoc commands on a built plan (`adhoc/`: bt eval, export, sample)."""
