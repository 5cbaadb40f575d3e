"""A Hugging Face checkpoint folder as a preset's starting point (`model.init = { hf = "folder" }`).

Read at plan time with json alone (and the 8-byte length plus JSON header of each safetensors
shard): no torch, no transformers, no code from the checkpoint, ever. What it gives the plan:

- the model's shape, from config.json (a preset key that contradicts it is refused by name);
- the files the import step reads, by role, each then hashed by content like a data file;
- the tokenizer.json that becomes every stage's tokenizer, and its end-of-document token.

Only architectures whose computation buildtrain's Transformer reproduces exactly are admitted:
llama (no attention or MLP biases; SmolLM2 is one), mistral (no sliding window shorter than a
sequence), qwen2 (q, k and v biases) and qwen3 (per-head RMSNorm on q and k, a head size of its
own), with SiLU-gated MLPs, RMSNorm, and default RoPE or Llama 3.x's llama3 scaling. Anything
else a config.json asks for is refused by its key, never approximated.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import attrs

from buildtrain.config.schema import RopeScalingConfig
from buildtrain.sources.safetensors_header import read_safetensors_header

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
# Small JSON files an export ships again beside the fine-tuned weights (the chat template lives
# in tokenizer_config.json); read by the import step, copied into its output as they are.
BASE_FILES = (
    "config.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # transformers 5 writes the chat template here
    "generation_config.json",
    "special_tokens_map.json",
)
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = ("F32", "BF16", "F16")  # held exactly as float32; anything else is refused
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")
MAX_JSON = 64 << 20  # a config or index larger than this is not one
LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor")  # besides original_max_position_embeddings
# Keys of a RoPE table buildtrain reads; any other (a nested per-layer table, a yarn setting) is refused
ROPE_KEYS = (
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    *LLAMA3,
    "original_max_position_embeddings",
)


class CheckpointProblem(Exception):
    """Why a folder cannot be imported: one line, naming the file and the fix."""


@attrs.frozen(kw_only=True)
class Checkpoint:
    folder: Path
    architecture: str  # config.json's model_type
    model: dict[str, Any]  # ModelConfig fields the checkpoint decides, by field name
    hf_keys: dict[str, str]  # ModelConfig field -> the config.json key it comes from (messages)
    sliding_window: int | None  # attention window; a longer training sequence would differ
    max_positions: int
    base_files: dict[str, Path]  # BASE_FILES present, by name
    shards: tuple[Path, ...]  # safetensors files, in name order
    tokenizer: Path | None
    end_of_document: str | None  # tokenizer_config.json's eos_token
    chat_template: str | None  # its Jinja chat template (tokenizer_config.json or chat_template.jinja)

    def files(self) -> list[Path]:
        """Every file the import step reads (its inputs, by content)."""
        return [*self.base_files.values(), *self.shards]


def _json(path: Path) -> Any:
    try:
        if not path.is_file() or path.stat().st_size > MAX_JSON:
            raise CheckpointProblem(f"{path}: not a regular JSON file of at most {MAX_JSON >> 20} MiB")
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointProblem(f"{path}: cannot be read as JSON ({exc})") from None


def _json_object(path: Path) -> dict[str, Any]:
    found = _json(path)
    if not isinstance(found, dict):
        raise CheckpointProblem(
            f"{path}: is not a JSON object (it holds {type(found).__name__}); download it again"
        )
    return found


def _positive(hf: dict[str, Any], key: str, default: float, path: Path) -> float:
    value = hf.get(key, default)
    if not _finite(value):
        raise CheckpointProblem(f"{path}: {key} must be a positive finite number (got {value!r})")
    return float(value)


def read_checkpoint(folder: Path) -> Checkpoint:
    """The checkpoint in `folder`, or a `CheckpointProblem` saying what is wrong with it."""
    if not folder.is_dir():
        raise CheckpointProblem(f"{folder}: is not a folder; give a Hugging Face checkpoint folder")
    if not (folder / CONFIG).is_file():
        raise CheckpointProblem(f"{folder}: has no {CONFIG}; give a Hugging Face checkpoint folder")
    hf = _json_object(folder / CONFIG)
    architecture, model, keys = model_settings(hf, folder / CONFIG)
    shards = _shards(folder)
    for shard in shards:
        _check_dtypes(shard)
    base = {name: folder / name for name in BASE_FILES if (folder / name).is_file()}
    eos, template = None, None
    if "tokenizer_config.json" in base:
        settings = _json_object(base["tokenizer_config.json"])
        eos, template = _token_text(settings.get("eos_token")), _template(settings.get("chat_template"))
    if template is None and "chat_template.jinja" in base:
        try:
            template = base["chat_template.jinja"].read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointProblem(
                f"{base['chat_template.jinja']}: cannot be read as text ({exc})"
            ) from None
    window = hf.get("sliding_window") if architecture == "mistral" else None
    return Checkpoint(
        folder=folder,
        architecture=architecture,
        model=model,
        hf_keys=keys,
        sliding_window=window if isinstance(window, int) else None,
        max_positions=int(hf.get("max_position_embeddings") or 0),
        base_files=base,
        shards=shards,
        tokenizer=folder / TOKENIZER if (folder / TOKENIZER).is_file() else None,
        end_of_document=eos,
        chat_template=template,
    )


def _template(value: Any) -> str | None:
    """A chat template as tokenizer_config.json holds it: a string, or named templates."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _int(hf: dict[str, Any], key: str, path: Path, default: int | None = None) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointProblem(f"{path}: {key} must be a positive integer (got {value!r})")
    return value


def _finite(value: Any) -> bool:
    """A positive, finite number (json reads `Infinity` and `NaN` as floats)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def _rope(hf: dict[str, Any], path: Path) -> tuple[float, RopeScalingConfig | None]:
    """RoPE's base and scaling, read as transformers reads them: a non-empty rope_scaling (4.x)
    wins over rope_parameters (5.x); rope_theta is the table's, else the top level's."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    table = hf.get(key) or {}
    if not isinstance(table, dict):
        raise CheckpointProblem(f"{path}: {key} must be a JSON object (got {table!r})")
    unknown = sorted(set(table) - set(ROPE_KEYS))
    if unknown:
        raise CheckpointProblem(f"{path}: {key}.{unknown[0]} is not supported; use a checkpoint without it")
    kind_key = "rope_type" if "rope_type" in table else "type"
    kind = table.get(kind_key, "default")
    if kind not in ("default", "llama3"):
        raise CheckpointProblem(
            f"{path}: {key}.{kind_key} = {kind!r} is not supported (buildtrain computes default and "
            "llama3 RoPE); use a checkpoint without it"
        )
    partial = table.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointProblem(
            f"{path}: partial_rotary_factor = {partial!r} is not supported (buildtrain rotates every channel)"
        )
    theta = _positive(table if "rope_theta" in table else hf, "rope_theta", 10000.0, path)
    if kind == "default":
        return theta, None
    for name in LLAMA3:
        if not _finite(table.get(name)):
            raise CheckpointProblem(
                f"{path}: {key}.{name} must be a positive finite number (got {table.get(name)!r})"
            )
    name = "original_max_position_embeddings"  # transformers' fallback: the model's own length
    original = table.get(name, hf.get("max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise CheckpointProblem(f"{path}: {key}.{name} must be a positive integer (got {original!r})")
    try:
        scaling = RopeScalingConfig(
            original_max_position_embeddings=original, **{n: float(table[n]) for n in LLAMA3}
        )
    except ValueError as exc:  # high_freq_factor not above low_freq_factor
        raise CheckpointProblem(f"{path}: {key}.high_freq_factor {exc}") from None
    return theta, scaling


def _refuse_unsupported(hf: dict[str, Any], architecture: str, path: Path) -> None:
    """What a config.json asks for that buildtrain's model does not compute, by its key."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointProblem(f"{path}: hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
    biases = {"attention_bias": hf.get("attention_bias", False), "mlp_bias": hf.get("mlp_bias", False)}
    if architecture != "qwen2" and any(biases.values()):
        raise CheckpointProblem(f"{path}: attention_bias and mlp_bias must be false (got {biases})")
    if architecture in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise CheckpointProblem(f"{path}: use_sliding_window is not supported; it must be false")
    layers = hf.get("layer_types") or []
    other = [kind for kind in layers if kind != "full_attention"] if isinstance(layers, list) else [layers]
    if other:
        raise CheckpointProblem(
            f"{path}: layer_types names {other[0]!r}; buildtrain computes full_attention layers only"
        )


def _head_dim(hf: dict[str, Any], dim: int, heads: int, path: Path) -> int:
    """config.json's head_dim as ModelConfig holds it: 0 where it is dim / heads (the default)."""
    value = hf.get("head_dim")
    if value is None or (not dim % heads and value == dim // heads):
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
        raise CheckpointProblem(f"{path}: head_dim must be a positive even integer (got {value!r})")
    return value


def model_settings(hf: dict[str, Any], path: Path) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(architecture, ModelConfig fields, their config.json keys) of a checkpoint's config."""
    architecture = hf.get("model_type")
    if architecture not in ARCHITECTURES:
        raise CheckpointProblem(
            f"{path}: model_type {architecture!r} is not supported; buildtrain imports "
            f"{', '.join(ARCHITECTURES)}"
        )
    _refuse_unsupported(hf, architecture, path)
    heads = _int(hf, "num_attention_heads", path)
    dim = _int(hf, "hidden_size", path)
    theta, scaling = _rope(hf, path)
    keys = {
        "dim": "hidden_size",
        "head_dim": "head_dim",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "n_kv_heads": "num_key_value_heads",
        "ffn_hidden": "intermediate_size",
        "vocab_size": "vocab_size",
        "norm_eps": "rms_norm_eps",
        "rope_theta": "rope_theta",
        "rope_scaling": "rope_scaling",
        "tie_embeddings": "tie_word_embeddings",
        "qkv_bias": "model_type",
        "qk_norm": "model_type",
        "mlp": "hidden_act",
        "norm": "model_type",
    }
    model = {
        "dim": dim,
        "head_dim": _head_dim(hf, dim, heads, path),
        "n_layers": _int(hf, "num_hidden_layers", path),
        "n_heads": heads,
        "n_kv_heads": _int(hf, "num_key_value_heads", path, heads),
        "ffn_hidden": _int(hf, "intermediate_size", path),
        "vocab_size": _int(hf, "vocab_size", path),
        "norm_eps": _positive(hf, "rms_norm_eps", 1e-6, path),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": architecture == "qwen2",
        "qk_norm": architecture == "qwen3",
        "mlp": "swiglu",
        "norm": "rmsnorm",
    }
    return architecture, model, keys


def _shards(folder: Path) -> tuple[Path, ...]:
    """The safetensors files holding the weights: those the index names, or the folder's."""
    index = folder / INDEX
    if index.is_file():
        weight_map = _json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointProblem(f"{index}: has no weight_map of tensor names to shard files")
        names = sorted(set(weight_map.values()))
        for name in names:
            if os.path.basename(name) != name or not (folder / name).is_file():
                raise CheckpointProblem(
                    f"{index}: names the shard {name!r}, which is missing from {folder}; download it again"
                )
        return tuple(folder / name for name in names)
    found = tuple(sorted(p for p in folder.glob("*.safetensors") if p.is_file()))
    if found:
        return found
    pickles = [name for name in PICKLES if (folder / name).exists()] + sorted(
        p.name for p in folder.glob("pytorch_model-*.bin")
    )
    if pickles:
        raise CheckpointProblem(
            f"{folder}: holds only pickle weights ({pickles[0]}), which buildtrain never loads (unpickling "
            "can run code); save them as safetensors (save_pretrained(..., safe_serialization=True))"
        )
    raise CheckpointProblem(f"{folder}: has no *.safetensors weights")


def _check_dtypes(shard: Path) -> None:
    try:
        header, _ = read_safetensors_header(shard)
    except (OSError, ValueError) as exc:
        raise CheckpointProblem(f"{shard}: not a safetensors file ({exc})") from None
    for name, entry in header.items():
        dtype = entry.get("dtype") if isinstance(entry, dict) and name != "__metadata__" else None
        if dtype is not None and dtype not in DTYPES:
            raise CheckpointProblem(
                f"{shard}: tensor {name} is {dtype}; buildtrain imports {', '.join(DTYPES)} weights "
                "(held as float32): convert the checkpoint to one of them"
            )
