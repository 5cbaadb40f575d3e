"""Pre-flight checks that need the machine, not just the preset: data presence, memory, device.

They run at `bt plan` time so that a doomed run fails in a fraction of a second instead of an hour
in. The memory estimate is `shape.memory_estimate`.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat
from pathlib import Path

from buildtrain.config.loader import LoadedPreset
from buildtrain.config.problems import KeyPath, Problem
from buildtrain.config.schema import world_size_problem
from buildtrain.config.shape import memory_estimate, planned_vocab_size

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

    def stage_key(index: int, *key: str) -> KeyPath:
        """The key as the preset spelled it: in the stage's own table, or inherited from the top."""
        own = ("stages", index, *key)
        return own if own in loaded.provenance else key

    for index, stage in enumerate(config.stages):
        unfit = world_size_problem(stage.train, world_size)
        if unfit is not None:
            key = stage_key(index, "train", "micro_batch_size")
            source = loaded.blame(key, stage_key(index, "train", "batch_size"))
            problems.append(Problem(source, key, unfit))
        if stage.data.source != "files":
            sources[stage.name] = []
            continue
        files, empty = expand_sources(stage.data.files)
        sources[stage.name] = files
        key = stage_key(index, "data", "files")
        for pattern in empty:
            hint = (
                f"; it is a folder: give a glob such as '{pattern.rstrip('/')}/*.txt'"
                if os.path.isdir(pattern)
                else ""
            )
            problems.append(Problem(loaded.source_of(key), key, f"'{pattern}' matches no file{hint}"))

    available = machine_memory()
    for stage in config.stages:
        needed = memory_estimate(config.model, stage.train, planned_vocab_size(stage.data))
        if needed > available:
            problems.append(
                Problem(
                    loaded.source_of(("model",)),
                    ("model",),
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
                ("numerics", "device"),
                "is 'cuda' but no CUDA device is visible on this machine; use device = \"cpu\"",
            )
        )
    return sources, [str(problem) for problem in dict.fromkeys(problems)]
