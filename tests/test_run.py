"""`bt run`: same plan, same weights; caching; locking; clean failures; run records; export."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import MICRO, MICRO_STAGES, actions, plan_hash, run_bt, step_digests, summaries

from buildtrain.errors import ExitCode
from buildtrain.plan.stored import load_plan, save_plan
from buildtrain.store.store import Store

REFORMATTED_MICRO = """
# the micro preset again: other key order, other spelling of numbers, inline tables, comments
name = "micro"   # same name

[train]
warmup_steps = 2
lr = 0.003          # was 3e-3
micro_batch_size = 2
batch_size = 4
seq_len = 32
steps = 12
checkpoint_every = 4
keep_checkpoints = 3

[model]
n_kv_heads = 2
ffn_hidden = 64
n_heads = 4
n_layers = 2
dim = 32

[eval]
max_batches = 4
batch_size = 4
seq_len = 32

[data]
heldout_fraction = 1e-1
split_block = 256
source = "synthetic"

  [data.synthetic]
  seed = 0
  lines = 8
  documents = 200
  kind = "arithmetic"
"""


def test_same_plan_gives_same_weights_in_another_store_and_directory(micro_built, tmp_path):
    _, reference_hash, reference = micro_built
    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    (elsewhere / "renamed.toml").write_text(REFORMATTED_MICRO)
    store = tmp_path / "other-store"

    planned = plan_hash(run_bt("plan", str(elsewhere / "renamed.toml"), store=store, cwd=elsewhere))
    assert planned == reference_hash
    result = run_bt("run", planned, "--target", "train:main", store=store)
    assert result.returncode == 0, result.stderr
    assert step_digests(store, planned)["train:main"] == reference["train:main"]


def test_second_run_is_a_null_build_without_torch(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    probe = textwrap.dedent(f"""
        import sys
        from buildtrain.cli import main
        code = main(["run", "{micro_built[1]}", "--progress", "off"])
        assert "torch" not in sys.modules, "a null build imported torch"
        sys.exit(code)
    """)
    env = {**os.environ, "BT_STORE": str(store), "BT_EXPERIMENTS": str(tmp_path / "experiments")}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    (summary,) = summaries(tmp_path / "experiments")
    assert set(actions(summary).values()) == {"cached"}
    assert summary["executed"] == 0


# Runs `bt ARGS` with os.fsync and os.fdatasync counted (the real calls still made): the path
# of every file or folder synced, as JSON into OUT. A null build starts no other process.
SYNC_COUNTER = textwrap.dedent("""
    import json, os, sys
    synced = []
    def counted(real):
        def call(fd):
            number = fd if isinstance(fd, int) else fd.fileno()
            synced.append(os.readlink(f"/proc/self/fd/{number}"))
            return real(fd)
        return call
    os.fsync, os.fdatasync = counted(os.fsync), counted(os.fdatasync)
    from buildtrain.cli import main
    try:
        code = main(sys.argv[2:])
    finally:
        with open(sys.argv[1], "w") as out:
            json.dump(synced, out)
    sys.exit(code)
""")


def _synced(tmp_path, store, *args):
    out = tmp_path / "synced.json"
    env = {**os.environ, "BT_STORE": str(store), "BT_EXPERIMENTS": str(tmp_path / "experiments")}
    result = subprocess.run(
        [sys.executable, "-c", SYNC_COUNTER, str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names synced files through /proc")
def test_a_null_build_syncs_nothing(micro_built, tmp_path):
    """Issue 48: a null build made 6 fsyncs per plan (its run record), 8 from a preset (the plan's
    metadata, planned again) and 16 the first time (the stamps of outputs it verified), none of
    them for store data it changed. The first command proves that the count sees the fsyncs of a
    plan that is written."""
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    stamps = Store(store).stamps
    shutil.rmtree(stamps, ignore_errors=True)  # so that the first null build stamps every output
    synced = _synced(tmp_path, store, "plan", str(MICRO), "--set", "train.lr=1e-3")
    assert os.path.join(os.path.realpath(store), "plans") in synced  # a new plan: durable
    for args in (("run", str(MICRO)), ("run", micro_built[1]), ("run", str(MICRO))):
        assert _synced(tmp_path, store, *args) == [], args
    assert len(list(stamps.iterdir())) == len(micro_built[2])  # outputs verified and stamped
    runs = summaries(tmp_path / "experiments")
    assert len(runs) == 3 and all(run["executed"] == 0 for run in runs)  # each run still recorded


def test_changing_finetune_lr_reruns_only_finetune_eval_export(stages_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(stages_built[0], store)
    experiments = tmp_path / "experiments"
    changed = plan_hash(
        run_bt("plan", str(MICRO_STAGES), "--set", "stages.finetune.train.lr=5e-4", store=store)
    )
    assert changed != stages_built[1]
    result = run_bt("run", changed, store=store, env={"BT_EXPERIMENTS": str(experiments)})
    assert result.returncode == 0, result.stderr
    (summary,) = summaries(experiments)
    assert actions(summary) == {
        "data:pretrain": "cached",
        "train:pretrain": "cached",
        "data:finetune": "cached",
        "train:finetune": "executed",
        "eval": "executed",
        "export": "executed",
    }


def test_two_concurrent_runs_build_once(tmp_path):
    store = tmp_path / ".bt"
    experiments = tmp_path / "experiments"
    planned = plan_hash(run_bt("plan", str(MICRO), store=store))
    env = {
        **os.environ,
        "BT_STORE": str(store),
        "BT_EXPERIMENTS": str(experiments),
        "BT_TEST_STEP_DELAY": "0.3",
    }
    command = [sys.executable, "-m", "buildtrain", "run", planned, "--target", "train:main"]
    first = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    second = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    errors = [first.communicate(timeout=300)[1], second.communicate(timeout=300)[1]]

    assert first.returncode == 0 and second.returncode == 0, errors
    train = [actions(s)["train:main"] for s in summaries(experiments)]
    assert sorted(train) == ["cached", "executed"]
    assert any("waiting: pid" in e for e in errors), errors
    assert Store(store).outputs.verify(load_plan(Store(store), planned).by_label("train:main").hash) == []


def test_no_wait_exits_with_the_locked_code(tmp_path):
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(MICRO), store=store))
    env = {
        **os.environ,
        "BT_STORE": str(store),
        "BT_EXPERIMENTS": str(tmp_path / "x"),
        "BT_TEST_STEP_DELAY": "0.5",
    }
    holder = subprocess.Popen(
        [sys.executable, "-m", "buildtrain", "run", planned, "--target", "train:main"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        train = load_plan(Store(store), planned).by_label("train:main").hash
        lock = store / "locks" / f"{train}.lock"
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the first run holds the train step's lock
        result = run_bt("run", planned, "--target", "train:main", "--no-wait", store=store)
        assert result.returncode == ExitCode.LOCKED, result.stderr
        assert "is being built by pid" in result.stderr
    finally:
        holder.terminate()
        holder.communicate(timeout=120)


def test_non_finite_loss_fails_cleanly_naming_the_step(tmp_path):
    store = tmp_path / ".bt"
    result = run_bt(
        "run",
        str(MICRO),
        "--set",
        "train.lr=1e6",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "train.checkpoint_every=1",
        store=store,
    )
    assert result.returncode == ExitCode.FAILED, result.stderr
    assert "Traceback" not in result.stderr
    assert "at step" in result.stderr and "loss is" in result.stderr
    # no output was published, and every checkpoint that exists is intact
    plan = load_plan(Store(store), Store(store).plans.hashes()[0])
    train = plan.by_label("train:main")
    assert not Store(store).outputs.has(train.hash)
    from buildtrain.store import objects

    for folder in (Store(store).outputs.work_dir(train.hash) / "checkpoints").glob("step-*"):
        assert objects.verify(folder) == []


def test_plan_for_another_toolchain_is_refused(tmp_path, monkeypatch):
    from buildtrain.config.loader import load_preset
    from buildtrain.kinds import kind as kinds
    from buildtrain.plan import compile as compiler

    real = kinds.fingerprint

    def elsewhere(kind, numerics, **options):
        facts = real(kind, numerics, **options)
        return {**facts, "torch": "0.0.1+elsewhere"} if "torch" in facts else facts

    monkeypatch.setattr(kinds, "fingerprint", elsewhere)
    foreign = compiler.compile_plan(load_preset(MICRO).config, {})
    store = Store(tmp_path / ".bt")
    save_plan(store, foreign)
    result = run_bt("run", foreign.hash, store=store.root)
    assert result.returncode == ExitCode.TOOLCHAIN_MISMATCH, result.stderr
    assert "torch: plan has '0.0.1+elsewhere'" in result.stderr
    assert "plan it again on this machine" in result.stderr


def test_run_record_has_config_plan_logs_metrics_and_summary(micro_built, tmp_path):
    store = tmp_path / ".bt"
    experiments = tmp_path / "experiments"
    result = run_bt(
        "run", str(MICRO), "--target", "train:main", store=store, env={"BT_EXPERIMENTS": str(experiments)}
    )
    assert result.returncode == 0, result.stderr
    again = run_bt(
        "run", str(MICRO), "--target", "train:main", store=store, env={"BT_EXPERIMENTS": str(experiments)}
    )
    assert again.returncode == 0
    records = sorted(p for p in experiments.iterdir())
    assert len(records) == 2  # never overwritten
    record = records[0]
    assert record.name.endswith(micro_built[1][:12])
    names = {p.name for p in record.iterdir()}
    events = {name for name in names if name.startswith("events.out.tfevents.")}  # for TensorBoard
    assert len(events) == 1
    assert names - events == {
        "config.json",
        "plan.json",
        "train.log",
        "metrics.jsonl",
        "summary.json",
    }
    assert json.loads((record / "plan.json").read_text())["hash"] == micro_built[1]
    log = [json.loads(line) for line in (record / "train.log").read_text().splitlines()]
    step_lines = [line for line in log if line["event"] == "train_step"]
    assert len(step_lines) == 12
    assert {"step", "loss", "lr", "tokens_per_s", "grad_norm", "max_rss_mb", "timestamp"} <= set(
        step_lines[0]
    )
    metrics = [json.loads(line) for line in (record / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["event"] == "train_step"] == list(range(1, 13))
    summary = json.loads((record / "summary.json").read_text())
    assert summary["outcome"] == "done" and summary["exit_code"] == 0
    train = next(s for s in summary["steps"] if s["label"] == "train:main")
    assert train["action"] == "executed" and train["duration_s"] > 0
    assert train["digests"] == micro_built[2]["train:main"]
    assert step_lines[-1]["loss"] < step_lines[0]["loss"]


def test_data_files_are_found_by_content_after_a_move(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(400))
    (corpus / "a.txt").write_text(text)
    old = os.stat(corpus / "a.txt")
    os.utime(corpus / "a.txt", ns=(old.st_atime_ns, old.st_mtime_ns - 10**10))  # not racy: cacheable
    preset = tmp_path / "files.toml"
    preset.write_text(
        f'extends = "{MICRO}"\n[data]\nsource = "files"\nfiles = ["corpus/*.txt"]\nsplit_block = 128\n'
    )
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(preset), store=store))

    moved = tmp_path / "moved"
    moved.mkdir()
    (corpus / "a.txt").rename(moved / "renamed.txt")
    assert (
        plan_hash(run_bt("plan", str(preset), "--set", f'data.files=["{moved}/*.txt"]', store=store))
        == planned
    )
    result = run_bt("run", planned, "--target", "data:main", store=store)
    assert result.returncode == 0, result.stderr

    (moved / "renamed.txt").unlink()
    Store(store).outputs.quarantine(load_plan(Store(store), planned).by_label("data:main").hash)
    result = run_bt("run", planned, "--target", "data:main", store=store)
    assert result.returncode == ExitCode.FAILED
    assert "is gone" in result.stderr and "plan again" in result.stderr


@pytest.mark.parametrize(
    ("replacement", "said"),
    [
        ("edited", "changed since planning"),
        ("fifo", "is now a FIFO, not a regular file"),
        ("dev-zero-link", "is now a device, not a regular file"),
    ],
)
def test_a_data_file_replaced_after_planning_fails_the_run_in_one_line(tmp_path, replacement, said):
    """Never a hang: a FIFO would block the data step forever and /dev/zero never ends."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(400)))
    preset = tmp_path / "files.toml"
    preset.write_text(
        f'extends = "{MICRO}"\n[data]\nsource = "files"\nfiles = ["corpus/*.txt"]\nsplit_block = 128\n'
    )
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(preset), store=store))
    (corpus / "a.txt").unlink()
    if replacement == "edited":
        (corpus / "a.txt").write_text("edited after planning\n")
    elif replacement == "fifo":
        os.mkfifo(corpus / "a.txt")
    else:
        (corpus / "a.txt").symlink_to("/dev/zero")
    result = run_bt("run", planned, "--target", "data:main", "--progress", "off", store=store, timeout=120)
    assert result.returncode == ExitCode.FAILED, result.stderr
    assert f"the data file {corpus / 'a.txt'} {said}" in result.stderr
    assert "plan again" in result.stderr and "Traceback" not in result.stderr


def test_export_copies_a_read_only_package_with_checksums(micro_built, tmp_path):
    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    destination = tmp_path / "package"
    result = run_bt("export", micro_built[1], str(destination), store=store)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(destination)
    names = {p.name for p in destination.iterdir()}
    assert names == {"model.safetensors", "config.json", "tokenizer.json", "eval.json", "hf", "BLAKE3SUMS"}
    from buildtrain.store.objects import hash_file

    for line in (destination / "BLAKE3SUMS").read_text().splitlines():
        digest, name = line.split("  ")
        assert hash_file(destination / name)[0] == digest
    assert not (destination / "model.safetensors").stat().st_mode & stat.S_IWUSR
    assert not (destination / "hf" / "model.safetensors").stat().st_mode & stat.S_IWUSR
    assert "hf/config.json" in (destination / "BLAKE3SUMS").read_text()  # the checksums cover hf/
    assert json.loads((destination / "tokenizer.json").read_text())["vocab_size"] == 257
    again = run_bt("export", micro_built[1], str(destination), store=store)
    assert again.returncode == ExitCode.USAGE and "already exists" in again.stderr


def test_unknown_target_is_a_usage_error(micro_built, tmp_path):
    result = run_bt(
        "run",
        micro_built[1],
        "--target",
        "train:nope",
        store=micro_built[0],
        env={"BT_EXPERIMENTS": str(tmp_path)},
    )
    assert result.returncode == ExitCode.USAGE
    assert "has no step 'train:nope'" in result.stderr
    assert "train:main" in result.stderr


def test_out_of_memory_fails_cleanly_naming_the_step(tmp_path):
    """A virtual-memory limit on `bt run` (inherited by its step process) makes one of the first
    updates of a 34M-parameter model fail to allocate (which one depends on what the update keeps:
    the CPU's one-pass AdamW holds no temporaries, and fails at the second, after a checkpoint);
    torch's import fits under the limit."""
    import resource

    store = tmp_path / ".bt"
    big = [
        "--set",
        "model.dim=1024",
        "--set",
        "model.n_heads=8",
        "--set",
        "model.n_kv_heads=8",
        "--set",
        "model.ffn_hidden=4096",
        "--set",
        "train.steps=2",
        "--set",
        "train.checkpoint_every=1",
    ]
    planned = plan_hash(run_bt("plan", str(MICRO), *big, store=store))
    assert run_bt("run", planned, "--target", "data:main", store=store).returncode == 0
    limit = int(1.2 * 2**30)
    env = {**os.environ, "BT_STORE": str(store), "BT_EXPERIMENTS": str(tmp_path / "experiments")}
    limited = subprocess.run(
        [sys.executable, "-m", "buildtrain", "run", planned, "--target", "train:main"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    assert limited.returncode == ExitCode.FAILED, limited.stderr
    assert re.search(r"out of memory at step [12] ", limited.stderr), limited.stderr
    assert "Traceback" not in limited.stderr
    assert "lower train.micro_batch_size" in limited.stderr
    train = load_plan(Store(store), planned).by_label("train:main")
    assert not Store(store).outputs.has(train.hash)
    result = run_bt("run", planned, "--target", "train:main", store=store)
    assert result.returncode == 0, result.stderr


def _report_training(progress: bool | None) -> str:
    """What the terminal shows of a train step of 20 updates, logged every 10, on a pipe."""
    import io

    from buildtrain.executor.loop.progress import Reporter

    stream = io.StringIO()
    reporter = Reporter(progress, log_every=10, stream=stream)
    reporter.progress_started("train:main")
    for step in range(1, 21):
        line = {"loss": 2.5, "lr": 3e-3, "grad_norm": 0.5, "tokens_per_s": 1234.0, "steps": 20}
        reporter.event({"event": "train_step", "step": step, **line})
    reporter.progress_finished()
    reporter.step("train:main", "executed", "1.0s")
    return stream.getvalue()


def test_progress_lines_off_a_terminal_and_a_bar_when_asked():
    lines = _report_training(None).splitlines()  # not a terminal: lines at steps 1, 10 and 20
    assert [line.split("  loss")[0].split()[-1] for line in lines[:-1]] == ["1/20", "10/20", "20/20"]
    assert "1,234 tok/s" in lines[0] and lines[-1].endswith("executed  1.0s")
    # `--progress on` draws the bar even on a pipe (it once drew nothing and left a blank line)
    drawn = _report_training(True)
    assert "20/20" in drawn and "loss 2.5000" in drawn and "1,234 tok/s" in drawn
    assert "\x1b[" in drawn  # a terminal's drawing, redrawn in place
    assert drawn.rstrip().endswith("executed  1.0s") and "step 10/20" not in drawn


def test_quiet_run_says_only_what_the_run_came_to(tmp_path):
    """`bt run -q` (issue 48): one 'done' line on stderr for a build and for a null build, nothing
    on stdout; an error is still said."""
    store = tmp_path / ".bt"
    plan = plan_hash(run_bt("plan", str(MICRO), store=store))
    for executed in ("1 executed, 0 cached", "0 executed, 1 cached"):
        quiet = run_bt("run", plan, "-q", "--target", "data:main", store=store)
        assert quiet.returncode == 0, quiet.stderr
        assert quiet.stdout == ""
        (line,) = quiet.stderr.splitlines()
        assert line.startswith("done in ") and f": {executed}; record: " in line
    refused = run_bt("run", "ffff", "-q", store=store)
    assert refused.returncode == ExitCode.USAGE and refused.stderr.startswith("bt run: ")


def test_the_lines_of_plans_running_at_once_say_whose_they_are():
    import io

    from buildtrain.executor.loop.progress import Reporter

    stream = io.StringIO()
    reporter = Reporter(False, log_every=1, stream=stream, plan="ae4b709d87ac")
    reporter.say("bt run ae4b709d87ac 'micro'")
    reporter.step("data:main", "cached")
    reporter.progress_started("train:main")
    reporter.event(
        {
            "event": "train_step",
            "step": 1,
            "steps": 2,
            "loss": 2.5,
            "lr": 3e-3,
            "grad_norm": 0.5,
            "tokens_per_s": 9.0,
        }
    )
    reporter.result("done in 0.1s")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and all(line.startswith("[ae4b709d87ac] ") for line in lines), lines
    quiet = io.StringIO()
    silent = Reporter(True, log_every=1, stream=quiet, quiet=True)
    silent.say("announce")
    silent.step("data:main", "cached")
    silent.progress_started("train:main")
    silent.progress_finished()
    silent.result("done in 0.1s")
    assert quiet.getvalue() == "done in 0.1s\n"
