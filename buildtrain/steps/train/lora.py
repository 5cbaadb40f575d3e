"""Low-rank adapters (LoRA): y = W x + alpha / rank x B A dropout(x), with W frozen.

An adapter is a child module of the projection it adapts (`blocks.0.attention.wqkv.lora_q.A`),
added by a forward hook, so the model's own tensor names and its initialization are untouched
and a checkpoint holds the frozen weights and the adapters under their plain names. q, k and v
share buildtrain's fused `wqkv` projection: each has its own adapter over its rows (nh query
heads, nkv key heads, nkv value heads), exactly what peft puts on q_proj, k_proj and v_proj.

A starts uniform in +-1/sqrt(fan_in) (peft's default, kaiming-uniform with a = sqrt(5)) drawn from
the plan's seeded generator, in parameter order, after the seed is applied: the adapters are a
function of (seed, "lora") alone. B starts at zero, so the first forward is the base model's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from buildtrain.config.schema import LoraConfig, ModelConfig
from buildtrain.config.shape import head_dim

# target -> the projection it adapts, under a block (peft's names for them: `steps/export/hf.py`)
TARGETS = {
    "q": "attention.wqkv",
    "k": "attention.wqkv",
    "v": "attention.wqkv",
    "o": "attention.wo",
    "gate": "ffn.w1",
    "up": "ffn.w3",
    "down": "ffn.w2",
}


class Adapter(nn.Module):
    """B A over rows [start, end) of a projection's output."""

    def __init__(self, fan_in: int, start: int, end: int, lora: LoraConfig) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.zeros(lora.rank, fan_in))
        self.B = nn.Parameter(torch.zeros(end - start, lora.rank))
        self.start, self.end = start, end
        self.scale = lora.alpha / lora.rank
        self.p = lora.dropout
        self.generator: torch.Generator | None = None  # set per forward by the model (dropout)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale x B A x for x (..., fan_in): (..., end - start)."""
        if self.generator is not None and self.p > 0.0:
            keep = torch.rand(x.shape, generator=self.generator, device=x.device) >= self.p
            x = x * keep / (1.0 - self.p)
        return (x @ self.A.t()) @ self.B.t() * self.scale


def rows(target: str, model: ModelConfig, out_features: int) -> tuple[int, int]:
    """The output rows of its projection that a target adapts."""
    q, kv = model.n_heads * head_dim(model), model.n_kv_heads * head_dim(model)
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}.get(target, (0, out_features))


def _add_deltas(linear: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    """The forward hook: the projection's output plus its adapters' deltas in their rows."""
    (x,) = inputs
    pieces, at = [], 0
    for adapter in sorted(adapters_of(linear), key=lambda a: a.start):
        if adapter.start > at:
            pieces.append(output.new_zeros(*output.shape[:-1], adapter.start - at))
        pieces.append(adapter.delta(x))
        at = adapter.end
    if at < output.shape[-1]:
        pieces.append(output.new_zeros(*output.shape[:-1], output.shape[-1] - at))
    return output + torch.cat(pieces, dim=-1)


def adapters_of(module: nn.Module) -> Iterator[Adapter]:
    return (child for child in module.children() if isinstance(child, Adapter))


def add_adapters(model: nn.Module, lora: LoraConfig, config: ModelConfig, generator: torch.Generator) -> None:
    """Freeze every weight of `model` and give each targeted projection its adapters."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for block in model.blocks:  # type: ignore[attr-defined]
        hooked = set()
        for target in lora.targets:
            linear = block.get_submodule(TARGETS[target])
            start, end = rows(target, config, linear.out_features)
            linear.add_module(f"lora_{target}", Adapter(linear.in_features, start, end, lora))
            if id(linear) not in hooked:
                linear.register_forward_hook(_add_deltas)
                hooked.add(id(linear))
    with torch.no_grad():
        for _, adapter in named_adapters(model):  # registration order: block by block, target by target
            bound = 1.0 / math.sqrt(adapter.A.shape[1])
            values = torch.empty(adapter.A.shape, dtype=torch.float32)
            adapter.A.copy_(values.uniform_(-bound, bound, generator=generator))
    model.adapters = [adapter for _, adapter in named_adapters(model)]  # type: ignore[assignment]


def named_adapters(model: nn.Module) -> list[tuple[str, Adapter]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, Adapter)]


def is_adapter_tensor(name: str) -> bool:
    return ".lora_" in name


def merged(
    tensors: dict[str, torch.Tensor], lora: LoraConfig, config: ModelConfig
) -> dict[str, torch.Tensor]:
    """A checkpoint's weights with its adapters added in (W + scale B A in their rows), under
    the model's plain names: what evaluation, a later stage and the hf/ export load."""
    weights = {name: t.clone() for name, t in tensors.items() if not is_adapter_tensor(name)}
    scale = lora.alpha / lora.rank
    for index in range(config.n_layers):
        for target in lora.targets:
            module = f"blocks.{index}.{TARGETS[target]}"
            weight = weights[f"{module}.weight"]
            start, end = rows(target, config, weight.shape[0])
            a, b = tensors[f"{module}.lora_{target}.A"], tensors[f"{module}.lora_{target}.B"]
            weight[start:end] += scale * (b @ a)
    return weights
