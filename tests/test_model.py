"""The transformer: parameter count agrees with `config.shape`, shapes, causality, seeded init, dropout,
the hand-written RMSNorm and RoPE against their definitions; and the held-out evaluation that runs it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.config.schema import BYTE_VOCAB_SIZE, EvalConfig, ModelConfig
from buildtrain.config.shape import parameter_count
from buildtrain.errors import StepFailed
from buildtrain.steps.train.batches import TokenStream
from buildtrain.steps.train.heldout import evaluate
from buildtrain.steps.train.model import RMSNormFunction, RotaryQKV, Transformer, dropout, rope_tables


def seeded(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def tiny(**overrides: object) -> ModelConfig:
    settings_ = {"dim": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 24, **overrides}
    return ModelConfig(**settings_)  # type: ignore[arg-type]


def built(config: ModelConfig, seed: int = 0, vocab: int = BYTE_VOCAB_SIZE) -> Transformer:
    model = Transformer(config, vocab)
    model.initialize(seeded(seed))
    return model


@st.composite
def model_configs(draw: st.DrawFn) -> ModelConfig:
    n_heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    mlp, norm = draw(st.sampled_from(["swiglu", "gelu"])), draw(st.sampled_from(["rmsnorm", "layernorm"]))
    return ModelConfig(
        dim=n_heads * head_dim,
        head_dim=draw(st.sampled_from([0, 6])),  # a head size of its own (qwen3), or dim / n_heads
        n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads,
        n_kv_heads=draw(st.sampled_from([d for d in (1, 2, 4) if n_heads % d == 0])),
        ffn_hidden=draw(st.integers(1, 40)),
        mlp=mlp,
        norm=norm,
        tie_embeddings=draw(st.booleans()),
        qkv_bias=draw(st.booleans()),
        qk_norm=(norm, mlp) == ("rmsnorm", "swiglu") and draw(st.booleans()),
    )


@pytest.mark.parametrize(
    "config",
    [
        tiny(),
        tiny(mlp="gelu", norm="layernorm"),
        tiny(tie_embeddings=False),
        tiny(dim=32, n_heads=8, n_kv_heads=1),
        tiny(dim=32, n_heads=4, n_kv_heads=4, mlp="gelu", tie_embeddings=False, norm="layernorm"),
    ],
    ids=["default", "gelu-layernorm", "untied", "gqa-8-to-1", "mha-untied"],
)
def test_parameter_count_matches_the_real_model(config: ModelConfig) -> None:
    model = Transformer(config, BYTE_VOCAB_SIZE)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())


@settings(max_examples=40, deadline=None)
@given(config=model_configs(), vocab=st.integers(2, 300))
def test_parameter_count_matches_for_any_config(config: ModelConfig, vocab: int) -> None:
    model = Transformer(config, vocab)
    assert parameter_count(config, vocab) == sum(p.numel() for p in model.parameters())


def test_forward_gives_logits_per_position() -> None:
    model = built(tiny())
    tokens = torch.randint(0, BYTE_VOCAB_SIZE, (3, 7), generator=seeded(1))
    logits = model(tokens)
    assert logits.shape == (3, 7, BYTE_VOCAB_SIZE)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("config", [tiny(), tiny(mlp="gelu", norm="layernorm", n_kv_heads=4)])
def test_forward_is_causal(config: ModelConfig) -> None:
    model = built(config)
    tokens = torch.randint(0, BYTE_VOCAB_SIZE, (2, 9), generator=seeded(2))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % BYTE_VOCAB_SIZE
    before, after = model(tokens), model(changed)
    # Earlier positions cannot see a later token (tolerance only for kernel blocking, not leakage).
    assert torch.allclose(before[:, :6], after[:, :6], rtol=0.0, atol=1e-6)
    assert (before[:, 6:] - after[:, 6:]).abs().max() > 1e-4


def test_tied_embeddings_share_one_tensor() -> None:
    tied, untied = built(tiny()), built(tiny(tie_embeddings=False))
    assert tied.output.weight is tied.embedding.weight
    assert not torch.equal(untied.output.weight, untied.embedding.weight)


def test_initialize_with_equal_seeds_gives_identical_weights_whatever_the_global_rng() -> None:
    with torch.random.fork_rng():  # leave the global RNG of the test session as it was
        torch.manual_seed(1)
        one = built(tiny(), seed=5)
        torch.manual_seed(2)  # construction draws from the global RNG; initialize must overwrite it all
        two = built(tiny(), seed=5)
    names = [name for name, _ in one.named_parameters()]
    assert names == [name for name, _ in two.named_parameters()]
    for (name, a), (_, b) in zip(one.named_parameters(), two.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_initialize_with_different_seeds_differs_in_every_matrix() -> None:
    one, two = built(tiny(), seed=5), built(tiny(), seed=6)
    for (name, a), (_, b) in zip(one.named_parameters(), two.named_parameters(), strict=True):
        if a.dim() >= 2:
            assert not torch.equal(a, b), name
        else:
            assert torch.equal(a, b), name  # gains are ones, biases zeros, whatever the seed


def test_initialize_does_not_touch_the_global_rng() -> None:
    model = Transformer(tiny(), BYTE_VOCAB_SIZE)
    state = torch.get_rng_state()
    model.initialize(seeded(0))
    assert torch.equal(torch.get_rng_state(), state)


def test_initialize_uses_the_configured_scales() -> None:
    config = tiny(dim=32, n_heads=4, ffn_hidden=64, n_layers=2, init_std=0.05, norm="layernorm")
    model = built(config)
    embedding_std = model.embedding.weight.std().item()
    residual_std = model.blocks[0].attention.wo.weight.std().item()
    assert embedding_std == pytest.approx(0.05, rel=0.1)
    assert residual_std == pytest.approx(0.05 / 2.0, rel=0.2)  # init_std / sqrt(2 * n_layers)
    assert torch.equal(model.norm.weight, torch.ones(32)) and torch.equal(model.norm.bias, torch.zeros(32))


def test_dropout_without_generator_is_the_identity() -> None:
    x = torch.randn(4, 5, generator=seeded(0))
    assert dropout(x, 0.5, None) is x
    assert dropout(x, 0.0, seeded(1)) is x
    config = tiny(dropout=0.3)
    with_dropout, without = built(config, seed=3), built(tiny(), seed=3)
    tokens = torch.randint(0, BYTE_VOCAB_SIZE, (2, 6), generator=seeded(4))
    assert torch.equal(with_dropout(tokens), without(tokens))  # no generator: evaluation, no dropout


def test_dropout_with_a_seeded_generator_is_reproducible() -> None:
    x = torch.randn(64, 64, generator=seeded(0))
    one, two = dropout(x, 0.25, seeded(9)), dropout(x, 0.25, seeded(9))
    assert torch.equal(one, two)
    assert not torch.equal(one, dropout(x, 0.25, seeded(10)))
    kept = one != 0
    assert torch.allclose(one[kept], x[kept] / 0.75)
    assert 0.6 < kept.float().mean().item() < 0.9

    model = built(tiny(dropout=0.3), seed=3)
    tokens = torch.randint(0, BYTE_VOCAB_SIZE, (2, 6), generator=seeded(4))
    a, b = model(tokens, seeded(11)), model(tokens, seeded(11))
    assert torch.equal(a, b)
    assert not torch.equal(a, model(tokens, seeded(12)))
    assert not torch.equal(a, model(tokens))


def test_dropout_leaves_the_global_rng_alone() -> None:
    model = built(tiny(dropout=0.3))
    tokens = torch.randint(0, BYTE_VOCAB_SIZE, (2, 6), generator=seeded(4))
    state = torch.get_rng_state()
    model(tokens, seeded(1))
    assert torch.equal(torch.get_rng_state(), state)


def heldout_stream(folder: Path, tokens: int) -> TokenStream:
    values = [(i * 31 + 7) % BYTE_VOCAB_SIZE for i in range(tokens)]
    (folder / "heldout-00000.bin").write_bytes(b"".join(v.to_bytes(2, "little") for v in values))
    return TokenStream(folder, {"shards": [{"file": "heldout-00000.bin", "tokens": tokens}]})


def test_heldout_loss_is_the_mean_cross_entropy_over_consecutive_windows(tmp_path: Path) -> None:
    model, stream = built(tiny()), heldout_stream(tmp_path, 50)
    result = evaluate(model, stream, EvalConfig(seq_len=8, batch_size=4), torch.device("cpu"))
    windows = torch.stack([stream.read(i * 8, 9) for i in range(6)])  # (50 - 1) // 8 = 6 windows
    with torch.no_grad():
        logits = model(windows[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten()).item()
    assert result["tokens"] == 48
    assert result["loss"] == pytest.approx(expected, rel=1e-6)
    assert result["bits_per_token"] == pytest.approx(result["loss"] / math.log(2))
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    limited = evaluate(model, stream, EvalConfig(seq_len=8, batch_size=2, max_batches=1), torch.device("cpu"))
    assert limited["tokens"] == 16
    assert evaluate(model, stream, EvalConfig(seq_len=8, batch_size=4), torch.device("cpu")) == result


def test_heldout_split_shorter_than_a_window_fails_clearly(tmp_path: Path) -> None:
    stream = heldout_stream(tmp_path, 8)
    with pytest.raises(StepFailed, match=r"held-out split has 8 tokens, fewer than eval.seq_len \+ 1 = 9"):
        evaluate(built(tiny()), stream, EvalConfig(seq_len=8), torch.device("cpu"))


def test_build_never_draws_from_the_global_generator() -> None:
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    config = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48)
    first = Transformer.build(config, BYTE_VOCAB_SIZE, seeded(7))
    assert torch.equal(torch.get_rng_state(), before)
    second = Transformer.build(config, BYTE_VOCAB_SIZE, seeded(7))
    assert first.output.weight is first.embedding.weight
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def rms_norm_by_definition(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_rms_norm_function_computes_the_definition_and_its_gradient(rows: int, width: int, seed: int) -> None:
    generator = seeded(seed)
    x = torch.randn(2, rows, width, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(width, generator=generator, dtype=torch.float64, requires_grad=True)
    ours = RMSNormFunction.apply(x, weight, 1e-5)
    assert torch.allclose(ours, rms_norm_by_definition(x, weight, 1e-5), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFunction.apply(x, w, 1e-5), (x, weight))


def test_rms_norm_function_agrees_with_torch_in_float32() -> None:
    x = torch.randn(8, 64, 96, generator=seeded(3), requires_grad=True)
    weight = torch.rand(96, generator=seeded(4)).add(0.5).requires_grad_()
    grad = torch.randn(8, 64, 96, generator=seeded(5))
    ours = RMSNormFunction.apply(x, weight, 1e-5)
    ours_grads = torch.autograd.grad(ours, (x, weight), grad)
    theirs = F.rms_norm(x, (96,), weight, 1e-5)
    theirs_grads = torch.autograd.grad(theirs, (x, weight), grad)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    for mine, reference in zip(ours_grads, theirs_grads, strict=True):
        assert torch.allclose(mine, reference, rtol=1e-4, atol=1e-5)


def rotary(qkv: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """q, k and v (B, T, heads, hs), as the projection (B, T, heads, hs) lays them out."""
    cos, sin = rope_tables(qkv.shape[-1], qkv.shape[1], 100.0)
    q, k, v = RotaryQKV.apply(qkv, cos.to(qkv.dtype), sin.to(qkv.dtype), n_heads, n_kv_heads)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def test_rotary_qkv_rotates_channel_i_with_channel_i_plus_half_and_passes_v_through() -> None:
    qkv = torch.randn(2, 5, 4 + 2 * 2, 8, generator=seeded(0), dtype=torch.float64)
    q, k, v = rotary(qkv, 4, 2)
    position, pair = 3, 1  # the angle of pair i at position t is t * 100 ** (-2i / hs)
    angle = position * 100.0 ** (-2 * pair / 8)
    x = torch.complex(qkv[:, position, :6, pair], qkv[:, position, :6, pair + 4])
    turned = x * complex(math.cos(angle), math.sin(angle))
    rotated = torch.cat((q, k), dim=2)[:, position]
    assert torch.allclose(rotated[:, :, pair], turned.real) and torch.allclose(
        rotated[:, :, pair + 4], turned.imag
    )
    assert torch.equal(v, qkv[:, :, 6:])


@settings(max_examples=20, deadline=None)
@given(shift=st.integers(0, 10), seed=st.integers(0, 2**16))
def test_rotated_scores_depend_only_on_the_distance_between_positions(shift: int, seed: int) -> None:
    """RoPE's law: a query at m and a key at n score as if the same vectors sat at m - n and 0."""
    vector = torch.randn(2, 8, generator=seeded(seed), dtype=torch.float64)
    qkv = torch.zeros(1, 16, 3, 8, dtype=torch.float64)
    qkv[0, 5 + shift, 0], qkv[0, shift, 1] = vector[0], vector[1]  # query at 5 + shift, key at shift
    q, k, _ = rotary(qkv, 1, 1)
    qkv_near = torch.zeros(1, 16, 3, 8, dtype=torch.float64)
    qkv_near[0, 5, 0], qkv_near[0, 0, 1] = vector[0], vector[1]
    q_near, k_near, _ = rotary(qkv_near, 1, 1)
    score = (q[0, 5 + shift, 0] * k[0, shift, 0]).sum()
    # the tables are float32, so the angles agree to float32 rounding
    assert torch.allclose(score, (q_near[0, 5, 0] * k_near[0, 0, 0]).sum(), rtol=1e-5, atol=1e-6)


def test_rotary_qkv_gradient_is_the_gradient_of_its_forward() -> None:
    qkv = torch.randn(2, 5, 2 + 2 * 1, 6, generator=seeded(1), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rotary(t, 2, 1), (qkv,))
