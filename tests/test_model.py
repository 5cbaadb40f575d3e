"""The transformer: parameter count agrees with `config.shape`, shapes, causality, seeded init, dropout;
and the held-out evaluation that runs it."""

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
from buildtrain.steps.heldout import evaluate
from buildtrain.steps.train.batches import TokenStream
from buildtrain.steps.train.model import Transformer, dropout


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
    return ModelConfig(
        dim=n_heads * head_dim,
        n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads,
        n_kv_heads=draw(st.sampled_from([d for d in (1, 2, 4) if n_heads % d == 0])),
        ffn_hidden=draw(st.integers(1, 40)),
        mlp=draw(st.sampled_from(["swiglu", "gelu"])),
        norm=draw(st.sampled_from(["rmsnorm", "layernorm"])),
        tie_embeddings=draw(st.booleans()),
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
