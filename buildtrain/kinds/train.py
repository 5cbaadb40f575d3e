"""The train kind: one stage's training, from its data step's shards and, for a later stage, its
parent's final weights. Computes with torch; may run on several ranks as one step; `bt verify`
compares it update by update against the recorded trace."""

from __future__ import annotations

import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.canonical import digest
from buildtrain.config.convert import converter
from buildtrain.config.schema import ModelConfig, NumericsConfig, Stage, TrainConfig, world_size_problem
from buildtrain.config.steps import TrainStep, heldout_only
from buildtrain.kinds.kind import Derived, RankBudget, StepKind, digest_problems
from buildtrain.plan.plan import Step
from buildtrain.store import objects
from buildtrain.store.checkpoints import state_digest
from buildtrain.store.layout import CHECKPOINTS, RESULT, TRACE, TRAIN_STATE, checkpoint_update
from buildtrain.store.tensors import combine, safetensors_digests

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning


class TrainKind(StepKind):
    name = "train"
    computes = "buildtrain.steps.train.step"
    headline = "weights"
    per_stage = True
    torch_toolchain = True
    ranks = True
    rank_inputs = ("data",)  # the other ranks receive their starting weights from rank 0
    resumable = True
    verify_by_updates = True
    summary = "training"

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        assert stage is not None
        if not stage.train.steps:
            return None  # nothing to compute: its consumers read the weights it starts from (`weights`)
        config = planning.config
        during = heldout_only(config.eval) if config.eval.every else None  # evaluation during training
        step_config = TrainStep(model=config.model, train=stage.train, eval=during).to_config()
        if stage.init_from:
            parent: str | None = planning.weights(stage.init_from).hash
        else:  # the pretrained checkpoint's weights, or none (a seeded initialization)
            imported = planning.planned("import_hf", stage.name)
            parent = None if imported is None else imported.hash
        inputs = {"data": planning.required("data", stage.name).hash, "init": parent}
        toolchain = self.toolchain(
            step_config, config.numerics, planning.world_size, machine=planning.machine
        )
        return Step.create(f"{self.name}:{stage.name}", self.name, step_config, inputs, toolchain)

    def hashed_world_size(self, config: Mapping[str, Any], world_size: int) -> int | None:
        # The invariant reduction gives the same bits at any world size; allreduce does not.
        return world_size if config["train"].get("reduction") == "allreduce" else None

    def numerics_facts(self, numerics: NumericsConfig) -> dict[str, Any]:
        return {"compile": True} if numerics.compile else {}  # only when set: eager plans keep theirs

    def world_size_problem(self, config: Mapping[str, Any], world_size: int) -> str | None:
        problem = world_size_problem(converter.structure(config["train"], TrainConfig), world_size)
        return None if problem is None else f"train.micro_batch_size: {problem}"

    def rank_budget(self, config: Mapping[str, Any]) -> RankBudget | None:
        train = converter.structure(config["train"], TrainConfig)
        if train.reduction != "invariant":
            return None  # the world size of an allreduce plan is fixed by its hash
        from buildtrain.config.shape import memory_estimate, parameter_count  # only when it computes

        model = converter.structure(config["model"], ModelConfig)
        return RankBudget(
            micro_batches=train.batch_size // train.micro_batch_size,
            flop=6 * parameter_count(model) * train.batch_size * train.seq_len * train.steps,
            rank_memory=memory_estimate(model, train),
        )

    def updates(self, config: Mapping[str, Any]) -> int:
        return int(config["train"]["steps"])

    def kept_updates(self, config: Mapping[str, Any]) -> list[int]:
        """The last update and the scheduled ones before it (`schedule.checkpoint_due`), as many
        as `train.keep_checkpoints`, newest first: what `assemble_output` keeps."""
        train = config["train"]
        steps, every, keep = (
            int(train["steps"]),
            int(train["checkpoint_every"]),
            int(train["keep_checkpoints"]),
        )
        kept, update = [steps], steps - (steps % every or every)
        while len(kept) < keep and update > 0:
            kept.append(update)
            update -= every
        return kept

    def output_problems(self, step_hash: str, output: Path, config: Mapping[str, Any]) -> list[str]:
        """A recorded train output is this step's own when its result records the step's number
        of updates and every checkpoint in it carries the step's hash."""
        updates = self.updates(config)
        try:
            result = json.loads((output / RESULT).read_bytes())
            if result.get("steps") != updates:
                return [f"it records {result.get('steps')} updates, the step has {updates}"]
            for name in result["checkpoints"]:
                state = json.loads((output / CHECKPOINTS / name / TRAIN_STATE).read_bytes())
                if state.get("step_hash") != step_hash:
                    found = str(state.get("step_hash"))[:12]
                    return [f"checkpoints/{name} was written by step {found}, not {step_hash[:12]}"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return [f"its result or checkpoints cannot be read ({exc})"]
        return []

    def derived_problems(self, output: Path) -> list[str]:
        """Its declared digests, then its kept checkpoints against the trace's records. The two
        read different files, so they are hashed side by side (blake3 lets go of the GIL): a
        pull's check of a 72 MB output is mostly this."""
        try:
            names = json.loads((output / RESULT).read_bytes())["checkpoints"][1:]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            names, unreadable = [], [f"its result cannot be read ({exc})"]
        else:
            unreadable = []
        with ThreadPoolExecutor(1) as pool:
            kept = pool.submit(kept_problems, output, names)
            return digest_problems(self, output) or unreadable or kept.result()

    def derive_digests(self, output: Path) -> list[Derived]:
        """The weights from the file the result names; the trace's digest from its lines; the
        final state from the final checkpoint's tensors and from the trace's last record of it."""
        result = json.loads((output / RESULT).read_bytes())
        weights, final = result["weights"], f"{CHECKPOINTS}/{_checkpoint(result['checkpoints'][0])}"
        listed = objects.sealed_files(output)
        if weights not in listed:  # a name from the output's own result: never outside it
            raise ValueError(f"{RESULT} names weights {weights!r} the output does not hold")
        entries = trace_entries(output)
        recorded = next(e["state"] for e in reversed(entries) if "state" in e)
        return [
            Derived(name="weights", value=combine(safetensors_digests(output / weights)), file=weights),
            Derived(name="trace", value=digest("trace", entries), file=TRACE),
            Derived(name="state", value=recorded, file=TRACE),
            Derived(name="state", value=state_digest(output / final), file=final),
        ]


def trace_entries(output: Path) -> list[dict[str, Any]]:
    """The whole trace of a train output, one entry per line."""
    return [json.loads(line) for line in (output / TRACE).read_bytes().splitlines() if line.strip()]


def _checkpoint(name: Any) -> str:
    """A checkpoint name from an output's result, refused unless it is one (never a path)."""
    if not isinstance(name, str) or checkpoint_update(name) is None:
        raise ValueError(f"{RESULT} names checkpoint {name!r}")
    return name


def kept_problems(output: Path, names: list[str]) -> list[str]:
    """The kept checkpoints before the final one must hold the state the trace records at their
    update (verify resumes from them, evaluation curves score them)."""
    try:
        recorded = {e.get("step"): e.get("state") for e in trace_entries(output) if "eval" not in e}
        for name in names:
            update, found = checkpoint_update(_checkpoint(name)), state_digest(output / CHECKPOINTS / name)
            if found != recorded.get(update):
                return [
                    f"{CHECKPOINTS}/{name}: its tensors give state {found[:12]}, the trace records "
                    f"{str(recorded.get(update))[:12]} at update {update} (forged or damaged)"
                ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"its kept checkpoints cannot be checked against its trace ({type(exc).__name__}: {exc})"]
    return []


KIND = TrainKind()
