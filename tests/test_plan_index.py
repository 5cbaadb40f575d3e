"""The plan index (store/plan_index.py): prefixes resolve without listing plans/, the index is
only ever a hint checked against plans/, and concurrent writers never lose an entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import MICRO
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.errors import UsageError
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.stored import load_plan, save_plan
from buildtrain.store.store import Store
from buildtrain.verify import fsck as fsck_module
from buildtrain.verify.gc import collect

REPO = Path(__file__).resolve().parent.parent


def make_plan(value: int) -> Plan:
    data = Step.create("data:main", "data", {"data": {"n": value}}, {"sources": []}, {"tool": "x"})
    return Plan.create("p", {"name": "p", "value": value}, (data,), (data.hash,))


def saved(store: Store, count: int) -> list[str]:
    hashes = []
    for value in range(count):
        plan = make_plan(value)
        save_plan(store, plan)
        hashes.append(plan.hash)
    return sorted(hashes)


def unlisted(store: Store) -> None:
    """Make any listing of plans/ fail the test: the lookups under test must not list."""

    def refuse() -> list[str]:
        raise AssertionError("plans/ was listed")

    store.plans.hashes = refuse  # type: ignore[method-assign]


def test_a_prefix_resolves_through_the_index_without_listing_plans(tmp_path: Path) -> None:
    store = Store(tmp_path / ".bt")
    hashes = saved(store, 20)
    assert store.plans.resolve(hashes[0][:8]) == hashes[0]  # the first prefix lookup builds the index
    assert store.plans.index.is_ready()
    unlisted(store)
    for plan_hash in hashes:
        assert store.plans.resolve(plan_hash[:10]) == plan_hash
        assert store.plans.resolve(plan_hash) == plan_hash
        assert load_plan(store, plan_hash[:10]).hash == plan_hash


def test_an_ambiguous_prefix_keeps_its_error_through_the_index(tmp_path: Path) -> None:
    store = Store(tmp_path / ".bt")
    store.mark()
    store.plans.dir.mkdir()
    one, two = "abcd" + "1" * 60, "abcd" + "2" * 60
    for plan_hash in (one, two):
        store.plans.path(plan_hash).write_bytes(b"{}")  # copied in: never indexed
    with pytest.raises(UsageError, match=r"ambiguous \(abcd11111111, abcd22222222\)"):
        store.plans.resolve("abcd")  # nothing indexed under it: plans/ is listed, and the index rebuilt
    assert store.plans.index.indexed() == {one, two} and store.plans.index.is_ready()
    unlisted(store)
    with pytest.raises(UsageError, match="ambiguous"):
        store.plans.resolve("abcd")
    assert store.plans.resolve("abcd2") == two


def test_an_entry_is_only_a_hint(tmp_path: Path) -> None:
    """An entry whose plan is gone is skipped; a plan that is damaged is refused as before."""
    store = Store(tmp_path / ".bt")
    hashes = saved(store, 3)
    store.plans.rebuild_index()
    store.plans.path(hashes[0]).unlink()
    with pytest.raises(UsageError, match="no plan"):
        store.plans.resolve(hashes[0][:12])
    store.plans.path(hashes[1]).write_bytes(store.plans.path(hashes[2]).read_bytes())
    with pytest.raises(Exception, match="does not match its hash"):
        load_plan(store, hashes[1][:12])


def test_a_plan_without_an_entry_is_found_and_indexed(tmp_path: Path) -> None:
    store = Store(tmp_path / ".bt")
    hashes = saved(store, 3)
    store.plans.rebuild_index()
    store.plans.index.entry(hashes[1]).unlink()  # as if written by a bt without the index
    assert store.plans.resolve(hashes[1][:12]) == hashes[1]
    assert store.plans.index.entry(hashes[1]).exists()


def test_fsck_reports_a_stale_index_and_repair_rebuilds_it(tmp_path: Path) -> None:
    store = Store(tmp_path / ".bt")
    hashes = saved(store, 5)
    store.plans.rebuild_index()
    assert store.plans.index_problems() == []
    gone = "ab" + "0" * 62
    store.plans.index.add(gone)  # a plan file deleted by hand: its entry is skipped, no damage
    assert store.plans.index_problems() == []
    store.plans.index.entry(hashes[0]).unlink()  # a plan a prefix lookup would not see: damage
    result = fsck_module.fsck(store)
    assert result is not None
    found = [d for d in result.damaged if d.kind == "plan index"]
    assert len(found) == 1 and found[0].problems == [f"1 stored plan(s) not indexed ({hashes[0][:12]}, ...)"]
    repaired = fsck_module.fsck(store, fix=True)
    assert repaired is not None and any("rebuilt" in r for r in repaired.repaired)
    assert store.plans.index_problems() == []
    assert store.plans.index.indexed() == set(hashes)
    clean = fsck_module.fsck(store)
    assert clean is not None and not [d for d in clean.damaged if d.kind == "plan index"]


def test_gc_drop_removes_the_entry_with_its_plan(tmp_path: Path) -> None:
    store = Store(tmp_path / ".bt")
    hashes = saved(store, 2)
    store.plans.rebuild_index()
    collect(store, [hashes[0][:12]])
    assert store.plans.index.indexed() == {hashes[1]}
    assert store.plans.index_problems() == []


WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[3])
    from pathlib import Path
    from test_plan_index import make_plan
    from buildtrain.plan.stored import save_plan
    from buildtrain.store.store import Store
    store = Store(Path(sys.argv[1]))
    first = int(sys.argv[2])
    for value in range(first, first + 40):
        save_plan(store, make_plan(value))
    """
)


def test_concurrent_writers_and_a_repair_lose_no_entry(tmp_path: Path) -> None:
    """Four processes save 40 plans each while this one repairs the index over and over (which
    drops the entries of plans it does not see yet); every stored plan ends up indexed."""
    store = Store(tmp_path / ".bt")
    saved(store, 1)
    store.plans.rebuild_index()
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(store.root), str(1000 * (w + 1)), str(REPO / "tests")],
            stderr=subprocess.PIPE,
        )
        for w in range(4)
    ]
    try:
        # Repairs race the first plans; the rest are saved after the last repair, so their
        # entries are the writers' own.
        while len(store.plans.hashes()) < 100 and any(w.poll() is None for w in writers):
            store.plans.repair_index()
    finally:
        for writer in writers:
            writer.wait(timeout=120)
    assert [w.returncode for w in writers] == [0] * 4, [w.stderr.read() for w in writers if w.stderr]
    stored = set(store.plans.hashes())
    assert len(stored) == 161
    assert stored <= store.plans.index.indexed()
    assert store.plans.index_problems() == []


hashes_strategy = st.lists(
    st.text("0123456789abcdef", min_size=64, max_size=64).map(lambda h: h[:2] * 2 + h[4:]),
    min_size=1,
    max_size=12,
    unique=True,
)


@settings(max_examples=40, deadline=None)
@given(hashes=hashes_strategy, length=st.integers(4, 8), pick=st.integers(0, 11))
def test_the_index_answers_as_a_listing_does(hashes: list[str], length: int, pick: int) -> None:
    """The law: through the index, a prefix names the same plans (or fails the same way) as a
    search of plans/ would."""
    with tempfile.TemporaryDirectory() as scratch:
        store = Store(Path(scratch) / ".bt")
        store.mark()
        store.plans.dir.mkdir()
        for plan_hash in hashes:
            (store.plans.dir / f"{plan_hash}.json").write_bytes(json.dumps({}).encode())
        store.plans.rebuild_index()
        prefix = hashes[pick % len(hashes)][:length]
        expected = [h for h in sorted(hashes) if h.startswith(prefix)]
        unlisted(store)
        if len(expected) == 1:
            assert store.plans.resolve(prefix) == expected[0]
        else:
            with pytest.raises(UsageError, match="ambiguous"):
                store.plans.resolve(prefix)


def test_parallel_bt_plan_processes_index_every_plan(tmp_path: Path) -> None:
    """Four `bt plan --sweep` processes at once into one store: every plan they print is stored,
    indexed, and found by a prefix."""
    store = tmp_path / ".bt"
    environment = {**os.environ, "BT_STORE": str(store)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "buildtrain", "plan", str(MICRO), "--sweep", f"name={names}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
            cwd=tmp_path,
        )
        for names in (",".join(f"w{w}-{i}" for i in range(10)) for w in range(4))
    ]
    printed = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        printed += out.split()
    opened = Store(store)
    assert len(set(printed)) == 40 and set(printed) == set(opened.plans.hashes())
    assert set(printed) <= opened.plans.index.indexed()
    for plan_hash in printed:
        assert opened.plans.resolve(plan_hash[:12]) == plan_hash
    assert opened.plans.index_problems() == []
