"""The training state on disk and its digests: weights, optimizer moments, counters.

Tensors go to safetensors (no pickle on any load path), structure to JSON. The same tensor names
serve the files, the digests in the trace and the divergence report of `bt verify`, so a report can
say `model.blocks.0.attention.wqkv.weight` and a reader can open that tensor.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import safetensors.torch
import torch

from buildtrain.steps.train.optimizer import AdamW

# File names inside a checkpoint (resume, verify, export and fsck read them): store/layout.py.
from buildtrain.store.layout import MODEL, OPTIMIZER, TRACE, TRAIN_STATE  # noqa: F401
from buildtrain.store.tensors import DTYPE_CODES, tensor_digest


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


# Two prime moduli below 2**31 and odd position multipliers: every term stays below 2**31, so a sum
# over fewer than 2**32 elements cannot overflow int64, and integer sums are exact in any order.
CHECKSUM_PRIMES = (2_147_483_629, 2_147_483_587)
NARROW_VIEWS = {1: torch.uint8, 2: torch.int16}  # wider elements are read as 32-bit words


def _checksum_terms(tensor: torch.Tensor) -> torch.Tensor:
    """Two exact, position-dependent integer sums of a tensor's bit patterns, on its device."""
    flat = tensor.detach().contiguous().reshape(-1)
    words = flat.view(NARROW_VIEWS.get(flat.element_size(), torch.int32))
    bits = words.to(torch.int64) & 0xFFFFFFFF
    position = torch.arange(words.numel(), device=flat.device, dtype=torch.int64)
    terms = []
    for index, prime in enumerate(CHECKSUM_PRIMES):
        multiplier = (position * (2 * index + 3) + 1) % prime  # below 2**31: products below 2**63
        terms.append(((bits % prime) * multiplier % prime).sum() % prime)
    return torch.stack(terms)


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Per-tensor checksums computed where the tensors live, with one small copy to the host.

    The per-update record on a GPU: a blake3 digest needs every byte on the host, which at
    GPT-2 size costs more than the update itself. An element changed anywhere, or two elements
    swapped, changes a checksum (short of a collision modulo both primes); the full digests are
    still taken at every checkpoint and at the end, so nothing rests on the checksums alone.
    """
    names = sorted(tensors)
    if not names:
        return {}
    sums = torch.stack([_checksum_terms(tensors[name]) for name in names]).tolist()
    return {name: f"{first:08x}{second:08x}" for name, (first, second) in zip(names, sums, strict=True)}


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    safetensors.torch.save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(path))


def load_model(model: torch.nn.Module, path: Path) -> None:
    """Load weights by name; every parameter must be present and nothing else."""
    loaded = safetensors.torch.load_file(str(path))
    expected = set(model_tensors(model))
    if set(loaded) != expected:
        missing, extra = sorted(expected - set(loaded)), sorted(set(loaded) - expected)
        raise ValueError(
            f"{path.name}: tensors do not match the model (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(loaded[name])


def load_optimizer(model: torch.nn.Module, optimizer: AdamW, path: Path) -> None:
    """Restore AdamW moments and step counts saved by `optimizer_tensors`."""
    optimizer.load_state_tensors(model.named_parameters(), safetensors.torch.load_file(str(path)))
