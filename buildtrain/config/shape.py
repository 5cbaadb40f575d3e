"""The model's arithmetic without torch: head sizes, parameter count, memory of a training update.

One home for these numbers, so that pre-flight (which must not import torch), the executor's
choice of ranks and the model itself agree; a test builds the real model and compares.
"""

from __future__ import annotations

import attrs

from buildtrain.config.schema import BYTE_VOCAB_SIZE, DataConfig, ModelConfig, TokenizerConfig, TrainConfig

FLOAT32_BYTES = 4
GIB = 1 << 30


def head_dim(model: ModelConfig) -> int:
    """Channels per attention head (query, key and value alike)."""
    return model.head_dim or model.dim // model.n_heads


def parameter_count(model: ModelConfig, vocab_size: int = BYTE_VOCAB_SIZE) -> int:
    """Parameters of `steps.train.model.Transformer(model, vocab_size)`: tied weights count once."""
    q_dim, kv_dim = model.n_heads * head_dim(model), model.n_kv_heads * head_dim(model)
    norm = model.dim * (2 if model.norm == "layernorm" else 1)  # LayerNorm has a bias, RMSNorm not
    attention = model.dim * q_dim * 2 + model.dim * kv_dim * 2  # wqkv (q part), wo; wqkv (k and v parts)
    attention += (q_dim + 2 * kv_dim) if model.qkv_bias else 0
    attention += 2 * head_dim(model) if model.qk_norm else 0
    mlp = model.dim * model.ffn_hidden * (3 if model.mlp == "swiglu" else 2)
    block = attention + mlp + 2 * norm
    vocab_size = model.vocab_size or vocab_size  # a checkpoint's embedding has its own rows
    embeddings = vocab_size * model.dim * (1 if model.tie_embeddings else 2)
    return embeddings + model.n_layers * block + norm


def gradient_vectors(train: TrainConfig) -> int:
    """Gradient-sized float32 buffers an update holds at its peak: the gradient itself, plus for
    the invariant reduction one partial sum per level of its tree and the newest micro-batch's."""
    if train.reduction == "allreduce":
        return 1
    micro_batches = train.batch_size // train.micro_batch_size
    return 2 + max(0, micro_batches - 1).bit_length()


@attrs.frozen
class RankMemory:
    """Bytes one rank holds at the peak of an update, by kind (pre-flight names each)."""

    weights: int
    gradients: int  # with the reduction's partial sums
    optimizer: int  # the two AdamW moments
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        parts = zip(("weights", "gradients", "AdamW state", "activations"), attrs.astuple(self), strict=True)
        return ", ".join(f"{name} {size / GIB:,.2f}" for name, size in parts)


def largest_unit(model: ModelConfig, vocab_size: int) -> int:
    """Parameters of the largest unit FSDP2 gathers whole for its forward and backward: one block,
    or the root (embeddings, output, final norm)."""
    one, two = (parameter_count(attrs.evolve(model, n_layers=n), vocab_size) for n in (1, 2))
    block = two - one
    return max(block, one - block)


def rank_memory(
    model: ModelConfig, train: TrainConfig, vocab_size: int = BYTE_VOCAB_SIZE, world_size: int = 1
) -> RankMemory:
    """Float32 weights, gradients (and the reduction's partial sums), two AdamW moments and one
    micro-batch of activations, on one rank of `world_size`.

    Unsharded, every rank holds the whole state. Sharded (FSDP2), a rank holds 1/world_size of
    it, plus up to two units gathered whole (the one computing and the one prefetched), their
    gradients and the exchange's buffer of one unit. Activation checkpointing keeps each block's
    input and one block's activations at a time.
    """
    parameters = parameter_count(model, vocab_size) * FLOAT32_BYTES
    tokens = train.micro_batch_size * train.seq_len
    per_layer = (
        tokens * (12 * model.dim + 3 * model.ffn_hidden)
        + train.micro_batch_size * model.n_heads * train.seq_len**2 * 2
    ) * FLOAT32_BYTES
    logits = tokens * (model.vocab_size or vocab_size) * 3 * FLOAT32_BYTES
    if train.activation_checkpointing:
        blocks = model.n_layers * tokens * model.dim * FLOAT32_BYTES + per_layer
    else:
        blocks = model.n_layers * per_layer
    if train.sharding != "fsdp":
        return RankMemory(parameters, parameters * gradient_vectors(train), 2 * parameters, blocks + logits)
    shard = -(-parameters // world_size)
    unit = largest_unit(model, vocab_size) * FLOAT32_BYTES
    return RankMemory(
        weights=shard + 2 * unit,
        gradients=shard * (gradient_vectors(train) - 1) + 2 * unit,
        optimizer=2 * shard,
        activations=blocks + logits,
    )


def memory_estimate(
    model: ModelConfig, train: TrainConfig, vocab_size: int = BYTE_VOCAB_SIZE, world_size: int = 1
) -> int:
    """Bytes one rank needs at the peak of an update (`rank_memory`, in total)."""
    return rank_memory(model, train, vocab_size, world_size).total


def planned_vocab_size(data: DataConfig) -> int:
    """The vocabulary a stage will train with, as far as the preset says: a trained BPE's size;
    bytes otherwise (a given tokenizer file's size is known only once the step reads it)."""
    tokenizer = data.tokenizer
    if isinstance(tokenizer, TokenizerConfig) and tokenizer.kind == "bpe":
        return tokenizer.vocab_size
    return BYTE_VOCAB_SIZE
