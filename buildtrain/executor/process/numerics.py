"""The numerics profile, in three parts: the environment a step's process starts with, the torch
settings applied right after `import torch` in that process, and how a profile turns a machine's
cores into processes and threads.

The environment matters most: MKL's conditional numerical reproducibility (MKL_CBWR), the
ATen/oneDNN instruction-set caps and the thread counts are read once, when the libraries load, so
they must be in the process environment before torch is imported; setting them later silently
does nothing. That is why every computing step runs in a child process started with this
environment.

Why `portable` computes on one thread per process: ATen cuts elementwise and reduction work into
min(threads, ceil(n / 32,768)) chunks, and the bits depend on where the cuts fall (a chunk's tail
takes the scalar path, whose SiLU and sigmoid round differently from the vector path; a whole-tensor
sum is added up per chunk). Measured on torch 2.13 CPU under the portable environment
(benchmarks/thread_invariance.py): SiLU, its gradient and sigmoid differ from 3 threads on, sums of
90k elements already at 2. Which kernels are affected depends on the shapes, the torch build and
the CPU, so a list of safe kernels proves nothing about the next model. One thread per process
has a single chunk per op whatever the machine, so its bits cannot depend on the thread count; a
machine's cores work as ranks instead, which the `invariant` gradient tree makes exact at any
world size.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

# Pin MKL to its AVX2 code path in strict CNR mode and cap ATen's and oneDNN's kernels at AVX2, so
# that the same kernels run on any AVX2 x86-64 CPU, Intel or AMD (MKL grants the branch on AMD only
# with the shim that `mkl.py` loads, and the branch is checked after import).
PORTABLE_CPU = {
    "MKL_CBWR": "AVX2,STRICT",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "DNNL_MAX_CPU_ISA": "AVX2",
}
# glibc's allocator gives freed blocks back to the kernel: from 128 KiB a block is its own mapping,
# unmapped when freed, and the heap's free top is trimmed. A training step allocates and frees its
# activations every micro-batch, so each new tensor paid page faults on first touch: on the 2-core
# VM, our RMSNorm forward and backward took 2.7 ms at 1024 x 256 instead of 0.74 ms, and the whole
# GPT-2-shaped update about 3% longer (issue 26). Blocks below 32 MiB (glibc's largest setting) now
# come from the heap, and up to 1 GiB of freed heap stays mapped for the next micro-batch. Memory
# placement never changes the arithmetic, so the bits do not depend on these; other C libraries
# ignore them.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
# cuBLAS's workspace configuration, read when CUDA starts, set only where the installed torch
# requires it (`cublas_workspace_required`).
CUDA_DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# The check in torch that refuses a cuBLAS call under use_deterministic_algorithms(True) without
# that variable: declared in ATen/Context.h for as long as torch has it.
CUBLAS_CHECK = b"alertCuBLASConfigNotDeterministic"

# A train step under `portable` shares its cores out as single-threaded ranks only when the step is
# big enough for the extra start-up (torchrun and one more `import torch`, about 3 s here) to pay.
# On the 2-core development machine two ranks ran updates 1.6x faster than one process at 3.4M
# parameters, which repays 3 s from about 8 s of single-process work: 4e11 FLOP at that model's
# 53 GFLOP/s. presets/tiny.toml (1.2e11 FLOP) took the same wall time either way.
RANKS_MIN_FLOP = 5e11


def portable_cpu(profile: str, device: str) -> bool:
    return profile == "portable" and device == "cpu"


def intra_op_threads(profile: str, device: str, threads: int) -> int:
    """The threads one process computes with: one under portable on the CPU (see above)."""
    return 1 if portable_cpu(profile, device) else threads


def portable_ranks(cores: int, micro_batches: int, step_flop: float) -> int:
    """How many single-threaded ranks a portable train step uses on `cores` cores.

    The ranks share an update's micro-batches evenly, so the most that fit is the largest divisor
    of the micro-batch count not above the cores; a step too small to repay the start-up of
    several processes runs on one. Only speed depends on this choice, never the bits.
    """
    if step_flop < RANKS_MIN_FLOP:
        return 1
    return max(n for n in range(1, min(cores, micro_batches) + 1) if micro_batches % n == 0)


def environment(profile: str, device: str, threads: int) -> dict[str, str]:
    """Environment variables a step process needs for this profile, device and thread count."""
    count = str(intra_op_threads(profile, device, threads))
    env = {"OMP_NUM_THREADS": count, "MKL_NUM_THREADS": count, **KEEP_FREED_MEMORY}
    if portable_cpu(profile, device):
        env.update(PORTABLE_CPU)
    if device == "cuda" and cublas_workspace_required():
        env.update(CUDA_DETERMINISTIC)
    return env


@functools.cache
def cublas_workspace_required(torch_folder: Path | None = None) -> bool:
    """Whether the installed torch needs CUBLAS_WORKSPACE_CONFIG for deterministic cuBLAS.

    Torch used to refuse any cuBLAS call under use_deterministic_algorithms(True) on CUDA >= 10.2
    unless the variable was ":4096:8" or ":16:8" (`Context::alertCuBLASConfigNotDeterministic`,
    declared in ATen/Context.h). pytorch/pytorch#161749 removed that check: since CUDA 11 torch
    gives cuBLAS a workspace of its own per handle and stream (#85447), which is what cuBLAS's
    reproducibility notes ask for, so the variable no longer decides the bits. torch 2.13 has no
    such check (not in ATen/Context.h, not in libtorch_cpu's strings, not in
    use_deterministic_algorithms' documentation; read on 2.13.0+cpu, cf30153). The variable is
    not free: it fixes cuBLAS's workspace where torch sizes it per GPU (pytorch#120925; #109856
    measured 9.0 against 3.45 it/s); its cost here is for a GPU to measure (`benchmarks/gpu.py
    --parts`, the "cuBLAS workspace" rows). So the step process sets it only where the installed
    torch still declares the check, read from torch's header without importing torch; where the
    header cannot be read, it is set (never wrong for the bits, at worst slower).
    """
    if torch_folder is None:
        spec = importlib.util.find_spec("torch")  # finds torch, imports nothing
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            return True
        torch_folder = Path(locations[0])
    try:
        return CUBLAS_CHECK in (torch_folder / "include" / "ATen" / "Context.h").read_bytes()
    except OSError:
        return True


def check_before_import(profile: str, device: str, threads: int) -> None:
    """Refuse to compute if torch is already loaded or the environment lacks the profile."""
    if "torch" in sys.modules:
        raise RuntimeError("torch was imported before the numerics profile was applied")
    missing = {k: v for k, v in environment(profile, device, threads).items() if os.environ.get(k) != v}
    if missing:
        raise RuntimeError(f"the step process was started without the numerics environment: {missing}")


def before_import(profile: str, device: str, threads: int) -> None:
    """What a step process does before `import torch`: check the environment, then, on the CPU,
    load the shim that makes MKL treat any x86-64 vendor as it treats Intel's (`mkl.py`).

    Under portable that is what makes MKL take the asked branch (checked after import). Under
    native it gives an AMD CPU the kernels MKL picks for an Intel one of the same instruction
    set: on a 2-core AMD EPYC (AVX-512) tiny's native train step took 3.0-3.3 s with it and
    3.6-3.7 s without, in alternating runs.
    """
    check_before_import(profile, device, threads)
    if device == "cpu":
        from buildtrain.executor.process import mkl

        if mkl.applies():
            mkl.load_shim()


def apply_after_import(torch: Any, profile: str, device: str, threads: int) -> dict[str, Any]:
    """Torch-level settings; returns what was set, for the log."""
    count = intra_op_threads(profile, device, threads)
    torch.set_num_threads(count)
    torch.use_deterministic_algorithms(True)  # error, not warn, on a nondeterministic kernel
    # Deterministic mode also fills each new uninitialized tensor (NaN), a guard against kernels that
    # read memory they never wrote. Every buffer here is written before it is read (the invariance
    # tests compare bits across threads, ranks, resumes and stores), and the fills were ~1,200
    # kernels an update at GPT-2 small on an H100, 6 ms of 71.
    torch.utils.deterministic.fill_uninitialized_memory = False
    applied: dict[str, Any] = {"threads": count, "deterministic_algorithms": True}
    if device == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "torch's default")
        applied.update(cudnn_benchmark=False, tf32=False, cublas_workspace=workspace)
    applied["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return applied


def check_after_import(torch: Any, profile: str, device: str) -> dict[str, Any]:
    """Fail closed: under portable on the CPU, refuse to compute unless MKL really runs the branch
    the environment asked for (`mkl.check_branch`); returns what was found, for the log."""
    from buildtrain.executor.process import mkl

    if not (portable_cpu(profile, device) and mkl.applies()):
        return {}
    return {
        "mkl_branch": mkl.check_branch(torch, PORTABLE_CPU["MKL_CBWR"]),
        "mkl_sees_intel": mkl.sees_intel(torch),
    }


def import_torch(profile: str, device: str, threads: int) -> tuple[Any, dict[str, Any]]:
    """The one way a computing process imports torch: the environment checked and MKL's shim
    loaded before, the profile's settings applied and MKL's branch checked after. Returns torch
    and what was applied, for the log."""
    before_import(profile, device, threads)
    import torch  # only now: the numerics environment is in place

    applied = apply_after_import(torch, profile, device, threads)
    applied.update(check_after_import(torch, profile, device))
    return torch, applied
