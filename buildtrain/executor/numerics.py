"""The numerics profile, in two halves: the environment a step's process starts with, and the
torch settings applied right after `import torch` in that process.

The environment half matters most: MKL's conditional numerical reproducibility (MKL_CBWR) and the
ATen/oneDNN instruction-set caps are read once, when the libraries load, so they must be in the
process environment before torch is imported; setting them later silently does nothing. That is
why every computing step runs in a child process started with this environment.

Measured on torch 2.13 CPU (see README, Reproducibility): with the portable settings a training
loop is bit-identical at 1 and 2 threads; without them, 1 and 2 threads give different weights.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# Pin MKL to its AVX2 code path in strict CNR mode and cap ATen's and oneDNN's kernels at AVX2, so
# that reductions are computed in the same order on any AVX2 x86-64 CPU, whatever the thread count.
PORTABLE_CPU = {
    "MKL_CBWR": "AVX2,STRICT",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "DNNL_MAX_CPU_ISA": "AVX2",
}
# cuBLAS needs a fixed workspace configuration for deterministic results; read when CUDA starts.
CUDA_DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def environment(profile: str, device: str, threads: int) -> dict[str, str]:
    """Environment variables a step process needs for this profile, device and thread count."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if device == "cpu" and profile == "portable":
        env.update(PORTABLE_CPU)
    if device == "cuda":
        env.update(CUDA_DETERMINISTIC)
    return env


def check_before_import(profile: str, device: str, threads: int) -> None:
    """Refuse to compute if torch is already loaded or the environment lacks the profile."""
    if "torch" in sys.modules:
        raise RuntimeError("torch was imported before the numerics profile was applied")
    missing = {k: v for k, v in environment(profile, device, threads).items() if os.environ.get(k) != v}
    if missing:
        raise RuntimeError(f"the step process was started without the numerics environment: {missing}")


def apply_after_import(torch: Any, device: str, threads: int) -> dict[str, Any]:
    """Torch-level settings; returns what was set, for the log."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)  # error, not warn, on a nondeterministic kernel
    applied: dict[str, Any] = {"threads": threads, "deterministic_algorithms": True}
    if device == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        applied.update(cudnn_benchmark=False, tf32=False)
    applied["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return applied
