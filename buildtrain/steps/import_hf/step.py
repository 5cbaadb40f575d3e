"""The import step: a Hugging Face checkpoint (llama, mistral, qwen2, qwen3) in buildtrain's layout.

Output (sealed by MANIFEST.json):

    model.safetensors   the weights as `steps/train/model.py` names them, in the checkpoint's dtypes
    base/               the checkpoint's config.json, tokenizer_config.json, ... as they were
    result.json         where the weights are (as a train step's result says), their digest

Its inputs are the checkpoint's files by content, each checked against the plan as it is read;
which file is which comes from the step's config (by digest), never from a path. The shards'
headers (our own parser, `store/tensors.py`) are read and checked first, so the whole output
layout is known before any tensor byte is read: then each shard is streamed once through a
reused buffer, hashed, and each tensor's bytes are written straight to their place in the
output. Tensors keep their dtype (F32, BF16 or F16; training widens them to float32 exactly as
it loads them): no torch, no pickle, no code from the checkpoint, half the bytes of float32 for
a bf16 checkpoint, and the disk writes while the shards are read. The renaming is the inverse of
`steps/export/hf.py`: q, k and v projections stacked by rows into `wqkv` (nh query heads, then nkv key
heads, then nkv value heads), gate/up/down into w1/w3/w2.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.canonical import canonical_bytes
from buildtrain.config.pretrained import CONFIG, CheckpointProblem, model_settings
from buildtrain.errors import StepFailed
from buildtrain.sources.durable import DurableWriter, durable_file, write_bytes_durably
from buildtrain.sources.safetensors_header import decode_header, header_size, read_safetensors_header
from buildtrain.steps.sources import SourceReader, read_source
from buildtrain.store.layout import IMPORT_BASE, RESULT
from buildtrain.store.tensors import combine, encode_header, tensor_digest, tensor_entries

if TYPE_CHECKING:
    from buildtrain.steps.context import StepContext

RESULT_FORMAT = 1
WEIGHTS = "model.safetensors"
BASE = IMPORT_BASE
# Buffers some checkpoints carry that are recomputed, never trained: dropped.
RECOMPUTED = ("rotary_emb.inv_freq",)
MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
NORMS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
# The library's dtype names -> (safetensors code, bytes per element)
DTYPES = {
    "F32": ("F32", 4),
    "float32": ("F32", 4),
    "BF16": ("BF16", 2),
    "bfloat16": ("BF16", 2),
    "F16": ("F16", 2),
    "float16": ("F16", 2),
}
# Shards are streamed through one buffer this large: reused memory costs no page faults (a fresh
# 320 MB `bytes` cost 0.16 s to fill here, against 0.04 s through a reused buffer).
STREAM_CHUNK = 8 << 20


@attrs.frozen
class Stored:
    """Where a checkpoint keeps one tensor: which shard, and which bytes of its data section."""

    shard: int
    dtype: str  # safetensors code: F32, BF16 or F16
    shape: tuple[int, ...]
    begin: int
    end: int


Layout = dict[str, tuple[Stored, ...]]  # buildtrain's name -> its parts, stacked by rows


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    files = ctx.step.config["files"]
    by_digest = {source.blake3: source for source in ctx.sources}
    base = {name: read_source(by_digest[digest]) for name, digest in files["base"].items()}
    try:
        _, model, _ = model_settings(json.loads(base[CONFIG]), Path(CONFIG))
    except CheckpointProblem as exc:
        raise StepFailed(str(exc)) from None
    with contextlib.ExitStack() as opened:
        readers = [opened.enter_context(SourceReader(by_digest[digest])) for digest in files["shards"]]
        layout = buildtrain_layout(read_headers(readers), model)
        copy_weights(readers, layout, out / WEIGHTS)
    (out / BASE).mkdir()
    for name, raw in base.items():
        write_bytes_durably(out / BASE / name, raw)
    digests = {"weights": combine(weights_digests(out / WEIGHTS))}
    body = {"format": RESULT_FORMAT, "weights": WEIGHTS, "digests": digests}
    write_bytes_durably(out / RESULT, canonical_bytes(body))
    ctx.log.info("checkpoint_imported", tensors=len(layout), weights=digests["weights"][:12])
    return digests


def read_headers(readers: list[SourceReader]) -> dict[str, Stored]:
    """Where every tensor of the checkpoint is; a name in two shards is refused."""
    found: dict[str, Stored] = {}
    for shard, reader in enumerate(readers):
        for name, where in read_header(reader, shard).items():
            if name in found:
                raise StepFailed(
                    f"{reader.source}: tensor {name} is in another shard too; the checkpoint is inconsistent"
                )
            found[name] = where
    return found


def read_header(reader: SourceReader, shard: int) -> dict[str, Stored]:
    """Where each tensor of a shard is, from its header (read through `reader`, which is then at
    the shard's data section), each entry checked against the planned size of the file."""
    label = str(reader.source)
    try:
        size = header_size(bytes(reader.read(8)), label)
        header = decode_header(reader.read(size), size, label)
    except ValueError as exc:
        raise StepFailed(f"{label}: not a safetensors file ({exc})") from None
    data = reader.source.size - 8 - size
    return {
        name: stored(name, entry, shard, data, label)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def stored(name: str, entry: Any, shard: int, data: int, label: str) -> Stored:
    """One header entry, its dtype, shape and offsets checked against the `data` bytes after the
    header; anything malformed is a StepFailed naming `label`."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        raise StepFailed(f"{label}: tensor {name} has no dtype in the header; not a safetensors file")
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise StepFailed(f"{label}: tensor {name} is {entry['dtype']}; buildtrain imports F32, BF16 and F16")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2:
        raise StepFailed(f"{label}: tensor {name} has a malformed shape or data_offsets")
    begin, end = offsets
    if not begin <= end <= data or end - begin != math.prod(shape) * dtype[1]:
        raise StepFailed(
            f"{label}: tensor {name} of shape {shape} does not fit bytes {begin}..{end} of the file's data"
        )
    return Stored(shard=shard, dtype=dtype[0], shape=tuple(shape), begin=begin, end=end)


def _naturals(value: Any) -> bool:
    """Whether a header value is a list of non-negative integers."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def copy_weights(readers: list[SourceReader], layout: Layout, path: Path, chunk: int = STREAM_CHUNK) -> None:
    """Write buildtrain's weights file: the header, then every shard read to its end (which checks
    it against the plan), `chunk` bytes at a time, each tensor's bytes written at their place as
    they pass."""
    header, places = encode_header(
        (name, parts[0].dtype, stacked_shape(parts), sum(p.end - p.begin for p in parts))
        for name, parts in layout.items()
    )
    # Per shard, (first byte, end, where it goes in the output): a part's rows follow those above it
    moves: list[list[tuple[int, int, int]]] = [[] for _ in readers]
    for name, parts in layout.items():
        to = places[name]
        for part in parts:
            moves[part.shard].append((part.begin, part.end, to))
            to += part.end - part.begin
    buffer = bytearray(chunk)
    with durable_file(path) as output:
        output.write(header)
        for reader, shard_moves in zip(readers, moves, strict=True):
            stream_shard(reader, shard_moves, buffer, output)


def stream_shard(
    reader: SourceReader, moves: list[tuple[int, int, int]], buffer: bytearray, output: DurableWriter
) -> None:
    """Read a shard's data section to its end; the bytes [begin, end) of each move are written at
    its output offset as they pass through the buffer."""
    position = 0
    while chunk := reader.readinto(buffer):
        end = position + len(chunk)
        for begin, stop, to in moves:
            low, high = max(begin, position), min(stop, end)
            if low < high:
                output.write_at(to + low - begin, chunk[low - position : high - position])
        position = end


def stacked_shape(parts: tuple[Stored, ...]) -> tuple[int, ...]:
    """The shape of parts stacked by rows (one part: its own shape)."""
    first = parts[0].shape
    return (sum(p.shape[0] for p in parts), *first[1:]) if len(parts) > 1 else first


def weights_digests(path: Path) -> dict[str, str]:
    """What `store.tensors.safetensors_digests` computes, from the file just written: mapped
    rather than read (no fresh pages for its size), tensors digested in parallel."""
    entries = list(tensor_entries(*read_safetensors_header(path)))
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:

        def one(entry: tuple[str, str, list[int], int, int]) -> str:
            name, dtype, shape, begin, end = entry
            with memoryview(data)[begin:end] as raw:  # released before the mapping closes
                return tensor_digest(name, dtype, shape, raw)

        with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:  # blake3 lets go of the GIL
            return {entry[0]: found for entry, found in zip(entries, pool.map(one, entries), strict=True)}


def expected_shapes(model: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """buildtrain's tensor names and shapes for a model of these settings (tied: no output)."""
    dim, hidden, vocab = model["dim"], model["ffn_hidden"], model["vocab_size"]
    head = model.get("head_dim") or dim // model["n_heads"]
    qkv = (model["n_heads"] + 2 * model["n_kv_heads"]) * head
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
                f"{block}.attention.wo.weight": (dim, model["n_heads"] * head),
                f"{block}.ffn.w1.weight": (hidden, dim),
                f"{block}.ffn.w3.weight": (hidden, dim),
                f"{block}.ffn.w2.weight": (dim, hidden),
            }
        )
        if model["qkv_bias"]:
            shapes[f"{block}.attention.wqkv.bias"] = (qkv,)
        if model.get("qk_norm"):
            shapes.update({f"{block}.attention.{n}.weight": (head,) for n in ("q_norm", "k_norm")})
    return shapes


def buildtrain_layout(found: dict[str, Stored], model: dict[str, Any]) -> Layout:
    """The checkpoint's tensors under buildtrain's names, checked against the model's shapes."""
    renamed: Layout = {}
    projections: dict[str, dict[str, Stored]] = {}  # "blocks.i.attention.wqkv.weight" -> q, k, v
    for name, where in found.items():
        if name.endswith(RECOMPUTED) or (name == "lm_head.weight" and model["tie_embeddings"]):
            continue  # a tied head is the embedding itself
        target = buildtrain_name(name)
        if target is None:
            raise StepFailed(f"the checkpoint has a tensor buildtrain's model does not: {name}")
        prefix, _, leaf = target.rpartition(".")  # "blocks.0.attention.wq", "weight"
        if prefix.endswith((".wq", ".wk", ".wv")):
            block, _, part = prefix.rpartition(".")
            projections.setdefault(f"{block}.wqkv.{leaf}", {})[part] = where
            continue
        renamed[target] = (where,)
    for fused, parts in projections.items():
        if set(parts) != {"wq", "wk", "wv"}:
            raise StepFailed(f"the checkpoint lacks part of {fused} (has {sorted(parts)}); it is incomplete")
        stacked = tuple(parts[p] for p in ("wq", "wk", "wv"))
        if len({p.dtype for p in stacked}) != 1:
            raise StepFailed(
                f"the q, k and v projections of {fused} differ in dtype ({sorted(p.dtype for p in stacked)})"
            )
        if len({p.shape[1:] for p in stacked}) != 1 or not stacked[0].shape:
            raise StepFailed(
                f"the q, k and v projections of {fused} cannot be stacked by rows ({[p.shape for p in stacked]})"
            )
        renamed[fused] = stacked
    expected = expected_shapes(model)
    missing = sorted(set(expected) - set(renamed))
    if missing:
        raise StepFailed(
            f"the checkpoint lacks {len(missing)} tensors config.json implies, e.g. {missing[0]}"
        )
    for name, shape in expected.items():
        if stacked_shape(renamed[name]) != shape:
            raise StepFailed(
                f"tensor {name} has shape {list(stacked_shape(renamed[name]))}, config.json implies {list(shape)}"
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
    if module == "self_attn" and leaf in ("q_norm", "k_norm") and kind == "weight":
        return f"{block}.attention.{leaf}.weight"
    if module == "mlp" and leaf in MLP:
        return f"{block}.ffn.{MLP[leaf]}.{kind}"
    return None
