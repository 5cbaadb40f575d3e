"""`bt fsck` finds every damaged object and says what uses it; `bt run` never loads one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import run_bt, step_digests

from buildtrain.errors import ExitCode
from buildtrain.plan.stored import load_plan
from buildtrain.store.store import Store
from buildtrain.verify.fsck import check


def stored_objects(store: Path) -> list[Path]:
    """Every file that is part of an object (the stat cache and plan metadata are not objects)."""
    roots = [store / "plans", store / "steps", store / "evals", store / "work"]
    return sorted(
        p
        for root in roots
        if root.is_dir()
        for p in root.rglob("*")
        if p.is_file() and not p.name.endswith(".meta.json")
    )


def flip(path: Path, position: int) -> bytes:
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[position % len(damaged)] ^= 0x01
    path.write_bytes(bytes(damaged))
    return original


def test_flipping_any_byte_of_any_object_is_reported_with_its_users(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    files = stored_objects(store)
    assert len(files) > 20
    for index, path in enumerate(files):
        original = flip(path, position=index * 7919)
        try:
            damaged, _ = check(Store(store))
        finally:
            path.write_bytes(original)
        relative = path.relative_to(store).as_posix()
        assert damaged, f"a flipped byte in {relative} went unnoticed"
        (item,) = damaged
        assert relative.startswith(item["object"]), (relative, item)
        if relative.startswith("steps/"):
            assert any(micro_built[1][:12] in r for r in item["referenced_by"])
    assert check(Store(store))[0] == []


def test_fsck_cli_exit_codes_and_message(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    clean = run_bt("fsck", store=store)
    assert clean.returncode == ExitCode.OK and "all intact" in clean.stderr
    plan = load_plan(Store(store), micro_built[1])
    train = plan.by_label("train:main")
    flip(next((store / "steps" / train.hash / "checkpoints").rglob("model.safetensors")), 100)
    damaged = run_bt("fsck", store=store)
    assert damaged.returncode == ExitCode.CORRUPT
    assert f"steps/{train.hash}" in damaged.stderr
    assert f"used by train:main of plan {micro_built[1][:12]}" in damaged.stderr


def test_run_rebuilds_a_damaged_output_instead_of_loading_it(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    plan = load_plan(Store(store), micro_built[1])
    train = plan.by_label("train:main")
    flip(store / "steps" / train.hash / "trace.jsonl", 10)
    result = run_bt("run", micro_built[1], store=store)
    assert result.returncode == 0, result.stderr
    assert "output damaged" in result.stderr and "rebuilding" in result.stderr
    assert step_digests(store, micro_built[1]) == micro_built[2]
    assert list((store / "quarantine").iterdir())


@pytest.mark.parametrize("position", [0, 200, -2])
def test_a_damaged_plan_is_refused(micro_built, tmp_path, position):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    flip(store / "plans" / f"{micro_built[1]}.json", position)
    result = run_bt("run", micro_built[1], store=store)
    assert result.returncode == ExitCode.CORRUPT, result.stderr
    assert "Traceback" not in result.stderr


def test_fsck_repair_quarantines_every_damaged_object_and_run_makes_the_store_whole(micro_built, tmp_path):
    """Damage of every shape at once (an eval entry holding null, another a folder, a stamp, lock
    and stat cache that are folders, plan metadata holding []): fsck exits 5 naming each without
    crashing; --repair moves them aside (exit 0); bt run then finds a whole store."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    plan = load_plan(Store(store), micro_built[1])
    train = plan.by_label("train:main").hash
    entry = next((store / "evals").glob("*.json"))
    entry.write_text("null")
    (store / "evals" / f"{'a' * 64}.json").mkdir()
    (store / "plans" / f"{micro_built[1]}.meta.json").write_text("[]")
    for folder in (
        Store(store).outputs.stamp_path(train),
        store / "locks" / f"{train}.lock",
        store / "cache" / "files.json",
    ):
        folder.unlink(missing_ok=True)
        folder.mkdir(parents=True)
        (folder / "junk").write_text("x")
    export = plan.by_label("export").hash
    flip(store / "steps" / export / "BLAKE3SUMS", 3)

    found = run_bt("fsck", "--json", store=store)
    assert found.returncode == ExitCode.CORRUPT, found.stderr
    assert "Traceback" not in found.stderr
    import json

    named = {item["object"]: item["kind"] for item in json.loads(found.stdout)["damaged"]}
    assert named == {
        f"evals/{entry.name}": "evaluation result",
        f"evals/{'a' * 64}.json": "evaluation result",
        f"plans/{micro_built[1]}.meta.json": "plan metadata",
        f"cache/verified/{train}.json": "stamp",
        f"locks/{train}.lock": "lock",
        "cache/files.json": "stat cache",
        f"steps/{export}": "step output",
    }

    repaired = run_bt("fsck", "--repair", store=store)
    assert repaired.returncode == ExitCode.OK, repaired.stderr
    assert repaired.stderr.count("repaired ") == len(named)
    assert run_bt("fsck", store=store).returncode == ExitCode.OK
    result = run_bt("run", micro_built[1], store=store)
    assert result.returncode == 0, result.stderr
    assert step_digests(store, micro_built[1]) == micro_built[2]
    assert run_bt("fsck", store=store).returncode == ExitCode.OK


def test_a_read_only_store_still_plans_a_stored_plan_and_null_builds(micro_built, tmp_path, monkeypatch):
    """Every write into the store fails (as on a read-only mount; the tests run as root, where
    chmod does not stop writes): planning an already-stored plan and a null build only read."""
    import errno

    from conftest import MICRO

    from buildtrain.executor.loop.run import RunOptions, run_plan
    from buildtrain.plan.planner import plan_preset
    from buildtrain.sources import durable, stat_cache

    root = tmp_path / ".bt"
    shutil.copytree(micro_built[0], root)
    store = Store(root)

    def refuse(path: Path, data: bytes, **_: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(durable, "write_bytes_durably", refuse)
    monkeypatch.setattr(stat_cache, "write_bytes_durably", refuse)
    assert plan_preset(MICRO, [], store).plan.hash == micro_built[1]
    code = run_plan(
        store, load_plan(store, micro_built[1]), RunOptions(experiments=tmp_path / "exp", progress=False)
    )
    assert code == ExitCode.OK


# -- every folder: metrics, sweeps, the store's own folders, work folders --------------------------


def test_an_edited_metrics_summary_is_reported_and_never_shown(micro_built, tmp_path):
    import json

    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    train = load_plan(Store(store), micro_built[1]).by_label("train:main").hash
    path = Path(Store(store).results.step_metrics_path(train))
    shown = json.loads(run_bt("ls", "--metrics", "--json", store=store).stdout)
    assert isinstance(shown[0]["train_loss"], float)
    body = path.read_bytes()
    loss = json.loads(body.partition(b"\n")[2])["train"]["final_loss"]
    path.write_bytes(body.replace(json.dumps(loss).encode(), b"0.125", 1))
    found = run_bt("fsck", "--json", store=store)
    assert found.returncode == ExitCode.CORRUPT
    named = {item["object"]: item["kind"] for item in json.loads(found.stdout)["damaged"]}
    assert named == {f"metrics/steps/{train}.json": "metrics summary"}
    shown = json.loads(run_bt("ls", "--metrics", "--json", store=store).stdout)
    assert shown[0]["train_loss"] is None and shown[0]["tokens_per_s"] is None  # a blank, never 0.125
    assert run_bt("fsck", "--repair", store=store).returncode == ExitCode.OK
    assert not path.exists() and run_bt("fsck", store=store).returncode == ExitCode.OK


def test_a_sweep_is_checked_against_its_hash_and_its_plans(micro_built, tmp_path):
    import json

    from conftest import MICRO

    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    planned = run_bt("plan", str(MICRO), "--sweep", "train.lr=0.001,0.002", store=store)
    assert planned.returncode == 0, planned.stderr
    (sweep,) = (store / "sweeps").iterdir()
    assert run_bt("fsck", store=store).returncode == ExitCode.OK
    body = json.loads(sweep.read_bytes())
    (store / "plans" / f"{body['points'][0]['plan']}.json").unlink()
    found = run_bt("fsck", "--json", store=store)
    assert found.returncode == ExitCode.CORRUPT
    (item,) = json.loads(found.stdout)["damaged"]
    assert item["object"] == f"sweeps/{sweep.name}" and "not in the store" in item["problems"][0]
    sweep.write_bytes(sweep.read_bytes().replace(b"0.002", b"0.003"))
    assert "does not match its hash" in run_bt("fsck", store=store).stderr


@pytest.mark.parametrize(
    "name", ["plans", "locks", "tmp", "quarantine", "work", "evals", "metrics", "steps", "sweeps", "cache"]
)
@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_file_or_link_in_place_of_a_store_folder_is_reported_and_repaired(
    micro_built, tmp_path, name, kind
):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    outside = tmp_path / "outside"
    outside.mkdir()
    place = store / name
    if place.exists():
        shutil.rmtree(place)
    place.symlink_to(outside, target_is_directory=True) if kind == "link" else place.write_text("x")
    found = run_bt("fsck", store=store)
    assert found.returncode == ExitCode.CORRUPT and f"damaged store folder: {name}" in found.stderr
    refused = run_bt("run", micro_built[1], store=store)
    assert refused.returncode == ExitCode.CORRUPT, refused.stderr
    (line,) = refused.stderr.strip().splitlines()[-1:]
    assert f"{name} is a {'symbolic link' if kind == 'link' else 'file'}, not a store folder" in line
    assert "free space" not in refused.stderr and "Traceback" not in refused.stderr
    repaired = run_bt("fsck", "--repair", store=store)
    assert repaired.returncode == ExitCode.OK, repaired.stderr
    assert f"repaired {name}: moved to quarantine/{name}." in repaired.stderr
    assert list(outside.iterdir()) == []  # never written through
    assert run_bt("fsck", store=store).returncode == ExitCode.OK


@pytest.mark.parametrize("folder", ["checkpoints", "trace"])
def test_a_file_in_place_of_a_step_s_checkpoints_is_reported_and_named_by_run(micro_built, tmp_path, folder):
    """Also in place of the trace segments kept beside the checkpoints."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    train = load_plan(Store(store), micro_built[1]).by_label("train:main").hash
    shutil.rmtree(store / "steps" / train)  # so that bt run trains it again
    shutil.rmtree(Store(store).outputs.work_dir(train), ignore_errors=True)
    misplaced = Store(store).outputs.work_dir(train) / folder
    misplaced.parent.mkdir(parents=True, exist_ok=True)
    misplaced.write_text("not a folder")
    found = run_bt("fsck", store=store)
    assert found.returncode == ExitCode.CORRUPT
    assert f"damaged work folder: work/{train}/{folder}" in found.stderr
    failed = run_bt("run", micro_built[1], store=store)
    assert failed.returncode == ExitCode.CORRUPT, failed.stderr
    assert "not a folder of checkpoints; run bt fsck --repair" in failed.stderr
    assert "free space" not in failed.stderr and "Traceback" not in failed.stderr
    assert run_bt("fsck", "--repair", store=store).returncode == ExitCode.OK
    result = run_bt("run", micro_built[1], store=store)
    assert result.returncode == 0, result.stderr
    assert step_digests(store, micro_built[1]) == micro_built[2]


def test_fsck_refuses_a_folder_that_is_not_a_store(tmp_path):
    home = tmp_path / "home"
    (home / "tmp").mkdir(parents=True)
    (home / "tmp" / "notes.txt").write_text("mine")
    (home / "letter.txt").write_text("mine")
    for args in (["fsck"], ["fsck", "--repair"]):
        refused = run_bt(*args, store=home)
        assert refused.returncode == ExitCode.USAGE, refused.stderr
        assert f"{home} is not a buildtrain store" in refused.stderr
    assert (home / "tmp" / "notes.txt").read_text() == "mine" and not (home / "quarantine").exists()


def test_a_train_output_resealed_with_another_steps_checkpoints_is_reported(
    micro_built, stages_built, tmp_path
):
    """The seal binds files to a folder name; the train kind also checks whose checkpoints they
    are, so another step's output copied into place and sealed again is still foreign."""
    from buildtrain.store import objects

    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    train = load_plan(Store(store), micro_built[1]).by_label("train:main")
    other = load_plan(Store(stages_built[0]), stages_built[1]).by_label("train:pretrain")
    output = store / "steps" / train.hash
    shutil.rmtree(output)
    shutil.copytree(stages_built[0] / "steps" / other.hash, output)
    (output / objects.MANIFEST).unlink()
    objects.seal(output, objects.sealed_digests(stages_built[0] / "steps" / other.hash), name=train.hash)
    assert not objects.verify(output)  # the seal holds
    damaged, _ = check(Store(store))
    found = {item["object"]: item for item in damaged}
    assert f"steps/{train.hash}" in found, damaged
    problem = found[f"steps/{train.hash}"]["problems"][0]
    assert "updates, the step has" in problem or "was written by step" in problem


def test_a_file_in_place_of_quarantine_and_a_damaged_object_are_both_repaired(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    shutil.rmtree(store / "quarantine", ignore_errors=True)
    (store / "quarantine").write_text("x")
    damaged = next(p for p in stored_objects(store) if p.relative_to(store).parts[0] == "steps")
    flip(damaged, position=3)
    repaired = run_bt("fsck", "--repair", store=store)
    assert repaired.returncode == ExitCode.OK, repaired.stderr
    assert "repaired quarantine: moved to quarantine/quarantine." in repaired.stderr, repaired.stderr
    assert "Traceback" not in repaired.stderr
    assert run_bt("fsck", store=store).returncode == ExitCode.OK
