"""What a kind of step is: the one protocol every step kind implements, once, in its own module.

The planner, the executor, `bt verify`, `bt fsck`, `bt gc` and the views ask a step's kind what to
do with it; none of them tests a kind's name. A kind says:

- how it enters a plan (`plan`: its config slice, its inputs, its toolchain), once per stage or once
  per plan, in registry order;
- what enters its hash besides its config and inputs (`toolchain`: buildtrain's own computing code,
  and torch's build and numerics where it computes with torch);
- where its computation starts (`computes`: a module with `execute(ctx, out)`, which is also the
  root of its code hash, with `also_computes`: modules it reaches by name);
- what it needs to run (`reads_sources`, `needs_torch`, `ranks`: several processes as one step);
- how `bt verify` compares it (`verify_by_updates`: watched update by update, else re-executed and
  its digests compared; `spot_checked`: whether a `--steps N` spot check re-executes it);
- what the store holds for it besides its sealed output (`output_problems`, `references`: what fsck
  checks and what gc keeps);
- which of its declared digests follow from its files (`derive_digests`, `derived_problems`): a
  manifest's seal is unkeyed, so a pull and fsck trust a declared digest only once the bytes give
  it again (`stored_problems`).

Torch-free and cheap to import: `bt plan` and a null build load every kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from buildtrain.config.schema import NumericsConfig
from buildtrain.plan.toolchain import Machine, fingerprint
from buildtrain.store import objects

if TYPE_CHECKING:
    from buildtrain.config.schema import Stage
    from buildtrain.kinds.planning import Planning
    from buildtrain.plan.plan import Step


class StepKind:
    """The defaults of a kind that computes without torch, on one process, once per plan."""

    name: ClassVar[str]
    computes: ClassVar[str]  # the module whose `execute(ctx, out)` computes an output of this kind
    # Modules its computation reaches by name rather than by import (the eval kind's suite
    # scorers, `config/suites/`): roots of its code hash beside `computes`.
    also_computes: ClassVar[tuple[str, ...]] = ()
    per_stage: ClassVar[bool] = False  # planned once for each stage (else once per plan, after them)
    torch_toolchain: ClassVar[bool] = False  # computes with torch: its build and numerics enter the hash
    reads_sources: ClassVar[bool] = False  # data files are located by content before it runs
    ranks: ClassVar[bool] = False  # may run on several processes as one step (with their controls)
    rank_inputs: ClassVar[tuple[str, ...]] = ()  # what ranks other than the lead read (it sends the rest)
    resumable: ClassVar[bool] = False  # keeps checkpoints in its work folder and resumes from them
    verify_by_updates: ClassVar[bool] = False  # verify watches it update by update
    spot_checked: ClassVar[bool] = True  # `bt verify --steps N` re-executes it (else: skipped)
    package: ClassVar[bool] = False  # its output is what `bt export` copies out and `bt sample` loads
    headline: ClassVar[str | None] = None  # the digest that stands for its output (bt verify shows it)
    summary: ClassVar[str | None] = None  # what its metrics summary holds: "training", "evaluation"
    # Where set, its computing module's `complete_from_store(store, step)` may complete a step from
    # what the store holds, without a process; the run says why in these words.
    completes_from_store: ClassVar[str | None] = None
    sources: ClassVar[str] = "source files"  # what its files are, as `bt diff` names a change of them
    # The input whose kept checkpoints this kind evaluates while that step trains (evaluation
    # beside training), each as soon as it is sealed: its `computes` module then has
    # `evaluate_checkpoint(ctx, folders, before_scoring)`, and `checkpoints_evaluated(config,
    # kept)` says which updates. None: it waits for its inputs' outputs, as any step does.
    checkpoints_of: ClassVar[str | None] = None
    # Torch-free, one thread, and after a train step in plan order without reading it: the local
    # engine builds it beside that train step, on the core evaluation beside training uses, when
    # its inputs are built by then (`executor/loop/beside.py`); else in plan order, as any step.
    beside_training: ClassVar[bool] = False

    # -- planning -------------------------------------------------------------------------------

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        """This kind's step for `stage` (None for a kind planned once per plan), or None."""
        raise NotImplementedError

    def toolchain(
        self,
        config: Mapping[str, Any],
        numerics: NumericsConfig,
        world_size: int = 1,
        threads: int | None = None,
        machine: Machine | None = None,
    ) -> dict[str, Any]:
        """The toolchain part of a step's hash: what the planner records and what the executor
        checks this machine against (`threads`: the count a native plan will run at; `machine`:
        the one that will execute the step, default this one)."""
        machine = machine or Machine.here(cuda=numerics.device == "cuda")
        facts = fingerprint(
            self.computes,
            numerics,
            also=self.also_computes,
            torch=self.torch_toolchain,
            threads=threads,
            world_size=self.hashed_world_size(config, world_size),
            extra=self.numerics_facts(numerics),
            machine=machine,
        )
        return {**facts, **self.library_facts(config, machine)}

    def hashed_world_size(self, config: Mapping[str, Any], world_size: int) -> int | None:
        """The world size the hash records: only where the result depends on it."""
        return None

    def numerics_facts(self, numerics: NumericsConfig) -> dict[str, Any]:
        """Numerics settings beyond the profile that change this kind's bits (only when set)."""
        return {}

    def library_facts(self, config: Mapping[str, Any], machine: Machine) -> dict[str, str]:
        """Libraries besides torch whose version changes this kind's output, on `machine`."""
        return {}

    # -- running --------------------------------------------------------------------------------

    def needs_torch(self, config: Mapping[str, Any]) -> bool:
        """Whether its process applies the numerics environment and imports torch."""
        return self.torch_toolchain

    def world_size_problem(self, config: Mapping[str, Any], world_size: int) -> str | None:
        """Why this step cannot share its work among `world_size` processes, if it cannot."""
        return None

    def rank_budget(self, config: Mapping[str, Any]) -> RankBudget | None:
        """How many single-threaded ranks a portable step could use, or None (runs on one)."""
        return None

    # -- verify, fsck, gc -------------------------------------------------------------------------

    def updates(self, config: Mapping[str, Any]) -> int:
        """How many updates verify compares one by one (kinds verified by updates)."""
        return 0

    def checkpoints_evaluated(self, config: Mapping[str, Any], kept: list[int]) -> list[int]:
        """Of the `checkpoints_of` input's kept updates (`kept`, newest first: the final one
        first), those this step evaluates beside training, oldest first."""
        return []

    def kept_updates(self, config: Mapping[str, Any]) -> list[int]:
        """The updates whose checkpoints a finished output keeps, newest first (resumable kinds):
        a build resumed from a pulled checkpoint pulls the older ones too, so that its output
        holds what an uninterrupted build's does."""
        return []

    def output_problems(self, step_hash: str, output: Path, config: Mapping[str, Any]) -> list[str]:
        """What makes a sealed output of this step (`step_hash`, `config`) not its own, beyond
        its seal."""
        return []

    def derived_problems(self, output: Path) -> list[str]:
        """What its files say against the digests its manifest declares (`digest_problems`):
        what a pull and fsck check beyond `output_problems`. `bt verify` leaves it to the
        re-execution, which names the file that differs and says "not reproduced"."""
        return digest_problems(self, output)

    def derive_digests(self, output: Path) -> list[Derived]:
        """The declared digests this kind computes again from a sealed output's files, each with
        the file it follows from (the files are those `objects.verify` found intact). Raises
        ValueError, KeyError, TypeError or OSError where a file is not what the kind writes."""
        return []

    def references(self, output: Path) -> list[str]:
        """Evaluation cache keys this output names (gc keeps those entries)."""
        return []


def stored_problems(kind: StepKind, step_hash: str, output: Path, config: Mapping[str, Any]) -> list[str]:
    """Everything a store checks of a sealed output beyond its files' blake3 (fsck, a pull)."""
    return kind.output_problems(step_hash, output, config) or kind.derived_problems(output)


@attrs.frozen(kw_only=True)
class Derived:
    """A declared digest computed again from an output's bytes."""

    name: str  # the digest's name in the manifest ("weights", "package", "eval", ...)
    value: str
    file: str  # what it follows from, as a refusal names it


def digest_problems(kind: StepKind, output: Path) -> list[str]:
    """The first declared digest of a sealed output that its files do not give ([] when all
    do). A manifest is sealed by an unkeyed digest anyone can compute: files changed and the
    manifest sealed again with the honest digests pass every blake3, and only this check (or
    re-executing) tells them apart."""
    try:
        declared = objects.sealed_digests(output)
        derived = kind.derive_digests(output)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, StopIteration) as exc:
        return [f"its files cannot give the digests its manifest declares ({type(exc).__name__}: {exc})"]
    for found in derived:
        claimed = declared.get(found.name)
        if claimed != found.value:
            return [
                f"{found.file}: gives {found.name} {found.value[:12]}, the manifest declares "
                f"{str(claimed)[:12]} (forged or damaged)"
            ]
    return []


@attrs.frozen(kw_only=True)
class RankBudget:
    """What decides how many ranks a step can use."""

    micro_batches: int  # micro-batches per update, shared out among the ranks
    flop: int  # the step's work: too little is not worth another process
    rank_memory: int  # bytes one rank takes (each holds the whole model and optimizer)
