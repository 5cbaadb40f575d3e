"""Sampling from a trained `Transformer` with a key/value cache.

The prompt is run once (prefill); each new token then attends to the cached keys and values of all
earlier positions, so a token costs one position's work, not the whole sequence's. Randomness comes
only from the generator seeded with the caller's seed: the same seed, weights and prompt give the
same tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from buildtrain.steps.train.model import Transformer


class KVCache:
    """Keys and values of every position so far, per block: each (B, nkv, T, hs)."""

    def __init__(self, layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat((old_k, k), dim=2)
        self.values[layer] = v if old_v is None else torch.cat((old_v, v), dim=2)
        return self.keys[layer], self.values[layer]  # type: ignore[return-value]


@torch.no_grad()
def forward_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, vocab) after `tokens` (B, T), which follow the cache's positions. Either a
    prefill (empty cache, any T) or one token at a time (T = 1): the two shapes whose causal mask
    SDPA expresses directly."""
    B, T = tokens.shape
    start = cache.length
    assert start == 0 or T == 1, "prefill once, then one token at a time"
    cos, sin = model.rope_for(start + T, tokens.device)
    cos, sin = cos[start:], sin[start:]
    x = model.embedding(tokens)  # (B, T, C)
    for layer, block in enumerate(model.blocks):
        attention = block.attention
        h = block.attention_norm(x)
        q, k, v = attention.qkv(h, cos, sin)  # (B, nh, T, hs), (B, nkv, T, hs) twice
        k, v = cache.extend(layer, k, v)  # (B, nkv, start + T, hs)
        gqa = attention.n_heads != attention.n_kv_heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0, enable_gqa=gqa)  # (B, nh, T, hs)
        x = x + attention.wo(y.transpose(1, 2).reshape(B, T, -1))
        x = x + block.ffn(block.ffn_norm(x))
    cache.length = start + T
    return model.output(model.norm(x[:, -1]))  # (B, vocab)


def pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """The next token of one sequence: greedy at temperature 0, else drawn from the tempered
    distribution over the `top_k` likeliest tokens (all when 0)."""
    if temperature == 0.0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        threshold = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    stop: int | None = None,
) -> list[int]:
    """Up to `tokens` new token ids after `prompt` (not empty), ending early at `stop`."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device  # an eval step on a GPU generates there
    cache = KVCache(len(model.blocks))
    logits = forward_cached(model, torch.tensor([prompt], device=device), cache)
    produced: list[int] = []
    for _ in range(tokens):
        token = pick(logits[0], temperature, top_k, generator)
        if token == stop:
            break
        produced.append(token)
        logits = forward_cached(model, torch.tensor([[token]], device=device), cache)
    return produced
