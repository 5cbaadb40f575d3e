"""The team cache wired into bt (issue 21): `bt run --remote`, `bt push`, `bt pull`, `bt ls
--remote`, `bt show --remote`, `bt verify --push`, against a real S3 server (SeaweedFS, started
once per session) and a shared folder.

A store that runs a plan another store pushed executes nothing and gets the same bits; a damaged,
missing or foreign object on the remote is named and never served; two stores building at once
both succeed with identical digests; a build that differs is reported as non-determinism.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import seaweed
from conftest import MICRO, Reference, actions, plan_hash, run_bt, step_digests, summaries

from buildtrain.plan.stored import load_plan
from buildtrain.store import objects
from buildtrain.store.remote import keys
from buildtrain.store.remote.remote import Remote
from buildtrain.store.store import Store

PERTURB = {"BT_TEST_PERTURB": "7:blocks.1.ffn.w2.weight:1e-3"}


@pytest.fixture(params=["folder", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An empty remote's URL: a fresh folder, or a fresh prefix in the session's SeaweedFS (whose
    AWS_* variables are set for this process and every bt it starts)."""
    if request.param == "folder":
        (tmp_path / "remote").mkdir()
        return f"file://{tmp_path / 'remote'}"
    server: seaweed.Seaweed = request.getfixturevalue("seaweed_server")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return server.url(f"r-{uuid.uuid4().hex[:12]}")


def bt_at(store: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    store.parent.mkdir(parents=True, exist_ok=True)
    return run_bt(*args, store=store, env=env)


def pushed(micro_built: Reference, url: str) -> str:
    """The micro plan pushed by hand from the session's built store; its hash."""
    store, plan, _ = micro_built
    done = bt_at(store, "push", plan, "--remote", url)
    assert done.returncode == 0, done.stderr
    return plan


def test_a_second_store_pulls_every_step_and_then_builds_nothing(
    remote: str, tmp_path: Path, micro_built: Reference
) -> None:
    a, b = tmp_path / "a" / ".bt", tmp_path / "b" / ".bt"
    built = bt_at(a, "run", str(MICRO), "--remote", remote)
    assert built.returncode == 0, built.stderr
    plan = plan_hash(bt_at(a, "plan", str(MICRO)))
    assert step_digests(a, plan) == micro_built[2]  # a remote changes where, never what

    run = bt_at(b, "run", plan, env={"BT_REMOTE": remote})  # a full hash B never planned
    assert run.returncode == 0, run.stderr
    assert "0 executed, 4 pulled, 0 cached" in run.stderr
    assert step_digests(b, plan) == micro_built[2]
    entries = {path.name for path in (b / "evals").glob("*.json")}
    assert entries and entries == {path.name for path in (a / "evals").glob("*.json")}  # with their steps
    assert bt_at(b, "fsck").returncode == 0  # what was pulled is a store like any other
    again = bt_at(b, "run", plan, "--remote", remote)
    assert "0 executed, 4 cached" in again.stderr
    records = summaries(b.parent / "experiments")
    assert set(actions(records[-2]).values()) == {"pulled"} and records[-2]["pulled"] == 4
    assert set(actions(records[-1]).values()) == {"cached"} and records[-1]["executed"] == 0


def _damage(url: str, plan_hash_: str, store: Path, how: str) -> str:
    """Damage the remote copy of the train step; returns what the error must name."""
    steps = [step.hash for step in load_plan(Store(store), plan_hash_).steps]
    backend = Remote.open(url).backend
    files = objects.read_manifest(Store(store).outputs.path(steps[1]))["files"]
    name, entry = max(files.items(), key=lambda item: item[1]["size"])
    blob = keys.blob(entry["blake3"])
    if how == "flipped":
        raw = bytearray(backend.get(blob))
        raw[len(raw) // 2] ^= 0x01
        backend.put(blob, bytes(raw))
        return f"{name}: blob {entry['blake3'][:12]} ({blob}) does not match its blake3"
    if how == "deleted":
        backend.delete(blob)
        return f"blob {entry['blake3'][:12]} ({blob}) is missing"
    backend.delete(keys.step(steps[1]))
    backend.put(keys.step(steps[1]), backend.get(keys.step(steps[0])))
    return "(a foreign object)"


@pytest.mark.parametrize("how", ["flipped", "deleted", "foreign"])
def test_damage_on_the_remote_is_named_and_never_served(
    remote: str, how: str, tmp_path: Path, micro_built: Reference
) -> None:
    plan = pushed(micro_built, remote)
    named = _damage(remote, plan, micro_built[0], how)
    b = tmp_path / "b" / ".bt"
    pull = bt_at(b, "pull", plan, "--remote", remote)
    assert pull.returncode == 5, pull.stderr
    assert named in pull.stderr and "train:main" in pull.stderr
    train = load_plan(Store(b), plan).steps[1].hash
    assert not Store(b).outputs.has(train)  # nothing of it was kept
    assert Store(b).outputs.has(load_plan(Store(b), plan).steps[0].hash)  # the intact data step was


def test_a_run_builds_a_step_whose_remote_copy_is_damaged(tmp_path: Path, micro_built: Reference) -> None:
    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    plan = pushed(micro_built, url)
    named = _damage(url, plan, micro_built[0], "flipped")
    b = tmp_path / "b" / ".bt"
    bt_at(b, "pull", plan, "--remote", url)  # fetches the plan (and the intact steps)
    run = bt_at(b, "run", plan, "--remote", url)
    assert run.returncode == 0, run.stderr
    assert named in run.stderr
    assert actions(summaries(b.parent / "experiments")[-1])["train:main"] == "executed"
    assert step_digests(b, plan) == micro_built[2]


def test_two_stores_building_at_once_agree(tmp_path: Path, seaweed_server: seaweed.Seaweed) -> None:
    url = seaweed_server.url(f"race-{uuid.uuid4().hex[:12]}")
    stores = [tmp_path / name / ".bt" for name in "ab"]
    env = {**os.environ, **seaweed_server.env(), "BT_REMOTE": url}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "buildtrain", "run", str(MICRO)],
            env={**env, "BT_STORE": str(store), "BT_EXPERIMENTS": str(store.parent / "experiments")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for store in stores
    ]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    plan = plan_hash(bt_at(stores[0], "plan", str(MICRO)))
    assert step_digests(stores[0], plan) == step_digests(stores[1], plan)
    train = [actions(summaries(s.parent / "experiments")[-1])["train:main"] for s in stores]
    assert sorted(train) == ["executed", "pulled"], outputs  # the lease: one built, one waited


def test_a_build_that_differs_is_reported_as_non_determinism(tmp_path: Path, micro_built: Reference) -> None:
    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    plan = pushed(micro_built, url)
    c = tmp_path / "c" / ".bt"
    built = bt_at(c, "run", str(MICRO), env=PERTURB)
    assert built.returncode == 0, built.stderr
    push = bt_at(c, "push", plan, "--remote", url)
    assert push.returncode == 4, push.stderr
    assert "non-determinism" in push.stderr and "train:main" in push.stderr
    train = load_plan(Store(c), plan).steps[1].hash
    assert Remote.open(url).output_digests(train) == micro_built[2]["train:main"]  # never overwritten
    show = bt_at(c, "show", plan, "--remote", url)
    assert "weights differs between builds" in show.stdout and "not deterministic" in show.stdout


def test_ls_remote_attestations_and_verify_push(tmp_path: Path, micro_built: Reference) -> None:
    """Issue 45 R4: a push and a verify --push on one machine are one builder, not two; a second
    builder counts once its key is in the puller's keyring; records count 0 without it."""
    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    store, plan, _ = micro_built
    empty = bt_at(store, "ls", "--remote", url)
    assert empty.returncode == 0 and "no plans" in empty.stdout
    pushed(micro_built, url)  # the first push makes this builder's key (trusted here as 'self')
    listed = bt_at(store, "ls", "--remote", env={"BT_REMOTE": url})
    assert listed.stdout.split() == [plan, "micro"]
    assert json.loads(bt_at(store, "ls", "--remote", url, "--json").stdout) == [
        {"plan": plan, "name": "micro"}
    ]
    verify = bt_at(store, "verify", plan, "--push", "--remote", url, env={"BT_MACHINE": "second"})
    assert verify.returncode == 0, verify.stderr
    assert "train:main: attested on" in verify.stderr and "(1 trusted builder agrees (self))" in verify.stderr
    bob = {"BT_KEYS": str(tmp_path / "bob-keys")}
    again = bt_at(store, "verify", plan, "--push", "--remote", url, env=bob)
    assert "(1 trusted builder agrees (self); 2 records ignored: 2 untrusted key)" in again.stderr
    reader = {"BT_KEYS": str(tmp_path / "reader-keys")}
    b = tmp_path / "b" / ".bt"
    refused = bt_at(b, "pull", plan, "--remote", url, "--min-attestations", "1", env=reader)
    assert refused.returncode == 4, refused.stderr
    assert "0 trusted builders agree; 3 records ignored: 3 untrusted key: not pulled" in refused.stderr
    for name, keys_env in (("alice", {}), ("bob", bob)):
        exported = tmp_path / f"{name}.pem"
        exported.write_text(bt_at(store, "keys", "export", env=keys_env).stdout)
        trusted = bt_at(b, "keys", "trust", str(exported), "--name", name, env=reader)
        assert trusted.returncode == 0, trusted.stderr
    listed = bt_at(b, "keys", "ls", env=reader).stdout.split()
    assert listed[1::2] == ["alice", "bob"] and len(listed[0]) == 64
    show = bt_at(b, "show", plan, "--remote", url, env=reader)
    assert (
        "train:main" in show.stdout and "on the remote, 2 trusted builders agree (alice, bob)" in show.stdout
    )
    shown = json.loads(bt_at(b, "show", plan, "--remote", url, "--json", env=reader).stdout)
    row = shown["steps"][1]
    assert (row["label"], row["agreeing"], row["signers"], row["ignored"]) == (
        "train:main",
        2,
        ["alice", "bob"],
        {},
    )
    accepted = bt_at(b, "pull", plan, "--remote", url, "--min-attestations", "2", env=reader)
    assert accepted.returncode == 0, accepted.stderr
    assert step_digests(b, plan) == micro_built[2]
    again = bt_at(b, "push", plan, "--remote", url, env=reader)  # pulled here: not one more build
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / "reader-keys" / "builder.pem").exists()
    assert "2 trusted builders agree" in bt_at(b, "show", plan, "--remote", url, env=reader).stdout


def test_a_run_pulls_only_what_enough_trusted_builders_signed(tmp_path: Path, micro_built: Reference) -> None:
    """`bt run --min-attestations N` (or the team's $BT_MIN_ATTESTATIONS): a step signed by fewer
    trusted keys is built here instead, and says why; once its builder is trusted it is pulled."""
    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    _, plan, honest = micro_built
    store = tmp_path / "a" / ".bt"  # builds, pushes its checkpoints and output, signs the output
    assert bt_at(store, "run", str(MICRO), "--remote", url).returncode == 0
    reader = {"BT_KEYS": str(tmp_path / "reader-keys"), "BT_REMOTE": url}
    b = tmp_path / "b" / ".bt"
    assert plan_hash(bt_at(b, "plan", str(MICRO), env=reader)) == plan
    built = bt_at(b, "run", plan, env={**reader, "BT_MIN_ATTESTATIONS": "1"})
    assert built.returncode == 0, built.stderr
    assert (
        "0 trusted builders agree; 1 record ignored: 1 untrusted key: not pulled; building it here"
        in built.stderr
    )
    assert "4 executed, 0 cached" in built.stderr and step_digests(b, plan) == honest
    exported = tmp_path / "builder.pem"
    exported.write_text(bt_at(store, "keys", "export").stdout)
    assert bt_at(b, "keys", "trust", str(exported), "--name", "builder", env=reader).returncode == 0
    c = tmp_path / "c" / ".bt"
    pulled = bt_at(c, "run", plan, "--min-attestations", "1", env={**reader, "BT_KEYS": reader["BT_KEYS"]})
    assert pulled.returncode == 0, pulled.stderr
    assert "0 executed, 4 pulled" in pulled.stderr and step_digests(c, plan) == honest
    bad = bt_at(c, "run", plan, env={**reader, "BT_MIN_ATTESTATIONS": "two"})
    assert bad.returncode == 2 and "BT_MIN_ATTESTATIONS='two'" in bad.stderr, bad.stderr


def test_a_prefix_the_store_lacks_says_a_remote_gives_full_hashes(
    tmp_path: Path, micro_built: Reference
) -> None:
    """Issue 48: with a remote set, a prefix the empty store lacks names the way that works."""
    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    plan = pushed(micro_built, url)
    b = tmp_path / "b" / ".bt"
    for command in (("run", plan[:8]), ("pull", plan[:8])):
        refused = bt_at(b, *command, "--remote", url)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert f"by its full hash (bt ls --remote {url} lists them)" in refused.stderr
    without = bt_at(b, "run", plan[:8])
    assert without.returncode == 2 and "bt ls --remote" not in without.stderr


def test_a_remote_enters_no_hash_and_no_import_without_one(tmp_path: Path, micro_built: Reference) -> None:
    store = tmp_path / ".bt"
    plain = plan_hash(bt_at(store, "plan", str(MICRO)))
    with_remote = plan_hash(bt_at(store, "plan", str(MICRO), env={"BT_REMOTE": "s3://team-bucket/bt"}))
    assert plain == with_remote

    def imported(*args: str, remote: str | None = None, at: Path = store) -> str:
        env = {**os.environ, "BT_STORE": str(at), "BT_EXPERIMENTS": str(tmp_path / "experiments")}
        env.pop("BT_REMOTE", None)
        env.update({"BT_REMOTE": remote} if remote else {})
        argv = [sys.executable, "-X", "importtime", "-m", "buildtrain", *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stderr

    for stderr in (imported("plan", str(MICRO)), imported("run", micro_built[1], at=micro_built[0])):
        assert "buildtrain.store.remote" not in stderr and "obstore" not in stderr
        assert "cryptography" not in stderr
    # With a remote, a null build never opens it: the S3 client and the signing library stay unloaded.
    null = imported("run", micro_built[1], remote="s3://team-bucket/bt", at=micro_built[0])
    assert "obstore" not in null and "cryptography" not in null


def test_a_bad_remote_is_one_line_and_exit_2(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    for args in (("run", str(MICRO), "--remote", "http://x"), ("push", str(MICRO)), ("ls", "--remote")):
        done = bt_at(store, *args, env={"BT_REMOTE": ""})
        assert done.returncode == 2, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_a_lost_lease_stops_the_step(
    tmp_path: Path, micro_built: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal that finds another holder's record stops the step (Marin #8107)."""
    import time

    from buildtrain.executor.remote import remote as run_remote
    from buildtrain.store.remote import leases
    from buildtrain.store.remote.url import parse_url

    (tmp_path / "remote").mkdir()
    monkeypatch.setattr(run_remote, "LEASE_S", 0.6)
    said: list[str] = []
    cache = run_remote.RemoteCache(
        parse_url(f"file://{tmp_path / 'remote'}"), lambda _, text: said.append(text)
    )
    stopped: list[bool] = []
    cache.on_lost = lambda: stopped.append(True)
    step = load_plan(Store(micro_built[0]), micro_built[1]).steps[1]
    local = Store(tmp_path / "b" / ".bt")
    with cache.building(local, step) as build:
        assert build
        top, mine = leases.current(cache.remote.backend, step.hash)
        assert mine is not None and mine.holder == cache.holder
        other = leases.Lease(
            step=step.hash, generation=top + 1, holder="other", token="t", expires=time.time() + 60
        )
        assert leases._write(cache.remote.backend, other)
        time.sleep(0.6)  # past a renewal (every third of the lease)
    assert stopped == [True] and any("taken over by other" in line for line in said)


def test_a_train_step_killed_on_one_machine_resumes_on_another(
    tmp_path: Path, micro_built: Reference
) -> None:
    """Store A pushes its checkpoints while training and is SIGKILLed once its second one
    reached the remote; store B starts from that checkpoint and gets the bits, and the files,
    of an uninterrupted build (the first kept checkpoint comes from the remote too)."""
    import signal
    import time

    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    a, b = tmp_path / "a" / ".bt", tmp_path / "b" / ".bt"
    plan = plan_hash(bt_at(a, "plan", str(MICRO)))
    train = load_plan(Store(a), plan).steps[1].hash
    env = {**os.environ, "BT_STORE": str(a), "BT_EXPERIMENTS": str(tmp_path / "experiments")}
    slow = subprocess.Popen(
        [sys.executable, "-m", "buildtrain", "run", plan, "--remote", url],
        env={**env, "BT_TEST_STEP_DELAY": "0.4"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its step process too goes down with the group
    )
    checkpoints = tmp_path / "remote" / "work" / train
    deadline = time.monotonic() + 120
    second = checkpoints / "step-000008.json"  # micro: a checkpoint every 4 updates, 3 kept
    while not second.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(slow.pid, signal.SIGKILL)
    slow.wait()
    assert second.exists(), "the second checkpoint never reached the remote"
    assert not Remote.open(url).has_output(train)
    shutil.rmtree(tmp_path / "remote" / "leases")  # A's lease would expire in a minute: skip the wait
    shutil.copytree(tmp_path / "remote", tmp_path / "snapshot")  # the remote as A left it
    run = bt_at(b, "run", plan, "--remote", url)
    assert run.returncode == 0, run.stderr
    assert "resuming from step-" in run.stderr and "pulled from" in run.stderr
    assert step_digests(b, plan) == micro_built[2]
    # ...and the same files: the kept checkpoints from before the resume came from the remote too
    honest = Store(micro_built[0]).outputs.path(train)
    assert objects.sealed_files(Store(b).outputs.path(train)) == objects.sealed_files(honest)
    # A store that asks for signed results does not start from a checkpoint: no one signs one.
    c = tmp_path / "c" / ".bt"
    strict = bt_at(c, "run", plan, "--remote", f"file://{tmp_path / 'snapshot'}", "--min-attestations", "1")
    assert strict.returncode == 0, strict.stderr
    assert "not resuming from the remote's checkpoint (no one signs one)" in strict.stderr
    assert "resuming from step-" not in strict.stderr and step_digests(c, plan) == micro_built[2]


def test_a_run_stopped_before_any_push_resumes_on_another_machine_from_the_hash_alone(
    tmp_path: Path, micro_built: Reference, seaweed_server: seaweed.Seaweed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48: the plan is uploaded before its first step builds, not when a push first
    happens. Store A's data step was built without the remote, so nothing of the run had been
    pushed when A is killed after its first checkpoint reached S3; store B, which never saw the
    preset, runs the plan by hash and gets the weights of an uninterrupted build."""
    import signal
    import time

    for name, value in seaweed_server.env().items():
        monkeypatch.setenv(name, value)
    url = seaweed_server.url(f"r-{uuid.uuid4().hex[:12]}")
    a, b = tmp_path / "a" / ".bt", tmp_path / "b" / ".bt"
    plan = plan_hash(bt_at(a, "plan", str(MICRO)))
    assert bt_at(a, "run", plan, "--target", "data:main").returncode == 0
    train = load_plan(Store(a), plan).steps[1].hash
    env = {**os.environ, "BT_STORE": str(a), "BT_EXPERIMENTS": str(tmp_path / "experiments")}
    slow = subprocess.Popen(
        [sys.executable, "-m", "buildtrain", "run", plan, "--remote", url],
        env={**env, "BT_TEST_STEP_DELAY": "0.4"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its step process too goes down with the group
    )
    remote = Remote.open(url)
    deadline = time.monotonic() + 120
    while not remote.checkpoints(train) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(slow.pid, signal.SIGKILL)
    slow.wait()
    assert remote.checkpoints(train), "no checkpoint reached the remote"
    assert not remote.has_output(train) and plan in remote.plans()
    for key in remote.backend.list("leases"):  # A's lease would expire in a minute: skip the wait
        remote.backend.delete(key)
    run = bt_at(b, "run", plan, "--remote", url)
    assert run.returncode == 0, run.stderr
    assert "resuming from step-" in run.stderr
    assert step_digests(b, plan) == micro_built[2]


def test_a_remote_out_of_reach_is_one_warning_and_the_run_builds_locally(
    tmp_path: Path, micro_built: Reference
) -> None:
    store = tmp_path / "a" / ".bt"
    nowhere = f"file://{tmp_path / 'nowhere'}"
    run = bt_at(store, "run", str(MICRO), "--remote", nowhere)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("is not a folder") == 1 and "building locally" in run.stderr
    assert step_digests(store, micro_built[1]) == micro_built[2]
    push = bt_at(store, "push", micro_built[1], "--remote", nowhere)
    assert push.returncode == 1 and "push failed" in push.stderr and "Traceback" not in push.stderr


def test_no_wait_refuses_a_step_leased_on_the_remote(tmp_path: Path) -> None:
    from buildtrain.store.remote import leases

    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    a = tmp_path / "a" / ".bt"
    plan = plan_hash(bt_at(a, "plan", str(MICRO)))
    data = load_plan(Store(a), plan).steps[0].hash
    held = leases.take(Remote.open(url).backend, data, "elsewhere:1:abc", 60)
    assert held.holder == "elsewhere:1:abc"
    run = bt_at(a, "run", plan, "--remote", url, "--no-wait")
    assert run.returncode == 7, run.stderr
    assert "elsewhere:1:abc is building this step (remote lease" in run.stderr
    assert not Store(a).outputs.has(data)


def test_a_sweep_split_between_two_stores_is_then_built_on_both(tmp_path: Path) -> None:
    """A 2x2 sweep: store A builds two points, store B the other two, both against one remote;
    then each runs all four with nothing executed, and a second time as a null build."""
    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    a, b = tmp_path / "a" / ".bt", tmp_path / "b" / ".bt"
    axes = ["--sweep", "train.lr=1e-3,3e-3", "--sweep", "train.steps=4,8"]
    planned = bt_at(a, "plan", str(MICRO), *axes)
    points = planned.stdout.split()
    assert planned.returncode == 0 and len(points) == 4, planned.stderr
    assert bt_at(b, "plan", str(MICRO), *axes).stdout.split() == points  # each has the preset
    for store, half in ((a, points[:2]), (b, points[2:])):
        done = bt_at(store, "run", *half, "--remote", url)
        assert done.returncode == 0, done.stderr
    for store in (a, b):
        every = bt_at(store, "run", *points, "--remote", url)
        assert every.returncode == 0, every.stderr
        assert "0 executed" in every.stderr and "distinct steps" in every.stderr
        assert all(record["executed"] == 0 for record in summaries(store.parent / "experiments")[-4:])
        again = bt_at(store, "run", *points, "--remote", url)
        assert all(
            set(actions(r).values()) == {"cached"} for r in summaries(store.parent / "experiments")[-4:]
        )
        assert again.returncode == 0
    digests = [step_digests(store, point) for store in (a, b) for point in points]
    assert digests[:4] == digests[4:]


def test_checkpoints_that_began_on_the_remote_are_not_resumed_under_a_requirement(
    tmp_path: Path, micro_built: Reference
) -> None:
    """A store whose work on a step began from a pulled checkpoint (the mark an earlier run left)
    does not resume from it once signed results are required: it builds the step from scratch."""
    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    built, plan, honest = micro_built
    store = tmp_path / "a" / ".bt"
    assert bt_at(store, "plan", str(MICRO)).returncode == 0
    train = load_plan(Store(built), plan).steps[1].hash
    work = Store(store).outputs.work_dir(train)
    (work / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        Store(built).outputs.path(train) / "checkpoints", work / "checkpoints", dirs_exist_ok=True
    )
    (work / "pulled-checkpoint.json").write_text('{"checkpoint": "step-000008", "remote": "elsewhere"}')
    run = bt_at(store, "run", plan, "--remote", url, "--min-attestations", "1")
    assert run.returncode == 0, run.stderr
    assert "not resuming from checkpoints that began on the remote" in run.stderr, run.stderr
    assert "resuming from checkpoint at step" not in run.stderr
    assert step_digests(store, plan) == honest
