"""Signals at the wrong moment in a step process: inside `import torch`, after the executor died.

A signal that lands while a step process imports torch is remembered and acted on once the import
is done (the step ends as interrupted, exit 3, one line), never raised inside the import; a step
process whose executor is gone stops quietly instead of printing tracebacks onto a dead terminal.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from conftest import MICRO, plan_hash, run_bt

from buildtrain.executor.process.faults import SIGNAL_AFTER_PUBLISH

IN_IMPORT = {"BT_TEST_SIGNAL_IN_IMPORT": "torch.nn"}  # deep inside `import torch`


def test_a_sigterm_inside_import_torch_stops_the_train_step_cleanly(tmp_path):
    store = tmp_path / ".bt"
    plan = plan_hash(run_bt("plan", str(MICRO), store=store))
    stopped = run_bt("run", plan, store=store, env=IN_IMPORT)
    assert stopped.returncode == 3, stopped.stderr
    assert "Traceback" not in stopped.stderr and "Error:" not in stopped.stderr
    assert f"resume with: bt run {plan}" in stopped.stderr
    resumed = run_bt("run", plan, store=store)
    assert resumed.returncode == 0, resumed.stderr


def test_a_sigterm_inside_import_torch_stops_an_eval_step_before_it_begins(tmp_path):
    store = tmp_path / ".bt"
    plan = plan_hash(run_bt("plan", str(MICRO), store=store))
    assert run_bt("run", plan, store=store, env={"BT_TEST_SIGNAL_IN_IMPORT": ""}).returncode == 0
    shown = run_bt("show", plan, "--json", store=store).stdout
    steps = {s["kind"]: s["hash"] for s in json.loads(shown)["steps"]}
    for kind in ("eval", "export"):
        shutil.rmtree(store / "steps" / steps[kind])
    shutil.rmtree(store / "evals")
    stopped = run_bt("run", plan, store=store, env=IN_IMPORT)
    assert stopped.returncode == 3, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert "interrupted during eval" in stopped.stderr
    logs = "".join(path.read_text() for path in (tmp_path / "experiments").glob("*/train.log"))
    assert "stopped by SIGTERM before eval began; nothing was written" in logs
    assert not (store / "steps" / steps["eval"]).exists()
    assert run_bt("run", plan, store=store).returncode == 0


def test_a_step_process_whose_reader_is_gone_stops_quietly():
    code = (
        "import os\n"
        "from buildtrain.executor.process.worker import EventStream\n"
        "read, write = os.pipe(); os.close(read)\n"
        "stream = EventStream(os.fdopen(write, 'w', buffering=1))\n"
        "stream.write('{}\\n'); stream.flush()\n"
        "raise SystemExit(0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert result.stderr == ""


def test_a_worker_whose_parent_died_before_it_could_ask_for_its_signal_exits():
    code = f"from buildtrain.executor.process.launch import die_with_parent; die_with_parent({os.getpid() + 10**6})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 137 and result.stderr == ""
    same = f"from buildtrain.executor.process.launch import die_with_parent; die_with_parent({os.getpid()})"
    assert subprocess.run([sys.executable, "-c", same], timeout=60).returncode == 0


def test_a_ctrl_c_as_a_train_step_publishes_its_output_loses_none_of_its_metrics(tmp_path):
    """SIGINT to bt and the step process right after the train output is published, before the
    process says so (issue 48): the run stops (exit 3), and the step's summary is written anyway,
    so the tables show its loss and speed after the resume, not a blank for good."""
    store = tmp_path / ".bt"
    plan = plan_hash(run_bt("plan", str(MICRO), store=store))
    stopped = run_bt("run", plan, store=store, env={SIGNAL_AFTER_PUBLISH: "train:main"})
    assert stopped.returncode == 3, stopped.stderr
    assert "stopped after train:main completed" in stopped.stderr and "Traceback" not in stopped.stderr
    (log,) = (tmp_path / "experiments").glob("*/metrics.jsonl")
    trained = [json.loads(line) for line in log.read_text().splitlines()]
    last = [line for line in trained if line["event"] == "train_step"][-1]
    resumed = run_bt("run", plan, store=store)
    assert resumed.returncode == 0, resumed.stderr
    assert "train:main       cached" in resumed.stderr  # the summary could only come from the stopped run
    (row,) = json.loads(run_bt("ls", "--metrics", "--json", store=store).stdout)
    assert row["train_loss"] == last["loss"] and row["status"] == "built"
    assert isinstance(row["tokens_per_s"], float) and row["tokens_per_s"] > 0
