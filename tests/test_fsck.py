"""`bt fsck` finds every damaged object and says what uses it; `bt run` never loads one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import run_bt, step_digests

from buildtrain.errors import ExitCode
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
    plan = Store(store).load_plan(micro_built[1])
    train = plan.by_label("train:main")
    flip(next((store / "steps" / train.hash / "checkpoints").rglob("model.safetensors")), 100)
    damaged = run_bt("fsck", store=store)
    assert damaged.returncode == ExitCode.CORRUPT
    assert f"steps/{train.hash}" in damaged.stderr
    assert f"used by train:main of plan {micro_built[1][:12]}" in damaged.stderr


def test_run_rebuilds_a_damaged_output_instead_of_loading_it(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    plan = Store(store).load_plan(micro_built[1])
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
