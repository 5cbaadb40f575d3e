"""A scripted corruption sweep: every kind of stored object, every way of damaging it.

Kinds: the data, train, eval and export outputs, a checkpoint, an evaluation result, a plan, its
metadata, a stamp, the stat cache and a lock. Modes: flip a byte, truncate, delete, replace by a
directory, swap with another plan's object, replace by a symbolic link (to an intact copy outside
the store: content that is right but not the store's own is still refused), and, for folders,
replace by a file.

`test_every_kind_and_mode_is_detected_and_never_read_as_valid` covers the whole cross product in
process (fsck's scan plus every reader; fast). Running `bt fsck` and `bt run` on every case would
take minutes (each rebuilt train or eval step starts torch), so the end-to-end tests combine
cases: together they damage every kind and use every mode at least once, and each asserts that
`bt fsck` exits 5 naming what is damaged, that `bt run` rebuilds, that the final weights, the
evaluation and the export equal a clean build's, and that fsck then finds the store whole.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import attrs
from conftest import MICRO, run_bt, step_digests

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.errors import BuildtrainError, ExitCode
from buildtrain.plan.stored import load_plan
from buildtrain.steps.eval.cache import cache_key, lookup
from buildtrain.store import objects
from buildtrain.store.checkpoints import checkpoint_problems
from buildtrain.store.outputs import STAMP_FORMAT
from buildtrain.store.store import Store
from buildtrain.verify.fsck import scan

MODES = ("flip", "truncate", "delete", "directory", "swap", "symlink", "file")
FOLDER_KINDS = ("data output", "train output", "eval output", "export output", "checkpoint")
FILE_KINDS = ("eval entry", "plan", "plan metadata", "stamp", "stat cache", "lock")
# Deleting a whole cache or index file is no damage: it is rebuilt (or was only a hint); a lock
# holds no data, and another store's stat cache is a valid cache (entries match only by stat).
NOT_DAMAGE = {(kind, "delete") for kind in FILE_KINDS}
NOT_APPLICABLE = {("lock", "flip"), ("lock", "truncate"), ("lock", "swap"), ("stat cache", "swap")} | {
    (kind, "file")
    for kind in FILE_KINDS  # "a folder replaced by a file" is for folders
}
# The file damaged inside a folder object by flip, truncate and delete.
INNER = {
    "data output": "data.json",
    "train output": "checkpoints/step-000012/model.safetensors",
    "eval output": "eval.json",
    "export output": "model.safetensors",
    "checkpoint": "model.safetensors",
}


@attrs.frozen
class World:
    """A copy of the micro store with every kind of object, and another plan's objects to swap in."""

    root: Path
    plan: str
    hashes: dict[str, str]  # label -> step hash
    eval_key: str
    other: Path  # the other plan's store (read only: never mutated)
    other_plan: str

    @property
    def store(self) -> Store:
        return Store(self.root)

    def path(self, kind: str) -> Path:
        h = self.hashes
        return {
            "data output": self.root / "steps" / h["data:main"],
            "train output": self.root / "steps" / h["train:main"],
            "eval output": self.root / "steps" / h["eval"],
            "export output": self.root / "steps" / h["export"],
            "checkpoint": self.root / "work" / h["train:main"] / "checkpoints" / "step-000008",
            "eval entry": self.root / "evals" / f"{self.eval_key}.json",
            "plan": self.root / "plans" / f"{self.plan}.json",
            "plan metadata": self.root / "plans" / f"{self.plan}.meta.json",
            "stamp": self.store.outputs.stamp_path(h["train:main"]),
            "stat cache": self.root / "cache" / "files.json",
            "lock": self.root / "locks" / f"{h['data:main']}.lock",
        }[kind]

    def foreign(self, kind: str) -> Path:
        """The same kind of object, made for another plan (or, for a stamp, another step)."""
        other = load_plan(Store(self.other), self.other_plan)
        finetune = other.by_label("train:finetune").hash
        return {
            "data output": self.other / "steps" / other.by_label("data:finetune").hash,
            "train output": self.other / "steps" / finetune,
            "eval output": self.other / "steps" / other.by_label("eval").hash,
            "export output": self.other / "steps" / other.by_label("export").hash,
            # Same name, sealed and intact: only its recorded identity (the step hash) differs.
            "checkpoint": self.other / "steps" / finetune / "checkpoints" / "step-000008",
            "eval entry": next((self.other / "evals").glob("*.json")),
            "plan": self.other / "plans" / f"{self.other_plan}.json",
            "plan metadata": self.other / "plans" / f"{self.other_plan}.meta.json",
            "stamp": self.store.outputs.stamp_path(self.hashes["data:main"]),
        }[kind]

    def object_name(self, kind: str) -> str:
        return self.path(kind).relative_to(self.root).as_posix()


def world_at(root: Path, micro_built, stages_built) -> World:
    store = Store(root)
    plan = load_plan(store, micro_built[1])
    hashes = {step.label: step.hash for step in plan.steps}
    key, _ = cache_key(
        plan.by_label("eval"),
        store.outputs.path(hashes["train:main"]),
        store.outputs.path(hashes["data:main"]),
    )
    return World(root, micro_built[1], hashes, key, stages_built[0], stages_built[1])


def make_world(tmp_path: Path, micro_built, stages_built) -> World:
    """The micro store copied to `tmp_path/.bt`, with stamps, checkpoints in work/, a stat cache
    and a lock file added, so that it holds every kind of object, all intact."""
    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    world = world_at(root, micro_built, stages_built)
    store, hashes = world.store, world.hashes
    for step_hash in hashes.values():
        assert store.outputs.check(step_hash) == []  # writes each output's stamp
    # A train step in progress: its checkpoints in work/ (copies of the finished ones).
    train = hashes["train:main"]
    shutil.copytree(store.outputs.path(train) / "checkpoints", store.outputs.work_dir(train) / "checkpoints")
    source = tmp_path / "corpus.txt"
    source.write_text("1+1=2\n" * 100)
    os.utime(source, (time.time() - 60, time.time() - 60))  # older than the racy window
    cache = store.stat_cache()
    cache.digest_of(source)
    cache.save()
    with store.locks.hold(hashes["data:main"]):
        pass
    # A complete plan index, whatever lookups the shared store has seen: a deleted plan is then
    # also an index entry without its plan, which is still no damage.
    store.plans.rebuild_index()
    assert scan(store).damaged == []
    return world


def flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def damage(world: World, kind: str, mode: str, outside: Path) -> None:
    """Apply `mode` to the object of `kind` in `world`."""
    target = world.path(kind)
    folder = kind in FOLDER_KINDS
    inner = target / INNER[kind] if folder else target
    if mode == "flip":
        flip_byte(inner)
    elif mode == "truncate":
        inner.write_bytes(inner.read_bytes()[: inner.stat().st_size // 2])
    elif mode == "delete":
        inner.unlink()
    elif mode == "directory":
        place = target / objects.MANIFEST if folder else target
        place.unlink()
        place.mkdir()
        (place / "junk").write_bytes(b"x")
    elif mode == "swap":
        foreign = world.foreign(kind)
        if folder:
            shutil.rmtree(target)
            shutil.copytree(foreign, target)
        else:
            target.write_bytes(foreign.read_bytes())
    elif mode == "file":
        shutil.rmtree(target)
        target.write_bytes(b"not a folder")
    elif mode == "symlink":  # the object itself, intact, but kept outside the store
        outside.mkdir(parents=True, exist_ok=True)
        moved = outside / target.name
        shutil.move(target, moved)
        target.symlink_to(moved, target_is_directory=folder)
    else:
        raise AssertionError(mode)


def rejected_by_readers(world: World, kind: str) -> bool:
    """Whether every reader of this kind of object refuses it now (nothing damaged read as valid)."""
    store, h = world.store, world.hashes
    if kind in ("data output", "train output", "eval output", "export output"):
        step_hash = world.path(kind).name
        return bool(store.outputs.check(step_hash)) and bool(store.outputs.verify(step_hash))
    if kind == "checkpoint":
        return bool(checkpoint_problems(world.path(kind), 8, {"step_hash": h["train:main"]}))
    if kind == "eval entry":
        return lookup(store, world.eval_key) is None
    if kind == "plan":
        try:
            load_plan(store, world.plan)
        except BuildtrainError:
            return True
        return False
    if kind == "plan metadata":
        return store.plans.meta(world.plan) == {}
    if kind == "stamp":
        return store.outputs.read_stamp(h["train:main"]) is None
    if kind == "stat cache":
        return store.stat_cache().entries == {}
    if kind == "lock":  # a lock is not read, but taking it must still work
        with store.locks.hold(h["data:main"], wait=False):
            return world.path(kind).is_file() and not world.path(kind).is_symlink()
    raise AssertionError(kind)


CASES = [
    (kind, mode)
    for kind in (*FOLDER_KINDS, *FILE_KINDS)
    for mode in MODES
    if (kind, mode) not in NOT_APPLICABLE
]


def test_every_kind_and_mode_is_detected_and_never_read_as_valid(micro_built, stages_built, tmp_path):
    clean = make_world(tmp_path / "clean", micro_built, stages_built).root
    for index, (kind, mode) in enumerate(CASES):
        case = tmp_path / f"case{index}"
        shutil.copytree(clean, case / ".bt", symlinks=True)
        world = world_at(case / ".bt", micro_built, stages_built)
        damage(world, kind, mode, case / "outside")
        named = [item.object for item in scan(world.store).damaged]
        if (kind, mode) in NOT_DAMAGE:
            assert named == [], (kind, mode, named)
        else:
            assert named == [world.object_name(kind)], (kind, mode, named)
            assert rejected_by_readers(world, kind), (kind, mode)
        shutil.rmtree(case)


def forge_stamp(store: Store, step_hash: str) -> None:
    """Stamp an output as verified as it is now: what decay that keeps size, mtime and ctime
    looks like to a stamp (a real disk can do that; a test cannot without forging)."""
    body = {"format": STAMP_FORMAT, "step": step_hash, "files": store.outputs._stats(step_hash)}
    store.replace_file(
        store.outputs.stamp_path(step_hash), canonical_bytes({**body, "seal": digest("stamp", body)})
    )


def fsck_names(root: Path, tmp_path: Path) -> tuple[int, str]:
    """`bt fsck` on a copy (fsck drops the stamps of damaged outputs; the original keeps them)."""
    copy = tmp_path / "fsck-copy" / ".bt"
    shutil.copytree(root, copy, symlinks=True)
    result = run_bt("fsck", store=copy)
    shutil.rmtree(copy.parent)
    assert "Traceback" not in result.stderr
    return result.returncode, result.stderr


def assert_whole_and_clean(world: World, micro_built) -> None:
    """The build equals a clean one (weights, evaluation, export) and fsck finds nothing."""
    assert step_digests(world.root, world.plan) == micro_built[2]
    after = run_bt("fsck", store=world.root)
    assert after.returncode == ExitCode.OK, after.stderr


def test_caches_indexes_and_cheap_outputs_damaged_together_are_rebuilt(micro_built, stages_built, tmp_path):
    """data/directory, eval output/file, export/symlink, export file/truncate, plan/delete, plan
    metadata/flip, stamp/symlink, stat cache/directory, lock/directory: no torch step needs to
    run again."""
    world = make_world(tmp_path, micro_built, stages_built)
    cases = [
        ("data output", "directory"),  # MANIFEST.json replaced by a folder (once: never rebuildable)
        ("lock", "directory"),
        ("eval output", "file"),  # an output replaced by a file (once: never rebuildable)
        ("export output", "truncate"),
        ("plan metadata", "flip"),
        ("stamp", "symlink"),
        ("stat cache", "directory"),
        ("plan", "delete"),
    ]
    for kind, mode in cases:
        damage(world, kind, mode, tmp_path / "outside")
    code, report = fsck_names(world.root, tmp_path)
    assert code == ExitCode.CORRUPT, report
    for kind, mode in cases:
        assert (f": {world.object_name(kind)}" in report) is ((kind, mode) not in NOT_DAMAGE), (kind, report)

    result = run_bt("run", str(MICRO), store=world.root)  # a deleted plan comes back from its preset
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "data:main" in result.stderr and "moved to" in result.stderr
    assert_whole_and_clean(world, micro_built)
    export = world.store.outputs.path(world.hashes["export"])  # now a link to an intact copy outside
    shutil.move(export, tmp_path / "outside" / "export")
    export.symlink_to(tmp_path / "outside" / "export", target_is_directory=True)
    result = run_bt("run", world.plan, store=world.root)
    assert result.returncode == 0 and "export" in result.stderr and "moved to" in result.stderr, result.stderr
    assert (tmp_path / "outside" / "export" / objects.MANIFEST).is_file()  # moved, never followed
    assert_whole_and_clean(world, micro_built)
    gc = run_bt("gc", store=world.root)
    assert gc.returncode == 0 and "quarantine/" in gc.stderr, gc.stderr
    assert (tmp_path / "outside" / "export" / objects.MANIFEST).is_file()


def test_foreign_outputs_results_and_checkpoints_and_hidden_decay_are_rebuilt(
    micro_built, stages_built, tmp_path
):
    """Defects 2, 3, 4 and 6 of issue 14 in one build: another plan's train output under this
    train step's hash, another plan's evaluation result under this evaluation's key, checkpoints
    flipped, renamed beyond train.steps and linked, and data decayed under a stamp that still
    matches. The run must rebuild all of it (training resumes from the only intact checkpoint)."""
    world = make_world(tmp_path, micro_built, stages_built)
    store, train = world.store, world.hashes["train:main"]
    for label in ("eval", "export"):  # so that the evaluation result is read
        shutil.rmtree(store.outputs.path(world.hashes[label]))
    damage(world, "train output", "swap", tmp_path / "outside")
    damage(world, "eval entry", "swap", tmp_path / "outside")
    checkpoints = store.outputs.work_dir(train) / "checkpoints"
    flip_byte(checkpoints / "step-000012" / "model.safetensors")
    (checkpoints / "step-000008").rename(checkpoints / "step-000030")
    (checkpoints / "step-000016").symlink_to(
        shutil.copytree(checkpoints / "step-000004", tmp_path / "step-000004")
    )
    flip_byte(store.outputs.path(world.hashes["data:main"]) / "heldout-00000.bin")
    forge_stamp(store, world.hashes["data:main"])
    assert store.outputs.check(world.hashes["data:main"]) == []  # the stamp is fooled

    code, report = fsck_names(world.root, tmp_path)
    assert code == ExitCode.CORRUPT, report
    for name in (
        f"steps/{world.hashes['data:main']}",
        f"steps/{train}",
        f"evals/{world.eval_key}.json",
        *(f"work/{train}/checkpoints/step-0000{n}" for n in ("12", "16", "30")),
    ):
        assert f": {name}\n" in report, (name, report)

    result = run_bt("run", world.plan, store=world.root)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "input data:main is damaged; rebuilding it" in result.stderr
    log = next((tmp_path / "experiments").glob("*/train.log")).read_text()
    events = [json.loads(line) for line in log.splitlines()]
    skipped = {e["checkpoint"] for e in events if e.get("event") == "checkpoint_skipped"}
    assert {"step-000012", "step-000016", "step-000030"} <= skipped, skipped
    assert [e["step"] for e in events if e.get("event") == "resumed"] == [4]
    assert_whole_and_clean(world, micro_built)


def test_two_runs_meeting_one_damaged_output_both_succeed(micro_built, stages_built, tmp_path):
    """The damaged output is moved aside and rebuilt under the step's lock, by one run only."""
    world = make_world(tmp_path, micro_built, stages_built)
    flip_byte(world.store.outputs.path(world.hashes["data:main"]) / "train-00000.bin")
    environment = {**os.environ, "BT_STORE": str(world.root), "BT_EXPERIMENTS": str(tmp_path / "experiments")}
    command = [sys.executable, "-m", "buildtrain", "run", world.plan]
    runs = [subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [run.communicate(timeout=300)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0], outputs
    assert len(list((world.root / "quarantine").iterdir())) == 1
    assert_whole_and_clean(world, micro_built)


def test_fsck_rehashes_past_a_matching_stamp_and_drops_it(micro_built, stages_built, tmp_path):
    """Decay under a stamp that still matches: fsck finds it anyway and drops the stamp, so the
    advice it gives ("bt run rebuilds it") holds: the next check re-hashes and refuses it."""
    world = make_world(tmp_path, micro_built, stages_built)
    store, train = world.store, world.hashes["train:main"]
    flip_byte(store.outputs.path(train) / INNER["train output"])
    forge_stamp(store, train)
    assert store.outputs.check(train) == []  # the stamp alone is fooled
    assert [item.object for item in scan(store).damaged] == [f"steps/{train}"]
    assert store.outputs.read_stamp(train) is None
    assert store.outputs.check(train) != []
