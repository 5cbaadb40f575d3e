"""Checkpoints: exact restore of weights and AdamW state, atomicity, fallback past damage, pruning."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.config.schema import BYTE_VOCAB_SIZE, ModelConfig
from buildtrain.errors import CorruptObject, StepFailed
from buildtrain.steps.train import checkpoint
from buildtrain.steps.train.model import Transformer
from buildtrain.steps.train.optimizer import AdamW
from buildtrain.steps.train.state import (
    FROZEN,
    MODEL,
    OPTIMIZER,
    TRACE,
    TRAIN_STATE,
    digests,
    load_model,
    model_tensors,
    optimizer_tensors,
    save_tensors,
    state_tensors,
)
from buildtrain.store import layout, objects, trace

CONFIG = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32)
IDENTITY = {"step_hash": "a" * 64, "seed": 0}


def seeded(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def fresh(seed: int = 0) -> tuple[Transformer, AdamW]:
    """A tiny model and an AdamW with the trainer's two groups (decayed matrices, plain vectors)."""
    model = Transformer(CONFIG, BYTE_VOCAB_SIZE)
    model.initialize(seeded(seed))
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    return model, optimizer


def train_step(model: Transformer, optimizer: AdamW, step: int) -> None:
    tokens = torch.randint(0, BYTE_VOCAB_SIZE, (2, 9), generator=seeded(1000 + step))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.update()
    optimizer.zero_grad()


def state_at(step: int, **identity: Any) -> dict[str, Any]:
    return {**IDENTITY, **identity, "step": step, "cursor": 2 * step, "tokens": 16 * step}


def trace_to(step: int) -> list[dict[str, Any]]:
    return [{"step": s, "loss": f"{s:08x}", "lr": 0.01 * s} for s in range(1, step + 1)]


def history_to(folder: Path, step: int) -> checkpoint.Trace:
    """A trace holding the lines of updates 1 to `step`, none of them sealed yet."""
    history = checkpoint.Trace(folder)
    for entry in trace_to(step):
        history.append(entry)
    return history


def segment_entries(path: Path) -> list[dict[str, Any]]:
    return trace.parse((path / TRACE).read_bytes())[1]


def snapshot(model: Transformer, optimizer: AdamW) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state_tensors(model, optimizer).items()}


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


class Skips:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, path: Path, why: str) -> None:
        self.calls.append((path.name, why))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """Checkpoints at steps 1 and 2 of a tiny run, and the exact state tensors at each."""
    folder = tmp_path_factory.mktemp("run") / "checkpoints"
    model, optimizer = fresh()
    states = {}
    history = checkpoint.Trace(folder)
    for step in (1, 2):
        train_step(model, optimizer, step)
        history.append(trace_to(step)[-1])
        checkpoint.save(folder, step, model, optimizer, state_at(step), history)
        states[step] = snapshot(model, optimizer)
    return folder, states


def copy_of(saved: tuple[Path, Any], target: Path) -> Path:
    shutil.copytree(saved[0], target)
    return target


def test_save_writes_a_sealed_complete_checkpoint_and_no_temporary(saved: tuple[Path, Any]) -> None:
    folder, _ = saved
    assert sorted(p.name for p in folder.iterdir()) == ["step-000001", "step-000002"]
    path = folder / "step-000002"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [MODEL, OPTIMIZER, TRAIN_STATE, TRACE, objects.MANIFEST]
    )
    assert objects.verify(path) == []
    assert segment_entries(path) == trace_to(2)[1:]  # only the update since the checkpoint before
    pool = sorted(p.name for p in (folder.parent / "trace").iterdir())
    assert pool == sorted(f"{objects.sealed_files(p)[TRACE]}.jsonl" for p in folder.iterdir())


def test_load_newest_restores_weights_and_adamw_state_exactly(
    saved: tuple[Path, Any], tmp_path: Path
) -> None:
    folder, states = saved
    model, optimizer = fresh(seed=99)  # other weights, no optimizer state yet
    skips = Skips()
    resumed = checkpoint.load_newest(folder, model, optimizer, IDENTITY, skips)
    assert resumed is not None and skips.calls == []
    assert resumed.update == 2 and resumed.path == folder / "step-000002"
    assert resumed.state == {"format": checkpoint.STATE_FORMAT, **state_at(2)}
    assert resumed.trace.whole() == trace_to(2)  # read back through the chain of segments
    assert_same_tensors(snapshot(model, optimizer), states[2])
    assert any(name.endswith(".exp_avg_sq") for name in states[2])

    # And training on from the restored state gives the very bits an uninterrupted run gives.
    reference, reference_optimizer = fresh()
    for step in (1, 2, 3):
        train_step(reference, reference_optimizer, step)
    train_step(model, optimizer, 3)
    assert_same_tensors(snapshot(model, optimizer), snapshot(reference, reference_optimizer))
    assert digests(model_tensors(model)) == digests(model_tensors(reference))


@settings(max_examples=25, deadline=None)
@given(which=st.integers(min_value=0), index=st.integers(min_value=0), mask=st.integers(1, 255))
def test_a_checkpoint_with_a_flipped_byte_is_skipped_for_the_previous_one(
    saved: tuple[Path, Any], which: int, index: int, mask: int
) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = copy_of(saved, Path(scratch) / "checkpoints")
        files = sorted(p for p in (folder / "step-000002").iterdir())
        target = files[which % len(files)]
        raw = bytearray(target.read_bytes())
        raw[index % len(raw)] ^= mask
        target.write_bytes(bytes(raw))

        model, optimizer = fresh(seed=99)
        skips = Skips()
        resumed = checkpoint.load_newest(folder, model, optimizer, IDENTITY, skips)
        assert [name for name, _ in skips.calls] == ["step-000002"]
        assert resumed is not None and resumed.update == 1
        assert_same_tensors(snapshot(model, optimizer), saved[1][1])


def test_an_unsealed_checkpoint_is_skipped(saved: tuple[Path, Any], tmp_path: Path) -> None:
    folder = copy_of(saved, tmp_path / "checkpoints")
    (folder / "step-000002" / objects.MANIFEST).unlink()
    skips = Skips()
    resumed = checkpoint.load_newest(folder, *fresh(), IDENTITY, skips)
    assert resumed is not None and resumed.update == 1
    assert skips.calls == [("step-000002", "no manifest (incomplete or not sealed)")]


def test_temporary_folders_are_never_candidates(saved: tuple[Path, Any], tmp_path: Path) -> None:
    folder = copy_of(saved, tmp_path / "checkpoints")
    # Even complete, verifying copies under temporary or odd names are not resumed from.
    shutil.copytree(folder / "step-000002", folder / ".step-000009.tmp")
    shutil.copytree(folder / "step-000002", folder / "step-000010.tmp")
    (folder / "step-000011").write_bytes(b"a file, not a folder")
    assert checkpoint.candidates(folder) == [(2, folder / "step-000002"), (1, folder / "step-000001")]
    skips = Skips()
    resumed = checkpoint.load_newest(folder, *fresh(), IDENTITY, skips)
    assert resumed is not None and resumed.update == 2 and skips.calls == []


def test_a_checkpoint_of_another_configuration_is_skipped(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    model, optimizer = fresh()
    train_step(model, optimizer, 1)
    checkpoint.save(folder, 1, model, optimizer, state_at(1), history_to(folder, 1))
    at_one = snapshot(model, optimizer)
    train_step(model, optimizer, 2)
    checkpoint.save(folder, 2, model, optimizer, state_at(2, seed=7), history_to(folder, 2))

    skips = Skips()
    restored, restored_optimizer = fresh(seed=5)
    resumed = checkpoint.load_newest(folder, restored, restored_optimizer, IDENTITY, skips)
    assert resumed is not None and resumed.update == 1
    assert skips.calls == [("step-000002", "belongs to another configuration (seed)")]
    assert_same_tensors(snapshot(restored, restored_optimizer), at_one)
    # A skipped checkpoint is moved out of the candidates, so it never counts among those kept.
    assert checkpoint.candidates(folder) == [(1, folder / "step-000001")]
    assert len(list(folder.glob("damaged-step-000002.*"))) == 1

    skips = Skips()
    other = {**IDENTITY, "step_hash": "b" * 64}
    assert checkpoint.load_newest(folder, *fresh(), other, skips) is None
    assert [name for name, _ in skips.calls] == ["step-000001"]


def test_no_checkpoints_means_start_fresh(tmp_path: Path) -> None:
    skips = Skips()
    assert checkpoint.load_newest(tmp_path / "missing", *fresh(), IDENTITY, skips) is None
    (tmp_path / "empty").mkdir()
    assert checkpoint.load_newest(tmp_path / "empty", *fresh(), IDENTITY, skips) is None
    assert skips.calls == []


def test_saving_a_step_again_replaces_it(saved: tuple[Path, Any], tmp_path: Path) -> None:
    folder = copy_of(saved, tmp_path / "checkpoints")
    (folder / ".step-000002.tmp").mkdir()  # left over from a crash
    (folder / ".step-000002.tmp" / "junk").write_bytes(b"half written")
    model, optimizer = fresh(seed=3)
    path = checkpoint.save(folder, 2, model, optimizer, state_at(2), history_to(folder, 2))
    assert objects.verify(path) == []
    assert sorted(p.name for p in folder.iterdir()) == ["step-000001", "step-000002"]
    assert segment_entries(path) == trace_to(2)
    assert digests(model_tensors(model)) == digests(model_tensors(load_into_fresh(path)))


def load_into_fresh(path: Path) -> Transformer:
    model, _ = fresh(seed=42)
    load_model(model, path / MODEL)
    return model


def test_prune_keeps_the_newest_k_and_removes_temporaries(tmp_path: Path) -> None:
    for step in (1, 2, 3, 999_999, 1_000_000):
        (tmp_path / checkpoint.checkpoint_name(step)).mkdir()
    (tmp_path / ".step-1000001.tmp").mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [step for step, _ in checkpoint.candidates(tmp_path)] == [1_000_000, 999_999, 3, 2, 1]
    checkpoint.prune(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step-1000000", "step-999999"]
    checkpoint.prune(tmp_path, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step-1000000", "step-999999"]


def test_prune_keeps_what_an_uninterrupted_build_keeps(tmp_path: Path) -> None:
    """Checkpoints at 3 and 9 were taken at interruptions (every 4 is the schedule): they count for
    nothing, and the newest stays while it is the newest, since resume starts there."""
    every_four = lambda update: update % 4 == 0  # noqa: E731
    for step in (3, 4, 8, 9):
        (tmp_path / checkpoint.checkpoint_name(step)).mkdir()
    checkpoint.prune(tmp_path, 2, every_four)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000008", "step-000009"]
    (tmp_path / checkpoint.checkpoint_name(12)).mkdir()
    checkpoint.prune(tmp_path, 2, every_four)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000008", "step-000012"]


def test_checkpoint_name_is_zero_padded_and_matches_the_pattern() -> None:
    assert checkpoint.checkpoint_name(50) == "step-000050"
    assert layout.checkpoint_update(checkpoint.checkpoint_name(1_234_567)) == 1_234_567
    assert layout.checkpoint_update(".step-000050.tmp") is None


@pytest.mark.parametrize("name", [".step-000050.tmp", "step-000050.tmp", "step-50", "damaged-step-000050.1"])
def test_only_checkpoint_names_parse(name: str) -> None:
    assert layout.checkpoint_update(name) is None


def test_checkpoint_names_sort_by_update_not_as_strings() -> None:
    names = [checkpoint.checkpoint_name(at) for at in (999_999, 1_000_000, 2)]
    assert sorted(names)[-1] == "step-999999"  # as strings, the newest would be wrong
    assert [at for at, _ in layout.newest_first(Path(name) for name in names)] == [1_000_000, 999_999, 2]
    assert layout.newest_first([Path("notes.txt"), Path(".step-000001.tmp")]) == []


def test_load_model_refuses_a_different_tensor_set(tmp_path: Path) -> None:
    model, _ = fresh()
    tensors = model_tensors(model)
    save_tensors(tmp_path / "extra.safetensors", {**tensors, "stray": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"unexpected \['stray'\]"):
        load_model(model, tmp_path / "extra.safetensors")
    missing = dict(tensors)
    missing.pop("norm.weight")
    save_tensors(tmp_path / "missing.safetensors", missing)
    with pytest.raises(ValueError, match=r"missing \['norm\.weight'\]"):
        load_model(model, tmp_path / "missing.safetensors")


def test_state_tensors_name_every_parameter_and_moment_once() -> None:
    model, optimizer = fresh()
    assert optimizer_tensors(model, optimizer) == {}
    train_step(model, optimizer, 1)
    tensors = state_tensors(model, optimizer)
    parameters = [name for name, _ in model.named_parameters()]
    assert "output.weight" not in parameters  # tied to the embedding, listed once
    expected = {f"model.{n}" for n in parameters} | {
        f"optimizer.{n}.{slot}" for n in parameters for slot in ("exp_avg", "exp_avg_sq", "step")
    }
    assert set(tensors) == expected
    assert list(digests(tensors)) == sorted(tensors)


def test_a_checkpoint_renamed_or_linked_under_another_step_is_never_resumed(
    saved: tuple[Path, Any], tmp_path: Path
) -> None:
    """A folder's name must agree with its sealed manifest and its recorded step: renamed to a
    later step (even beyond train.steps) or linked, it is reported and moved aside."""
    folder = copy_of(saved, tmp_path / "checkpoints")
    (folder / "step-000002").rename(folder / "step-000030")
    (folder / "step-000040").symlink_to(folder / "step-000001")
    skips = Skips()
    resumed = checkpoint.load_newest(folder, *fresh(), IDENTITY, skips)
    assert resumed is not None and resumed.update == 1
    assert [name for name, _ in skips.calls] == ["step-000040", "step-000030"]
    assert checkpoint.candidates(folder) == [(1, folder / "step-000001")]


def test_the_torch_free_layout_names_the_same_state_file() -> None:
    assert layout.TRAIN_STATE == TRAIN_STATE


def test_a_checkpoint_taken_at_an_interruption_is_no_boundary_of_the_trace(tmp_path: Path) -> None:
    """Resumed from a checkpoint taken at an interruption, the next scheduled checkpoint seals the
    very segment an uninterrupted build seals: an output's files do not depend on interruptions.
    The resume reads that checkpoint's own segment, never the segments before it."""
    model, optimizer = fresh()
    lines = trace_to(4)
    straight = tmp_path / "straight" / "checkpoints"
    history = checkpoint.Trace(straight)
    for step in (1, 2, 3, 4):
        history.append(lines[step - 1])
        if step % 2 == 0:
            checkpoint.save(straight, step, model, optimizer, state_at(step), history)

    interrupted = tmp_path / "interrupted" / "checkpoints"
    history = checkpoint.Trace(interrupted)
    for step in (1, 2, 3):
        history.append(lines[step - 1])
        if step == 2:
            checkpoint.save(interrupted, step, model, optimizer, state_at(step), history)
    checkpoint.save(interrupted, 3, model, optimizer, state_at(3), history, boundary=False)
    (interrupted.parent / "trace" / f"{history.head}.jsonl").unlink()  # resume must not need it
    resumed = checkpoint.load_newest(interrupted, *fresh(seed=9), IDENTITY, Skips())
    assert resumed is not None and resumed.update == 3
    resumed.trace.reopen((resumed.path / TRACE).read_bytes())
    resumed.trace.append(lines[3])
    checkpoint.save(interrupted, 4, model, optimizer, state_at(4), resumed.trace)

    ours, theirs = interrupted / "step-000004", straight / "step-000004"
    assert (ours / TRACE).read_bytes() == (theirs / TRACE).read_bytes()
    assert segment_entries(ours) == lines[2:]
    with pytest.raises(StepFailed, match="damaged"):  # the segment of updates 1-2 was removed above
        resumed.trace.whole()
    assert checkpoint.candidates(interrupted) == []  # moved aside: the next build starts afresh


# -- weights that do not train (LoRA's base model) --------------------------------------------


def partly_frozen(seed: int = 0) -> tuple[Transformer, AdamW]:
    """A tiny model of which only the attention projections train, as adapters do under LoRA."""
    model, _ = fresh(seed)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.endswith("wqkv.weight"))
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, AdamW([{"params": trained, "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


class PartlyFrozenRun:
    """Checkpoints of a partly frozen model, as the trainer takes them (one `FrozenFile`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.model, self.optimizer = partly_frozen()
        self.frozen, self.history = checkpoint.FrozenFile(), checkpoint.Trace(folder)

    def update_and_save(self, step: int) -> Path:
        train_step(self.model, self.optimizer, step)
        self.history.append(trace_to(step)[-1])
        return checkpoint.save(
            self.folder, step, self.model, self.optimizer, state_at(step), self.history, frozen=self.frozen
        )


def test_frozen_weights_are_written_once_then_linked_and_resume_exactly(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    run = PartlyFrozenRun(folder)
    first, second = run.update_and_save(1), run.update_and_save(2)
    model, optimizer, frozen = run.model, run.optimizer, run.frozen
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert set(safetensors.torch.load_file(str(second / MODEL))) == trained
    assert (first / FROZEN).stat().st_ino == (second / FROZEN).stat().st_ino  # one file, linked
    assert checkpoint.frozen_file(second) == frozen and frozen.path == second / FROZEN

    other, other_optimizer = partly_frozen(seed=99)  # other weights, frozen ones included
    resumed = checkpoint.load_newest(folder, other, other_optimizer, IDENTITY, Skips())
    assert resumed is not None and resumed.update == 2
    assert_same_tensors(snapshot(other, other_optimizer), snapshot(model, optimizer))


def test_a_frozen_file_changed_on_disk_is_never_linked_into_a_new_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    run = PartlyFrozenRun(folder)
    first = run.update_and_save(1)
    with open(first / FROZEN, "r+b") as handle:  # the same file, changed in place
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)[0]
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last ^ 1]))
    with pytest.raises(CorruptObject, match="frozen weights changed on disk"):
        run.update_and_save(2)
    assert not (folder / "step-000002").exists()  # refused before it was committed
