"""Every failure a user can cause, or a disk can, ends in one line and a documented exit code.

One test per class of failure (issue 14): mistakes in presets and on the command line (exit 2,
never a traceback, never a hang); failures inside a step (disk full, a split too short: exit 1 and
a message that says what survived); signals while waiting for a lock (exit 3, recorded as such);
names and paths that would escape the store or the export folder; wrong exit codes and messages.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MICRO, run_bt, summaries

from buildtrain import cli
from buildtrain.canonical import canonical_bytes
from buildtrain.errors import ExitCode
from buildtrain.executor.process.launch import Launch
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.stored import load_plan
from buildtrain.store.objects import append_flushed
from buildtrain.store.store import Store


def bt_main(*argv: str) -> tuple[int, str]:
    """`bt ARGV` in this process: its exit code and stderr (argparse errors included)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, err.getvalue()


def one_line_error(text: str) -> str:
    """The message of a refusal: no traceback, and only the problem plus bt's own summary line."""
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, text
    return lines[0]


def _deep_extends(root: Path) -> Path:
    for level in range(1000):
        text = f'extends = "c{level + 1}.toml"\n' if level < 999 else 'name = "deep"\n'
        (root / f"c{level}.toml").write_text(text)
    return root / "c0.toml"


def _fifo(root: Path) -> Path:
    os.mkfifo(root / "fifo.toml")
    return root / "fifo.toml"


def _extends_folder(root: Path) -> Path:
    (root / "base").mkdir()
    (root / "p.toml").write_text('extends = "base"\n')
    return root / "p.toml"


def _micro(_: Path) -> Path:
    return MICRO


SAFE_SET = "letters, digits, '.', '_' and '-'"


@pytest.mark.parametrize(
    ("preset", "extra", "expected"),
    [
        (_micro, ["--set", "numerics.threads=9223372036854775807"], "numerics.threads: must be <= 4096"),
        (_micro, ["--threads", "3000000000"], "--threads: must be <= 4096"),
        (_micro, ["--nproc", "3000000000"], "--nproc: must be <= 1024"),
        (_micro, ["--set", 'name="/etc/x"'], f"name: '/etc/x' is not a safe name: use only {SAFE_SET}"),
        (_micro, ["--set", 'name="../x"'], f"name: '../x' is not a safe name: use only {SAFE_SET}"),
        (_micro, ["--set", 'name="a\\u0000b"'], "name: 'a\\x00b' is not a safe name"),
        (_micro, ["--set", 'stages.main.name="a/b"'], "stages[0].name: 'a/b' is not a safe name"),
        (_deep_extends, [], "extends: chain deeper than 32 presets"),
        (_fifo, [], "fifo.toml: is a FIFO, not a preset file"),
        (_extends_folder, [], "extends: 'base' is a directory, not a preset file"),
        (_micro, ["--nnodes", "2", "--rdzv-endpoint", "node0"], "--rdzv-endpoint: expected HOST:PORT"),
        (_micro, ["--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29500"], "cannot resolve"),
    ],
    ids=lambda value: value.__name__ if callable(value) else None,
)
def test_preset_and_command_line_mistakes_are_one_line_usage_errors(
    tmp_path, monkeypatch, preset, extra, expected
):
    monkeypatch.chdir(tmp_path)
    command = "run" if any(flag in extra for flag in ("--threads", "--nnodes")) else "plan"
    started = time.monotonic()
    code, err = bt_main("--store", str(tmp_path / ".bt"), command, str(preset(tmp_path)), *extra)
    assert code == ExitCode.USAGE, err
    assert expected in one_line_error(err)
    assert time.monotonic() - started < 10  # a FIFO or a deep chain neither hangs nor crawls
    assert not (tmp_path / "experiments").exists()  # nothing was run


def test_a_train_split_shorter_than_seq_len_fails_the_step_in_one_line(tmp_path):
    store = tmp_path / ".bt"
    short = [
        "--set",
        "data.synthetic.documents=20",
        "--set",
        "data.split_block=64",
        "--set",
        "train.seq_len=2048",
    ]
    result = run_bt("run", str(MICRO), *short, "--progress", "off", store=store)
    assert result.returncode == ExitCode.FAILED, result.stderr
    assert "train:main failed: the train split has" in one_line_error(result.stderr.splitlines()[-1])
    assert "lower train.seq_len" in result.stderr and "Traceback" not in result.stderr


def _limited_run(store: Path, planned: str, limit: int) -> subprocess.CompletedProcess:
    """`bt run` whose processes cannot write a file beyond `limit` bytes (a disk that is full)."""
    return _limited_bt(store, limit, "run", planned, "--progress", "off")


def _limited_bt(store: Path, limit: int, *args: str) -> subprocess.CompletedProcess:
    """`bt ARGS` whose processes cannot write a file beyond `limit` bytes: every write past it
    fails as a full disk's does (EFBIG instead of ENOSPC, with no file name either)."""
    env = {**os.environ, "BT_STORE": str(store), "BT_EXPERIMENTS": str(store.parent / "experiments")}
    return subprocess.run(
        [sys.executable, "-m", "buildtrain", *args],
        env=env,
        cwd=store.parent,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )


@pytest.mark.parametrize("where", ["data", "checkpoint"])
def test_a_full_disk_fails_the_step_in_one_line_and_leaves_the_store_intact(micro_built, tmp_path, where):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    plan = load_plan(Store(store), micro_built[1])
    if where == "data":  # the data step writes a 27 kB shard first
        shutil.rmtree(store / "steps")
        limit = 16 << 10
    else:  # the data step is built; the first checkpoint's 109 kB of weights do not fit
        for label in ("train:main", "eval", "export"):
            shutil.rmtree(store / "steps" / plan.by_label(label).hash)
        limit = 64 << 10
    failed = _limited_run(store, micro_built[1], limit)
    assert failed.returncode == ExitCode.FAILED, failed.stderr
    message = one_line_error(failed.stderr.splitlines()[-1])
    label = "data:main" if where == "data" else "train:main"
    assert message.startswith(f"bt run: {label} failed: cannot write") and "free space" in message
    assert ("checkpoint" in message) == (where == "checkpoint"), message  # only a train step has them
    assert "Traceback" not in failed.stderr
    assert run_bt("fsck", store=store).returncode == ExitCode.OK  # nothing damaged was left behind
    assert not Store(store).outputs.has(plan.by_label(label).hash)


def test_a_full_disk_in_the_export_step_names_the_output_being_written(micro_built, tmp_path):
    """A copy's error names its source first: the message named the train step's checkpoint."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    export = load_plan(Store(store), micro_built[1]).by_label("export").hash
    shutil.rmtree(store / "steps" / export)
    failed = _limited_run(store, micro_built[1], 64 << 10)  # the 109 kB of weights do not fit
    assert failed.returncode == ExitCode.FAILED, failed.stderr
    message = one_line_error(failed.stderr.splitlines()[-1])
    assert message.startswith(f"bt run: export failed: cannot write {store / 'tmp'}"), message
    assert "model.safetensors: File too large; nothing partial was published" in message
    assert "steps" not in message and "checkpoints" not in message
    assert not Store(store).outputs.has(export)


def test_a_record_line_that_does_not_fit_names_its_file():
    """/dev/full fails every write with ENOSPC, as a full disk does: without a file name."""
    with open("/dev/full", "ab", buffering=0) as handle, pytest.raises(OSError) as caught:
        append_flushed(handle, b"a line\n")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == "/dev/full"


@pytest.mark.parametrize("command", ["export", "record", "plan"])
def test_a_full_disk_names_the_path_being_written(micro_built, tmp_path, command):
    """`bt export` printed a Python list of tuples; the run record and `bt plan` named no path."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    if command == "export":
        failed = _limited_bt(store, 64 << 10, "export", micro_built[1], str(tmp_path / "out"))
        said = f"bt export: cannot use {tmp_path / 'out'}: File too large (writing "
    elif command == "record":  # a null build: the first file it writes is the record's config.json
        failed = _limited_bt(store, 1 << 10, "run", micro_built[1], "--progress", "off")
        said = f"bt run: cannot use {tmp_path / 'experiments'}/"
    else:
        shutil.rmtree(store / "plans")
        failed = _limited_bt(store, 1 << 10, "plan", str(MICRO))
        said = f"bt plan: cannot use {store / 'plans' / micro_built[1]}.json: File too large"
    assert failed.returncode == ExitCode.FAILED, failed.stderr
    assert one_line_error(failed.stderr).startswith(said), failed.stderr
    assert not list(tmp_path.glob(".out.*")) and not list((store / "plans").glob(".*.tmp"))


@pytest.mark.parametrize(
    "content", [b"null", b"[]", b'{"sources": [], "overrides": 3, "preset": 5, "created": []}', b"\xff"]
)
def test_a_damaged_plan_meta_file_is_read_as_absent(micro_built, tmp_path, content, monkeypatch):
    """The meta file holds hints (where the preset and data were), never anything hashed."""
    monkeypatch.setenv("BT_EXPERIMENTS", str(tmp_path / "experiments"))  # not the repository's
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    (store / "plans" / f"{micro_built[1]}.meta.json").write_bytes(content)
    for command in (
        ["show", micro_built[1]],
        ["show", "--json", micro_built[1]],
        ["ls"],
        ["run", micro_built[1]],
    ):
        code, err = bt_main("--store", str(store), *command)
        assert code == ExitCode.OK, (command, err)


def test_the_rendezvous_of_several_machines_is_bounded():
    """torchrun's own default is ten minutes of silence for an endpoint no node reaches."""
    launch = Launch(nproc=1, nnodes=2, rdzv_endpoint="node0:29500", rdzv_timeout=7)
    command = launch.command()
    assert command[command.index("--rdzv-conf") + 1] == "timeout=7"
    code, err = bt_main("run", str(MICRO), "--nnodes", "2", "--rdzv-endpoint", "node0:99999")
    assert code == ExitCode.USAGE and "port in 1..65535" in err


def _wait_for(records: Path, text: str, process: subprocess.Popen, seconds: float = 60) -> None:
    """Until a run record's log says `text` (or the process ended)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        if any(text in p.read_text() for p in records.glob("*/train.log")):
            return
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"{text} never appeared in {records}: {process.communicate(timeout=60)}")


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT], ids=lambda n: n.name)
def test_a_signal_while_waiting_for_a_step_lock_is_a_recorded_interruption(micro_built, tmp_path, number):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    export = load_plan(Store(store), micro_built[1]).by_label("export")
    shutil.rmtree(store / "steps" / export.hash)
    (store / "locks").mkdir(exist_ok=True)
    lock = os.open(store / "locks" / f"{export.hash}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another bt builds the export step
    records = tmp_path / "experiments"
    env = {**os.environ, "BT_STORE": str(store), "BT_EXPERIMENTS": str(records)}
    waiting = subprocess.Popen(
        [sys.executable, "-m", "buildtrain", "run", micro_built[1], "--progress", "off"],
        env=env,
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(records, "waiting_for_lock", waiting)
        waiting.send_signal(number)
        _, err = waiting.communicate(timeout=60)
    finally:
        os.close(lock)
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == ExitCode.INTERRUPTED, err
    assert (
        f"stopped by {number.name}" in one_line_error(err.splitlines()[-1]) and "resume with: bt run" in err
    )
    (summary,) = summaries(records)
    assert summary["outcome"] == "interrupted" and summary["exit_code"] == ExitCode.INTERRUPTED


def _edited_plan(store: Path, planned: str, *, name: str | None = None, label: str | None = None) -> str:
    """A stored plan edited by hand, but self-consistent: every hash recomputed and stored under it."""
    plan = load_plan(Store(store), planned)
    steps = tuple(
        Step.create(label if label and s.kind == "eval" else s.label, s.kind, s.config, s.inputs, s.toolchain)
        for s in plan.steps
    )
    edited = Plan.create(name or plan.name, plan.config, steps, plan.targets)
    (store / "plans" / f"{edited.hash}.json").write_bytes(canonical_bytes(edited.to_body()))
    return edited.hash


@pytest.mark.parametrize(
    "edit",
    [{"label": "/tmp/bt-escaped"}, {"label": "eval:../../escaped"}, {"name": "../../escaped"}],
    ids=["absolute-label", "climbing-label", "climbing-name"],
)
def test_an_edited_stored_plan_cannot_choose_paths(micro_built, tmp_path, monkeypatch, edit):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "deep" / ".bt"
    shutil.copytree(micro_built[0], store)
    edited = _edited_plan(store, micro_built[1], **edit)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for command in (
        ["show", edited],
        ["run", edited],
        ["export", edited],
        ["verify", edited, "--steps", "1"],
    ):
        code, err = bt_main("--store", str(store), *command)
        assert code == ExitCode.CORRUPT, (command, err)
        assert "is not a safe name" in err or "not 'eval' or 'eval:NAME' with a safe NAME" in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written anywhere
    assert not Path("/tmp/bt-escaped").exists()


def test_export_never_touches_what_it_did_not_create(micro_built, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    mine = tmp_path / ".package.tmp"  # a folder of the user's that an old export would have removed
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, err = bt_main("--store", str(store), "export", micro_built[1], "package")
    assert code == ExitCode.OK, err
    assert (mine / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "package" / "model.safetensors").is_file()
    code, err = bt_main("--store", str(store), "export", micro_built[1])
    assert code == ExitCode.OK, err
    (default,) = (tmp_path / "export").iterdir()
    assert default.name == f"micro-{micro_built[1][:12]}"
    leftovers = {p.name for p in tmp_path.iterdir()} | {p.name for p in (tmp_path / "export").iterdir()}
    assert not any(name.endswith(".tmp") and name != ".package.tmp" for name in leftovers), leftovers


@pytest.mark.parametrize("inside", ["steps/copy", "copy", "tmp/copy", "quarantine/deep/copy"])
def test_export_into_the_store_is_refused(micro_built, tmp_path, inside):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    code, err = bt_main("--store", str(store), "export", micro_built[1], str(store / inside))
    assert code == ExitCode.USAGE, err
    assert "is inside the store" in one_line_error(err)
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_export_leaves_no_partial_copy(micro_built, tmp_path, monkeypatch, number):
    """The signal arrives once the copy is half made (a deterministic hook, not a sleep)."""
    from buildtrain.executor.adhoc import deliver

    monkeypatch.chdir(tmp_path)
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    copy = deliver._copy_package

    def copy_then_signal(output: Path, package: Path, destination: Path) -> None:
        copy(output, package, destination)  # the whole package copied, not yet renamed into place
        os.kill(os.getpid(), number)

    monkeypatch.setattr(deliver, "_copy_package", copy_then_signal)
    # As at a terminal: a test session started in the background inherits SIGINT ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, err = bt_main("--store", str(store), "export", micro_built[1], "package")
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert code == ExitCode.INTERRUPTED, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".bt"]  # no package, no hidden copy
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_closed_stdout_ends_quietly(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    env = {**os.environ, "BT_STORE": str(store)}
    script = f"set -o pipefail; {sys.executable} -m buildtrain show --json {micro_built[1]} | true"
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode in (0, cli.BROKEN_PIPE), result.stderr
    assert result.stderr == ""


def test_ctrl_c_during_verify_of_a_built_plan_advises_verify_again(micro_built, tmp_path):
    """`bt run HASH` does nothing for a built plan: the advice must be the command that helps."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    env = {
        **os.environ,
        "BT_STORE": str(store),
        "BT_EXPERIMENTS": str(tmp_path / "experiments"),
        "BT_TEST_STEP_DELAY": "1.0",  # a slow train step (12 s): time to interrupt it while it trains
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "buildtrain", "verify", micro_built[1]],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    seen = []
    for line in process.stderr:  # the data step's verdict: the train step runs next
        seen.append(line)
        if "data:main" in line:
            break
    time.sleep(5.0)  # past the step process's import of torch (a signal inside it is issue 20's)
    process.send_signal(signal.SIGINT)
    rest = process.communicate(timeout=120)[1]
    assert process.returncode == ExitCode.INTERRUPTED, "".join(seen) + rest
    last = rest.strip().splitlines()[-1]
    assert last == (
        f"bt verify: interrupted; the recorded build of {micro_built[1][:12]} is untouched; "
        f"check it again with: bt verify {micro_built[1][:12]}"
    ), rest
    assert "Traceback" not in rest
