"""The step process of a watched job: `python -m buildtrain.verify.worker --job JOB.json
--events-fd FD` (or `--serve FD`), with the arguments of `buildtrain.executor.process.worker`.

It is that worker with one addition: a train step whose job has a `watch` table is observed by a
`Watcher` on rank 0, which compares every update with the recorded trace. Verify plugs into the
executor here, from above, so the executor never imports verify.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from buildtrain.executor.process import worker

if TYPE_CHECKING:
    from buildtrain.executor.process.job import Job
    from buildtrain.verify.watch import Watcher


def watcher_for(job: Job, log: Any) -> Watcher | None:
    """The watcher a job asks for, if any. Called once the worker has applied the numerics
    environment and imported torch, which the watcher needs (so not imported above)."""
    if not job.options.watch:
        return None
    from buildtrain.verify.watch import Watcher

    return Watcher.from_job(job.options.watch, log)


def main(argv: list[str] | None = None) -> int:
    return worker.main(argv, observer=watcher_for)


if __name__ == "__main__":
    worker.exit_now(main())
