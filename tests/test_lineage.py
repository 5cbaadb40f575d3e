"""Lineage: from an output down to source digests, and from weights back to their plan and step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, BtRunner, plan_hash, run_bt
from sweeps_built import BuiltSweep, built_sweep

from buildtrain.errors import ExitCode

OWN_TEXT = REPO / "examples" / "own_text.toml"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> BuiltSweep:
    return built_sweep(tmp_path_factory)


def _walk(node: dict) -> list[dict]:
    found = [node]
    for value in node["inputs"].values():
        if isinstance(value, dict) and "inputs" in value:
            found += _walk(value)
    return found


def test_lineage_goes_from_the_export_down_to_the_corpus(sweep: BuiltSweep) -> None:
    result = run_bt("show", sweep.plans[0], "--lineage", "--json", store=sweep.store)
    assert result.returncode == 0, result.stderr
    (export,) = json.loads(result.stdout)
    assert export["label"] == "export" and export["built"] and "weights" in export["outputs"]
    labels = {node["label"] for node in _walk(export)}
    assert labels == {"export", "eval", "train:finetune", "train:pretrain", "data:pretrain", "data:finetune"}
    data = next(node for node in _walk(export) if node["label"] == "data:pretrain")
    assert data["inputs"]["sources"]["synthetic"]["kind"] == "arithmetic"
    assert all("buildtrain" in node["toolchain"] for node in _walk(export))
    text = run_bt("show", sweep.plans[0], "--lineage", store=sweep.store).stdout
    assert "<- init: train:pretrain" in text and "(as above)" in text


def test_lineage_names_source_files_by_digest(bt: BtRunner) -> None:
    planned = plan_hash(bt("plan", str(OWN_TEXT)))
    (export,) = json.loads(bt("show", planned, "--lineage", "--json").stdout)
    sources = next(n["inputs"]["sources"] for n in _walk(export) if n["kind"] == "data")
    assert sources and all(len(s["blake3"]) == 64 and s["size"] > 0 for s in sources)
    assert any(Path(seen).name.endswith(".txt") for s in sources for seen in s["seen_at"])
    assert "<- source blake3" in bt("show", planned, "--lineage").stdout


def test_why_finds_the_plan_and_step_of_exported_weights(sweep: BuiltSweep, tmp_path: Path) -> None:
    destination = tmp_path / "export"
    assert run_bt("export", sweep.plans[2], str(destination), store=sweep.store).returncode == 0
    for question in (
        str(destination),
        str(destination / "BLAKE3SUMS"),
        str(destination / "model.safetensors"),  # a file: its own digest (it was a UTF-8 error)
        str(destination / "hf" / "model.safetensors"),
    ):
        result = run_bt("why", question, "--json", store=sweep.store)
        assert result.returncode == 0, result.stderr
        body = json.loads(result.stdout)
        producers = {(p["plan"], p["label"]) for item in body["found"] for p in item["plans"]}
        assert (sweep.plans[2], "export") in producers
    digest = next(
        line.split()[0] for line in (destination / "BLAKE3SUMS").read_text().splitlines() if "model" in line
    )
    text = run_bt("why", digest[:16], store=sweep.store).stdout
    assert f"produced by export of plan {sweep.plans[2][:12]}" in text


@pytest.mark.parametrize("question, code", [("0000000000000000", ExitCode.USAGE), ("xyz", ExitCode.USAGE)])
def test_why_without_an_answer_says_so_in_one_line(sweep: BuiltSweep, question: str, code: int) -> None:
    result = run_bt("why", question, store=sweep.store)
    assert result.returncode == code
    assert "Traceback" not in result.stderr
    assert len((result.stdout + result.stderr).strip().splitlines()) == 1
