"""The model's fused CPU kernels (`kernels.c`) as autograd functions (and AdamW's update, which
`optimizer.py` calls), and the choice to use them.

A process computes either with these ("fused") or with torch's eager operations ("eager"), never a
mix decided case by case: the plan records which (`numerics.kernels`, resolved against the machine
in the toolchain fingerprint) and the step process selects it before it builds a model
(`select`). Elsewhere (tests, benchmarks, a notebook) the first use decides as a plan would:
fused where there is a C compiler. The kernels take float32 CPU tensors outside torch.compile; a
tensor of another device or dtype (a GPU, bf16 autocast) takes the eager path in either mode,
which the plan's device and dtype already fix.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from buildtrain import native

SOURCE = Path(__file__).with_suffix(".c")
MODES = ("fused", "eager")
_MODE: list[str] = []  # this process's choice, once made


def select(mode: str) -> None:
    """Compute with `mode` from now on; "fused" builds (or loads) the library now, so that a
    compiler problem stops the step before it trains."""
    if mode not in MODES:
        raise ValueError(f"unknown kernels mode {mode!r}")
    if mode == "fused":
        library()
    _MODE[:] = [mode]


def mode() -> str:
    if not _MODE:
        _MODE.append("fused" if native.compiler() is not None else "eager")
    return _MODE[0]


PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a subclass that dispatches elsewhere (DTensor)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these tensors go through the fused kernels."""
    return (
        not torch.compiler.is_compiling()  # first: torch.compile need not trace the rest
        and mode() == "fused"
        and all(type(t) in PLAIN and t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
    )


_LONG, _POINTER, _FLOAT = ctypes.c_long, ctypes.c_void_p, ctypes.c_float
# Every kernel but the norm's backward takes, last, the threads it may use (`_threads`).
SIGNATURES = {
    "bt_rms_norm_forward": [_POINTER] * 4 + [_LONG, _LONG, _FLOAT, _LONG],
    "bt_rms_norm_backward": [_POINTER] * 6 + [_LONG, _LONG],
    "bt_swiglu_forward": [_POINTER] * 3 + [_LONG, _LONG],
    "bt_swiglu_backward": [_POINTER] * 5 + [_LONG, _LONG],
    "bt_rope": [_POINTER] * 4 + [_LONG] * 11,
    "bt_adamw": [_POINTER] * 4 + [_LONG] + [_FLOAT] * 7 + [_LONG],
    "bt_parallel_parts": [_LONG] * 3,
}
RETURNS = {"bt_parallel_parts": _LONG}  # the others return nothing


@functools.cache
def library() -> ctypes.CDLL:
    return declare(native.load(SOURCE))


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with every kernel's argument and return types set (a build of kernels.c)."""
    for name, arguments in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, RETURNS.get(name)
    return lib


def _threads() -> int:
    """The threads a kernel may use: torch's intra-op count, which the step's numerics set. The
    count changes no bit (kernels.c says why); a call too small to be worth a thread uses fewer."""
    return torch.get_num_threads()


def _expect(condition: bool, what: str) -> None:
    """The C reads exactly the sizes it is given: a mismatch would read past a tensor, not fail."""
    if not condition:
        raise ValueError(f"{what}: shapes do not match")


class RMSNorm(torch.autograd.Function):
    """x / rms(x) * weight over the last dimension; keeps x and one rstd per row for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _expect(weight.shape == x.shape[-1:], f"RMSNorm weight {tuple(weight.shape)} for x {tuple(x.shape)}")
        x, weight, width = x.contiguous(), weight.contiguous(), x.shape[-1]
        out, rstd = torch.empty_like(x), x.new_empty(x.shape[:-1])
        library().bt_rms_norm_forward(
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rstd.data_ptr(),
            rstd.numel(),
            width,
            eps,
            _threads(),
        )
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        dx, dweight = torch.empty_like(x), torch.empty_like(weight)
        library().bt_rms_norm_backward(
            grad.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            rstd.data_ptr(),
            dx.data_ptr(),
            dweight.data_ptr(),
            rstd.numel(),
            x.shape[-1],
        )
        return dx, dweight, None


class SwiGLU(torch.autograd.Function):
    """silu(a) * b in one pass; keeps a and b (not silu(a)) for backward."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        _expect(a.shape == b.shape, f"SwiGLU gate {tuple(a.shape)} and up {tuple(b.shape)}")
        a, b = a.contiguous(), b.contiguous()
        out = torch.empty_like(a)
        library().bt_swiglu_forward(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(), _threads())
        ctx.save_for_backward(a, b)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        da, db = torch.empty_like(a), torch.empty_like(b)
        library().bt_swiglu_backward(
            grad.data_ptr(), a.data_ptr(), b.data_ptr(), da.data_ptr(), db.data_ptr(), a.numel(), _threads()
        )
        return da, db


def rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """out = x * cos + swap_halves(x) * sin for x and out (B, T, heads, hs) in any strides along
    B, T and heads (out's channels contiguous); cos and sin (T, 1, hs)."""
    B, T, H, hs = x.shape
    tables = (T, 1, hs)
    _expect(
        out.shape == x.shape and out.stride(-1) == 1 and hs % 2 == 0 and cos.shape == sin.shape == tables,
        f"RoPE of x {tuple(x.shape)} into {tuple(out.shape)} by tables {tuple(cos.shape)}",
    )
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    library().bt_rope(
        out.data_ptr(),
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        B,
        T,
        H,
        hs,
        *x.stride()[:3],
        *out.stride()[:3],
        _threads(),
    )


def adamw(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: tuple[float, float, float, float, float, float, float],
) -> None:
    """One AdamW update of `param` and its moments, in place, in one pass (`bt_adamw`). `scalars`:
    the decay factor, the lerp weight, beta2, 1 - beta2, the bias correction of the second moment,
    eps and minus the step size, each as torch takes it (optimizer.py)."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    _expect(
        all(t.shape == param.shape and t.is_contiguous() for t in tensors),
        f"AdamW of a parameter {tuple(param.shape)}",
    )
    library().bt_adamw(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        param.numel(),
        *scalars,
        _threads(),
    )
