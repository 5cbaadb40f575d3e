"""A decoder-only transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One config (`ModelConfig`), five small modules, shapes in comments. `Transformer.build` initializes
every weight from an explicit generator in parameter order, leaving torch's global RNG as it was;
dropout draws from a generator the caller passes. On the CPU in float32, RMSNorm, SwiGLU and RoPE
compute with the fused C kernels of `kernels.py` where the process selected them, else with the
torch operations written here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from buildtrain.config.schema import ModelConfig, RopeScalingConfig
from buildtrain.config.shape import head_dim
from buildtrain.steps.train import kernels
from buildtrain.steps.train.rope import inverse_frequencies


class RMSNormFunction(torch.autograd.Function):
    """x / rms(x) * weight over the last dimension, with its gradient written out: the CPU's eager
    path (`kernels.RMSNorm` is the fused one).

    Why by hand: on the CPU `F.rms_norm` is not one kernel but pow, mean, add, rsqrt and two
    multiplications, each with its own autograd node: 3.5 ms per norm forward and backward against
    0.7 ms for `layer_norm` (GPT-2-like shape, issue 26). Each kernel here is a pass over the
    activations, so there are as few as eager mode allows: the forward reads x once for its norm
    (one vector-norm kernel) and writes twice (normed, output); the backward makes five passes and
    one matrix-vector product, the per-row mean(grad * weight * normed) being (grad * normed) @
    weight / width. Forward and backward at 1024 x 256, one thread: 0.42-0.69 ms, where the
    previous eleven passes took 0.50-0.74 ms and `layer_norm` 0.28-0.38 ms.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        width = x.shape[-1]
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (..., 1): sqrt(sum x^2)
        rstd = norm.square_().div_(width).add_(eps).rsqrt_()
        normed = x * rstd
        ctx.save_for_backward(normed, rstd, weight)
        return normed * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        normed, rstd, weight = ctx.saved_tensors
        grad_times_normed = grad * normed
        grad_weight = grad_times_normed.flatten(0, -2).sum(0)
        # d(x * rstd)/dx applied to grad * weight: rstd * (grad * weight - normed * mean(grad * weight * normed))
        dot = (grad_times_normed @ weight).unsqueeze(-1).div_(-weight.shape[0])  # (..., 1)
        return (grad * weight).addcmul_(normed, dot).mul_(rstd), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.applies(x, self.weight):
            return kernels.RMSNorm.apply(x, self.weight, self.eps)
        if x.device.type == "cpu":
            return RMSNormFunction.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused kernel on CUDA


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.dim, config.norm_eps)
    return nn.LayerNorm(config.dim, eps=config.norm_eps)


def rope_tables(
    head_dim: int, seq_len: int, theta: float, scaling: RopeScalingConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of the rotary angles for rotate-half RoPE, each (T, 1, head_dim).

    Channel i and channel i + head_dim / 2 of a head form pair i (the layout of Llama and
    transformers): cos repeats over both halves; sin is negated on the first half, so that
    x * cos + swap_halves(x) * sin rotates every pair.
    """
    frequencies = inverse_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), frequencies)  # (T, hs / 2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)


def rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """out = x * cos + swap_halves(x) * sin, with x (B, T, heads, hs) in any strides along heads.

    Three kernels and no temporary: the product, then each half adds the other half's term in
    place. (`torch.roll` would build the swapped copy with a concatenation, a full extra pass.)
    Each element is one product plus one product-sum, as in x * cos + rolled * sin.
    """
    half = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        # torch.compile cannot trace an `out=` that is not contiguous (k, laid out head by head,
        # is not): it would split the graph in every layer. Compiled, the product is fused anyway.
        out.copy_(x * cos)
    else:
        torch.mul(x, cos, out=out)
    out[..., :half].addcmul_(x[..., half:], sin[..., :half])
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])


class RotaryQKV(torch.autograd.Function):
    """Split the fused projection (B, T, nh + 2 nkv, hs) into q, k (rotated) and v, each as
    attention reads them, (B, heads, T, hs).

    One function so that the backward writes the projection's gradient once, in place: through
    autograd, each of the three slices' gradients would be a zero-filled tensor of the full width,
    added up. The rotation's gradient is the rotation by the opposite angle: the same
    `rotate_into` with sin negated.
    """

    @staticmethod
    def forward(
        ctx: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # In the projection's dtype: under bf16 autocast, float32 tables would promote q and k to
        # float32 copies that attention then casts back (on the CPU in float32, nothing changes).
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
        ctx.save_for_backward(cos, sin)
        qk = n_heads + n_kv_heads
        B, T, _, hs = qkv.shape
        # k heads-major: laid out (B, T, heads, hs) with q, one position of a head was 2 KB from
        # the next at the GPT-2-like shape, a power of two that maps them all to the same cache
        # sets, and attention took about 10% longer than on nanoGPT's layout. q stays
        # token-major in a buffer of its own: attention's output takes q's layout, and so is
        # (B, T, heads, hs) already, which the output projection reads without a copy (3-4% less
        # attention time than q heads-major too).
        q, k = qkv.new_empty(B, T, n_heads, hs), qkv.new_empty(B, n_kv_heads, T, hs)
        rotate = kernels.rotate_into if kernels.applies(qkv) else rotate_into
        ctx.rotate = rotate
        rotate(q, qkv[:, :, :n_heads], cos, sin)
        rotate(k.transpose(1, 2), qkv[:, :, n_heads:qk], cos, sin)
        return q.transpose(1, 2), k, qkv[:, :, qk:].transpose(1, 2)

    @staticmethod
    def backward(
        ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None]:
        cos, sin = ctx.saved_tensors
        unrotate = -sin
        grad_q, grad_k, grad_v = (g.transpose(1, 2) for g in (grad_q, grad_k, grad_v))  # (B, T, heads, hs)
        nh, qk = grad_q.shape[2], grad_q.shape[2] + grad_k.shape[2]
        grad = grad_v.new_empty(*grad_v.shape[:2], qk + grad_v.shape[2], grad_v.shape[3])
        ctx.rotate(grad[:, :, :nh], grad_q, cos, unrotate)
        ctx.rotate(grad[:, :, nh:qk], grad_k, cos, unrotate)
        grad[:, :, qk:].copy_(grad_v)
        return grad, None, None, None, None


def dropout(x: torch.Tensor, p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Dropout drawn from an explicit generator on x's device (off when there is none, as in
    evaluation)."""
    if generator is None or p == 0.0:
        return x
    keep = torch.rand(x.shape, generator=generator, device=x.device) >= p
    return x * keep / (1.0 - p)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = head_dim(config)
        # q, k and v in one GEMM: rows are nh query heads, then nkv key heads, then nkv value heads.
        self.wqkv = nn.Linear(
            config.dim, (config.n_heads + 2 * config.n_kv_heads) * self.head_dim, bias=config.qkv_bias
        )
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        # qwen3: each query and key head normalized over its own channels, before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, nh, T, hs), k and v (B, nkv, T, hs) of x (B, T, C), RoPE applied to q and k."""
        B, T, _ = x.shape
        qkv = self.wqkv(x).view(B, T, -1, self.head_dim)  # (B, T, nh + 2 nkv, hs)
        if self.q_norm is not None and self.k_norm is not None:
            qk = self.n_heads + self.n_kv_heads
            q, k = self.q_norm(qkv[:, :, : self.n_heads]), self.k_norm(qkv[:, :, self.n_heads : qk])
            qkv = torch.cat((q, k, qkv[:, :, qk:]), dim=2)
        return RotaryQKV.apply(qkv, cos, sin, self.n_heads, self.n_kv_heads)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        # Each key/value head serves a group of query heads; SDPA reads them in place, no copies.
        gqa = self.n_heads != self.n_kv_heads
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, nh, T, hs)
        else:  # packed records: causal within each record only (`record_mask`)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            gate, up = self.w1(x), self.w3(x)
            if kernels.applies(gate, up):
                return self.w2(kernels.SwiGLU.apply(gate, up))
            return self.w2(F.silu(gate) * up)
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = make_norm(config)
        self.attention = Attention(config)
        self.ffn_norm = make_norm(config)
        self.ffn = FeedForward(config)
        self.p = config.dropout

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        generator: torch.Generator | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + dropout(self.attention(self.attention_norm(x), cos, sin, mask), self.p, generator)
        return x + dropout(self.ffn(self.ffn_norm(x)), self.p, generator)


def recomputed(
    block: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    generator: torch.Generator | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """A block whose activations are not kept but computed again in the backward pass. Dropout
    draws from `generator`, which torch's checkpoint does not rewind: the block rewinds it itself,
    so the recomputation draws what the forward pass drew."""
    from torch.utils.checkpoint import checkpoint

    start = generator.get_state() if generator is not None else None

    def forward(x: torch.Tensor) -> torch.Tensor:
        if generator is not None and start is not None:
            generator.set_state(start)
        return block(x, cos, sin, generator, mask)

    return checkpoint(forward, x, use_reentrant=False)


def record_mask(tokens: torch.Tensor, end_of_document: int) -> torch.Tensor:
    """(B, 1, T, T): position i attends to position j <= i of its own record only, a record
    ending at each end-of-document token. RoPE scores depend on relative positions alone, so a
    record computes in a packed window exactly as it would alone (to float rounding)."""
    ended = tokens == end_of_document  # (B, T)
    record = torch.cumsum(ended, dim=1) - ended.long()  # the end token belongs to its record
    same = record.unsqueeze(2) == record.unsqueeze(1)  # (B, T, T)
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).tril()
    return (same & causal).unsqueeze(1)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = make_norm(config)
        self.output = nn.Linear(config.dim, vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.embedding.weight
        # cos and sin by (length, device): computed once, not per forward (nor copied to a GPU
        # per forward); not parameters, so never in a checkpoint.
        self.rope: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.adapters: list[nn.Module] = []  # LoRA adapters (`lora.py`): they draw dropout too
        self.checkpointing = (
            False  # recompute each block in the backward pass (train.activation_checkpointing)
        )

    def rope_for(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if (length, device) not in self.rope:
            config = self.config
            cos, sin = rope_tables(head_dim(config), length, config.rope_theta, config.rope_scaling)
            self.rope[(length, device)] = (cos.to(device), sin.to(device))
        return self.rope[(length, device)]

    def forward(
        self, tokens: torch.Tensor, generator: torch.Generator | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (B, T, vocab) for tokens (B, T); `mask` (B, 1, T, T): which positions each may
        attend to (packed records, `record_mask`), else every earlier one."""
        cos, sin = self.rope_for(tokens.shape[1], tokens.device)
        for adapter in self.adapters:
            adapter.generator = generator
        x = dropout(self.embedding(tokens), self.config.dropout, generator)  # (B, T, C)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = recomputed(block, x, cos, sin, generator, mask)
            else:
                x = block(x, cos, sin, generator, mask)
        return self.output(self.norm(x))  # (B, T, vocab)

    @classmethod
    def build(cls, config: ModelConfig, vocab_size: int, generator: torch.Generator) -> Transformer:
        """A model on the CPU whose every weight comes from `generator`, and from nothing else.

        torch's layers initialize themselves from the global RNG when constructed; forking it keeps
        its state untouched, and `initialize` then overwrites every parameter. (Building on the meta
        device would avoid the wasted init, but its reference kernels import torch._dynamo, which
        costs seconds per process.)
        """
        with torch.random.fork_rng(devices=[]):
            model = cls(config, vocab_size)
        model.initialize(generator)
        return model

    @torch.no_grad()
    def initialize(self, generator: torch.Generator) -> None:
        """Deterministic init in parameter order; residual projections scaled by depth (GPT-2)."""
        residual_std = self.config.init_std / math.sqrt(2 * self.config.n_layers)
        for name, parameter in self.named_parameters():
            if parameter.dim() == 1:
                parameter.fill_(1.0) if name.endswith("weight") else parameter.zero_()
                continue
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else self.config.init_std
            values = torch.empty(parameter.shape, dtype=torch.float32)
            values.normal_(0.0, std, generator=generator)
            parameter.copy_(values)
