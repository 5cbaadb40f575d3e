"""One portable plan, the same bytes on an Intel and an AMD CPU, proven on any x86-64 host.

qemu-user runs a Linux process on an emulated CPU: `-cpu Haswell` reports GenuineIntel with AVX2
and FMA, `-cpu EPYC` AuthenticAMD (qemu's TCG emulates AVX2 and FMA, not AVX-512). The micro
preset is planned once and built three times in three stores: with its step processes on this
machine, and with every step process under each emulated CPU (the launch hook below; bt itself
computes nothing). Each build's published outputs (data, weights, eval, export) are compared
byte for byte, and each train step's log says which vendor MKL's own check saw, so a hook that
silently did nothing fails here instead of passing.

`.ci/run` installs Debian's qemu-user, as it installs Slurm; without it these tests skip.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, plan_hash, run_bt

from buildtrain.executor.process import mkl
from buildtrain.executor.process.launch import EMULATOR_HOOK
from buildtrain.plan.stored import load_plan
from buildtrain.plan.toolchain import cpu_vendor
from buildtrain.store.store import Store

MICRO = REPO / "tests" / "presets" / "micro.toml"
QEMU = shutil.which("qemu-x86_64")
pytestmark = [
    pytest.mark.skipif(not mkl.applies(), reason="qemu-x86_64 emulates an x86-64 CPU on an x86-64 host here"),
    pytest.mark.skipif(QEMU is None, reason="needs qemu-user (apt-get install qemu-user, as .ci/run does)"),
]
CPUS = {"native": None, "intel": "Haswell", "amd": "EPYC"}


def published_files(store: Path, plan: str) -> dict[str, dict[str, bytes]]:
    """Every file of every built step's output, by step label and path: the bytes compared."""
    outputs = {}
    for step in load_plan(Store(store), plan).steps:
        folder = Store(store).outputs.path(step.hash)
        files = sorted(path for path in folder.rglob("*") if path.is_file())
        outputs[step.label] = {str(path.relative_to(folder)): path.read_bytes() for path in files}
    return outputs


def mkl_saw_intel(experiments: Path) -> bool:
    """What MKL's own vendor check answered in the train step's process (its numerics event)."""
    for log in experiments.rglob("*.log"):
        for line in log.read_text(encoding="utf-8").splitlines():
            if '"numerics_applied"' in line and '"train:main"' in line:
                return json.loads(line)["mkl_sees_intel"]
    raise AssertionError(f"no numerics_applied event of train:main under {experiments}")


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """The micro plan built natively and under each emulated CPU: store and plan hash."""
    built = {}
    for name, cpu in CPUS.items():
        store = tmp_path_factory.mktemp(name) / ".bt"
        planned = plan_hash(run_bt("plan", str(MICRO), store=store))
        env = {EMULATOR_HOOK: f"{QEMU} -cpu {cpu}"} if cpu else {}
        result = run_bt("run", planned, store=store, env=env, timeout=900)
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
        built[name] = (store, planned)
    return built


def test_one_plan_hash_on_this_machine_and_both_emulated_vendors(builds: dict[str, tuple[Path, str]]) -> None:
    assert len({planned for _, planned in builds.values()}) == 1


@pytest.mark.parametrize("name", ["intel", "amd"])
def test_an_emulated_vendor_publishes_this_machines_bytes(
    builds: dict[str, tuple[Path, str]], name: str
) -> None:
    here, other = published_files(*builds["native"]), published_files(*builds[name])
    assert set(here) == {"data:main", "train:main", "eval", "export"}
    for label, files in here.items():
        assert other[label].keys() == files.keys(), label
        differing = [path for path in files if other[label][path] != files[path]]
        assert not differing, f"{label} under qemu -cpu {CPUS[name]}: {differing}"


@pytest.mark.parametrize("name", ["native", "intel", "amd"])
def test_each_build_computed_on_the_vendor_it_claims(builds: dict[str, tuple[Path, str]], name: str) -> None:
    """MKL's own check (the one the shim answers for it) saw the emulated vendor: the steps
    really ran under qemu, and on both vendors' CPUs."""
    store, _ = builds[name]
    expected = cpu_vendor() == "intel" if name == "native" else name == "intel"
    assert mkl_saw_intel(store.parent / "experiments") is expected
