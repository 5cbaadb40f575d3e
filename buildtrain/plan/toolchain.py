"""The toolchain fingerprint: everything outside the config that changes the numbers.

Computed without importing torch (its version is read from `torch/version.py` as text) so that
`bt plan` stays instant; buildtrain's own code enters per step kind (see `sources_digest.py`).
What else enters depends on the numerics profile: `portable` promises the same bits at any thread
count on any x86-64 CPU with AVX2, so it records that target, not this CPU; `native` promises
nothing beyond this machine, so it records the thread count and the CPU itself.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from buildtrain.config.schema import NumericsConfig
from buildtrain.plan.sources_digest import source_digest


def torch_build() -> str:
    """The installed torch release, build tag and commit (`2.13.0+cpu@cf30153c4c13`).

    Read from torch/version.py as text: finding the package does not import it, and this is about
    thirty times cheaper than asking the package metadata.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "not-installed"
    try:
        text = (Path(spec.origin).parent / "version.py").read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    release = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    commit = re.search(r"^git_version\s*=\s*['\"]([0-9a-f]+)['\"]", text, re.MULTILINE)
    return (release.group(1) if release else "unknown") + (f"@{commit.group(1)[:12]}" if commit else "")


@functools.cache
def cpu_facts() -> dict[str, str]:
    flags: set[str] = set()
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "flags" and not flags:
                    flags = set(value.split())
                elif name.strip() == "model name":
                    model = value.strip()
    except OSError:
        pass
    if "avx512f" in flags:
        isa = "avx512"
    elif "avx2" in flags and "fma" in flags:
        isa = "avx2"
    else:
        isa = "baseline"
    return {"arch": platform.machine(), "isa": isa, "cpu": model}


def portable_target() -> str:
    """The CPU class the portable profile computes for (what its bits are identical across)."""
    arch = platform.machine()
    return "x86_64-avx2" if arch in ("x86_64", "AMD64") else arch


@functools.cache
def cuda_facts() -> dict[str, str]:
    """GPU model, driver and CUDA version from nvidia-smi (no torch import)."""
    if shutil.which("nvidia-smi") is None:
        return {"gpu": "none"}
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {"gpu": "unknown"}
    name, _, driver = output.partition(",")
    return {"gpu": name.strip(), "driver": driver.strip()}


def resolved_threads(numerics: NumericsConfig) -> int:
    return numerics.threads or os.cpu_count() or 1


def fingerprint(
    kind: str,
    numerics: NumericsConfig,
    *,
    torch: bool,
    threads: int | None = None,
    world_size: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The toolchain part of a step's hash, for a step of `kind` under `numerics`; a kind that
    computes without `torch` depends only on buildtrain's own code (its kind says which).

    `threads` overrides the thread count a native plan pins (the executor checks a machine with
    the count the plan will run at). `world_size` is given where a step's result depends on it;
    `extra`: numerics settings the kind's bits depend on beyond the profile.
    """
    facts: dict[str, Any] = {"buildtrain": source_digest(kind)}
    if not torch:
        return facts
    if world_size is not None:
        facts["world_size"] = world_size
    facts.update(torch=torch_build(), device=numerics.device, dtype=numerics.dtype, profile=numerics.profile)
    facts.update(extra or {})
    if numerics.device == "cuda":
        facts.update(cuda_facts())
    if numerics.profile == "portable":
        facts["target"] = portable_target()
    else:
        facts.update(cpu_facts(), threads=threads or resolved_threads(numerics))
    return facts


@functools.cache
def tokenizers_version() -> str:
    """The `tokenizers` release: a trained vocabulary and its encoding are that library's numbers."""
    from importlib import metadata

    try:
        return metadata.version("tokenizers")
    except metadata.PackageNotFoundError:
        return "not-installed"


def lm_eval_version() -> str:
    """The `lm-eval` release: a harness task's prompts, splits and metrics are its code."""
    from importlib import metadata

    try:
        return metadata.version("lm-eval")
    except metadata.PackageNotFoundError:
        return "not-installed"


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human lines naming each fingerprint field that differs."""
    lines = []
    for key in sorted(set(recorded) | set(current)):
        if recorded.get(key) != current.get(key):
            lines.append(f"{key}: plan has {recorded.get(key)!r}, this machine has {current.get(key)!r}")
    return lines
