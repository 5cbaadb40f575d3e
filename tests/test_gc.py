"""`bt gc` removes what no stored plan needs, and nothing else."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import run_bt, step_digests

from buildtrain.plan.stored import load_plan
from buildtrain.store import objects
from buildtrain.store.store import Store
from buildtrain.verify.fsck import check


def litter(store: Store, completed_step: str) -> list[Path]:
    """Things a crashed or superseded run leaves behind; returns what gc must remove."""
    orphan = store.new_temp("orphan")
    (orphan / "weights.bin").write_bytes(b"\0" * 64)
    objects.seal(orphan)
    objects.commit(orphan, store.outputs.path("f" * 64))  # an output no plan references
    leftover = store.new_temp("train-main")  # a temporary output of a killed step
    (leftover / "half.bin").write_bytes(b"x")
    work = store.outputs.work_dir(completed_step) / "checkpoints" / "step-000004"  # work of a finished step
    work.mkdir(parents=True)
    quarantined = store.quarantined / "deadbeef.1"
    quarantined.mkdir(parents=True)
    stray_eval = store.evals / f"{'e' * 64}.json"
    stray_eval.write_text("{}")
    return [
        store.outputs.path("f" * 64),
        leftover,
        store.outputs.work_dir(completed_step),
        quarantined,
        stray_eval,
    ]


def test_gc_removes_only_unreferenced_and_leftover_data(micro_built, tmp_path):
    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    store = Store(root)
    plan = load_plan(store, micro_built[1])
    doomed = litter(store, plan.by_label("train:main").hash)

    dry = run_bt("gc", "--dry-run", store=root)
    assert dry.returncode == 0, dry.stderr
    assert all(path.exists() for path in doomed)
    assert "would remove" in dry.stderr

    result = run_bt("gc", store=root)
    assert result.returncode == 0, result.stderr
    assert not any(path.exists() for path in doomed), [p for p in doomed if p.exists()]
    assert check(store)[0] == []
    assert step_digests(root, micro_built[1]) == micro_built[2]  # everything the plan needs is kept
    again = run_bt("run", micro_built[1], store=root)
    assert again.returncode == 0 and "executed" not in again.stderr.split("done")[0]


def test_dropping_a_plan_frees_its_outputs(micro_built, tmp_path):
    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    result = run_bt("gc", "--drop", micro_built[1][:8], store=root)
    assert result.returncode == 0, result.stderr
    assert Store(root).plans.hashes() == []
    assert list((root / "steps").iterdir()) == []
    assert list((root / "evals").iterdir()) == []
    # The plan's card and its steps' metrics summaries (what bt ls --metrics reads) go with them.
    assert list((root / "metrics" / "plans").glob("*.json")) == []
    assert list((root / "metrics" / "steps").glob("*.json")) == []


def test_gc_keeps_the_cards_and_summaries_of_kept_plans(micro_built, tmp_path):
    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    cards = sorted((root / "metrics" / "plans").glob("*.json"))
    summaries = sorted((root / "metrics" / "steps").glob("*.json"))
    assert cards and summaries
    stray = root / "metrics" / "steps" / f"{'d' * 64}.json"
    stray.write_text("{}")
    result = run_bt("gc", store=root)
    assert result.returncode == 0, result.stderr
    assert sorted((root / "metrics" / "plans").glob("*.json")) == cards
    assert sorted((root / "metrics" / "steps").glob("*.json")) == summaries


def test_gc_keeps_what_a_damaged_plan_may_use_and_never_follows_links(micro_built, tmp_path):
    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    outputs = sorted(p.name for p in (root / "steps").iterdir())
    plan_file = root / "plans" / f"{micro_built[1]}.json"
    raw = bytearray(plan_file.read_bytes())
    raw[200] ^= 0x01
    plan_file.write_bytes(bytes(raw))
    outside = tmp_path / "outside"
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "big.bin").write_bytes(b"\0" * 4096)
    (root / "steps" / ("d" * 64)).symlink_to(outside, target_is_directory=True)
    (root / "quarantine").mkdir()
    (root / "quarantine" / "link").symlink_to(outside, target_is_directory=True)

    dry = run_bt("gc", "--dry-run", store=root)
    assert dry.returncode == 0, dry.stderr
    assert f"warning: plan(s) {micro_built[1][:12]} cannot be read" in dry.stderr
    assert "steps/" not in dry.stderr  # nothing the damaged plan may reference is listed

    result = run_bt("gc", store=root)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (root / "steps").iterdir()) == sorted([*outputs, "d" * 64])
    assert "removed quarantine/link" in result.stderr and "freed 0.0 MB" in result.stderr
    assert (outside / "data" / "big.bin").stat().st_size == 4096  # a link is removed, not followed
    assert not (root / "quarantine" / "link").is_symlink()

    raw[200] ^= 0x01  # the plan mended: the link in steps/ is unreferenced, removed as a link
    plan_file.write_bytes(bytes(raw))
    result = run_bt("gc", store=root)
    assert result.returncode == 0, result.stderr
    assert f"removed steps/{'d' * 64}" in result.stderr and "freed 0.0 MB" in result.stderr
    assert sorted(p.name for p in (root / "steps").iterdir()) == outputs
    assert (outside / "data" / "big.bin").stat().st_size == 4096


def test_what_gc_could_not_remove_is_reported_as_left_never_as_removed(micro_built, tmp_path, monkeypatch):
    from buildtrain.verify import gc

    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    store = Store(root)
    leftover = store.new_temp("train-main")
    (leftover / "half.bin").write_bytes(b"x" * 100)
    monkeypatch.setattr(gc.objects, "remove_tree", lambda path: None)  # as if permissions said no
    report = gc.collect(store, drop=[])
    assert report.removed == [] and report.freed == 0
    assert report.left == [f"tmp/{leftover.name}: still there (permissions?)"]


def test_gc_refuses_a_folder_that_is_not_a_store_and_touches_nothing(tmp_path):
    home = tmp_path / "home"
    files = [
        home / "work" / "thesis" / "ch1.tex",
        home / "steps" / "photos" / "a.jpg",
        home / "tmp" / "notes.txt",
    ]
    for path in files:
        path.parent.mkdir(parents=True)
        path.write_text("mine")
    result = run_bt("gc", store=home)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{home} is not a buildtrain store" in line and "--store" in line
    assert all(path.read_text() == "mine" for path in files)
    assert not (home / "STORE.json").exists()


def test_a_store_made_before_markers_is_collected_and_marked(micro_built, tmp_path):
    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    (root / "STORE.json").unlink()  # as an earlier bt left it: recognised by a plan that verifies
    leftover = Store(root).new_temp("train-main")
    result = run_bt("gc", store=root)
    assert result.returncode == 0, result.stderr
    assert not leftover.exists() and (root / "STORE.json").is_file()


def test_dropping_a_plan_drops_the_sweeps_that_name_it(micro_built, tmp_path):
    import json

    from conftest import MICRO

    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    planned = run_bt("plan", str(MICRO), "--sweep", "train.lr=0.001,0.002", store=root)
    first, second = planned.stdout.split()
    (sweep,) = (root / "sweeps").iterdir()
    assert run_bt("gc", store=root).returncode == 0 and sweep.exists()  # all its plans are kept
    result = run_bt("gc", "--drop", first, store=root)
    assert result.returncode == 0, result.stderr
    assert f"removed sweeps/{sweep.name}" in result.stderr and not sweep.exists()
    assert Store(root).plans.hashes() == sorted([micro_built[1], second])
    assert json.loads(run_bt("fsck", "--json", store=root).stdout)["damaged"] == []


def test_a_plan_being_run_is_not_dropped(micro_built, tmp_path):
    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    store = Store(root)
    with store.locks.running(micro_built[1]):  # what bt run holds while it builds the plan's steps
        refused = run_bt("gc", "--drop", micro_built[1][:8], store=root)
    assert refused.returncode == 7, refused.stderr
    assert "is being built by a bt run" in refused.stderr
    assert store.plans.hashes() == [micro_built[1]]
    assert step_digests(root, micro_built[1]) == micro_built[2]


def test_gc_drop_during_a_bt_run_of_the_plan_is_refused_and_the_run_succeeds(micro_built, tmp_path):
    import fcntl
    import os
    import subprocess
    import sys
    import time

    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    store = Store(root)
    plan = load_plan(store, micro_built[1])
    for label in ("train:main", "eval", "export"):  # so that the run trains for a while
        shutil.rmtree(store.outputs.path(plan.by_label(label).hash))
    env = {**os.environ, "BT_STORE": str(root), "BT_EXPERIMENTS": str(tmp_path / "experiments")}
    run = subprocess.Popen(
        [sys.executable, "-m", "buildtrain", "run", micro_built[1], "--progress", "off"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lock, deadline = store.locks.plan_lock(micro_built[1]), time.monotonic() + 60
        while True:  # until the run holds its plan lock (shared): an exclusive try fails
            assert run.poll() is None and time.monotonic() < deadline, "the run ended before it was seen"
            if lock.exists():
                fd = os.open(lock, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except BlockingIOError:
                    break
                finally:
                    os.close(fd)
            time.sleep(0.05)
        refused = run_bt("gc", "--drop", micro_built[1][:8], store=root)
        assert refused.returncode == 7, refused.stderr
        assert "is being built by a bt run" in refused.stderr
    finally:
        _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert step_digests(root, micro_built[1]) == micro_built[2]
