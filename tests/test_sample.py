"""`bt sample`: the key/value cache computes what the full forward does, the same seed gives the
same text, and an unbuilt plan is refused in one line."""

from __future__ import annotations

import torch
from conftest import MICRO, Reference, plan_hash, run_bt

from buildtrain.config.schema import ModelConfig
from buildtrain.steps.train.generate import KVCache, forward_cached, generate
from buildtrain.steps.train.model import Transformer


def random_model(**shape: object) -> Transformer:
    config = ModelConfig(
        **{"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 48, **shape}
    )
    return Transformer.build(config, 50, torch.Generator().manual_seed(0)).eval()


def test_the_cache_gives_the_logits_of_the_whole_sequence() -> None:
    for shape in ({}, {"norm": "layernorm", "mlp": "gelu", "n_kv_heads": 4}):
        model = random_model(**shape)
        tokens = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(1))
        cache = KVCache(len(model.blocks))
        steps = [forward_cached(model, tokens[:, :5], cache)]
        steps += [forward_cached(model, tokens[:, i : i + 1], cache) for i in range(5, 12)]
        with torch.no_grad():
            full = model(tokens)  # (1, 12, vocab)
        for index, logits in zip(range(4, 12), steps, strict=True):
            assert torch.allclose(logits[0], full[0, index], atol=1e-5), index


def test_greedy_generation_follows_the_argmax_of_the_full_forward() -> None:
    model = random_model()
    produced = generate(model, [3, 7], tokens=6, temperature=0.0, top_k=0, seed=0)
    sequence = [3, 7]
    for token in produced:
        with torch.no_grad():
            assert int(model(torch.tensor([sequence]))[0, -1].argmax()) == token
        sequence.append(token)


def test_the_same_seed_draws_the_same_tokens_and_another_seed_others() -> None:
    model = random_model()
    first = generate(model, [1], tokens=30, temperature=1.0, top_k=10, seed=5)
    assert first == generate(model, [1], tokens=30, temperature=1.0, top_k=10, seed=5)
    assert first != generate(model, [1], tokens=30, temperature=1.0, top_k=10, seed=6)


def test_bt_sample_is_deterministic_for_a_seed(micro_built: Reference) -> None:
    store, planned, _ = micro_built
    args = ("sample", planned[:12], "--prompt", "12+3", "--tokens", "24", "--seed", "3", "--top-k", "8")
    first, second = run_bt(*args, store=store), run_bt(*args, store=store)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.startswith("12+3")
    other = run_bt(*args[:-4], "--seed", "4", "--temperature", "1.5", store=store)
    assert other.returncode == 0 and other.stdout != first.stdout


def test_bt_sample_refuses_an_unbuilt_plan_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(MICRO), store=store))
    result = run_bt("sample", planned, store=store)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"bt sample: plan {planned[:12]} is not built yet; run: bt run {planned[:12]}"
    )
    bad = run_bt("sample", planned, "--temperature", "-1", store=store)
    assert bad.returncode == 2 and "must be >= 0" in bad.stderr
