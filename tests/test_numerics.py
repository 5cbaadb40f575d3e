"""The numerics profile: the environment a step process needs, checked before torch is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from buildtrain.executor.process import numerics

PROFILE_KEYS = (
    set(numerics.PORTABLE_CPU)
    | set(numerics.CUDA_DETERMINISTIC)
    | set(numerics.KEEP_FREED_MEMORY)
    | {
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
    }
)


@pytest.mark.parametrize("threads", [1, 3, 16, 64])
def test_portable_cpu_pins_the_isa_and_one_thread_per_process(threads: int) -> None:
    env = numerics.environment("portable", "cpu", threads)
    assert env["MKL_CBWR"] == "AVX2,STRICT"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert "CUBLAS_WORKSPACE_CONFIG" not in env


@pytest.mark.parametrize(
    ("cores", "micro_batches", "expected"),
    [(1, 8, 1), (2, 8, 2), (3, 8, 2), (7, 8, 4), (16, 8, 8), (64, 6, 6), (4, 3, 3), (5, 7, 1)],
)
def test_portable_ranks_are_the_largest_divisor_of_the_micro_batches_within_the_cores(
    cores: int, micro_batches: int, expected: int
) -> None:
    assert numerics.portable_ranks(cores, micro_batches, numerics.RANKS_MIN_FLOP) == expected


def test_a_small_portable_step_stays_on_one_process() -> None:
    assert numerics.portable_ranks(16, 8, numerics.RANKS_MIN_FLOP / 2) == 1


def test_native_cpu_sets_only_threads_and_the_allocator() -> None:
    assert numerics.environment("native", "cpu", 2) == {
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
        **numerics.KEEP_FREED_MEMORY,
    }


@pytest.mark.parametrize("profile", ["portable", "native"])
def test_cuda_sets_the_cublas_workspace_only_where_torch_requires_it(profile: str) -> None:
    env = numerics.environment(profile, "cuda", 1)
    required = numerics.cublas_workspace_required()
    assert env.get("CUBLAS_WORKSPACE_CONFIG") == (":4096:8" if required else None)
    assert "MKL_CBWR" not in env and "ATEN_CPU_CAPABILITY" not in env
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"


def test_the_installed_torch_is_read_for_the_cublas_check(tmp_path) -> None:
    """Read from torch's own header: a torch that declares the check gets the variable, one that
    does not (2.13, pytorch#161749) does not, and one whose header cannot be read gets it."""
    installed = numerics.cublas_workspace_required()
    header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "Context.h")
    with open(header, "rb") as handle:
        assert installed == (numerics.CUBLAS_CHECK in handle.read())
    if torch.__version__.startswith("2.13."):
        assert not installed
    for declares, folder in ((True, tmp_path / "old"), (False, tmp_path / "new")):
        (folder / "include" / "ATen").mkdir(parents=True)
        declaration = b"  void alertCuBLASConfigNotDeterministic() const;\n" if declares else b""
        (folder / "include" / "ATen" / "Context.h").write_bytes(b"namespace at {\n" + declaration + b"}\n")
        assert numerics.cublas_workspace_required(folder) is declares
    assert numerics.cublas_workspace_required(tmp_path / "headerless") is True


def test_check_before_import_refuses_when_torch_is_already_loaded() -> None:
    assert "torch" in sys.modules  # this test process imported torch above
    with pytest.raises(RuntimeError, match="torch was imported before"):
        numerics.check_before_import("native", "cpu", 1)


CHECK = textwrap.dedent(
    """
    import json, sys
    from buildtrain.executor.process import numerics
    assert "torch" not in sys.modules, "importing the numerics module must not import torch"
    if sys.argv[4] == "import-torch":  # stands in for `import torch` at a fraction of the cost
        import types
        sys.modules["torch"] = types.ModuleType("torch")
    try:
        numerics.check_before_import(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc)}))
    else:
        print(json.dumps({"error": None}))
    """
)


def check_in_fresh_process(
    profile: str, device: str, threads: int, env: dict[str, str], import_torch: bool = False
) -> str | None:
    base = {k: v for k, v in os.environ.items() if k not in PROFILE_KEYS}
    result = subprocess.run(
        [sys.executable, "-c", CHECK, profile, device, str(threads), "import-torch" if import_torch else "-"],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout)["error"]


def test_check_before_import_passes_with_the_profile_environment() -> None:
    env = numerics.environment("portable", "cpu", 2)
    assert check_in_fresh_process("portable", "cpu", 2, env) is None


@pytest.mark.parametrize("dropped", ["MKL_CBWR", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS"])
def test_check_before_import_names_a_missing_variable(dropped: str) -> None:
    env = numerics.environment("portable", "cpu", 2)
    env.pop(dropped)
    error = check_in_fresh_process("portable", "cpu", 2, env)
    assert error is not None and "without the numerics environment" in error and dropped in error


def test_check_before_import_refuses_a_wrong_value() -> None:
    env = numerics.environment("native", "cpu", 2)
    error = check_in_fresh_process("native", "cpu", 1, env)  # started for 2 threads, asked for 1
    assert error is not None and "OMP_NUM_THREADS" in error


def test_check_before_import_refuses_after_torch_in_a_fresh_process() -> None:
    env = numerics.environment("native", "cpu", 1)
    error = check_in_fresh_process("native", "cpu", 1, env, import_torch=True)
    assert error is not None and "torch was imported before" in error


def test_apply_after_import_sets_threads_and_deterministic_algorithms() -> None:
    """(The portable profile's single thread is tested with the building blocks, in
    test_thread_invariance.py.)"""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        applied = numerics.apply_after_import(torch, "native", "cpu", 1)
        assert torch.get_num_threads() == 1
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # error mode, not warn
        assert applied["threads"] == 1 and applied["deterministic_algorithms"] is True
        assert applied["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
