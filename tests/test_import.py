"""model.init = { hf = "folder" }: a Hugging Face checkpoint imported by content (the import_hf
step), computing transformers' logits (float32, CPU, within 1e-5) for llama, mistral and qwen2,
GQA or not, tied or not; and every checkpoint it cannot hold refused in one line."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import blake3
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from checkpoints import make_checkpoint
from conftest import plan_hash, run_bt
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.config.convert import converter
from buildtrain.config.schema import ModelConfig
from buildtrain.errors import StepFailed
from buildtrain.plan.stored import load_plan
from buildtrain.steps.export.hf import ARCHITECTURES, hf_name, split_qkv, write_tensors
from buildtrain.steps.import_hf.step import (
    STREAM_CHUNK,
    buildtrain_layout,
    copy_weights,
    expected_shapes,
    read_header,
    read_headers,
    weights_digests,
)
from buildtrain.steps.sources import Source, SourceReader
from buildtrain.steps.train.model import Transformer
from buildtrain.steps.train.state import load_model
from buildtrain.store.store import Store
from buildtrain.store.tensors import combine, safetensors_digests

os.environ["HF_HUB_OFFLINE"] = "1"
TOLERANCE = 1e-5

CASES = [
    # architecture, heads, kv_heads, tie
    ("llama", 4, 2, False),
    ("llama", 4, 4, True),
    ("mistral", 4, 1, False),
    ("mistral", 2, 2, True),
    ("qwen2", 4, 2, False),
    ("qwen2", 4, 4, True),
]
PRESET = """\
name = "imported"
[model]
init = {{ hf = "{folder}" }}
{extra}
[data]
source = "files"
files = ["text/*.txt"]
split_block = 64
heldout_fraction = 0.2
[train]
steps = 4
seq_len = 32
batch_size = 4
micro_batch_size = 2
warmup_steps = 1
checkpoint_every = 2
[eval]
seq_len = 32
batch_size = 2
max_batches = 2
"""


def write_preset(root: Path, folder: str = "checkpoint", extra: str = "") -> Path:
    (root / "text").mkdir(exist_ok=True)
    (root / "text" / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (root / "text" / "b.txt").write_text("12 + 34 = 46\n" * 60)
    preset = root / "imported.toml"
    preset.write_text(PRESET.format(folder=folder, extra=extra))
    return preset


def imported(store: Path, plan: str) -> tuple[Transformer, dict]:
    """The import step's weights in buildtrain's model, and the plan's resolved model config."""
    loaded = load_plan(Store(store), plan)
    (step,) = [s for s in loaded.steps if s.label == "import_hf"]
    settings = converter.structure(loaded.config["model"], ModelConfig)
    model = Transformer.build(settings, settings.vocab_size, torch.Generator())
    load_model(model, Store(store).outputs.path(step.hash) / "model.safetensors")
    return model.eval(), loaded.config["model"]


@pytest.mark.parametrize(("architecture", "heads", "kv_heads", "tie"), CASES)
def test_imported_weights_compute_transformers_logits(
    tmp_path: Path, architecture: str, heads: int, kv_heads: int, tie: bool
) -> None:
    reference = make_checkpoint(tmp_path / "checkpoint", architecture, heads, kv_heads, tie)
    preset = write_preset(tmp_path)
    store = tmp_path / ".bt"
    plan = plan_hash(run_bt("plan", str(preset), store=store))
    built = run_bt("run", plan, "--target", "import_hf", store=store)
    assert built.returncode == 0, built.stderr
    model, settings = imported(store, plan)
    assert (settings["n_heads"], settings["n_kv_heads"], settings["tie_embeddings"]) == (heads, kv_heads, tie)
    assert settings.get("qkv_bias", False) == (architecture == "qwen2")
    tokens = torch.randint(0, settings["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        theirs = reference(tokens).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_bf16_checkpoints_are_widened_exactly(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "checkpoint", "llama", dtype=torch.bfloat16)
    store = tmp_path / ".bt"
    plan = plan_hash(run_bt("plan", str(write_preset(tmp_path)), store=store))
    assert run_bt("run", plan, "--target", "import_hf", store=store).returncode == 0
    model, _ = imported(store, plan)
    given = safetensors.torch.load_file(str(tmp_path / "checkpoint" / "model.safetensors"))
    assert torch.equal(model.embedding.weight, given["model.embed_tokens.weight"].float())
    # the digest the step recorded (from its arrays) is the digest of the file it wrote
    (step,) = [s for s in load_plan(Store(store), plan).steps if s.label == "import_hf"]
    output = Store(store).outputs.path(step.hash)
    recorded = json.loads((output / "result.json").read_text())["digests"]["weights"]
    assert recorded == combine(safetensors_digests(output / "model.safetensors"))


def test_the_import_is_keyed_by_content_not_by_path(tmp_path: Path) -> None:
    """A copy of the checkpoint elsewhere plans the same steps; one changed byte does not."""
    make_checkpoint(tmp_path / "checkpoint", "qwen2")
    shutil.copytree(tmp_path / "checkpoint", tmp_path / "moved")
    store = tmp_path / ".bt"
    first = plan_hash(run_bt("plan", str(write_preset(tmp_path)), store=store))
    second = plan_hash(run_bt("plan", str(write_preset(tmp_path, "moved")), store=store))
    assert first == second
    config = tmp_path / "moved" / "generation_config.json"
    config.write_text(config.read_text().replace("{", '{"x": 1, ', 1))
    changed = plan_hash(run_bt("plan", str(write_preset(tmp_path, "moved")), store=store))
    assert changed != first
    diff = run_bt("diff", first, changed, store=store)
    assert "base checkpoint changed" in diff.stdout + diff.stderr, diff.stdout


def _refused(tmp_path: Path, extra: str = "") -> str:
    result = run_bt("plan", str(write_preset(tmp_path, extra=extra)), store=tmp_path / ".bt")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    problems = [line for line in result.stderr.strip().splitlines() if not line.startswith("bt plan:")]
    assert len(problems) == 1, result.stderr  # one line, then bt's count of problems
    return problems[0]


def test_a_preset_that_contradicts_the_checkpoint_is_refused_by_key(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "checkpoint", "llama")
    line = _refused(tmp_path, "dim = 64")
    assert "model.dim" in line and "hidden_size" in line and "imported.toml" in line


def test_another_architecture_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "checkpoint", "llama")
    config = tmp_path / "checkpoint" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "gpt2"}))
    assert "model_type 'gpt2' is not supported" in _refused(tmp_path)


def test_pickle_only_weights_are_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "checkpoint", "llama")
    folder = tmp_path / "checkpoint"
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    assert "pickle" in _refused(tmp_path) and "pytorch_model.bin" in _refused(tmp_path)


def test_a_missing_shard_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "checkpoint", "llama")
    folder = tmp_path / "checkpoint"
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model.safetensors"},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    line = _refused(tmp_path)
    assert "model-00001-of-00002.safetensors" in line and "missing" in line


def test_an_unsupported_dtype_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "checkpoint", "llama")
    weights = tmp_path / "checkpoint" / "model.safetensors"
    tensors = safetensors.torch.load_file(str(weights))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float64)
    safetensors.torch.save_file(tensors, str(weights))
    line = _refused(tmp_path)
    assert "model.norm.weight is F64" in line


def import_files(paths: list[Path], model: dict, out: Path, chunk: int = STREAM_CHUNK) -> None:
    """The import step's weights file from checkpoint shards, each read as a planned source."""
    with contextlib.ExitStack() as opened:
        readers = [opened.enter_context(SourceReader(planned(path))) for path in paths]
        copy_weights(readers, buildtrain_layout(read_headers(readers), model), out, chunk)


def planned(path: Path) -> Source:
    raw = path.read_bytes()
    return Source(path=path, blake3=blake3.blake3(raw).hexdigest(), size=len(raw))


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.sampled_from([(2, 1), (2, 2), (4, 2), (4, 1)]),
    tie=st.booleans(),
    bias=st.booleans(),
    shards=st.integers(1, 3),
    chunk=st.integers(1, 3000),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_import_inverts_the_export(
    layers: int, heads: tuple[int, int], tie: bool, bias: bool, shards: int, chunk: int, seed: int
) -> None:
    """Law: buildtrain's weights exported under transformers' names (hf_export), saved by the
    safetensors library in one to three shards, and imported back (import_hf, streamed through a
    buffer of any size) are the file `write_tensors` writes of the same weights, byte for byte,
    fused q/k/v rows included; its digests, taken from the mapped file, are the store's."""
    model = {
        "dim": 8 * heads[0],
        "n_layers": layers,
        "n_heads": heads[0],
        "n_kv_heads": heads[1],
        "ffn_hidden": 24,
        "vocab_size": 11,
        "tie_embeddings": tie,
        "qkv_bias": bias,
        "norm": "rmsnorm",
        "mlp": "swiglu",
    }
    rng = np.random.default_rng(seed)
    ours = {n: rng.standard_normal(s).astype("<f4") for n, s in expected_shapes(model).items()}
    _, _, mlp_names = ARCHITECTURES[("rmsnorm", "swiglu")]
    exported = {}
    for name, values in ours.items():
        parts = split_qkv(name, "F32", values, model) if ".wqkv." in name else {name: ("F32", [], values)}
        exported.update({hf_name(part, mlp_names): v for part, (_, _, v) in parts.items()})
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        paths = [folder / f"model-{i}.safetensors" for i in range(shards)]
        for i, path in enumerate(paths):  # tensors dealt round robin: a fused tensor spans shards
            safetensors.numpy.save_file({n: exported[n] for n in sorted(exported)[i::shards]}, path)
        import_files(paths, model, folder / "imported.safetensors", chunk)
        write_tensors(
            folder / "expected.safetensors", {n: ("F32", list(v.shape), v) for n, v in ours.items()}
        )
        got = (folder / "imported.safetensors").read_bytes()
        assert got == (folder / "expected.safetensors").read_bytes()
        assert weights_digests(folder / "imported.safetensors") == safetensors_digests(
            folder / "imported.safetensors"
        )


def test_a_shard_changed_while_it_is_imported_is_refused_and_nothing_written(tmp_path: Path) -> None:
    model = {
        "dim": 8,
        "n_layers": 1,
        "n_heads": 2,
        "n_kv_heads": 1,
        "ffn_hidden": 24,
        "vocab_size": 11,
        "tie_embeddings": True,
        "qkv_bias": False,
        "norm": "rmsnorm",
        "mlp": "swiglu",
    }
    _, _, mlp_names = ARCHITECTURES[("rmsnorm", "swiglu")]
    exported = {}
    for name, shape in expected_shapes(model).items():
        values = np.ones(shape, "<f4")
        parts = split_qkv(name, "F32", values, model) if ".wqkv." in name else {name: ("F32", [], values)}
        exported.update({hf_name(part, mlp_names): v for part, (_, _, v) in parts.items()})
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(exported, path)
    source = planned(path)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # the same size, one bit of the last tensor changed
    path.write_bytes(raw)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    with SourceReader(source) as reader, pytest.raises(StepFailed) as failed:
        copy_weights([reader], buildtrain_layout(read_header(reader, 0), model), out)
    assert str(failed.value).startswith(f"{path}: changed since it was planned")
    assert not list(out.parent.iterdir()), "no weights file, not even a temporary one"


def test_a_checkpoint_without_its_tokenizer_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "checkpoint", "llama")
    (tmp_path / "checkpoint" / "tokenizer.json").unlink()
    assert "has no tokenizer.json" in _refused(tmp_path)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        ({"sliding_window": 16}, "longer than the checkpoint's sliding_window 16"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            "rope_scaling.rope_type = 'linear' is not supported",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_computations_buildtrain_does_not_implement_are_refused(
    tmp_path: Path, edit: dict, expected: str
) -> None:
    make_checkpoint(tmp_path / "checkpoint", "mistral")
    config = tmp_path / "checkpoint" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **edit}))
    assert expected in _refused(tmp_path)


@pytest.mark.parametrize(
    ("file", "text", "expected"),
    [
        ("config.json", None, "config.json: rms_norm_eps must be a positive finite number (got inf)"),
        ("config.json", "rope", "config.json: rope_theta must be a positive finite number (got nan)"),
        ("model.safetensors.index.json", "[]", "model.safetensors.index.json: is not a JSON object"),
        ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json: is not a JSON object"),
    ],
)
def test_json_a_checkpoint_cannot_hold_is_one_line_naming_file_and_key(
    tmp_path: Path, file: str, text: str | None, expected: str
) -> None:
    make_checkpoint(tmp_path / "checkpoint", "llama")
    path = tmp_path / "checkpoint" / file
    if file == "config.json":  # json.dumps writes Infinity and NaN, as Python's json reads them
        config = json.loads(path.read_text())
        if text == "rope":  # transformers 5 writes it in rope_parameters, 4.x at the top
            table = config["rope_parameters"] if "rope_theta" in config.get("rope_parameters", {}) else config
            table["rope_theta"] = float("nan")
        else:
            config["rms_norm_eps"] = float("inf")
        path.write_text(json.dumps(config))
    else:
        path.write_text(text or "")
    assert expected in _refused(tmp_path)


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    cut=st.integers(0, 10_000),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=3),
)
def test_the_import_reads_what_safetensors_reads_and_refuses_any_damage_in_one_line(
    shapes: list[list[int]], dtype: torch.dtype, cut: int, flips: list[tuple[int, int]]
) -> None:
    """Law: the import's own header parser places the safetensors library's tensors, bit for bit;
    the same file truncated or with bytes changed either still parses or is a StepFailed naming
    the file in one line, never another error."""
    tensors = {f"t{i}": torch.randn(shape).to(dtype) for i, shape in enumerate(shapes)}
    good = safetensors.torch.save(tensors)
    damaged = bytearray(good[: cut % (len(good) + 1)])
    for at, xor in flips:
        if damaged:
            damaged[at % len(damaged)] ^= xor
    with tempfile.TemporaryDirectory() as temporary:
        path = Path(temporary) / "x.safetensors"
        path.write_bytes(good)
        with SourceReader(planned(path)) as reader:
            found = read_header(reader, 0)
        data = good[8 + int.from_bytes(good[:8], "little") :]
        assert {name: data[at.begin : at.end] for name, at in found.items()} == {
            name: bytes(raw["data"]) for name, raw in safetensors.deserialize(good)
        }
        path.write_bytes(damaged)
        try:
            with SourceReader(planned(path)) as reader:
                read_header(reader, 0)
        except StepFailed as exc:
            assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc)


def test_a_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for path in paths:
        safetensors.numpy.save_file({"model.norm.weight": np.ones(8, "<f4")}, path)
    with contextlib.ExitStack() as opened:
        readers = [opened.enter_context(SourceReader(planned(path))) for path in paths]
        with pytest.raises(
            StepFailed, match=f"^{paths[1]}: tensor model.norm.weight is in another shard too"
        ):
            read_headers(readers)
