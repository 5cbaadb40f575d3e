"""`bt sample`: the key/value cache computes what the full forward does, the same seed gives the
same text, greedy sampling gives transformers' greedy text from the hf/ export (one prompt
convention), it says why it stopped, and every bad option or prompt is one line with exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers
from conftest import MICRO, Reference, plan_hash, run_bt
from test_hf_export import SHAPES, export_random_model
from tokenizers import Tokenizer

from buildtrain.config.schema import ModelConfig
from buildtrain.steps.sample import prompt_ids
from buildtrain.steps.train.generate import KVCache, forward_cached, generate
from buildtrain.steps.train.model import Transformer

os.environ["HF_HUB_OFFLINE"] = "1"


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


@pytest.mark.parametrize(("norm", "mlp", "heads", "kv_heads", "tie"), SHAPES[::2])
def test_greedy_sampling_continues_a_prompt_as_transformers_does(
    tmp_path: Path, norm: str, mlp: str, heads: int, kv_heads: int, tie: bool
) -> None:
    """One convention: the prompt's ids are the exported tokenizer's, nothing in front."""
    config = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_hidden=48,
        mlp=mlp,
        norm=norm,
        tie_embeddings=tie,
    )
    ours = export_random_model(tmp_path, config, seed=heads + kv_heads)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for prompt in ("Ada had a", "12+3"):
        ids = prompt_ids(Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")), prompt, 256, 64)
        expected = hf_tokenizer(prompt, return_tensors="pt").input_ids
        assert ids == expected[0].tolist()
        produced = generate(ours, ids, tokens=12, temperature=0.0, top_k=0, seed=0, stop=256)
        generated = theirs.generate(expected, max_new_tokens=12, do_sample=False, pad_token_id=256)
        assert produced == generated[0, len(ids) :].tolist()[: len(produced)], (norm, mlp, prompt)


def test_an_empty_prompt_starts_from_the_end_of_document_token(tmp_path: Path) -> None:
    export_random_model(tmp_path, ModelConfig(), seed=0)
    tokenizer = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert prompt_ids(tokenizer, "", 256, 64) == [256]
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.bos_token_id == 256


def test_bt_sample_prints_what_transformers_generates(micro_built: Reference, tmp_path: Path) -> None:
    store, planned, _ = micro_built
    result = run_bt(
        "sample", planned[:12], "--prompt", "12+3", "--tokens", "10", "--temperature", "0", store=store
    )
    assert result.returncode == 0, result.stderr
    exported = run_bt("export", planned, str(tmp_path / "out"), store=store, cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out" / "hf")
    ids = tokenizer("12+3", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert result.stdout == tokenizer.decode(out[0], skip_special_tokens=True) + "\n"


def test_bt_sample_says_why_it_stopped(micro_built: Reference) -> None:
    store, planned, _ = micro_built
    # micro's context is 32 tokens: 4 of prompt leave room for 28
    long = run_bt("sample", planned[:12], "--prompt", "12+3", "--tokens", "2147483647", store=store)
    assert long.returncode == 0, long.stderr
    assert long.stderr.strip() == (
        "bt sample: stopped at the model's context of 32 tokens (4 of prompt, 28 generated; "
        "--tokens asked for 2147483647)"
    )
    short = run_bt("sample", planned[:12], "--prompt", "12+3", "--tokens", "5", store=store)
    assert short.returncode == 0 and short.stderr == ""
    for seed in range(40):  # some seed draws the end-of-document token before 28 tokens
        result = run_bt(
            "sample", planned[:12], "--tokens", "28", "--seed", str(seed), "--temperature", "3", store=store
        )
        if result.stderr:
            assert result.stderr.startswith("bt sample: stopped at an end-of-document token after "), (
                result.stderr
            )
            assert result.stderr.rstrip().endswith(" of 28 tokens")
            break
    else:
        raise AssertionError("no seed drew the end-of-document token")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--temperature", "1e-39"),
            "argument --temperature: must be 0 (greedy) or in 0.001..1000, got 1e-39",
        ),
        (("--temperature", "nan"), "argument --temperature: must be >= 0, got nan"),
        (("--seed", "99999999999999999999999"), "argument --seed: must be in 0..2**64-1"),
        (("--seed", "-1"), "argument --seed: must be in 0..2**64-1"),
        (("--prompt", "\udcff\udcfe"), "--prompt is not UTF-8 text (byte 0xff at position 0)"),
        (("--prompt", "1" * 120_000), "--prompt is 120000 tokens; the model's context is 32 tokens"),
        (("--prompt", "1" * 32), "give a prompt of at most 31 tokens"),
    ],
)
def test_bad_sampling_options_are_one_line(
    micro_built: Reference, args: tuple[str, ...], message: str
) -> None:
    store, planned, _ = micro_built
    result = run_bt("sample", planned[:12], *args, store=store, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stdout == ""


def test_sample_verify_and_export_take_a_preset_path(micro_built: Reference, tmp_path: Path) -> None:
    store, planned, _ = micro_built
    by_hash = run_bt("sample", planned, "--seed", "2", store=store)
    by_preset = run_bt("sample", str(MICRO), "--seed", "2", store=store)
    assert by_preset.returncode == 0, by_preset.stderr
    assert by_preset.stdout == by_hash.stdout
    exported = run_bt("export", str(MICRO), str(tmp_path / "out"), store=store)
    assert exported.returncode == 0 and (tmp_path / "out" / "model.safetensors").is_file(), exported.stderr
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(f'extends = "{MICRO}"\n[sweep]\n"train.lr" = [1e-3, 2e-3]\n')
    # In a store of its own: planning the sweep stores its plans, which the session's shared store
    # must not gain (bt gc and fsck tests read it).
    (tmp_path / "sweep-store").mkdir()
    refused = run_bt("verify", str(sweep), store=tmp_path / "sweep-store" / ".bt")
    assert refused.returncode == 2 and "is a sweep of 2 plans; give one of their hashes" in refused.stderr
