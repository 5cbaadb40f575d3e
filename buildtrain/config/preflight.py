"""Pre-flight checks that need the machine, not just the preset: data presence, memory, device.

They run at `bt plan` time so that a doomed run fails in a fraction of a second instead of an hour
in. The memory estimate mirrors the model in `steps/train/model.py`; a test keeps the two equal.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat
from pathlib import Path

from buildtrain.config.loader import LoadedPreset, Problem, key_text
from buildtrain.config.schema import (
    BYTE_VOCAB_SIZE,
    ModelConfig,
    TokenizerConfig,
    TrainConfig,
    world_size_problem,
)

GIB = 1 << 30


def expand_sources(patterns: tuple[str, ...]) -> tuple[list[Path], list[str]]:
    """Files matched by the patterns, each once; and the patterns that matched nothing."""
    found: dict[tuple[int, int], Path] = {}  # by (device, inode): one stat per file, links count once
    empty: list[str] = []
    for pattern in patterns:
        matched = False
        for match in sorted(glob.glob(pattern, recursive=True)):
            try:
                info = os.stat(match)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                matched = True
                found.setdefault((info.st_dev, info.st_ino), Path(match))
        if not matched:
            empty.append(pattern)
    return list(found.values()), empty


def parameter_count(model: ModelConfig, vocab_size: int = BYTE_VOCAB_SIZE) -> int:
    head_dim = model.dim // model.n_heads
    kv_dim = model.n_kv_heads * head_dim
    norm = model.dim * (2 if model.norm == "layernorm" else 1)
    attention = model.dim * model.dim * 2 + model.dim * kv_dim * 2
    mlp = model.dim * model.ffn_hidden * (3 if model.mlp == "swiglu" else 2)
    block = attention + mlp + 2 * norm
    embeddings = vocab_size * model.dim * (1 if model.tie_embeddings else 2)
    return embeddings + model.n_layers * block + norm


def gradient_vectors(train: TrainConfig) -> int:
    """Gradient-sized float32 buffers an update holds at its peak: the gradient itself, plus for
    the invariant reduction one partial sum per level of its tree and the newest micro-batch's."""
    micro_batches = train.batch_size // train.micro_batch_size
    if train.reduction == "allreduce":
        return 1
    return 2 + max(0, micro_batches - 1).bit_length()


def memory_estimate(model: ModelConfig, train: TrainConfig, vocab_size: int = BYTE_VOCAB_SIZE) -> int:
    """Bytes for float32 weights, gradients (and the reduction's partial sums), two AdamW moments
    and one micro-batch of activations."""
    state = parameter_count(model, vocab_size) * 4 * (3 + gradient_vectors(train))
    tokens = train.micro_batch_size * train.seq_len
    per_layer = (
        tokens * (12 * model.dim + 3 * model.ffn_hidden)
        + train.micro_batch_size * model.n_heads * train.seq_len**2 * 2
    )
    activations = (model.n_layers * per_layer + tokens * vocab_size * 3) * 4
    return state + activations


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cuda_available() -> bool:
    """Whether a CUDA device is visible, asked without importing torch."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def preflight(loaded: LoadedPreset, world_size: int = 1) -> tuple[dict[str, list[Path]], list[str]]:
    """Source files per stage, and every machine-level problem with the preset for a run on
    `world_size` processes."""
    config = loaded.config
    problems: list[Problem] = []
    sources: dict[str, list[Path]] = {}

    def stage_key(index: int, *key: str) -> tuple[str | int, ...]:
        """The key as the preset spelled it: in the stage's own table, or inherited from the top."""
        own = ("stages", index, *key)
        return own if own in loaded.provenance else key

    for index, stage in enumerate(config.stages):
        unfit = world_size_problem(stage.train, world_size)
        if unfit is not None:
            key = stage_key(index, "train", "micro_batch_size")
            problems.append(Problem(loaded.source_of(key), key_text(key), unfit))
        if stage.data.source != "files":
            sources[stage.name] = []
            continue
        files, empty = expand_sources(stage.data.files)
        sources[stage.name] = files
        key = stage_key(index, "data", "files")
        for pattern in empty:
            problems.append(Problem(loaded.source_of(key), key_text(key), f"'{pattern}' matches no file"))

    available = machine_memory()
    for stage in config.stages:
        tokenizer = stage.data.tokenizer  # a trained BPE's size is known; a given file's only once read
        vocab_size = (
            tokenizer.vocab_size
            if isinstance(tokenizer, TokenizerConfig) and tokenizer.kind == "bpe"
            else BYTE_VOCAB_SIZE
        )
        needed = memory_estimate(config.model, stage.train, vocab_size)
        if needed > available:
            problems.append(
                Problem(
                    loaded.source_of(("model",)),
                    "model",
                    f"training stage '{stage.name}' needs about {needed / GIB:.1f} GiB "
                    f"(weights, gradients, AdamW state, activations) but this machine has {available / GIB:.1f} GiB; "
                    "reduce model.dim, model.n_layers, train.micro_batch_size or train.seq_len",
                )
            )
            break

    if config.numerics.device == "cuda" and not cuda_available():
        problems.append(
            Problem(
                loaded.source_of(("numerics", "device")),
                "numerics.device",
                "is 'cuda' but no CUDA device is visible on this machine; use device = \"cpu\"",
            )
        )
    lines: list[str] = []
    for problem in problems:
        if str(problem) not in lines:
            lines.append(str(problem))
    return sources, lines
