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
