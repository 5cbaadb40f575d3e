"""MKL's reproducible branch on any x86-64 vendor: asked for, made to hold, and checked.

The portable profile asks MKL for its AVX2 code path in strict reproducible mode
(`MKL_CBWR=AVX2,STRICT`, `numerics.PORTABLE_CPU`). MKL grants that only on a CPU it recognises as
Intel's: on an AMD EPYC it printed `CNR:AUTO,STRICT` under `MKL_VERBOSE=1`, ran its AUTO kernels,
and the same portable plan of presets/tiny.toml trained to other weights there (05aedd393c6d for
a Xeon's b56a01ce25ed). Everything else that computes (ATen's AVX2 kernels, our C kernels, numpy)
already agreed across vendors: MKL does the GEMMs and RoPE's cos/sin tables.

So a portable step process loads `mkl.c` before torch: it answers MKL's internal vendor check
(`mkl_serv_intel_cpu_true`) with yes, and the MKL inside torch's x86-64 wheels, which calls that
check through the dynamic linker, then takes the asked branch. Measured on the EPYC with the
shim: tiny trained to the Xeon's weights, the same at 1 and 4 threads, and strict AVX2 ran at
1.01x the speed of MKL's AUTO branch there. `MKL_CBWR=COMPATIBLE`, the one branch Intel
documents as the same on every vendor, gave other weights on each vendor and 0.48-0.59x the speed.

The shim is an undocumented interface, so nothing trusts it: after torch loads, `check_branch`
asks MKL which branch it really computes on (`mkl_serv_cbwr_get`, exported by the same MKL) and
refuses to compute when it is not the one asked for: a torch build without MKL, a future MKL that
checks the vendor another way, a machine without the C compiler that builds the shim. The way
out it names is `native`, whose hash names this machine.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

from buildtrain import native
from buildtrain.errors import StepFailed

SHIM = Path(__file__).with_suffix(".c")

# mkl_cbwr_get's argument and answers, from MKL's mkl_service.h (MKL_CBWR_ALL asks for the branch
# and the mode together; the answer is a branch value with the STRICT bit or'ed in; OFF: no
# MKL_CBWR was set).
CBWR_ALL = ~0
CBWR_BRANCHES = {
    "OFF": 1,
    "AUTO": 2,
    "COMPATIBLE": 3,
    "SSE2": 4,
    "SSE4_2": 8,
    "AVX": 9,
    "AVX2": 10,
    "AVX512": 12,
}
CBWR_STRICT = 0x10000


def applies() -> bool:
    """MKL exists only in torch's x86-64 builds: elsewhere there is no branch to ask for."""
    return platform.machine() in ("x86_64", "AMD64")


def encoded(setting: str) -> int:
    """`AVX2,STRICT` as mkl_cbwr_get answers it (0x1000a)."""
    branch, _, mode = setting.partition(",")
    return CBWR_BRANCHES[branch] | (CBWR_STRICT if mode == "STRICT" else 0)


def decoded(value: int) -> str:
    names = {number: name for name, number in CBWR_BRANCHES.items()}
    branch = names.get(value & ~CBWR_STRICT, f"unknown branch {value & ~CBWR_STRICT:#x}")
    return branch + (",STRICT" if value & CBWR_STRICT else "")


@functools.cache
def load_shim() -> str | None:
    """Before torch: load the vendor shim with global symbols. Returns why it could not be
    loaded (None: loaded), for `check_branch` to name if MKL then ignores the asked branch; an
    Intel CPU needs no shim, so a missing compiler fails nothing by itself. Once per process."""
    if native.compiler() is None:
        return "no C compiler builds buildtrain's MKL shim (executor/process/mkl.c): install one (apt-get install gcc)"
    try:
        native.load(SHIM, threaded=False, shared_symbols=True)
    except (StepFailed, OSError) as exc:
        return f"buildtrain's MKL shim did not load: {exc}"
    return None


def _mkl_function(torch: Any, name: str) -> Any:
    """A function of the MKL inside torch, as that library itself defines it (asked of its own
    handle, so the shim's definition does not answer); None where torch has no MKL."""
    import ctypes

    if not torch.backends.mkl.is_available():
        return None
    try:
        function = getattr(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")), name)
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    return function


def branch_taken(torch: Any) -> int | None:
    """The branch and mode MKL computes on in this process (None: torch has no MKL to ask)."""
    ask = _mkl_function(torch, "mkl_serv_cbwr_get")
    if ask is None:
        return None
    import ctypes

    ask.argtypes = [ctypes.c_int]
    return int(ask(CBWR_ALL))


def sees_intel(torch: Any) -> bool | None:
    """MKL's own vendor check, unanswered by the shim: whether the CPU (as CPUID reports it, so an
    emulated one under qemu) is Intel's. For the log; None where torch has no MKL."""
    check = _mkl_function(torch, "mkl_serv_intel_cpu_true")
    return None if check is None else bool(check())


def check_branch(torch: Any, asked: str) -> str:
    """Refuse to compute unless MKL really runs the branch `asked` (`AVX2,STRICT`); returns the
    branch, for the log."""
    taken = branch_taken(torch)
    if taken == encoded(asked):
        return asked
    if taken is None:
        cause = "this torch build has no MKL to ask; install torch's x86-64 wheel (pip install torch==2.13.0)"
    else:
        problem = load_shim()  # cached: what happened before torch loaded
        why = problem or "although buildtrain's shim loaded (this MKL checks the vendor another way)"
        cause = f"MKL computes on {decoded(taken)}: {why}"
    raise StepFailed(
        f"the portable profile needs MKL's {asked} branch, but {cause}; "
        f"or plan with --set numerics.profile=native, whose hash names this machine"
    )
