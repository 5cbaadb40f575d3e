"""Models that the benchmarks measure buildtrain's Transformer against (benchmark code, never
imported by buildtrain).

- `nanogpt`: a nanoGPT-shaped GPT written for this project: LayerNorm, a GELU MLP of 4 x width,
  learned positions, tied embeddings, one fused q/k/v projection.
- `previous_layout`: buildtrain's Transformer as it was before issue 26: separate q, k and v
  projections, RoPE on interleaved channel pairs (strided even/odd views, stack and flatten), and
  `F.rms_norm` (on the CPU a chain of small kernels; on CUDA one fused kernel). It keeps the
  current embedding, MLP and output, so a comparison isolates the attention and norm layout.

torch is imported inside the functions: a benchmark's parent process never imports it.
"""

from __future__ import annotations

from typing import Any


def nanogpt(dim: int, layers: int, heads: int, seq_len: int, vocab: int) -> Any:
    """A GPT with nanoGPT's shape and torch's default initialization (the global RNG)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
            self.fc, self.out = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.shape
            q, k, v = self.attn(self.ln_1(x)).split(dim, dim=2)
            q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.tokens.weight

        def forward(self, idx: torch.Tensor, _generator: Any = None) -> torch.Tensor:
            x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))  # (B, T, vocab)

    return GPT()


def previous_layout(config: Any, vocab: int, generator: Any) -> Any:
    """buildtrain's Transformer with the attention and RMSNorm of before issue 26, every weight
    drawn from `generator` as `Transformer.build` draws them."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from buildtrain.steps.train.model import Transformer

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.eps, self.weight = config.norm_eps, nn.Parameter(torch.ones(config.dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
            self.head_dim = config.dim // config.n_heads
            self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
            self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
            self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

        def forward(
            self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
        ) -> torch.Tensor:
            # the blocks pass `mask` since packed records attend within their own record; the
            # benchmarks give none, so the causal kernel runs as before
            B, T, _ = x.shape
            half = self.head_dim // 2  # today's tables (T, 1, hs) hold the old (T, hs / 2) ones
            cos, sin = cos[:, 0, :half], sin[:, 0, half:]
            q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
            k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
            v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            gqa = self.n_heads != self.n_kv_heads
            if mask is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)

    with torch.random.fork_rng(devices=[]):
        model = Transformer(config, vocab)
        for block in model.blocks:
            block.attention = Attention()
            if config.norm == "rmsnorm":
                block.attention_norm, block.ffn_norm = RMSNorm(), RMSNorm()
        if config.norm == "rmsnorm":
            model.norm = RMSNorm()
    model.initialize(generator)
    return model
