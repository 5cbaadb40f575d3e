"""AdamW, written out: the same update as torch.optim.AdamW's single-tensor path, in a dozen lines.

Why not torch.optim: constructing any torch optimizer imports torch._dynamo, about two seconds on
the machines this project targets, paid by every train step process; and a hand-written update
keeps the optimizer state what a checkpoint needs it to be, plain tensors by parameter name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

SLOTS = ("exp_avg", "exp_avg_sq", "step")


class AdamW:
    """Adam with decoupled weight decay. `param_groups` carry their own `lr` and `weight_decay`."""

    def __init__(
        self, groups: Iterable[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float
    ) -> None:
        self.param_groups = [{"lr": lr, **group, "params": list(group["params"])} for group in groups]
        self.betas, self.eps = betas, eps
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def slots(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The moments and step count of a parameter, created as zeros on first use."""
        if param not in self.state:
            self.state[param] = {
                "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param),
                "step": torch.zeros((), dtype=torch.float32),
            }
        return self.state[param]

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        for group in self.param_groups:
            lr, weight_decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.slots(param)
                state["step"] += 1
                step = state["step"].item()
                grad = param.grad
                param.mul_(1 - lr * weight_decay)  # decoupled weight decay
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1**step)
                denominator = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(self.eps)
                param.addcdiv_(state["exp_avg"], denominator, value=-step_size)

    def zero_grad(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None
