"""What `bt verify` concludes: a verdict per step and the verification as a whole, with the exit
code and JSON body the CLI reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import ExitCode
from buildtrain.executor.process.launch import SINGLE_PROCESS, Launch
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan


@attrs.frozen(kw_only=True)
class VerifyOptions:
    resume_at: tuple[int, ...] = ()
    threads: int | None = None
    steps: int | None = None
    keep: bool = False
    experiments: Path = Path("experiments")
    launch: Launch = SINGLE_PROCESS  # re-execute the train steps at this world size

    def resume_problem(self, plan: Plan) -> str | None:
        """Why a `--resume-at` point would never be reached in `plan`, if one would not: a kill
        is made after an update the re-execution runs and before its last (the header and the
        verdicts said "killed and resumed at 500" of a plan of 12 updates)."""
        if not self.resume_at:
            return None
        lengths = [
            kind_of(step.kind).updates(step.config)
            for step in plan.steps
            if kind_of(step.kind).verify_by_updates
        ]
        if not lengths:
            return f"--resume-at: plan {plan.hash[:12]} has no train step to kill and resume"
        end = min(max(lengths), self.steps) if self.steps else max(lengths)
        beyond = [point for point in self.resume_at if point >= end]
        if not beyond:
            return None
        runs = (
            f"--steps {self.steps} re-executes {end}"
            if end == self.steps
            else f"its longest train stage has {end}"
        )
        return (
            f"--resume-at {','.join(map(str, beyond))}: plan {plan.hash[:12]} would never be killed there "
            f"({runs} updates); choose points from 1 to {end - 1}"
        )


# What a step's re-execution came to: reproduced bit for bit; diverged from the recorded build;
# not compared (a comparison it stands for was not made: fails closed); damaged (the recorded output
# does not verify or is another step's); skipped (an input did not reproduce, or a spot check).
STATUSES = ("reproduced", "diverged", "not compared", "damaged", "skipped")


@attrs.frozen
class StepVerdict:
    label: str
    kind: str
    status: str = attrs.field(validator=attrs.validators.in_(STATUSES))
    recorded: dict[str, str] = attrs.Factory(dict)
    reexecuted: dict[str, str] = attrs.Factory(dict)
    detail: str = ""
    divergence: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class Verification:
    """What `bt verify` found: a verdict per step, and the settings it re-executed under."""

    plan: Plan
    verdicts: list[StepVerdict]
    threads: int
    world_size: int
    options: VerifyOptions

    def with_status(self, status: str) -> list[StepVerdict]:
        return [v for v in self.verdicts if v.status == status]

    @property
    def reproduced(self) -> bool:
        return not (
            self.with_status("damaged") or self.with_status("diverged") or self.with_status("not compared")
        )

    @property
    def exit_code(self) -> int:
        if self.with_status("damaged"):
            return ExitCode.CORRUPT
        return ExitCode.OK if self.reproduced else ExitCode.NOT_REPRODUCED

    def as_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.hash,
            "reproduced": self.reproduced,
            "threads": self.threads,
            "world_size": self.world_size,
            "resume_at": list(self.options.resume_at),
            "steps_limit": self.options.steps,
            "steps": [v.as_json() for v in self.verdicts],
        }
