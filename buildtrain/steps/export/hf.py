"""The `hf/` folder of an export: a model and tokenizer that Hugging Face transformers loads offline.

Every model shape the schema admits maps exactly onto a transformers architecture with the same
computation (no approximation, so logits agree to float rounding):

    norm      mlp     architecture   why this one
    rmsnorm   swiglu  llama          RMSNorm, RoPE, GQA, gated SiLU MLP: Llama itself
    rmsnorm   gelu    arcee          Llama's blocks with a plain (non-gated) MLP of any activation
    layernorm swiglu  stablelm       LayerNorm with bias, full rotary (partial_rotary_factor 1), gated MLP
    layernorm gelu    starcoder2     LayerNorm with bias, plain MLP; use_bias = false drops linear biases
    (qk_norm: rmsnorm, swiglu)  qwen3  Llama's blocks with per-head RMSNorm on q and k

head_dim and a llama3 rope_scaling are written as they are: from them transformers computes the
frequencies `steps/train/rope.py` computes, bit for bit.

RoPE: buildtrain rotates halves (channel i with channel i + head_dim / 2, frequency i), as
transformers does, so the query and key rows need no reordering. buildtrain's fused `wqkv`
projection (nh query heads, then nkv key heads, then nkv value heads, by rows) is split into
q_proj, k_proj and v_proj.

Torch-free and dtype-agnostic: tensors are read and written as raw little-endian safetensors, only
renamed and split by rows, so the weights are bit-identical to `model.safetensors`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from buildtrain.canonical import canonical_bytes
from buildtrain.sources.durable import write_bytes_durably
from buildtrain.sources.safetensors_header import read_safetensors_header
from buildtrain.store.tensors import encode_header

HF_FOLDER = "hf"
# (norm, mlp) -> (model_type, architecture class, MLP names: buildtrain -> transformers)
ARCHITECTURES: dict[tuple[str, str], tuple[str, str, dict[str, str]]] = {
    ("rmsnorm", "swiglu"): (
        "llama",
        "LlamaForCausalLM",
        {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
    ),
    ("rmsnorm", "gelu"): ("arcee", "ArceeForCausalLM", {"w1": "up_proj", "w2": "down_proj"}),
    ("layernorm", "swiglu"): (
        "stablelm",
        "StableLmForCausalLM",
        {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
    ),
    ("layernorm", "gelu"): ("starcoder2", "Starcoder2ForCausalLM", {"w1": "c_fc", "w2": "c_proj"}),
}
# qk_norm (the schema admits it with rmsnorm and swiglu only): Llama's blocks with per-head q/k norms
QWEN3 = ("qwen3", "Qwen3ForCausalLM", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})
NUMPY_OF = {"F32": np.uint32, "BF16": np.uint16, "F16": np.uint16}  # raw bits: split, never computed


def hf_config(
    model: dict[str, Any], vocab_size: int, max_positions: int, eod: int, dtype: str
) -> dict[str, Any]:
    """config.json for `model` (buildtrain's model config)."""
    model_type, architecture, _ = (
        QWEN3 if model.get("qk_norm") else ARCHITECTURES[(model["norm"], model["mlp"])]
    )
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": model["dim"],
        "intermediate_size": model["ffn_hidden"],
        "num_hidden_layers": model["n_layers"],
        "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model["n_kv_heads"],
        "head_dim": model.get("head_dim") or model["dim"] // model["n_heads"],
        "hidden_act": "silu" if model["mlp"] == "swiglu" else "gelu",  # gelu: the exact (erf) form
        "max_position_embeddings": max_positions,
        # transformers 5 reads rope_parameters; 4.x read rope_theta (and partial_rotary_factor)
        "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},
        "rope_theta": model["rope_theta"],
        "tie_word_embeddings": model["tie_embeddings"],
        "bos_token_id": eod,
        "eos_token_id": eod,
        "attention_dropout": 0.0,
        "dtype": dtype,
        "use_cache": True,
    }
    scaling = model.get("rope_scaling")
    if scaling is not None:  # llama3: 5.x reads it from rope_parameters, 4.x from rope_scaling
        config["rope_parameters"].update(scaling)
        config["rope_scaling"] = dict(scaling)
    if model_type in ("llama", "arcee"):
        config.update(rms_norm_eps=model["norm_eps"], attention_bias=False, mlp_bias=False)
    elif model_type == "qwen3":
        config.update(rms_norm_eps=model["norm_eps"], attention_bias=False, use_sliding_window=False)
    elif model_type == "stablelm":
        config.update(layer_norm_eps=model["norm_eps"], use_qkv_bias=False, qk_layernorm=False)
        config["rope_parameters"]["partial_rotary_factor"] = config["partial_rotary_factor"] = 1.0
    else:
        config.update(norm_epsilon=model["norm_eps"], use_bias=False, sliding_window=None)
    return config


def hf_name(name: str, mlp_names: dict[str, str]) -> str:
    """A buildtrain tensor name as transformers names it."""
    parts = name.split(".")
    if parts[0] == "embedding":
        return "model.embed_tokens.weight"
    if parts[0] == "output":
        return "lm_head.weight"
    if parts[0] == "norm":
        return f"model.norm.{parts[1]}"
    layer, module = parts[1], parts[2]
    if module == "attention" and parts[3] in ("q_norm", "k_norm"):  # qwen3's per-head norms
        return f"model.layers.{layer}.self_attn.{parts[3]}.{parts[4]}"
    if module == "attention":
        return f"model.layers.{layer}.self_attn.{parts[3].replace('w', '', 1)}_proj.{parts[4]}"
    if module == "ffn":
        return f"model.layers.{layer}.mlp.{mlp_names[parts[3]]}.{parts[4]}"
    norm = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}[module]
    return f"model.layers.{layer}.{norm}.{parts[3]}"


def split_qkv(
    name: str, kind: str, values: np.ndarray, model: dict[str, Any]
) -> dict[str, tuple[str, list[int], np.ndarray]]:
    """A fused `attention.wqkv` tensor as buildtrain's separate wq, wk, wv (split by output rows)."""
    head_dim = model.get("head_dim") or model["dim"] // model["n_heads"]
    rows = (model["n_heads"] * head_dim, model["n_kv_heads"] * head_dim, model["n_kv_heads"] * head_dim)
    parts, start = {}, 0
    for part, count in zip(("wq", "wk", "wv"), rows, strict=True):
        block = values[start : start + count]
        parts[name.replace("wqkv", part)] = (kind, list(block.shape), block)
        start += count
    return parts


def read_tensors(path: Path) -> dict[str, tuple[str, list[int], np.ndarray]]:
    """name -> (dtype, shape, raw elements) of a safetensors file."""
    header, start = read_safetensors_header(path)
    raw = path.read_bytes()
    found = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        kind = NUMPY_OF[entry["dtype"]]
        values = np.frombuffer(
            raw,
            dtype=np.dtype(kind).newbyteorder("<"),
            count=(end - begin) // np.dtype(kind).itemsize,
            offset=start + begin,
        )
        found[name] = (entry["dtype"], entry["shape"], values.reshape(entry["shape"]))
    return found


def write_tensors(path: Path, tensors: dict[str, tuple[str, list[int], np.ndarray]]) -> None:
    """A safetensors file with tensors in name order: the same input gives the same bytes."""
    blobs = {}
    for name, (_, _, values) in tensors.items():
        array = np.ascontiguousarray(values).astype(values.dtype.newbyteorder("<"), copy=False)
        blobs[name] = memoryview(array.reshape(-1)).cast("B")  # written as it is: no copy of the bytes
    header, _ = encode_header(
        (name, dtype, shape, len(blobs[name])) for name, (dtype, shape, _) in tensors.items()
    )
    write_bytes_durably(path, [header, *(blobs[name] for name in sorted(tensors))])


def write_hf(
    folder: Path,
    weights: Path,
    model: dict[str, Any],
    tokenizer_json: bytes,
    eod_token: str,
    eod: int,
    max_positions: int,
    dtype: str,
    base: Path | None = None,
) -> None:
    """Write config.json, model.safetensors and the tokenizer files into `folder`; a model that
    started from a checkpoint (`base`: the import step's copy of its files) keeps its config and
    tokenizer settings, so transformers loads it as the base architecture."""
    _, _, mlp_names = ARCHITECTURES[(model["norm"], model["mlp"])]
    tensors = read_tensors(weights)
    converted = {}
    for name, (kind, shape, values) in tensors.items():
        parts = split_qkv(name, kind, values, model) if ".wqkv." in name else {name: (kind, shape, values)}
        converted.update({hf_name(part, mlp_names): tensor for part, tensor in parts.items()})
    vocab_size = tensors["embedding.weight"][1][0]
    folder.mkdir()
    write_tensors(folder / "model.safetensors", converted)
    write_bytes_durably(folder / "tokenizer.json", tokenizer_json)
    if base is not None:
        write_base_files(folder, base, dtype, eod)
        return
    write_bytes_durably(
        folder / "config.json", canonical_bytes(hf_config(model, vocab_size, max_positions, eod, dtype))
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eod_token,
        "eos_token": eod_token,
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
    }
    write_bytes_durably(folder / "tokenizer_config.json", canonical_bytes(tokenizer_config))


def write_base_files(folder: Path, base: Path, dtype: str, eod: int) -> None:
    """The checkpoint's own config.json (its dtype now the export's; the end-of-document token
    where it names none, so generation stops) and tokenizer settings (the chat template among
    them), copied as they were."""
    config = json.loads((base / "config.json").read_bytes())
    config["dtype"] = dtype  # transformers 5's key; 4.x read torch_dtype
    if config.get("eos_token_id") is None:
        config["eos_token_id"] = eod
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    write_bytes_durably(folder / "config.json", canonical_bytes(config))
    for path in sorted(base.iterdir()):
        if path.name != "config.json":
            write_bytes_durably(folder / path.name, path.read_bytes())


PEFT_FOLDER = "peft"
# LoRA target -> (buildtrain's projection under a block, the transformers module peft adapts)
LORA_MODULES = {
    "q": ("attention.wqkv", "self_attn.q_proj"),
    "k": ("attention.wqkv", "self_attn.k_proj"),
    "v": ("attention.wqkv", "self_attn.v_proj"),
    "o": ("attention.wo", "self_attn.o_proj"),
    "gate": ("ffn.w1", "mlp.gate_proj"),
    "up": ("ffn.w3", "mlp.up_proj"),
    "down": ("ffn.w2", "mlp.down_proj"),
}


def write_peft(folder: Path, adapters: Path, lora: dict[str, Any], n_layers: int) -> None:
    """A peft adapter folder (adapter_config.json, adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained` places on the base checkpoint: peft's LoRA computes
    alpha / r x lora_B(lora_A(x)), buildtrain's adapters alpha / rank x B A x, so A and B are
    copied bit for bit, only renamed."""
    tensors = read_tensors(adapters)
    found = {}
    for index in range(n_layers):
        for target in lora["targets"]:
            ours, theirs = LORA_MODULES[target]
            prefix = f"base_model.model.model.layers.{index}.{theirs}"
            for part in ("A", "B"):
                found[f"{prefix}.lora_{part}.weight"] = tensors[f"blocks.{index}.{ours}.lora_{target}.{part}"]
    folder.mkdir()
    write_tensors(folder / "adapter_model.safetensors", found)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": sorted(LORA_MODULES[t][1].split(".")[1] for t in lora["targets"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
    }
    write_bytes_durably(folder / "adapter_config.json", canonical_bytes(config))
