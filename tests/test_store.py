"""The store: sealed directories (objects.py) and plans, prefixes and locks (store.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.errors import CorruptObject, Locked, UsageError
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.stored import load_plan, save_plan
from buildtrain.sources import durable
from buildtrain.store import objects
from buildtrain.store.store import Store

# -- objects: seal / verify / commit ------------------------------------------------------------

file_names = st.sampled_from(["a.bin", "b.json", "sub/c.safetensors", "sub/deeper/d.txt", "e"])
file_trees = st.dictionaries(file_names, st.binary(min_size=1, max_size=64), min_size=1, max_size=5)


@contextmanager
def no_fsync() -> Iterator[None]:
    """Skip the (slow, here irrelevant) fsyncs inside property tests that seal many directories."""
    with mock.patch.object(objects.os, "fsync", lambda fd: None):
        yield


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def flip_byte(path: Path, index: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[index % len(data)] ^= mask
    path.write_bytes(bytes(data))


@settings(max_examples=30, deadline=None)
@given(files=file_trees, digests=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
def test_seal_then_verify_is_clean_and_manifest_lists_every_file(
    files: dict[str, bytes], digests: dict[str, str]
) -> None:
    with tempfile.TemporaryDirectory() as scratch, no_fsync():
        root = Path(scratch) / "out"
        write_tree(root, files)
        body = objects.seal(root, digests)
        assert objects.verify(root) == []
        assert objects.verify(root, contents=False) == []
        manifest = objects.read_manifest(root)
        assert manifest["digests"] == digests
        assert manifest["files"] == {
            name: {"blake3": blake3.blake3(data).hexdigest(), "size": len(data)}
            for name, data in files.items()
        }
        assert body["files"] == manifest["files"]


@settings(max_examples=50, deadline=None)
@given(
    files=file_trees,
    which=st.integers(min_value=0),
    index=st.integers(min_value=0),
    mask=st.integers(min_value=1, max_value=255),
)
def test_any_single_flipped_byte_in_any_file_is_detected(
    files: dict[str, bytes], which: int, index: int, mask: int
) -> None:
    with tempfile.TemporaryDirectory() as scratch, no_fsync():
        root = Path(scratch) / "out"
        write_tree(root, files)
        objects.seal(root)
        targets = [*sorted(files), objects.MANIFEST]  # the manifest itself is a target too
        flip_byte(root / targets[which % len(targets)], index, mask)
        assert objects.verify(root) != []


def test_verify_without_contents_checks_sizes_only(tmp_path: Path) -> None:
    write_tree(tmp_path, {"a.bin": b"0123456789", "b.bin": b"abcdef"})
    objects.seal(tmp_path)
    flip_byte(tmp_path / "a.bin", 3, 0xFF)  # same size, other content
    assert objects.verify(tmp_path, contents=False) == []
    assert objects.verify(tmp_path) == ["a.bin: content does not match its blake3"]
    (tmp_path / "b.bin").write_bytes(b"abcdefg")  # other size
    assert objects.verify(tmp_path, contents=False) == ["b.bin: size 7, manifest says 6"]


def test_missing_manifest_means_incomplete(tmp_path: Path) -> None:
    write_tree(tmp_path, {"a.bin": b"data"})
    problems = objects.verify(tmp_path)
    assert len(problems) == 1 and "no manifest" in problems[0] and "incomplete" in problems[0]


def test_extra_and_missing_files_are_reported(tmp_path: Path) -> None:
    write_tree(tmp_path, {"a.bin": b"data", "b.bin": b"more"})
    objects.seal(tmp_path)
    (tmp_path / "intruder.bin").write_bytes(b"x")
    (tmp_path / "b.bin").unlink()
    assert objects.verify(tmp_path) == ["intruder.bin: not in the manifest", "b.bin: missing"]
    assert objects.verify(tmp_path, contents=False) == ["intruder.bin: not in the manifest", "b.bin: missing"]


def test_damaged_manifest_json_is_reported_not_raised(tmp_path: Path) -> None:
    write_tree(tmp_path, {"a.bin": b"data"})
    objects.seal(tmp_path)
    (tmp_path / objects.MANIFEST).write_bytes(b"\xff{not json")
    problems = objects.verify(tmp_path)
    assert len(problems) == 1 and "not valid JSON" in problems[0]
    with pytest.raises(ValueError):
        objects.read_manifest(tmp_path)


def test_manifest_rewritten_non_canonically_is_rejected(tmp_path: Path) -> None:
    """Same JSON value, different bytes: the manifest must be exactly its canonical encoding."""
    write_tree(tmp_path, {"a.bin": b"data"})
    objects.seal(tmp_path)
    body = json.loads((tmp_path / objects.MANIFEST).read_bytes())
    (tmp_path / objects.MANIFEST).write_text(json.dumps(body, indent=2))
    assert objects.verify(tmp_path) == ["manifest does not match its own digest"]


def test_commit_renames_into_place_creating_parents(tmp_path: Path) -> None:
    temporary = tmp_path / "tmp" / "step.abc"
    write_tree(temporary, {"a.bin": b"data"})
    objects.seal(temporary, name="abc")  # the name it will be found under
    final = tmp_path / "steps" / "deep" / "abc"
    objects.commit(temporary, final)
    assert not temporary.exists()
    assert objects.verify(final) == []


def test_write_bytes_durably_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    durable.write_bytes_durably(target, b"first")
    durable.write_bytes_durably(target, b"second")  # replaces an existing file
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@pytest.mark.parametrize("size", [0, 1, (1 << 20) + 7, durable.MMAP_THRESHOLD + 3])
def test_hash_file_matches_blake3_of_the_bytes_on_both_paths(tmp_path: Path, size: int) -> None:
    data = (bytes(range(251)) * (size // 251 + 1))[:size]
    path = tmp_path / "f"
    path.write_bytes(data)
    assert objects.hash_file(path) == (blake3.blake3(data).hexdigest(), size)


# -- store: plans ---------------------------------------------------------------------------------


def make_plan(name: str = "p", value: int = 1) -> Plan:
    data = Step.create("data:main", "data", {"data": {"n": value}}, {"sources": []}, {"tool": "x"})
    train = Step.create("train:main", "train", {"lr": 0.5}, {"data": data.hash, "init": None}, {"tool": "y"})
    return Plan.create(name, {"name": name, "value": value}, (data, train), (train.hash,))


def test_save_plan_then_load_plan_round_trips(tmp_path: Path) -> None:
    store = Store(tmp_path / ".bt")
    plan = make_plan()
    save_plan(store, plan, preset="presets/x.toml")
    loaded = load_plan(store, plan.hash)
    assert loaded == plan
    assert loaded.hash == plan.hash
    assert store.plans.hashes() == [plan.hash]
    meta = store.plans.meta(plan.hash)
    assert meta["preset"] == "presets/x.toml" and "created" in meta and "planned" in meta
    save_plan(store, plan, preset="other.toml")  # saving again keeps the plan and the creation time
    assert load_plan(store, plan.hash) == plan
    assert store.plans.meta(plan.hash)["created"] == meta["created"]
    assert store.plans.meta(plan.hash)["preset"] == "other.toml"


def fake_plan_files(store: Store, hashes: list[str]) -> None:
    store.plans.dir.mkdir(parents=True, exist_ok=True)
    for plan_hash in hashes:
        (store.plans.dir / f"{plan_hash}.json").write_bytes(b"{}")
        (store.plans.dir / f"{plan_hash}.meta.json").write_bytes(b"{}")


def test_resolve_full_hash_and_unique_prefix(tmp_path: Path) -> None:
    store = Store(tmp_path)
    one, two = "abcd" + "0" * 60, "abce" + "1" * 60
    fake_plan_files(store, [one, two])
    assert store.plans.hashes() == [one, two]  # meta files are not plans
    assert store.plans.resolve(one) == one
    assert store.plans.resolve("abcd") == one
    assert store.plans.resolve("abce1") == two
    assert store.plans.resolve("  ABCD0 \n") == one  # case and surrounding whitespace do not matter


def test_resolve_ambiguous_prefix_is_a_usage_error(tmp_path: Path) -> None:
    store = Store(tmp_path)
    fake_plan_files(store, ["abcd" + "0" * 60, "abcd" + "1" * 60])
    with pytest.raises(UsageError, match="ambiguous"):
        store.plans.resolve("abcd")
    assert store.plans.resolve("abcd1") == "abcd" + "1" * 60


@pytest.mark.parametrize("ref", ["abc", "", "xyz0123", "abcd-", "../abcd"])
def test_resolve_rejects_short_or_non_hex_refs(tmp_path: Path, ref: str) -> None:
    store = Store(tmp_path)
    fake_plan_files(store, ["abcd" + "0" * 60])
    with pytest.raises(UsageError, match="at least 4 hex digits"):
        store.plans.resolve(ref)


def test_resolve_unknown_is_a_usage_error(tmp_path: Path) -> None:
    store = Store(tmp_path / "nothing-here")
    with pytest.raises(UsageError, match="no plan"):
        store.plans.resolve("abcd")
    fake_plan_files(store, ["abcd" + "0" * 60])
    with pytest.raises(UsageError, match="no plan"):
        store.plans.resolve("abce")


def test_load_plan_of_garbage_raises_corrupt_object(tmp_path: Path) -> None:
    store = Store(tmp_path)
    plan = make_plan()
    save_plan(store, plan)
    (store.plans.dir / f"{plan.hash}.json").write_bytes(b"\x00garbage")
    with pytest.raises(CorruptObject, match="damaged"):
        load_plan(store, plan.hash)


def test_load_plan_under_another_hash_raises_corrupt_object(tmp_path: Path) -> None:
    """A valid plan stored under the wrong name does not match its hash."""
    store = Store(tmp_path)
    plan, other = make_plan(value=1), make_plan(value=2)
    save_plan(store, plan)
    save_plan(store, other)
    (store.plans.dir / f"{plan.hash}.json").write_bytes((store.plans.dir / f"{other.hash}.json").read_bytes())
    with pytest.raises(CorruptObject, match="does not match its hash"):
        load_plan(store, plan.hash)


@settings(max_examples=40, deadline=None)
@given(index=st.integers(min_value=0), mask=st.integers(min_value=1, max_value=255))
def test_any_flipped_byte_in_a_stored_plan_raises_corrupt_object(index: int, mask: int) -> None:
    with tempfile.TemporaryDirectory() as scratch, no_fsync():
        store = Store(Path(scratch))
        plan = make_plan()
        save_plan(store, plan)
        flip_byte(store.plans.dir / f"{plan.hash}.json", index, mask)
        with pytest.raises(CorruptObject):
            load_plan(store, plan.hash)


# -- store: locks ---------------------------------------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from buildtrain.store.store import Store

    with Store(Path(sys.argv[1])).locks.hold(sys.argv[2], wait=False):
        print("locked", flush=True)
        sys.stdin.read()  # hold the lock until the test closes our stdin
    """
)


def hold_lock(root: Path, step_hash: str) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), step_hash],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def release(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(timeout=30) == 0


def test_second_lock_in_another_process_raises_locked_and_names_the_holder(tmp_path: Path) -> None:
    store, step_hash = Store(tmp_path), "f00d" * 16
    holder = hold_lock(tmp_path, step_hash)
    try:
        assert (store.locks.dir / f"{step_hash}.lock").read_text() == str(holder.pid)
        with pytest.raises(Locked, match=f"pid {holder.pid}"), store.locks.hold(step_hash, wait=False):
            pytest.fail("acquired a lock that another process holds")
    finally:
        release(holder)
    with store.locks.hold(step_hash, wait=False) as fd:  # free once the holder is gone
        assert isinstance(fd, int)
        assert (store.locks.dir / f"{step_hash}.lock").read_text() == str(os.getpid())


def test_waiting_lock_reports_the_holder_then_acquires(tmp_path: Path) -> None:
    store, step_hash = Store(tmp_path), "beef" * 16
    holder = hold_lock(tmp_path, step_hash)
    seen: list[str] = []

    def on_wait(who: str) -> None:
        seen.append(who)
        release(holder)  # the holder goes away while we wait

    try:
        with store.locks.hold(step_hash, on_wait=on_wait):
            assert (store.locks.dir / f"{step_hash}.lock").read_text() == str(os.getpid())
    finally:
        if holder.poll() is None:
            release(holder)
    assert seen == [str(holder.pid)]


def test_locks_of_different_steps_are_independent(tmp_path: Path) -> None:
    store = Store(tmp_path)
    holder = hold_lock(tmp_path, "aaaa" * 16)
    try:
        with store.locks.hold("bbbb" * 16, wait=False):
            pass
    finally:
        release(holder)


# -- every object bound to its name; links and odd entries -------------------------------------


def test_a_sealed_folder_verifies_only_under_the_name_it_was_sealed_for(tmp_path: Path) -> None:
    write_tree(tmp_path / "tmp" / "x", {"a.bin": b"data"})
    objects.publish(tmp_path / "tmp" / "x", tmp_path / "steps" / ("a" * 64))
    assert objects.verify(tmp_path / "steps" / ("a" * 64)) == []
    os.rename(tmp_path / "steps" / ("a" * 64), tmp_path / "steps" / ("b" * 64))  # copied, renamed
    (problem,) = objects.verify(tmp_path / "steps" / ("b" * 64))
    assert "foreign" in problem
    (tmp_path / "steps" / ("a" * 64)).symlink_to(tmp_path / "steps" / ("b" * 64))
    assert "symbolic link" in objects.verify(tmp_path / "steps" / ("a" * 64))[0]


def test_links_and_non_files_inside_a_sealed_folder_are_problems(tmp_path: Path) -> None:
    write_tree(tmp_path / "out", {"a.bin": b"data", "b.bin": b"more"})
    objects.seal(tmp_path / "out")
    (tmp_path / "out" / "b.bin").unlink()
    (tmp_path / "out" / "b.bin").symlink_to(tmp_path / "elsewhere")
    os.mkfifo(tmp_path / "out" / "pipe")
    problems = objects.verify(tmp_path / "out")
    assert "b.bin: a symbolic link (foreign)" in problems and "pipe: not a regular file" in problems
    (tmp_path / "file").write_bytes(b"x")
    assert objects.verify(tmp_path / "file") == ["is not a folder"]


@pytest.mark.parametrize("content", [b"null", b"[]", b"{}", None])
def test_damaged_plan_metadata_reads_as_empty_and_bt_plan_replaces_it(
    tmp_path: Path, content: bytes | None
) -> None:
    store = Store(tmp_path)
    plan = make_plan()
    save_plan(store, plan, preset="p.toml")
    assert store.plans.meta(plan.hash)["preset"] == "p.toml"
    meta = tmp_path / "plans" / f"{plan.hash}.meta.json"
    meta.unlink()
    if content is None:
        meta.mkdir()
    else:
        meta.write_bytes(content)
    assert store.plans.meta(plan.hash) == {}
    save_plan(store, plan, preset="p.toml")
    assert store.plans.meta(plan.hash)["preset"] == "p.toml"
    other = make_plan(value=2)
    save_plan(store, other, preset="q.toml")
    meta.write_bytes((tmp_path / "plans" / f"{other.hash}.meta.json").read_bytes())  # another plan's
    assert store.plans.meta(plan.hash) == {}


def test_stamps_are_sealed_bound_to_their_output_and_never_override_a_mismatch(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for name in ("a" * 64, "b" * 64):
        write_tree(tmp_path / "tmp" / name, {"w.bin": b"weights"})
        objects.publish(tmp_path / "tmp" / name, store.outputs.path(name))
        assert store.outputs.check(name) == [] and store.outputs.read_stamp(name) is not None
    store.outputs.stamp_path("a" * 64).write_bytes(
        store.outputs.stamp_path("b" * 64).read_bytes()
    )  # another's stamp
    assert store.outputs.read_stamp("a" * 64) is None and store.outputs.stamp_problem("a" * 64)
    (store.outputs.path("a" * 64) / "w.bin").write_bytes(b"WEIGHTS")  # same size, new content
    assert store.outputs.check("a" * 64) != []
    assert not store.outputs.stamp_path("a" * 64).exists()  # a failed re-hash drops the stamp


def test_an_in_place_edit_that_restores_size_and_mtime_is_rehashed(tmp_path: Path) -> None:
    """The stat cache keys by ctime too: the kernel sets it on every write and every utime."""
    source = tmp_path / "corpus.txt"
    source.write_bytes(b"1+1=2\n" * 100)
    past = time.time() - 60
    os.utime(source, (past, past))
    cache = Store(tmp_path / ".bt").stat_cache()
    before = cache.digest_of(source)
    stat = source.stat()
    source.write_bytes(b"1+1=3\n" * 100)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert source.stat().st_size == stat.st_size and source.stat().st_mtime_ns == stat.st_mtime_ns
    assert cache.digest_of(source) != before


def test_quarantine_names_never_collide_and_links_are_moved_not_followed(tmp_path: Path) -> None:
    store = Store(tmp_path / ".bt")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_bytes(b"x")
    for _ in range(3):
        store.steps.mkdir(parents=True, exist_ok=True)
        store.outputs.path("c" * 64).symlink_to(tmp_path / "target")
        assert store.outputs.quarantine("c" * 64) is not None
    assert len(list(store.quarantined.iterdir())) == 3
    assert (tmp_path / "target" / "keep").read_bytes() == b"x"
    assert store.outputs.quarantine("c" * 64) is None  # nothing there: another run moved it


def test_a_folder_or_link_where_a_lock_belongs_is_set_aside(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.locks.dir.mkdir(parents=True)
    (store.locks.dir / f"{'d' * 64}.lock").mkdir()
    (store.locks.dir / f"{'e' * 64}.lock").symlink_to(tmp_path / "outside.lock")
    for name in ("d" * 64, "e" * 64):
        with store.locks.hold(name, wait=False):
            assert (store.locks.dir / f"{name}.lock").is_file() and not (
                store.locks.dir / f"{name}.lock"
            ).is_symlink()
    assert not (tmp_path / "outside.lock").exists()  # never created through the link


# -- the layout: one owner, a marker, real folders ------------------------------------------------


def test_no_module_spells_a_store_folder_but_the_layout() -> None:
    """Every folder and file name of a store is named in store/layout.py; the Store turns them
    into paths and everything else asks it (fsck and gc included)."""
    import ast

    from buildtrain.store import layout

    names = {
        layout.SWEEPS,
        layout.METRICS,
        layout.EVALS,
        layout.LOCKS,
        layout.TMP,
        layout.QUARANTINE,
        layout.CACHE,
        layout.MARKER,
        layout.CHECKPOINTS,
        layout.RESULT,
        layout.EVAL_RESULT,
        layout.TRAIN_STATE,
        layout.TRACE,
        layout.CHECKSUMS,
        "verified",
        "files.json",
    }
    package = Path(__file__).resolve().parent.parent / "buildtrain"

    def path_parts(node: ast.AST) -> list[ast.AST]:
        """Operands that become a path: `x / "name"`, `os.path.join(x, "name")`."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return [node.left, node.right]
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join":
            return list(node.args)
        return []

    spelled = [
        f"{path.relative_to(package)}:{node.lineno} {part.value!r}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "layout.py"
        for node in ast.walk(ast.parse(path.read_bytes()))
        for part in path_parts(node)
        if isinstance(part, ast.Constant) and part.value in names
    ]
    assert not spelled, "store names spelled outside store/layout.py:\n" + "\n".join(spelled)


def test_a_new_store_is_marked_and_a_foreign_folder_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / ".bt")
    assert store.identity() == "new"
    save_plan(store, make_plan())
    assert store.identity() == "marked" and store.marker.is_file()
    home = tmp_path / "home"
    (home / "work" / "thesis").mkdir(parents=True)
    (home / "work" / "thesis" / "ch1.tex").write_text("chapter one")
    (home / "notes.txt").write_text("mine")
    foreign = Store(home)
    assert foreign.identity() == "foreign"
    with pytest.raises(UsageError, match="is not a buildtrain store"):
        save_plan(foreign, make_plan())
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt", "work"]  # nothing written


def test_a_store_made_before_markers_is_recognised_by_a_plan_that_verifies(tmp_path: Path) -> None:
    from buildtrain.plan.stored import claim_store

    store = Store(tmp_path / ".bt")
    save_plan(store, make_plan())
    store.marker.unlink()  # as an earlier bt left it
    assert store.identity() == "unmarked"
    assert claim_store(store, create=False) and store.identity() == "marked"
    # Only store folders, but no plan that verifies (a user's work/ and tmp/): not a store.
    lookalike = Store(tmp_path / "lookalike")
    (lookalike.work / "thesis").mkdir(parents=True)
    lookalike.plans.dir.mkdir()
    (lookalike.plans.dir / f"{'a' * 64}.json").write_text("{}")
    assert lookalike.identity() == "unmarked"
    with pytest.raises(UsageError, match="not a buildtrain store"):
        claim_store(lookalike, create=False)
    assert not lookalike.marker.exists()


@pytest.mark.parametrize("name", ["locks", "tmp", "work", "quarantine", "evals", "metrics", "steps", "plans"])
@pytest.mark.parametrize("kind", ["link", "file"])
def test_a_link_or_file_in_place_of_a_store_folder_is_never_written_through(
    tmp_path: Path, name: str, kind: str
) -> None:
    store = Store(tmp_path / ".bt")
    save_plan(store, make_plan())
    outside = tmp_path / "outside"
    outside.mkdir()
    place = store.root / name
    if place.is_dir():
        place.rmdir() if not any(place.iterdir()) else os.rename(place, tmp_path / "moved")
    place.symlink_to(outside) if kind == "link" else place.write_text("x")
    with pytest.raises(CorruptObject, match=f"{name} is a (symbolic link|file), not a store folder"):
        store.check_layout()
    with pytest.raises(CorruptObject, match="bt fsck --repair"), store.locks.hold("a" * 64):
        pass
    assert list(outside.iterdir()) == []
    assert store.clear_folder(name) is not None
    store.check_layout()
    assert any(p.name.startswith(name) for p in store.quarantined.iterdir())


def test_a_run_of_a_plan_keeps_it_from_being_dropped(tmp_path: Path) -> None:
    store = Store(tmp_path / ".bt")
    plan = make_plan()
    save_plan(store, plan)
    with (
        store.locks.running(plan.hash),
        pytest.raises(Locked, match="is being built by a bt run"),
        store.locks.dropping(plan.hash),
    ):
        pass
    with store.locks.dropping(plan.hash):
        store.plans.path(plan.hash).unlink()
    with pytest.raises(UsageError, match="was dropped by bt gc"), store.locks.running(plan.hash):
        pass


def test_an_edited_step_metrics_summary_is_never_read(tmp_path: Path) -> None:
    store = Store(tmp_path / ".bt")
    step = "b" * 64
    store.results.save_step_metrics(
        step, {"label": "train:main", "train": {"final_loss": 4.25, "tokens_per_s": 1000.0}}
    )
    assert store.results.read_step_metrics(step)["train"]["final_loss"] == 4.25
    path = Path(store.results.step_metrics_path(step))
    path.write_bytes(path.read_bytes().replace(b"4.25", b"1.25"))
    assert store.results.read_step_metrics(step) is None
    os.replace(path, store.results.step_metrics_path("c" * 64))  # sound, but another step's
    assert store.results.read_step_metrics("c" * 64) is None


@settings(max_examples=50, deadline=None)
@given(update=st.integers(min_value=0, max_value=10**12))
def test_a_checkpoint_name_stands_for_its_update(update: int) -> None:
    from buildtrain.store import layout

    assert layout.checkpoint_update(layout.checkpoint_name(update)) == update
    assert layout.checkpoint_update("." + layout.checkpoint_name(update) + ".tmp") is None


@settings(max_examples=40, deadline=None)
@given(position=st.integers(min_value=0), mask=st.integers(min_value=1, max_value=255))
def test_any_flipped_byte_of_a_metrics_summary_makes_it_unread(position: int, mask: int) -> None:
    with tempfile.TemporaryDirectory() as folder, no_fsync():
        store = Store(Path(folder) / ".bt")
        store.results.save_step_metrics("a" * 64, {"label": "train:main", "train": {"final_loss": 3.5}})
        flip_byte(Path(store.results.step_metrics_path("a" * 64)), position, mask)
        assert store.results.read_step_metrics("a" * 64) is None
