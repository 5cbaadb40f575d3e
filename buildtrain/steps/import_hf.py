"""The import step: a Hugging Face checkpoint (llama, mistral, qwen2) in buildtrain's layout.

Output (sealed by MANIFEST.json):

    model.safetensors   the weights as `steps/train/model.py` names them, in the checkpoint's dtypes
    base/               the checkpoint's config.json, tokenizer_config.json, ... as they were
    result.json         where the weights are (as a train step's result says), their digest

Its inputs are the checkpoint's files by content, each checked against the plan as it is read;
which file is which comes from the step's config (by digest), never from a path. Tensors are
views of the checked bytes (through the header parser of `store/tensors.py`), written back
renamed in their own dtype (F32, BF16 or F16; training widens them to float32 exactly as it
loads them): no torch, no pickle, no code from the checkpoint, and half the bytes to write of a
bf16 checkpoint. The renaming is the inverse of `hf_export.py`: q, k and v projections stacked by
rows into `wqkv` (nh query heads, then nkv key heads, then nkv value heads), gate/up/down into
w1/w3/w2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from buildtrain.canonical import canonical_bytes
from buildtrain.config.pretrained import CONFIG, CheckpointProblem, model_settings
from buildtrain.errors import StepFailed
from buildtrain.steps.hf_export import write_tensors
from buildtrain.steps.sources import Source, read_source
from buildtrain.store.layout import IMPORT_BASE, RESULT
from buildtrain.store.objects import write_bytes_durably
from buildtrain.store.tensors import combine, decode_header, header_size, tensor_digest

if TYPE_CHECKING:
    from buildtrain.steps.context import StepContext

RESULT_FORMAT = 1
WEIGHTS = "model.safetensors"
BASE = IMPORT_BASE
# Buffers some checkpoints carry that are recomputed, never trained: dropped.
RECOMPUTED = ("rotary_emb.inv_freq",)
MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
NORMS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}

Tensors = dict[str, tuple[str, np.ndarray]]  # name -> (safetensors dtype, raw elements)
# The library's dtype names -> (safetensors code, numpy dtype of the raw elements)
DTYPES = {
    "F32": ("F32", "<f4"),
    "float32": ("F32", "<f4"),
    "BF16": ("BF16", "<u2"),
    "bfloat16": ("BF16", "<u2"),
    "F16": ("F16", "<f2"),
    "float16": ("F16", "<f2"),
}


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    files = ctx.step.config["files"]
    by_digest = {source.blake3: source for source in ctx.sources}
    base = {name: read_source(by_digest[digest]) for name, digest in files["base"].items()}
    try:
        _, model, _ = model_settings(json.loads(base[CONFIG]), Path(CONFIG))
    except CheckpointProblem as exc:
        raise StepFailed(str(exc)) from None
    found: Tensors = {}
    for digest in files["shards"]:
        found.update(read_raw(by_digest[digest]))
    weights = buildtrain_tensors(found, model)
    write_tensors(out / WEIGHTS, {name: (dtype, list(v.shape), v) for name, (dtype, v) in weights.items()})
    (out / BASE).mkdir()
    for name, raw in base.items():
        write_bytes_durably(out / BASE / name, raw)
    # From the arrays just written (the file's bytes exactly): re-reading 2x a bf16 checkpoint's
    # size cost 0.2 s of 1.8 s on 320 MB here. tests/test_import.py checks it against the file.
    digests = {"weights": combine(array_digests(weights))}
    body = {"format": RESULT_FORMAT, "weights": WEIGHTS, "digests": digests}
    write_bytes_durably(out / RESULT, canonical_bytes(body))
    ctx.log.info("checkpoint_imported", tensors=len(weights), weights=digests["weights"][:12])
    return digests


def array_digests(weights: Tensors) -> dict[str, str]:
    """What `store.tensors.safetensors_digests` computes from the file `write_tensors` writes."""
    return {
        name: tensor_digest(name, dtype.lower(), list(v.shape), memoryview(np.ascontiguousarray(v)).cast("B"))
        for name, (dtype, v) in weights.items()
    }


def read_raw(source: Source) -> Tensors:
    """Every tensor of a safetensors shard, as read (and checked) from its source."""
    return raw_tensors(memoryview(read_source(source)), str(source))


def raw_tensors(data: memoryview, label: str) -> Tensors:
    """Every tensor of safetensors bytes as (dtype, array of its raw elements), kept in its dtype
    (bf16 as its bit patterns): the import writes what it read, renamed, and training widens to
    float32 exactly when it loads them. The arrays are views of `data`, not copies: copying
    them out (as `safetensors.deserialize` does) cost 0.16 s of a 320 MB import here. Anything
    malformed is a StepFailed naming `label`."""
    try:
        size = header_size(bytes(data[:8]), label)
        header = decode_header(data[8 : 8 + size], size, label)
    except ValueError as exc:
        raise StepFailed(f"{label}: not a safetensors file ({exc})") from None
    body = data[8 + size :]
    found = {}
    for name, entry in header.items():
        if name != "__metadata__":
            found[name] = _tensor(name, entry, body, label)
    return found


def _tensor(name: str, entry: Any, body: memoryview, label: str) -> tuple[str, np.ndarray]:
    """One header entry's tensor, its dtype, shape and offsets checked against the bytes."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        raise StepFailed(f"{label}: tensor {name} has no dtype in the header; not a safetensors file")
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise StepFailed(f"{label}: tensor {name} is {entry['dtype']}; buildtrain imports F32, BF16 and F16")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2:
        raise StepFailed(f"{label}: tensor {name} has a malformed shape or data_offsets")
    begin, end = offsets
    itemsize = np.dtype(dtype[1]).itemsize
    if not begin <= end <= len(body) or end - begin != math.prod(shape) * itemsize:
        raise StepFailed(
            f"{label}: tensor {name} of shape {shape} does not fit bytes {begin}..{end} of the file's data"
        )
    return dtype[0], np.frombuffer(body[begin:end], dtype=dtype[1]).reshape(shape)


def _naturals(value: Any) -> bool:
    """Whether a header value is a list of non-negative integers."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def expected_shapes(model: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """buildtrain's tensor names and shapes for a model of these settings (tied: no output)."""
    dim, hidden, vocab = model["dim"], model["ffn_hidden"], model["vocab_size"]
    qkv = (model["n_heads"] + 2 * model["n_kv_heads"]) * (dim // model["n_heads"])
    shapes: dict[str, tuple[int, ...]] = {"embedding.weight": (vocab, dim), "norm.weight": (dim,)}
    if not model["tie_embeddings"]:
        shapes["output.weight"] = (vocab, dim)
    for layer in range(model["n_layers"]):
        block = f"blocks.{layer}"
        shapes.update(
            {
                f"{block}.attention_norm.weight": (dim,),
                f"{block}.ffn_norm.weight": (dim,),
                f"{block}.attention.wqkv.weight": (qkv, dim),
                f"{block}.attention.wo.weight": (dim, dim),
                f"{block}.ffn.w1.weight": (hidden, dim),
                f"{block}.ffn.w3.weight": (hidden, dim),
                f"{block}.ffn.w2.weight": (dim, hidden),
            }
        )
        if model["qkv_bias"]:
            shapes[f"{block}.attention.wqkv.bias"] = (qkv,)
    return shapes


def buildtrain_tensors(found: Tensors, model: dict[str, Any]) -> Tensors:
    """The checkpoint's tensors under buildtrain's names, checked against the model's shapes."""
    renamed: Tensors = {}
    projections: dict[
        str, dict[str, tuple[str, np.ndarray]]
    ] = {}  # "blocks.i.attention.wqkv.weight" -> q, k, v
    for name, values in found.items():
        if name.endswith(RECOMPUTED) or (name == "lm_head.weight" and model["tie_embeddings"]):
            continue  # a tied head is the embedding itself
        target = buildtrain_name(name)
        if target is None:
            raise StepFailed(f"the checkpoint has a tensor buildtrain's model does not: {name}")
        prefix, _, leaf = target.rpartition(".")  # "blocks.0.attention.wq", "weight"
        if prefix.endswith((".wq", ".wk", ".wv")):
            block, _, part = prefix.rpartition(".")
            projections.setdefault(f"{block}.wqkv.{leaf}", {})[part] = values
            continue
        renamed[target] = values
    for fused, parts in projections.items():
        if set(parts) != {"wq", "wk", "wv"}:
            raise StepFailed(f"the checkpoint lacks part of {fused} (has {sorted(parts)}); it is incomplete")
        dtypes = {parts[p][0] for p in ("wq", "wk", "wv")}
        if len(dtypes) != 1:
            raise StepFailed(f"the q, k and v projections of {fused} differ in dtype ({sorted(dtypes)})")
        stacked = np.concatenate([parts[p][1] for p in ("wq", "wk", "wv")], axis=0)
        renamed[fused] = (dtypes.pop(), stacked)
    expected = expected_shapes(model)
    missing = sorted(set(expected) - set(renamed))
    if missing:
        raise StepFailed(
            f"the checkpoint lacks {len(missing)} tensors config.json implies, e.g. {missing[0]}"
        )
    for name, shape in expected.items():
        if tuple(renamed[name][1].shape) != shape:
            raise StepFailed(
                f"tensor {name} has shape {list(renamed[name][1].shape)}, config.json implies {list(shape)}"
            )
    extra = sorted(set(renamed) - set(expected))
    if extra:
        raise StepFailed(f"the checkpoint has tensors config.json does not imply, e.g. {extra[0]}")
    return renamed


def buildtrain_name(name: str) -> str | None:
    """A transformers tensor name as buildtrain names it (q/k/v as wq/wk/wv, fused later)."""
    parts = name.split(".")
    if name == "model.embed_tokens.weight":
        return "embedding.weight"
    if name == "lm_head.weight":
        return "output.weight"
    if name == "model.norm.weight":
        return "norm.weight"
    if len(parts) not in (5, 6) or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    block, module = f"blocks.{parts[2]}", parts[3]
    if len(parts) == 5:
        return f"{block}.{NORMS[module]}.weight" if module in NORMS and parts[4] == "weight" else None
    leaf, kind = parts[4], parts[5]
    if module == "self_attn" and leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return f"{block}.attention.w{leaf[0]}.{kind}"
    if module == "mlp" and leaf in MLP:
        return f"{block}.ffn.{MLP[leaf]}.{kind}"
    return None
