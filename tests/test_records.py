"""`bt gc --records`: run records of null builds are pruned (each plan keeps its newest), `--keep N`
keeps each plan's N newest, and nothing that is not a finished run record is touched."""

from __future__ import annotations

from pathlib import Path

from conftest import run_bt
from hypothesis import given, settings
from hypothesis import strategies as st


def _records(draw_plans: list[tuple[int, bool]], root: Path) -> list:
    from buildtrain.verify.records import RecordFolder

    return [
        RecordFolder(folder=root / f"20260101T{index:06d}Z-{plan:012x}", plan=f"{plan:064x}", null_build=null)
        for index, (plan, null) in enumerate(draw_plans)
    ]


@given(
    runs=st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=30),
    keep=st.one_of(st.none(), st.integers(1, 4)),
)
@settings(max_examples=200, deadline=None)
def test_pruning_keeps_each_plans_newest_record_and_every_executed_one(runs, keep) -> None:
    from buildtrain.verify.records import doomed

    records = _records(runs, Path("/nowhere"))
    gone = doomed(records, keep)
    kept = [r for r in records if r not in gone]
    for plan in {r.plan for r in records}:
        mine = [r for r in records if r.plan == plan]
        assert max(mine, key=lambda r: r.order) in kept  # the newest stays, whatever it is
        mine_kept = [r for r in kept if r.plan == plan]
        if keep is None:
            assert all(r in mine_kept for r in mine if not r.null_build)  # executed runs stay
            assert sum(r.null_build for r in mine_kept) <= 1
        else:
            assert len(mine_kept) <= keep
            newest = sorted(mine, key=lambda r: r.order, reverse=True)[:keep]
            assert all(r in kept for r in newest if not r.null_build)


def test_bt_gc_records_prunes_null_builds_and_nothing_else(micro_built, tmp_path: Path) -> None:
    store, planned, _ = micro_built
    records = tmp_path / "records"
    env = {"BT_EXPERIMENTS": str(records)}
    for _ in range(3):  # null builds: nothing executed
        assert run_bt("run", planned, "--progress", "off", store=store, env=env).returncode == 0
    (records / "notes").mkdir()
    (records / "notes" / "thesis.tex").write_text("mine")
    (records / "20260101T000000Z-0123456789ab").mkdir()  # a record's name, no summary: a run going on
    (records / "20260101T000001Z-0123456789ab").symlink_to(records / "notes")
    folders = sorted(p.name for p in records.iterdir())
    dry = run_bt("gc", "--records", "--dry-run", store=store, env=env)
    assert dry.returncode == 0 and dry.stderr.count("would remove") == 2, dry.stderr
    assert sorted(p.name for p in records.iterdir()) == folders
    result = run_bt("gc", "--records", store=store, env=env)
    assert result.returncode == 0, result.stderr
    assert (
        result.stderr.count("removed ") == 2
        and "in 2 run record(s)" in result.stderr
        and "1 kept" in result.stderr
    )
    left = sorted(p.name for p in records.iterdir())
    assert (records / "notes" / "thesis.tex").read_text() == "mine"
    assert (records / "20260101T000000Z-0123456789ab").is_dir() and (
        records / "20260101T000001Z-0123456789ab"
    ).is_symlink()
    runs = sorted((f for f in folders if planned[:12] in f), key=lambda f: (f.split(".")[0], len(f), f))
    assert len(runs) == 3 and set(left) == {"notes", runs[-1]} | {
        "20260101T000000Z-0123456789ab",
        "20260101T000001Z-0123456789ab",
    }
    refused = run_bt("gc", "--records", "--drop", planned, store=store, env=env)
    assert refused.returncode == 2 and "prunes run records" in refused.stderr


def test_bt_gc_keep_leaves_each_plans_newest_records(tmp_path: Path) -> None:
    import json

    records = tmp_path / "experiments"
    for second, executed in enumerate((4, 0, 2, 0)):
        name = f"20260101T00000{second}Z-{'a' * 12}"
        (records / name).mkdir(parents=True)
        summary = {"run_id": name, "plan": "a" * 64, "outcome": "done", "exit_code": 0, "executed": executed}
        (records / name / "summary.json").write_text(json.dumps(summary))
    result = run_bt("gc", "--keep", "2", store=tmp_path / ".bt", env={"BT_EXPERIMENTS": str(records)})
    assert result.returncode == 0, result.stderr
    assert sorted(p.name[14] for p in records.iterdir()) == ["2", "3"]
