"""The training state on disk and its digests: weights, optimizer moments, counters.

Tensors go to safetensors (no pickle on any load path), structure to JSON. The same tensor names
serve the files, the digests in the trace and the divergence report of `bt verify`, so a report can
say `model.blocks.0.attention.wqkv.weight` and a reader can open that tensor.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
from pathlib import Path

import blake3
import safetensors.torch
import torch

from buildtrain.steps.train.optimizer import AdamW

# File names inside a checkpoint (resume, verify, export and fsck read them): store/layout.py.
from buildtrain.store.layout import FROZEN, MODEL, OPTIMIZER, SHARDS, TRACE, TRAIN_STATE  # noqa: F401
from buildtrain.store.tensors import DTYPE_CODES, sharded_tensors, tensor_digest


def digest_tensor(name: str, tensor: torch.Tensor) -> str:
    """The canonical digest of a tensor, hashed in place through a zero-copy view (no numpy)."""
    tensor = tensor.detach().contiguous().cpu()  # stays referenced while its bytes are read
    size = tensor.numel() * tensor.element_size()
    view = memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B") if size else b""
    dtype = DTYPE_CODES[str(tensor.dtype).removeprefix("torch.")]
    return tensor_digest(name, dtype, list(tensor.shape), view)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name; a tied weight appears once, under its first name."""
    return {name: p.detach() for name, p in model.named_parameters()}


def trained_and_frozen(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The parameters that train and those that do not (LoRA's base model; none otherwise)."""
    trained = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
    return trained, frozen


def optimizer_tensors(model: torch.nn.Module, optimizer: AdamW) -> dict[str, torch.Tensor]:
    """AdamW moments and step counts by parameter name (`<param>.exp_avg`, ...)."""
    return optimizer.state_tensors(model.named_parameters())


def state_tensors(model: torch.nn.Module, optimizer: AdamW | None) -> dict[str, torch.Tensor]:
    """Every tensor of the training state, with `model.` and `optimizer.` prefixes (the weights
    alone when no optimizer is given)."""
    tensors = {f"model.{k}": v for k, v in model_tensors(model).items()}
    if optimizer is not None:
        tensors.update({f"optimizer.{k}": v for k, v in optimizer_tensors(model, optimizer).items()})
    return tensors


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: digest_tensor(name, tensor) for name, tensor in sorted(tensors.items())}


class FrozenDigests:
    """The per-update digests of weights that do not train (LoRA's base model) taken once, not at
    every update: hashing 25M frozen parameters cost about 5% of each LoRA update of
    benchmarks/finetune.py. A digest is reused only while its tensor is the same memory at the
    same version: torch bumps a tensor's version at every in-place write, through any view and
    under no_grad, so a write that slipped past the freeze is still seen. (A write through
    `.data` is not; nothing writes weights that way once training runs.) Checkpoints digest the
    whole state afresh."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {f"model.{name}" for name, p in model.named_parameters() if not p.requires_grad}
        # name -> (the tensor, held so that its memory cannot be reused, its version, its digest)
        self.known: dict[str, tuple[torch.Tensor, int, str]] = {}

    def digests(self, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
        found = {}
        for name, tensor in sorted(tensors.items()):
            held = self.known.get(name)
            if held is not None and _same(held[0], tensor) and held[1] == tensor._version:
                found[name] = held[2]
                continue
            found[name] = digest_tensor(name, tensor)
            if name in self.names:
                self.known[name] = (tensor, tensor._version, found[name])
        return found


def _same(held: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether two tensors view the same elements of the same memory."""
    return (held.data_ptr(), held.dtype, held.shape, held.stride()) == (
        tensor.data_ptr(),
        tensor.dtype,
        tensor.shape,
        tensor.stride(),
    )


# The per-update checksum of a tensor: four exact sums of its 32-bit words, each word split into
# 16-bit halves and weighted by its position (low and high 15 bits, plus one). Every product is
# below 2**31, so sums over fewer than 2**32 words are exact in int64, in any order, on any device
# and thread count. A changed word changes a sum by (difference) x (weight), never zero; two
# different words that trade places change the sum of the weight that tells their positions apart
# (positions are told apart up to 2**30 words, 4 GiB of float32 in one tensor). No division: on a
# GPU, int64 modulo is emulated, and the earlier form with two prime moduli cost 28 ms an update at
# GPT-2 small on an H100, this one a fraction of it.
WEIGHT_BITS = 15
NARROW_VIEWS = {1: torch.uint8, 2: torch.int16}  # wider elements are read as 32-bit words
# Tensors are checksummed together in groups of at most this many words (int32 temporaries of
# 128 MiB each; a larger tensor is a group of its own): a few dozen kernels per group, not per tensor.
GROUP_WORDS = 1 << 25
ROW = 128  # words per row in `_group_sums`; divides 2**WEIGHT_BITS


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns as a flat view of 8-, 16- or 32-bit words."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(NARROW_VIEWS.get(flat.element_size(), torch.int32))


def _groups(words: list[torch.Tensor]) -> list[list[int]]:
    """Consecutive runs of word views of one dtype (torch.cat needs one), each small enough."""
    groups: list[list[int]] = []
    size = 0
    for index, view in enumerate(words):
        if groups and words[groups[-1][-1]].dtype == view.dtype and size + view.numel() <= GROUP_WORDS:
            groups[-1].append(index)
            size += view.numel()
        else:
            groups.append([index])
            size = view.numel()
    return groups


def _group_sums(words: list[torch.Tensor]) -> torch.Tensor:
    """(tensors, 4): the four sums of each tensor of a group, from a few passes over the group.

    Each tensor is laid out in rows of ROW words, its last row padded with zeros (which add
    nothing). A word at row r of its tensor, column c, sits at position r * ROW + c: its low
    weight is (r % (2**15 / ROW)) * ROW + c + 1, its high weight depends on r alone. So per row,
    the sum of each half and the sum of each half times (c + 1) are enough (in int32: below
    ROW * ROW * 2**16 = 2**30); row weights combine them in int64, then each tensor sums its rows.
    Four passes over the group's words after the copy, where weighting every word took a dozen
    (7 ms an update at GPT-2 small on an H200, issue 26; 6x faster on the CPU).
    """
    device = words[0].device
    counts = [-(-view.numel() // ROW) for view in words]  # rows per tensor
    padding = torch.zeros(ROW, dtype=words[0].dtype, device=device)
    pieces = []  # each tensor, then the zeros that fill its last row
    for view, rows in zip(words, counts, strict=True):
        pieces += [view, padding[: rows * ROW - view.numel()]]
    bits = torch.cat(pieces).to(torch.int32).view(-1, ROW)  # (rows, ROW)
    halves = torch.empty(2, *bits.shape, dtype=torch.int32, device=device)  # low, high
    torch.bitwise_and(bits, 0xFFFF, out=halves[0])
    torch.bitwise_right_shift(bits, 16, out=halves[1]).bitwise_and_(0xFFFF)
    column = torch.arange(1, ROW + 1, dtype=torch.int32, device=device)
    plain = halves.sum(dim=2, dtype=torch.int32).long()  # (2, rows)
    weighted = (halves * column).sum(dim=2, dtype=torch.int32).long()
    bounds = torch.tensor([0, *itertools.accumulate(counts)]).to(device)
    at = torch.arange(bits.shape[0], device=device)
    row = at - bounds[torch.searchsorted(bounds[1:], at, right=True)]  # within its tensor
    low = (row & ((1 << WEIGHT_BITS) // ROW - 1)) * ROW  # what the row adds to each column's low weight
    high = ((row * ROW >> WEIGHT_BITS) & ((1 << WEIGHT_BITS) - 1)) + 1
    sums = torch.cat((weighted + low * plain, high * plain))  # (4, rows): (low, high) x (lo, hi half)
    return torch.stack([piece.sum(dim=1) for piece in sums.split(counts, dim=1)])


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Per-tensor checksums computed where the tensors live, with one small copy to the host.

    The per-update record on a GPU: a blake3 digest needs every byte on the host, which at
    GPT-2 size costs more than the update itself. The four sums (above) reach the host and are
    digested there, 16 hex characters per tensor; the full digests are still taken at every
    checkpoint and at the end, so nothing rests on the checksums alone.
    """
    names = sorted(tensors)
    if not names:
        return {}
    words = [_words(tensors[name]) for name in names]
    sums = torch.cat([_group_sums([words[i] for i in group]) for group in _groups(words)]).tolist()
    return {
        name: blake3.blake3(struct.pack("<4q", *four)).hexdigest()[:16]
        for name, four in zip(names, sums, strict=True)
    }


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    safetensors.torch.save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(path))


def load_model(model: torch.nn.Module, path: Path) -> None:
    """Load weights by name, from a safetensors file or a checkpoint folder (either layout);
    every parameter must be present and nothing else."""
    loaded = checkpoint_weights(path) if path.is_dir() else safetensors.torch.load_file(str(path))
    load_weights(model, loaded, path.name)


def load_weights(model: torch.nn.Module, loaded: dict[str, torch.Tensor], where: str) -> None:
    """Copy weights by name into the model; `where` names them in the error when the names are
    not exactly the model's parameters."""
    expected = set(model_tensors(model))
    if set(loaded) != expected:
        missing, extra = sorted(expected - set(loaded)), sorted(set(loaded) - expected)
        raise ValueError(
            f"{where}: tensors do not match the model (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(loaded[name])


def load_optimizer(model: torch.nn.Module, optimizer: AdamW, path: Path) -> None:
    """Restore AdamW moments and step counts saved by `optimizer_tensors`."""
    optimizer.load_state_tensors(model.named_parameters(), safetensors.torch.load_file(str(path)))


def checkpoint_tensors(folder: Path, optimizer: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's weights (`model.` names; with `optimizer`, its AdamW state too, `optimizer.`
    names) as whole tensors on the CPU, whether one process wrote it or every rank its shards."""
    if (folder / SHARDS).is_dir():
        return _read_shards(folder / SHARDS, "" if optimizer else "model.")
    tensors = {f"model.{k}": v for k, v in safetensors.torch.load_file(str(folder / MODEL)).items()}
    if (folder / FROZEN).is_file():  # LoRA: the frozen weights, in a file of their own
        tensors.update(
            {f"model.{k}": v for k, v in safetensors.torch.load_file(str(folder / FROZEN)).items()}
        )
    if optimizer:
        loaded = safetensors.torch.load_file(str(folder / OPTIMIZER))
        tensors.update({f"optimizer.{k}": v for k, v in loaded.items()})
    return tensors


def checkpoint_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights by parameter name (no `model.` prefix), either layout."""
    return {k.removeprefix("model."): v for k, v in checkpoint_tensors(folder).items()}


def _read_shards(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Whole tensors (those named `prefix...`) from a sharded checkpoint's shard files."""
    dtypes = {code: getattr(torch, name) for name, code in DTYPE_CODES.items()}
    return {
        name: torch.frombuffer(bytearray(data), dtype=dtypes[dtype]).reshape(shape)
        for name, (dtype, shape, data) in sharded_tensors(folder, prefix).items()
    }
