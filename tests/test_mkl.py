"""MKL's reproducible branch on any x86-64 vendor (`executor/process/mkl.py`): asked for, made to hold by
the shim on an AMD CPU, and checked after torch loads, failing closed.

What is true differs by vendor, and each test says what it expects on each: MKL grants the asked
branch by itself only on Intel, and with the shim on both. Under qemu the two vendors' CPU models
compute the same bytes (test_vendors.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, plan_hash, run_bt, step_digests
from hypothesis import given
from hypothesis import strategies as st

from buildtrain import native
from buildtrain.errors import ExitCode, StepFailed
from buildtrain.executor.process import mkl, numerics
from buildtrain.plan.toolchain import cpu_vendor

MICRO = REPO / "tests" / "presets" / "micro.toml"
pytestmark = pytest.mark.skipif(not mkl.applies(), reason="MKL is in torch's x86-64 builds only")


@given(st.sampled_from(sorted(mkl.CBWR_BRANCHES)), st.booleans())
def test_a_branch_setting_reads_back_as_mkl_answers_it(branch: str, strict: bool) -> None:
    setting = branch + (",STRICT" if strict else "")
    assert mkl.decoded(mkl.encoded(setting)) == setting


def test_the_portable_setting_is_mkls_avx2_strict() -> None:
    assert mkl.encoded(numerics.PORTABLE_CPU["MKL_CBWR"]) == 0x1000A  # MKL_CBWR_AVX2 | MKL_CBWR_STRICT


IMPORT = textwrap.dedent(
    """
    import json, sys
    from buildtrain.errors import StepFailed
    from buildtrain.executor.process import mkl, numerics
    try:
        torch, applied = numerics.import_torch("portable", "cpu", 1)
    except StepFailed as exc:
        print(json.dumps({"error": str(exc)}))
    else:
        print(json.dumps({"branch": mkl.decoded(mkl.branch_taken(torch)), "applied": applied}))
    """
)


def import_portable(env: dict[str, str]) -> dict[str, object]:
    """What a fresh portable CPU process finds after importing torch the way a step does."""
    environment = {**os.environ, **numerics.environment("portable", "cpu", 1), **env}
    done = subprocess.run(
        [sys.executable, "-c", IMPORT], env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_portable_process_computes_on_the_asked_branch_on_this_cpu() -> None:
    """On an AMD CPU MKL ran AUTO here before the shim; now every vendor runs AVX2,STRICT."""
    found = import_portable({})
    assert found == {"branch": "AVX2,STRICT", "applied": found["applied"]}, f"on {cpu_vendor()}: {found}"
    assert found["applied"]["mkl_branch"] == "AVX2,STRICT"


def test_without_the_shim_only_an_intel_cpu_computes_and_any_other_is_refused() -> None:
    """No compiler, so no shim: Intel's MKL grants the branch by itself; on any other vendor MKL
    runs AUTO, and the process refuses to compute, naming the cause and the way out."""
    found = import_portable({"CC": "no-such-compiler"})
    if cpu_vendor() == "intel":
        assert found.get("branch") == "AVX2,STRICT", found
    else:
        error = str(found.get("error"))
        assert "MKL computes on AUTO,STRICT" in error, found
        assert "no C compiler" in error and "numerics.profile=native" in error


def test_a_branch_other_than_the_asked_one_is_refused() -> None:
    """This test process set no MKL_CBWR, so MKL's reproducible mode is off: asked for AVX2,STRICT
    it must refuse, on any vendor."""
    with pytest.raises(StepFailed, match=r"needs MKL's AVX2,STRICT branch, but MKL computes on OFF"):
        mkl.check_branch(torch, "AVX2,STRICT")


def test_a_torch_without_mkl_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert mkl.branch_taken(torch) is None
    with pytest.raises(StepFailed, match="this torch build has no MKL to ask"):
        mkl.check_branch(torch, "AVX2,STRICT")


def test_a_portable_run_without_the_shim_fails_closed_in_one_line_on_a_non_intel_cpu(tmp_path: Path) -> None:
    """Through `bt run`: on Intel the plan builds without a compiler (its kernels then eager);
    elsewhere the train step refuses with one line and exit 1, and publishes nothing."""
    store = tmp_path / ".bt"
    no_compiler = {"CC": "no-such-compiler"}
    planned = plan_hash(run_bt("plan", str(MICRO), env=no_compiler, store=store))
    result = run_bt("run", planned, env=no_compiler, store=store)
    if cpu_vendor() == "intel":
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == ExitCode.FAILED, result.stderr
    assert "Traceback" not in result.stderr
    failure = [line for line in result.stderr.splitlines() if "failed:" in line]
    assert len(failure) == 1 and "MKL computes on AUTO,STRICT" in failure[0], result.stderr
    assert set(step_digests(store, planned)) == {"data:main"}  # the data step needs no torch


def test_the_shim_is_built_without_openmp() -> None:
    """A library loaded before torch must not bring the system's OpenMP runtime in ahead of the
    one torch ships (the kernels, loaded after torch, are built with -fopenmp)."""
    if native.compiler() is None or shutil.which("readelf") is None:
        pytest.skip("needs a C compiler and readelf (Debian: gcc brings both)")
    library = native.load(mkl.SHIM, threaded=False, shared_symbols=True)
    needed = subprocess.run(["readelf", "-d", library._name], capture_output=True, text=True, check=True)
    assert "Dynamic section" in needed.stdout and "gomp" not in needed.stdout
