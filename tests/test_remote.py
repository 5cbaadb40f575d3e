"""The team cache's store layer (issue 21): a remote on a real S3 server (SeaweedFS, started once
per session) and in a shared folder; every test runs against both.

A pull serves an output only when every byte checks: a flipped byte, a missing blob or another
step's manifest is named and never served, and leaves nothing in the local store.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import attrs
import pytest
import seaweed
from conftest import MICRO, plan_hash, run_bt, time_bound
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.errors import CorruptObject, RemoteDamaged, RemoteUnavailable, UsageError
from buildtrain.plan.stored import load_plan
from buildtrain.store import checkpoints, durability, layout, objects, tensors, trace
from buildtrain.store.remote import keyring, keys, leases, signing
from buildtrain.store.remote.attest import (
    Attestation,
    attest,
    attestations,
    disagreements,
    record_of,
    statement,
    tally,
)
from buildtrain.store.remote.backend import AlreadyExists, ObjectMissing
from buildtrain.store.remote.keyring import Keyring
from buildtrain.store.remote.remote import Remote
from buildtrain.store.remote.url import RemoteUrl, parse_url
from buildtrain.store.store import Store

# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, list[str]]:
    """A store holding every output of tests/presets/micro.toml, built by `bt run`, and the step
    hashes in plan order."""
    store = tmp_path_factory.mktemp("built") / ".bt"
    plan = plan_hash(run_bt("plan", str(MICRO), store=store))
    done = run_bt("run", plan, store=store)
    assert done.returncode == 0, done.stderr
    return Store(store), [step.hash for step in load_plan(Store(store), plan).steps]


@pytest.fixture(params=["folder", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Remote:
    """An empty remote: a fresh folder, or a fresh prefix in the session's SeaweedFS bucket."""
    if request.param == "folder":
        (tmp_path / "remote").mkdir()
        return Remote.open(f"file://{tmp_path / 'remote'}")
    server: seaweed.Seaweed = request.getfixturevalue("seaweed_server")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return Remote.open(server.url(f"t-{uuid.uuid4().hex[:12]}"))


def fresh_store(tmp_path: Path, name: str = "b") -> Store:
    return Store(tmp_path / name / ".bt")


def tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def assert_nothing_left(store: Store) -> None:
    """No output, and nothing under tmp/, after a refused pull."""
    assert not any(store.steps.glob("*")) if store.steps.exists() else True
    assert not any(store.tmp.glob("*")) if store.tmp.exists() else True


def first_blob(remote: Remote, built: tuple[Store, list[str]]) -> tuple[str, str, str]:
    """(step hash, file name, blob key) of the largest file of the train step's output."""
    store, steps = built
    step = steps[1]
    files = objects.read_manifest(store.outputs.path(step))["files"]
    name = max(files, key=lambda n: files[n]["size"])
    return step, name, keys.blob(files[name]["blake3"])


# -- push and pull --------------------------------------------------------------------------------


def test_push_then_pull_gives_identical_outputs(
    remote: Remote, built: tuple[Store, list[str]], tmp_path: Path
) -> None:
    store, steps = built
    first = [remote.push_output(store, step) for step in steps]
    assert all(p.manifest == "written" for p in first) and sum(p.uploaded for p in first) > 0
    again = [remote.push_output(store, step) for step in steps]  # idempotent: nothing new
    assert all(p.manifest == "present" and p.uploaded == 0 and p.bytes_uploaded == 0 for p in again)
    other = fresh_store(tmp_path)
    for step in steps:
        assert remote.has_output(step)
        assert remote.pull_output(other, step) == other.outputs.path(step)
        assert objects.verify(other.outputs.path(step)) == []
        assert tree(other.outputs.path(step)) == tree(store.outputs.path(step))
    assert not any(other.tmp.iterdir())


def test_a_reader_racing_a_push_never_sees_half_a_step(
    remote: Remote, built: tuple[Store, list[str]], tmp_path: Path
) -> None:
    """While one thread pushes the largest output, another pulls it over and over: every pull is
    a miss or the whole output (RemoteDamaged would fail the test), never a manifest whose blobs
    are not all there."""
    store, steps = built
    sizes = {
        h: sum(e["size"] for e in objects.read_manifest(store.outputs.path(h))["files"].values())
        for h in steps
    }
    step = max(steps, key=sizes.__getitem__)
    pusher = threading.Thread(target=remote.push_output, args=(store, step))
    pusher.start()
    misses = 0
    for attempt in range(10_000):
        other = fresh_store(tmp_path, f"r{attempt}")
        if remote.pull_output(other, step) is not None:
            assert tree(other.outputs.path(step)) == tree(store.outputs.path(step))
            break
        misses += 1
    pusher.join()
    assert misses > 0  # the reader did run while the push was under way


def test_a_step_the_remote_lacks_is_a_miss_not_an_error(remote: Remote, tmp_path: Path) -> None:
    assert remote.pull_output(fresh_store(tmp_path), "ab" * 32) is None
    assert not remote.has_output("ab" * 32)


def test_a_flipped_byte_in_a_blob_is_named_and_never_served(
    remote: Remote, built: tuple[Store, list[str]], tmp_path: Path
) -> None:
    step, name, blob = first_blob(remote, built)
    remote.push_output(built[0], step)
    data = bytearray(remote.backend.get(blob))
    data[len(data) // 2] ^= 0x01
    remote.backend.put(blob, bytes(data))
    other = fresh_store(tmp_path)
    with pytest.raises(RemoteDamaged, match=rf"{name}: blob .*{blob}.*does not match its blake3") as caught:
        remote.pull_output(other, step)
    assert caught.value.exit_code == 5 and str(remote.url) in str(caught.value)
    assert_nothing_left(other)


def test_a_missing_blob_is_named_and_never_served(
    remote: Remote, built: tuple[Store, list[str]], tmp_path: Path
) -> None:
    step, name, blob = first_blob(remote, built)
    remote.push_output(built[0], step)
    remote.backend.delete(blob)
    other = fresh_store(tmp_path)
    with pytest.raises(RemoteDamaged, match=rf"{name}: blob .*{blob}.* is missing"):
        remote.pull_output(other, step)
    assert_nothing_left(other)


def test_another_steps_manifest_is_foreign(
    remote: Remote, built: tuple[Store, list[str]], tmp_path: Path
) -> None:
    store, steps = built
    for step in steps[:2]:
        remote.push_output(store, step)
    remote.backend.put(keys.step(steps[0]), remote.backend.get(keys.step(steps[1])))
    other = fresh_store(tmp_path)
    with pytest.raises(RemoteDamaged, match=rf"{keys.step(steps[0])}.*sealed for {steps[1][:24]}.*foreign"):
        remote.pull_output(other, steps[0])
    assert_nothing_left(other)


def test_a_pin_takes_only_that_build_and_a_refusal_leaves_nothing(
    remote: Remote, built: tuple[Store, list[str]], tmp_path: Path
) -> None:
    """A run's node pins the build its run holds: another build under the step's name is named
    and never served. A caller's `accept` sees the whole folder before it enters the store; a
    refusal leaves nothing behind, and an accepted pull is stamped (no second read before use)."""
    store, steps = built
    remote.push_output(store, steps[0])
    held = objects.manifest_self((store.outputs.path(steps[0]) / objects.MANIFEST).read_bytes())
    other = fresh_store(tmp_path)
    with pytest.raises(RemoteDamaged, match=rf"{keys.step(steps[0])}.*not the build this run holds"):
        remote.pull_output(other, steps[0], pinned="0" * 64)
    assert_nothing_left(other)
    seen: list[dict[str, bytes]] = []

    def refuse(folder: Path) -> str:
        seen.append(tree(folder))
        return "weights.safetensors gives weights 123, the manifest declares 456"

    with pytest.raises(RemoteDamaged, match=rf"step {steps[0][:12]} refused: weights.safetensors gives"):
        remote.pull_output(other, steps[0], pinned=held, accept=refuse)
    assert seen == [tree(store.outputs.path(steps[0]))]
    assert_nothing_left(other)
    assert remote.pull_output(other, steps[0], pinned=held, accept=lambda folder: None) is not None
    assert other.outputs.read_stamp(steps[0]) is not None and other.outputs.check(steps[0]) == []
    # Not fsynced on a local disk: its stamp counts on this boot only (tests/test_durability.py).
    assert other.outputs.read_stamp(steps[0]).get("boot") == durability.unsynced_boot(other.root)


def test_a_damaged_manifest_is_named(remote: Remote, built: tuple[Store, list[str]], tmp_path: Path) -> None:
    store, steps = built
    remote.push_output(store, steps[0])
    raw = remote.backend.get(keys.step(steps[0]))
    remote.backend.put(keys.step(steps[0]), raw.replace(b'"size":', b'"size": ', 1))
    other = fresh_store(tmp_path)
    with pytest.raises(RemoteDamaged, match="damaged manifest"):
        remote.pull_output(other, steps[0])
    assert_nothing_left(other)
    assert remote.push_output(store, steps[0]).manifest == "repaired"  # a push replaces damage
    assert remote.pull_output(other, steps[0]) is not None


def test_a_manifest_that_writes_outside_its_folder_is_refused(remote: Remote, tmp_path: Path) -> None:
    """A manifest is self-digested, not signed: anyone can forge one, so file names are checked."""
    step = "cd" * 32
    body = {
        "format": objects.MANIFEST_FORMAT,
        "name": step,
        "files": {"../escaped": {"blake3": "00" * 32, "size": 0}},
        "digests": {},
    }
    remote.backend.put(keys.step(step), canonical_bytes({**body, "self": digest("manifest", body)}))
    other = fresh_store(tmp_path)
    with pytest.raises(RemoteDamaged, match="outside its folder"):
        remote.pull_output(other, step)
    assert not (other.root / "tmp" / "escaped").exists()
    assert_nothing_left(other)


@pytest.mark.parametrize(
    "files",
    [
        {"a\0b": {"blake3": "00" * 32, "size": 0}},  # a NUL byte: open() raised a traceback
        {"hf": {"blake3": "00" * 32, "size": 0}, "hf/model.bin": {"blake3": "00" * 32, "size": 0}},
    ],
    ids=["nul", "file-and-folder"],
)
def test_a_manifest_naming_impossible_files_is_refused(remote: Remote, tmp_path: Path, files: dict) -> None:
    """Issue 45, R7: one line naming the manifest, never a traceback or a misleading disk error."""
    step = "ce" * 32
    body = {"format": objects.MANIFEST_FORMAT, "name": step, "files": files, "digests": {}}
    remote.backend.put(keys.step(step), canonical_bytes({**body, "self": digest("manifest", body)}))
    other = fresh_store(tmp_path)
    with pytest.raises(RemoteDamaged, match="a name with a NUL byte, one name as both a file and a folder"):
        remote.pull_output(other, step)
    assert_nothing_left(other)


def test_declared_sizes_are_bounded_by_the_disk(remote: Remote, tmp_path: Path) -> None:
    """Issue 45, R8: sizes are the remote's word; more than the disk holds is refused up front."""
    step = "cf" * 32
    body = {
        "format": objects.MANIFEST_FORMAT,
        "name": step,
        "files": {"huge.bin": {"blake3": "00" * 32, "size": 1 << 62}},
        "digests": {},
    }
    remote.backend.put(keys.step(step), canonical_bytes({**body, "self": digest("manifest", body)}))
    other = fresh_store(tmp_path)
    with pytest.raises(RemoteDamaged, match="declares 4611686018427387904 bytes of files"):
        remote.pull_output(other, step)
    assert_nothing_left(other)


def test_a_fifo_blob_on_a_shared_folder_never_hangs_a_pull(tmp_path: Path) -> None:
    """Issue 45, R8: open() of a FIFO waits for a writer forever; it is refused at once."""
    import os

    (tmp_path / "remote").mkdir()
    remote = Remote.open(f"file://{tmp_path / 'remote'}")
    step, blob = "d0" * 32, "11" * 32
    body = {
        "format": objects.MANIFEST_FORMAT,
        "name": step,
        "files": {"x.bin": {"blake3": blob, "size": 4}},
        "digests": {},
    }
    remote.backend.put(keys.step(step), canonical_bytes({**body, "self": digest("manifest", body)}))
    (tmp_path / "remote" / "blobs").mkdir(exist_ok=True)
    os.mkfifo(tmp_path / "remote" / keys.blob(blob))
    other = fresh_store(tmp_path)
    with time_bound(10, "a pull of a FIFO blob"), pytest.raises(RemoteDamaged, match="is missing"):
        remote.pull_output(other, step)
    assert_nothing_left(other)


def test_two_builds_that_disagree_never_overwrite(
    remote: Remote, built: tuple[Store, list[str]], tmp_path: Path
) -> None:
    """Another store holds a different output sealed for the same step: its push reports the
    conflict (non-determinism) and the remote keeps the first."""
    store, steps = built
    remote.push_output(store, steps[0])
    before = remote.backend.get(keys.step(steps[0]))
    other = fresh_store(tmp_path)
    folder = other.new_temp("forged")
    (folder / "tokens.bin").write_bytes(b"another build")
    objects.publish(folder, other.outputs.path(steps[0]), {"data": "ff" * 32})
    pushed = remote.push_output(other, steps[0])
    assert pushed.manifest == "conflict" and "another build" in (pushed.conflict or "")
    assert remote.backend.get(keys.step(steps[0])) == before


def test_a_damaged_local_output_is_never_pushed(
    remote: Remote, built: tuple[Store, list[str]], tmp_path: Path
) -> None:
    other = fresh_store(tmp_path)
    step = built[1][0]
    objects.link_tree(built[0].outputs.path(step), other.outputs.path(step))
    victim = next(
        p for p in sorted(other.outputs.path(step).rglob("*")) if p.is_file() and p.name != objects.MANIFEST
    )
    victim.unlink()
    victim.write_bytes(b"x")
    with pytest.raises(CorruptObject, match="was not pushed"):
        remote.push_output(other, step)
    assert not remote.has_output(step)


# -- checkpoints ----------------------------------------------------------------------------------


def make_checkpoint(
    store: Store, step: str, number: int, payload: bytes, previous: tuple[int, str | None] = (0, None)
) -> Path:
    """A sealed checkpoint of update `number` whose trace segment follows the one that ends at
    `previous` (its last update, its blake3), kept in the pool as a train step keeps it."""
    parent = store.outputs.work_dir(step) / "checkpoints"
    folder = store.new_temp("ckpt")
    (folder / "state.json").write_bytes(payload)
    data = payload * 1000 + b"\0" * (-len(payload) * 1000 % 4)
    head, _ = tensors.encode_header([("w", "F32", [len(data) // 4], len(data))])
    (folder / "model.safetensors").write_bytes(head + data)
    # The trace records the state its tensors give at its update (a pull checks it).
    state = {"state": checkpoints.state_digest(folder)}
    header = trace.Header(first=previous[0] + 1, last=number, previous=previous[1])
    lines = [
        canonical_bytes({"step": s, **(state if s == number else {})}) + b"\n"
        for s in range(previous[0] + 1, number + 1)
    ]
    raw = trace.segment_bytes(header, lines)
    trace.keep(layout.trace_segments(parent), trace.segment_digest(raw), raw=raw)
    (folder / layout.TRACE).write_bytes(raw)
    final = parent / f"step-{number:06d}"
    objects.publish(folder, final)
    return final


def segment_of(checkpoint: Path) -> tuple[int, str]:
    return trace.read_header((checkpoint / layout.TRACE).read_bytes()).last, objects.sealed_files(checkpoint)[
        layout.TRACE
    ]


def test_the_newest_checkpoint_that_verifies_is_pulled(remote: Remote, tmp_path: Path) -> None:
    local, step = fresh_store(tmp_path, "a"), "12" * 32
    previous: tuple[int, str | None] = (0, None)
    for number in (4, 8, 12):
        previous = segment_of(make_checkpoint(local, step, number, f"update {number}".encode(), previous))
        pushed = remote.push_newest_checkpoint(step, local.outputs.work_dir(step) / "checkpoints")
        assert pushed is not None and pushed.manifest == "written"
    assert remote.checkpoints(step) == ["step-000012", "step-000008", "step-000004"]
    newest = objects.read_manifest(local.outputs.work_dir(step) / "checkpoints" / "step-000012")["files"]
    remote.backend.delete(keys.blob(newest["model.safetensors"]["blake3"]))
    other = fresh_store(tmp_path)
    into = other.outputs.work_dir(step) / "checkpoints"
    pulled, problems = remote.pull_newest_checkpoint(other, step, into)
    assert pulled == into / "step-000008" and objects.verify(pulled) == []
    assert tree(pulled) == tree(local.outputs.work_dir(step) / "checkpoints" / "step-000008")
    assert len(problems) == 1 and "step-000012" in problems[0] and "missing" in problems[0]
    assert sorted(p.name for p in into.iterdir()) == ["step-000008"]
    assert not any(other.tmp.iterdir())
    # The segments it links back to came with it: the trace reads whole from update 1.
    whole = trace.whole(layout.trace_segments(into), (pulled / layout.TRACE).read_bytes())
    assert [entry["step"] for entry in whole] == list(range(1, 9))


def test_a_checkpoint_whose_trace_the_remote_lacks_is_never_resumed(remote: Remote, tmp_path: Path) -> None:
    """Segments are pushed before the checkpoint that links to them; one lost on the remote makes
    every checkpoint after it unusable there, and the pull falls back to one before it."""
    local, step = fresh_store(tmp_path, "a"), "56" * 32
    first = make_checkpoint(local, step, 4, b"four")
    remote.push_checkpoint(step, first)
    second = make_checkpoint(local, step, 8, b"eight", segment_of(first))
    remote.push_checkpoint(step, make_checkpoint(local, step, 12, b"twelve", segment_of(second)))
    assert remote.backend.exists(keys.blob(segment_of(second)[1])) is not None  # pushed with 12
    remote.backend.delete(keys.blob(segment_of(first)[1]))
    other = fresh_store(tmp_path)
    into = other.outputs.work_dir(step) / "checkpoints"
    pulled, problems = remote.pull_newest_checkpoint(other, step, into)
    assert pulled is None and len(problems) == 2
    assert all("trace segment" in problem or "missing" in problem for problem in problems), problems
    assert not any(into.glob("step-*"))


def test_another_steps_checkpoint_is_foreign(remote: Remote, tmp_path: Path) -> None:
    local, mine, theirs = fresh_store(tmp_path, "a"), "12" * 32, "34" * 32
    remote.push_checkpoint(theirs, make_checkpoint(local, theirs, 4, b"theirs"))
    remote.backend.put(
        keys.checkpoint(mine, "step-000004"), remote.backend.get(keys.checkpoint(theirs, "step-000004"))
    )
    other = fresh_store(tmp_path)
    pulled, problems = remote.pull_newest_checkpoint(
        other, mine, other.outputs.work_dir(mine) / "checkpoints"
    )
    assert pulled is None and "foreign" in problems[0] and "step-000004" in problems[0]
    assert not (other.outputs.work_dir(mine) / "checkpoints").exists()


# -- plans and evaluation entries -----------------------------------------------------------------


def test_plans_and_eval_entries_round_trip_and_damage_is_named(remote: Remote) -> None:
    plan, raw = "ef" * 32, b'{"a plan":1}'
    remote.push_plan(plan, raw)
    remote.push_plan(plan, raw)  # idempotent
    assert remote.plans() == [plan]
    assert remote.pull_plan(plan, lambda b: None if b == raw else "not this plan") == raw
    with pytest.raises(RemoteDamaged, match="does not belong under its name"):
        remote.pull_plan(plan, lambda b: "hashes to another plan")
    framed = bytearray(remote.backend.get(keys.plan(plan)))
    framed[-2] ^= 0x20
    remote.backend.put(keys.plan(plan), bytes(framed))
    with pytest.raises(
        RemoteDamaged, match=rf"plan {plan[:12]} \({keys.plan(plan)}\) does not match its blake3"
    ):
        remote.pull_plan(plan, lambda b: None)
    assert remote.pull_plan("01" * 32, lambda b: None) is None
    remote.push_eval("abc123", b"result")
    assert remote.pull_eval("abc123", lambda b: None) == b"result"
    assert remote.pull_eval("missing", lambda b: None) is None


# -- back ends ------------------------------------------------------------------------------------


def test_a_create_only_write_refuses_a_second_writer(remote: Remote) -> None:
    remote.backend.put("probe/one", b"first", create_only=True)
    with pytest.raises(AlreadyExists):
        remote.backend.put("probe/one", b"second", create_only=True)
    assert remote.backend.get("probe/one") == b"first"
    assert remote.backend.exists("probe/one") == 5 and remote.backend.exists("probe/two") is None
    assert remote.backend.list("probe") == ["probe/one"]
    remote.backend.delete("probe/one")
    remote.backend.delete("probe/one")  # no error when gone
    with pytest.raises(ObjectMissing):
        remote.backend.get("probe/one")


# -- leases ---------------------------------------------------------------------------------------


def test_a_racing_8_way_lease_has_exactly_one_winner(remote: Remote) -> None:
    for trial in range(3):
        step = f"{trial:02d}" * 32
        start: threading.Barrier = threading.Barrier(8)
        results: dict[str, leases.Lease] = {}

        def contend(
            holder: str, step: str = step, start: threading.Barrier = start, results: dict = results
        ) -> None:
            start.wait()
            results[holder] = leases.take(remote.backend, step, holder, 60)

        threads = [threading.Thread(target=contend, args=(f"builder-{i}",)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [holder for holder, lease in results.items() if lease.holder == holder]
        assert len(winners) == 1, results
        assert {lease.token for lease in results.values()} == {results[winners[0]].token}


def test_a_lease_renews_expires_is_taken_over_and_the_old_holder_learns_it(remote: Remote) -> None:
    step = "56" * 32
    assert leases.holder_id() != leases.holder_id()
    mine = leases.take(remote.backend, step, "a", 0.6)
    assert mine.holder == "a"
    assert leases.take(remote.backend, step, "b", 30).holder == "a"  # busy: b waits
    mine = leases.renew(remote.backend, mine, 0.6)
    time.sleep(0.7)
    theirs = leases.take(remote.backend, step, "b", 30)  # a's lease expired: b takes over
    assert theirs.holder == "b" and theirs.generation == mine.generation + 1
    with pytest.raises(leases.LeaseLost, match="expired"):
        leases.renew(remote.backend, mine, 30)
    late = leases.Lease(
        step=step, generation=mine.generation, holder="a", token=mine.token, expires=time.time() + 30
    )
    with pytest.raises(leases.LeaseLost, match="taken over by b"):
        leases.renew(remote.backend, late, 30)  # a's clock said it was still live: the write loses
    leases.release(remote.backend, theirs)
    assert leases.take(remote.backend, step, "c", 30).holder == "c"
    assert len(remote.backend.list(keys.leases(step))) <= 3  # the chain is pruned


def test_a_lease_expiring_beyond_the_longest_lease_is_taken_over_and_reported_once(
    remote: Remote, capsys: pytest.CaptureFixture[str]
) -> None:
    step = uuid.uuid4().hex * 2  # its own step: a record is reported once per process
    far = leases.Lease(step=step, generation=0, holder="z", token="t", expires=time.time() + 10**9)
    remote.backend.put(keys.lease(step, 0), leases._encode(far), create_only=True)
    assert not far.live(time.time())
    assert leases.current(remote.backend, step) == (0, None)  # treated as a damaged record
    mine = leases.take(remote.backend, step, "a", 30)  # `bt run` would have waited ~31 years
    assert mine.holder == "a" and mine.generation == 1
    reported = [line for line in capsys.readouterr().err.splitlines() if "lease on step" in line]
    assert len(reported) == 1 and "more than the longest lease (600 s)" in reported[0], reported
    with pytest.raises(ValueError, match="at most 600"):
        leases.take(remote.backend, "58" * 32, "a", 10**9)


# -- attestations ---------------------------------------------------------------------------------


STEP, PLAN = "78" * 32, "9a" * 32
OUTPUT = {"weights": "11" * 32, "data": "aa" * 32}
FILES = {"model.safetensors": "33" * 32, "config.json": "44" * 32}


def builder() -> tuple[Ed25519PrivateKey, str]:
    key = Ed25519PrivateKey.generate()
    return key, signing.key_id(signing.raw_public(key))


def record(keyid: str, machine: str = "alpha", digests: dict[str, str] = OUTPUT) -> Attestation:
    return Attestation(
        step=STEP,
        plan=PLAN,
        builder=keyid,
        machine=machine,
        toolchain={"torch": "2.13.0", "device": "cpu"},
        built_at="2026-11-24T05:00:00Z",
        inputs={"data": "55" * 32},
        digests=digests,
        files=FILES,
    )


def put_envelope(remote: Remote, body: dict) -> str:
    key = keys.attestation(STEP, digest("remote-attestation", body))
    remote.backend.put(key, canonical_bytes(body))
    return key


def test_attestations_count_distinct_trusted_keys_never_records(remote: Remote) -> None:
    """Issue 45 R4: 3 trusted signers count 3; any number of unsigned, untrusted, forged or
    copied records count 0, and each is reported by kind."""
    trusted = [builder() for _ in range(3)]
    ring = Keyring(
        names={k: f"t{i}" for i, (_, k) in enumerate(trusted)},
        public={k: signing.raw_public(key) for key, k in trusted},
    )
    for key, keyid in trusted:
        attest(remote.backend, record(keyid), key)
        attest(remote.backend, attrs.evolve(record(keyid), built_at="2026-11-25T00:00:00Z"), key)  # again
    counted = tally(attestations(remote.backend, STEP, ring), OUTPUT, FILES)
    assert sorted(counted.agreeing.values()) == ["t0", "t1", "t2"] and counted.ignored == {}
    outsider, outsider_id = builder()
    for machine in ("beta", "gamma", "delta", "epsilon", "zeta"):  # many untrusted records, one writer
        attest(remote.backend, record(outsider_id, machine), outsider)
    old = {"format": 1, "record": {"step": STEP, "machine": "m", "digests": OUTPUT}}  # before signatures
    remote.backend.put(keys.attestation(STEP, digest("remote-attestation", old)), canonical_bytes(old))
    unsigned = signing.envelope(statement(record(trusted[0][1], "nosig")), trusted[0][0])
    put_envelope(remote, {**unsigned, "signatures": []})
    # Forged: the statement names trusted key t0 as its builder, the signature is the outsider's.
    forged = signing.envelope(statement(record(trusted[0][1], "forger")), outsider)
    forged["signatures"][0]["keyid"] = trusted[0][1]
    put_envelope(remote, forged)
    damaged = attest(remote.backend, record(outsider_id, "eta"), outsider)
    remote.backend.put(damaged, remote.backend.get(damaged).replace(b'"payload":"', b'"payload":"A'))
    found = attestations(remote.backend, STEP, ring)
    counted = tally(found, OUTPUT, FILES)
    assert len(counted.agreeing) == 3
    assert counted.ignored == {"untrusted key": 5, "unsigned": 2, "forged": 1, "damaged": 1}
    assert "9 records ignored: 1 damaged, 1 forged, 2 unsigned, 5 untrusted key" in str(counted)
    assert damaged in "\n".join(counted.problems)
    assert len(tally(found, OUTPUT, {**FILES, "extra.bin": "66" * 32}).agreeing) == 0  # other files
    nobody = Keyring(names={}, public={})
    assert tally(attestations(remote.backend, STEP, nobody), OUTPUT).agreeing == {}


def test_trusted_builders_that_disagree_are_non_determinism(remote: Remote) -> None:
    (a, a_id), (b, b_id) = builder(), builder()
    ring = Keyring(
        names={a_id: "alice", b_id: "bob"}, public={a_id: signing.raw_public(a), b_id: signing.raw_public(b)}
    )
    attest(remote.backend, record(a_id), a)
    attest(remote.backend, record(b_id, digests={**OUTPUT, "weights": "22" * 32}), b)
    found = attestations(remote.backend, STEP, ring)
    counted = tally(found, OUTPUT)
    assert counted.agreeing == {a_id: "alice"} and counted.disagreeing == {b_id: "bob"}
    (differs,) = disagreements(found)
    assert differs.name == "weights" and differs.values["22" * 32] == ("bob at 2026-11-24T05:00:00Z",)
    assert "not deterministic" in str(differs)
    with pytest.raises(ValueError, match="signed by the builder it names"):
        attest(remote.backend, record(a_id), b)


def test_an_attestation_is_an_in_toto_statement_in_a_dsse_envelope() -> None:
    key, keyid = builder()
    body = signing.envelope(statement(record(keyid)), key)
    assert body["payloadType"] == "application/vnd.in-toto+json"
    payload = base64.b64decode(body["payload"])
    said = json.loads(payload)
    assert said["_type"] == "https://in-toto.io/Statement/v1"
    assert said["subject"][0] == {"name": "config.json", "digest": {"blake3": "44" * 32}}
    assert said["predicate"]["buildDefinition"]["externalParameters"] == {"plan": PLAN, "step": STEP}
    assert record_of(said) == record(keyid)
    (signature,) = body["signatures"]
    message = b"DSSEv1 28 application/vnd.in-toto+json %d " % len(payload) + payload  # DSSE's PAE
    key.public_key().verify(base64.b64decode(signature["sig"]), message)
    assert signature["keyid"] == hashlib.sha256(signing.raw_public(key)).hexdigest()


def test_keys_live_where_the_user_says_and_stay_private(tmp_path: Path) -> None:
    root = tmp_path / "keys"
    key = keyring.builder_key(root, create=True)
    assert stat.S_IMODE((root / keyring.BUILDER).stat().st_mode) == 0o600
    assert keyring.load_keyring(root).names == {signing.key_id(signing.raw_public(key)): "self"}
    assert signing.raw_public(keyring.builder_key(root)) == signing.raw_public(key)
    (root / keyring.BUILDER).chmod(0o644)
    with pytest.raises(UsageError, match="readable by others"):
        keyring.builder_key(root)
    with pytest.raises(UsageError, match="already trusted as 'self'"):
        keyring.trust(signing.raw_public(key), "again", root)


# -- names, keys and imports ----------------------------------------------------------------------

SEGMENT = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.()!*'", min_size=1, max_size=12).filter(
    lambda s: s not in {".", ".."}
)
BUCKETS = st.from_regex(r"\A[a-z0-9][a-z0-9.-]{1,20}[a-z0-9]\Z")


@given(
    st.one_of(
        st.builds(
            lambda b, p: RemoteUrl(scheme="s3", location=b, prefix="/".join(p)),
            BUCKETS,
            st.lists(SEGMENT, max_size=4),
        ),
        st.builds(
            lambda p: RemoteUrl(scheme="file", location="/" + "/".join(p)),
            st.lists(SEGMENT, min_size=1, max_size=4),
        ),
    )
)
def test_a_remote_url_round_trips(url: RemoteUrl) -> None:
    assert parse_url(str(url)) == url
    assert parse_url(str(url) + "/") == url  # a trailing slash names the same place


@pytest.mark.parametrize(
    "text",
    [
        "s3://",
        "s3://UPPER/x",
        "http://host/x",
        "file://relative/x",
        "file:///a/../b",
        "s3://b/x//y",
        "/mnt/x",
        "file://",  # file://$UNSET: never the file system's root (issue 45, R13)
        "file:///",
        "file:////",
    ],
)
def test_a_bad_remote_url_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="remote"):
        parse_url(text)


HEX64 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)


@given(HEX64, st.integers(min_value=0, max_value=10**12 - 1))
def test_keys_name_what_they_hold(value: str, generation: int) -> None:
    assert keys.blob(value) == f"blobs/{value}"
    assert keys.name_in("steps", keys.step(value)) == value
    assert keys.name_in("plans", keys.plan(value)) == value
    assert keys.generation_of(keys.lease(value, generation)) == generation
    assert keys.name_in(keys.checkpoints(value), keys.checkpoint(value, "step-000004")) == "step-000004"


@given(st.text(max_size=70).filter(lambda s: not keys.HASH.match(s)))
def test_a_key_never_holds_a_name_that_is_not_a_digest(value: str) -> None:
    with pytest.raises(ValueError):
        keys.blob(value)


def test_the_s3_client_is_imported_only_for_an_s3_remote(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from buildtrain.store.remote.remote import Remote\n"
        f"Remote.open('file://{tmp_path}').plans()\n"
        "assert 'obstore' not in sys.modules and 'boto3' not in sys.modules, sorted(sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_an_unreachable_remote_is_one_line_naming_it(
    tmp_path: Path, seaweed_server: seaweed.Seaweed, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RemoteUnavailable, match=r"is not a folder; create it"):
        Remote.open(f"file://{tmp_path / 'absent'}")
    for name, value in seaweed_server.env().items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        RemoteUnavailable, match=r"s3://no-such-bucket/x: there is no bucket 'no-such-bucket' at http"
    ) as caught:
        Remote.open("s3://no-such-bucket/x").plans()
    assert "\n" not in str(caught.value) and caught.value.exit_code == 1
    # A lookup of one object in it is a 404 as well: still named as the bucket, not as a plan
    # that is not on the remote.
    with pytest.raises(RemoteUnavailable, match=r"there is no bucket 'no-such-bucket'"):
        Remote.open("s3://no-such-bucket/x").pull_plan("0" * 64, lambda raw: None)


@given(
    st.builds(
        leases.Lease,
        step=HEX64,
        generation=st.integers(min_value=0, max_value=10**12 - 1),
        holder=st.text(min_size=1, max_size=20),
        token=st.text(alphabet="0123456789abcdef", min_size=32, max_size=32),
        expires=st.floats(min_value=0, max_value=4e9, allow_nan=False),
        released=st.booleans(),
    ),
    st.data(),
)
def test_a_lease_record_round_trips_and_any_flipped_byte_is_refused(
    lease: leases.Lease, data: st.DataObject
) -> None:
    raw = leases._encode(lease)
    assert leases._decode(raw, lease.step, lease.generation) == lease
    assert leases._decode(raw, lease.step, lease.generation + 1) is None  # found under another name
    at = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
    flipped = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(min_value=1, max_value=255))]) + raw[at + 1 :]
    assert leases._decode(flipped, lease.step, lease.generation) is None


@pytest.mark.skipif(sys.platform != "linux", reason="a nice value per thread is Linux's")
def test_the_checkpoint_pusher_yields_the_cpu_to_training_and_nothing_else_does() -> None:
    """The pusher's thread and the upload threads it starts run at nice 19; the rest of `bt run`
    (the lease's renewals, the main thread) keeps its priority."""
    from concurrent.futures import ThreadPoolExecutor

    from buildtrain.executor.remote import remote_checkpoints

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: dict[str, int] = {}

    def pusher() -> None:
        remote_checkpoints._lower_priority()
        seen["pusher"] = priority()
        with ThreadPoolExecutor(2) as pool:
            seen["upload"] = pool.submit(priority).result()

    before = priority()
    thread = threading.Thread(target=pusher)
    thread.start()
    thread.join()
    assert seen == {"pusher": remote_checkpoints.PUSHER_NICE, "upload": remote_checkpoints.PUSHER_NICE}
    assert priority() == before
