"""AdamW, written out: the same update as torch.optim.AdamW, in a dozen lines.

Why not torch.optim: constructing any torch optimizer imports torch._dynamo, about two seconds on
the machines this project targets, paid by every train step process; and a hand-written update
keeps the optimizer state what a checkpoint needs it to be, plain tensors by parameter name.

Each line updates every tensor of a group at once (`torch._foreach_*`: one kernel launch per
operation on a GPU, instead of one per tensor), with the element-wise arithmetic of torch's
single-tensor path, so the bits are the same. Step counts live on the host: no device syncs.

On the CPU, where the process computes with the fused kernels (`kernels.py`), each tensor's update
is instead one pass of a C kernel (`bt_adamw`) making the same operations in the same order, each
one exactly rounded: 3.3x faster at the GPT-2-like CPU shape (`benchmarks/optimizer.py`: 8.6
against 27.2 ms an update, one thread). Under `portable` its bits are torch's: MKL's strict mode
takes torch's square root exactly rounded too. Under `native`, MKL's default square root is not
(one element in about 160 is one unit in the last place off), so there the two differ. The kernel's
bits are the same at any thread count and vector width, and a shard of a tensor updates as that
part of the whole does, so sharded training keeps the bits of unsharded training. (torch's own
fused CPU AdamW is as fast, but rounds its vectorized body and its scalar tail differently: a
tensor's last elements, and each shard's, would depend on lengths.)

On a GPU the update is torch's fused AdamW kernel (`fused_update`), the one `torch.optim.AdamW(
fused=True)` runs, with its bits (on a GPU each element is computed alike, wherever it lies).
Those are not the written-out update's: a GPU plan trains to other weights than the same plan
would have before this kernel, and the GPU's weights differ from the CPU's, as they already did.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from buildtrain.steps.train import kernels

SLOTS = ("exp_avg", "exp_avg_sq", "step")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) parameter, gradient or moment, which an update
    changes in place (under no_grad, `to_local` is the part itself); a plain tensor as it is."""
    return tensor if type(tensor) in kernels.PLAIN else tensor.to_local()  # type: ignore[attr-defined]


def runs_fused(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused kernel updates `params` (this rank's parts): on a GPU."""
    return all(p.device.type == "cuda" for p in params)


def fused_update(
    tensors: list[list[torch.Tensor]],
    count: float,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """torch's fused AdamW kernel over `tensors` (parameters, gradients, first and second
    moments), called as `torch.optim.AdamW(fused=True)` calls it: on a GPU, one pass over each
    tensor where the written-out update makes eight (2.30 against 0.91 ms at GPT-2 small on an
    H200, `benchmarks/gpu.py --parts`). It takes one step count per tensor on their device: the
    same one for each here, filled there from the host's count (a launch, not a sync)."""
    params, grads, exp_avgs, exp_avg_sqs = tensors
    steps = [torch.full((), count, dtype=torch.float32, device=params[0].device)] * len(params)
    beta1, beta2 = betas
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


class AdamW:
    """Adam with decoupled weight decay. `param_groups` carry their own `lr` and `weight_decay`."""

    def __init__(
        self, groups: Iterable[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float
    ) -> None:
        self.param_groups = [{"lr": lr, **group, "params": list(group["params"])} for group in groups]
        self.betas, self.eps = betas, eps
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def slots(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The moments and step count of a parameter, created as zeros on first use (the count on
        the host: it only scales the update)."""
        if param not in self.state:
            self.state[param] = {
                "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param),
                "step": torch.zeros((), dtype=torch.float32),
            }
        return self.state[param]

    @torch.no_grad()
    def update(self) -> None:
        """One optimizer update of every parameter that has a gradient."""
        for group in self.param_groups:
            # Parameters that joined at different updates (a gradient that was None) have their own
            # step counts; in practice every parameter of a group is in one bucket.
            buckets: dict[float, list[torch.Tensor]] = {}
            for param in group["params"]:
                if param.grad is not None:
                    state = self.slots(param)
                    state["step"] += 1  # a host tensor: reading it below costs no device sync
                    buckets.setdefault(state["step"].item(), []).append(param)
            for count, params in buckets.items():
                self._apply(params, count, group["lr"], group["weight_decay"])

    def _apply(self, params: list[torch.Tensor], count: float, lr: float, weight_decay: float) -> None:
        """The AdamW update of `params`, whose step count is `count` (1 on the first update)."""
        grads = [p.grad for p in params if p.grad is not None]
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        beta1, beta2 = self.betas
        step_size, correction = lr / (1 - beta1**count), math.sqrt(1 - beta2**count)  # bias corrections
        tensors = [[local(t) for t in group] for group in (params, grads, exp_avgs, exp_avg_sqs)]
        if kernels.applies(*tensors[0], *tensors[1]):
            scalars = (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, correction, self.eps, -step_size)
            for param, grad, exp_avg, exp_avg_sq in zip(*tensors, strict=True):
                kernels.adamw(param, grad, exp_avg, exp_avg_sq, scalars)
            return
        if runs_fused(tensors[0]):
            fused_update(tensors, count, lr, weight_decay, self.betas, self.eps)
            return
        torch._foreach_mul_(params, 1 - lr * weight_decay)  # decoupled weight decay
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, correction)
        torch._foreach_add_(denominators, self.eps)
        torch._foreach_addcdiv_(params, exp_avgs, denominators, value=-step_size)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next update, for every group (the schedule decides it)."""
        for group in self.param_groups:
            group["lr"] = lr

    def state_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Moments and step counts by `<parameter name>.<slot>`, parameters named by `named`
        (the model's `named_parameters()`); a parameter never updated has none."""
        names = {id(p): name for name, p in named}
        found: dict[str, torch.Tensor] = {}
        for group in self.param_groups:
            for param in group["params"]:
                for slot, value in self.state.get(param, {}).items():
                    found[f"{names[id(param)]}.{slot}"] = value.detach()
        return found

    def load_state_tensors(
        self, named: Iterable[tuple[str, torch.Tensor]], tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Restore what `state_tensors` gave: moments onto their parameter's device, step counts
        on the host."""
        for name, param in named:
            slots = {slot: tensors[f"{name}.{slot}"] for slot in SLOTS if f"{name}.{slot}" in tensors}
            if slots:
                self.state[param] = {k: v.to(param.device) if k != "step" else v for k, v in slots.items()}

    def zero_grad(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None
