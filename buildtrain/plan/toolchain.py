"""The toolchain fingerprint: everything outside the config that changes the numbers.

Computed without importing torch (its version is read from `torch/version.py` as text) so that
`bt plan` stays instant; buildtrain's own code enters per step kind (see `sources_digest.py`).
What else enters depends on the numerics profile: `portable` promises the same bits at any thread
count on any x86-64 CPU with AVX2 and FMA, Intel or AMD, so it records that target, not this CPU; `native` promises nothing beyond this machine, so it records the thread count and the
CPU itself. A CPU step also records whether its model computes with the fused C kernels
(`numerics.kernels`; `auto` means: where the executing machine has a C compiler, `native.py`).

The facts come from the machine that will execute the step: this one, or a worker of a cluster
(`Machine`, which `bt plan --executor ray|slurm` asks the engine for), so that a plan made on a
laptop for GPU nodes names the GPU nodes' result.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from buildtrain import native
from buildtrain.config.schema import NumericsConfig
from buildtrain.plan.sources_digest import source_digest

# A test hook: the torch build this process reports (a worker that differs from the planner).
TORCH_BUILD_HOOK = "BT_TEST_TORCH_BUILD"


def torch_build() -> str:
    """The installed torch release, build tag and commit (`2.13.0+cpu@cf30153c4c13`).

    Read from torch/version.py as text: finding the package does not import it, and this is about
    thirty times cheaper than asking the package metadata.
    """
    if os.environ.get(TORCH_BUILD_HOOK):
        return os.environ[TORCH_BUILD_HOOK]
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
def cpuinfo() -> str:
    """/proc/cpuinfo's text, read once per process ("" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def cpuinfo_values(text: str, field: str) -> list[str]:
    """The values of every `field` line of a /proc/cpuinfo text (one per logical CPU), in order."""
    values = []
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            values.append(value.strip())
    return values


@functools.cache
def cpu_facts() -> dict[str, str]:
    text = cpuinfo()
    flags = set(next((value for value in cpuinfo_values(text, "flags") if value), "").split())
    model = (cpuinfo_values(text, "model name") or [platform.processor() or "unknown"])[-1]
    if "avx512f" in flags:
        isa = "avx512"
    elif "avx2" in flags and "fma" in flags:
        isa = "avx2"
    else:
        isa = "baseline"
    return {"arch": platform.machine(), "isa": isa, "cpu": model}


# Short names of /proc/cpuinfo's vendor_id (run records and messages; no hash names the vendor).
VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}


def portable_target() -> str:
    """The CPU class the portable profile computes for (what its bits are identical across):
    `x86_64-avx2`, the AVX2 code paths of any x86-64 CPU with AVX2 and FMA, Intel or AMD.

    The vendor is not part of it. It was, while MKL ignored the asked branch on AMD CPUs and one
    portable plan of presets/tiny.toml trained to other weights on an EPYC than on a Xeon; a
    portable step process now makes MKL take that branch on any vendor and refuses to compute
    when it does not (`executor/process/mkl.py`), and the same plan trains to the same weights on both.
    """
    arch = platform.machine()
    if arch not in ("x86_64", "AMD64"):
        return arch
    return "x86_64-avx2"


@functools.cache
def cpu_vendor() -> str:
    """This CPU's vendor, short (`intel`, `amd`), from /proc/cpuinfo; `unknown` without it."""
    return vendor_name(cpuinfo())


def vendor_name(text: str) -> str:
    """The short vendor name of a /proc/cpuinfo text (its first non-empty vendor_id)."""
    vendor = next((value for value in cpuinfo_values(text, "vendor_id") if value), None)
    return "unknown" if vendor is None else VENDORS.get(vendor, vendor.lower())


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


@attrs.frozen(kw_only=True)
class Machine:
    """What a step's fingerprint records of the machine that executes it; plain data, so an engine
    can carry it back from a worker (see `here`)."""

    torch: str  # torch_build()
    cpu: Mapping[str, str]  # cpu_facts(): arch, isa, model
    target: str  # portable_target()
    gpu: Mapping[str, str]  # cuda_facts(), asked only for a CUDA plan ({} otherwise)
    cores: int
    tokenizers: str  # tokenizers_version()
    kernels: str  # "fused" where a C compiler builds the CPU kernels (native.compiler()), else "eager"

    @classmethod
    def here(cls, cuda: bool) -> Machine:
        """This machine; `cuda`: also ask nvidia-smi (a CPU plan never needs it)."""
        return cls(
            torch=torch_build(),
            cpu=cpu_facts(),
            target=portable_target(),
            gpu=cuda_facts() if cuda else {},
            cores=os.cpu_count() or 1,
            tokenizers=tokenizers_version(),
            kernels="fused" if native.compiler() is not None else "eager",
        )


# An engine's answer to "what machine will execute a step of this device?" (None: this one).
WorkerProbe = Callable[[str], "Machine | None"]


def resolved_threads(numerics: NumericsConfig, machine: Machine | None = None) -> int:
    cores = machine.cores if machine is not None else os.cpu_count()
    return numerics.threads or cores or 1


def fingerprint(
    computes: str,
    numerics: NumericsConfig,
    *,
    torch: bool,
    also: tuple[str, ...] = (),
    threads: int | None = None,
    world_size: int | None = None,
    extra: Mapping[str, Any] | None = None,
    machine: Machine | None = None,
) -> dict[str, Any]:
    """The toolchain part of a step's hash, for a step whose kind computes in the module
    `computes` (`StepKind.computes`) under `numerics`; a kind that computes without `torch`
    depends only on buildtrain's own code (its kind says which).

    `also`: modules the computation reaches by name, not by import (`StepKind.also_computes`),
    hashed as the computing module is. `threads` overrides the thread count a native plan pins
    (the executor checks a machine with the count the plan will run at). `world_size` is given where a step's result depends on it;
    `extra`: numerics settings the kind's bits depend on beyond the profile; `machine`: the one
    that will execute the step (default: this one).
    """
    facts: dict[str, Any] = {"buildtrain": source_digest(computes, also=also)}
    if not torch:
        return facts
    machine = machine or Machine.here(cuda=numerics.device == "cuda")
    if world_size is not None:
        facts["world_size"] = world_size
    facts.update(torch=machine.torch, device=numerics.device, dtype=numerics.dtype, profile=numerics.profile)
    facts.update(extra or {})
    if numerics.device == "cuda":
        facts.update(machine.gpu)
    else:
        facts["kernels"] = machine.kernels if numerics.kernels == "auto" else numerics.kernels
    if numerics.profile == "portable":
        facts["target"] = machine.target
    else:
        facts.update(machine.cpu, threads=threads or resolved_threads(numerics, machine))
    return facts


@functools.cache
def tokenizers_version() -> str:
    """The `tokenizers` release: a trained vocabulary and its encoding are that library's numbers."""
    from importlib import metadata

    try:
        return metadata.version("tokenizers")
    except metadata.PackageNotFoundError:
        return "not-installed"


def library_version(distribution: str) -> str:
    """The release of `distribution` (a suite kind's `library`: `lm-eval`, whose code is a harness
    task's prompts, splits and metrics)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not-installed"


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human lines naming each fingerprint field that differs."""
    lines = []
    for key in sorted(set(recorded) | set(current)):
        if recorded.get(key) != current.get(key):
            lines.append(f"{key}: plan has {recorded.get(key)!r}, this machine has {current.get(key)!r}")
    return lines
