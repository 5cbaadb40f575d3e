"""The fused CPU kernels (`steps/train/kernels.c`): what they compute, that their bits depend on
the source alone (not on the vector width or the optimizer), and how they are built and chosen.
Every test here needs a C compiler, and the thread tests one with OpenMP (gcc): the suite's
machines have it (`.ci/run` installs gcc where there is no `cc`)."""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import MICRO, computing_with, plan_hash, run_bt, step_digests
from hypothesis import given, settings
from hypothesis import strategies as st
from test_model import rms_norm_by_definition, seeded

from buildtrain import native
from buildtrain.config.schema import ModelConfig, NumericsConfig
from buildtrain.errors import StepFailed
from buildtrain.kinds import KINDS
from buildtrain.plan.plan import Step
from buildtrain.plan.stored import load_plan
from buildtrain.plan.toolchain import Machine, fingerprint
from buildtrain.steps.train import kernels
from buildtrain.steps.train import model as eager
from buildtrain.store.store import Store

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


@pytest.fixture(autouse=True)
def fused_mode() -> Iterator[None]:
    with computing_with("fused"):
        yield


def close_to_float64(
    function: object, reference: object, inputs: list[torch.Tensor], tolerance: float
) -> None:
    """`function` in float32 against `reference` in float64: outputs and every input's gradient."""
    ours = [t.float().requires_grad_() for t in inputs]
    theirs = [t.double().requires_grad_() for t in inputs]
    out, expected = function(*ours), reference(*theirs)  # type: ignore[operator]
    grad = torch.randn(out.shape, generator=seeded(99), dtype=torch.float64)
    got = torch.autograd.grad(out, ours, grad.float())
    wanted = torch.autograd.grad(expected, theirs, grad)
    scale = expected.abs().max().item() + 1e-30
    assert (out.double() - expected).abs().max().item() <= tolerance * scale
    for mine, reference_grad in zip(got, wanted, strict=True):
        # Against at least 1, the size of the terms whose difference a gradient may be (RMSNorm's
        # over one channel cancels to nearly 0 exactly, where float32 keeps only the rounding).
        bound = tolerance * max(reference_grad.abs().max().item(), 1.0)
        assert (mine.double() - reference_grad).abs().max().item() <= bound


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(8, 300), seed=st.integers(0, 2**16))
def test_rms_norm_computes_the_definition_and_its_gradient(rows: int, width: int, seed: int) -> None:
    generator = seeded(seed)
    x = torch.randn(2, rows, width, generator=generator)
    weight = torch.rand(width, generator=generator) + 0.5
    close_to_float64(
        lambda x, w: kernels.RMSNorm.apply(x, w, 1e-5),
        lambda x, w: rms_norm_by_definition(x, w, 1e-5),
        [x, weight],
        2e-6,
    )


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 2000), scale=st.sampled_from([0.1, 1.0, 8.0, 40.0]), seed=st.integers(0, 2**16))
def test_swiglu_computes_silu_of_the_gate_times_up_and_its_gradient(n: int, scale: float, seed: int) -> None:
    generator = seeded(seed)
    gate, up = torch.randn(n, generator=generator) * scale, torch.randn(n, generator=generator)
    close_to_float64(kernels.SwiGLU.apply, lambda a, b: F.silu(a) * b, [gate, up], 2e-6)


def test_swiglu_at_the_edges_of_exp_and_beyond() -> None:
    gate = torch.tensor([-1e30, -200.0, -88.5, -87.0, -20.0, 0.0, 20.0, 87.0, 88.5, 200.0, 1e30])
    up = torch.ones_like(gate)
    ours = kernels.SwiGLU.apply(gate, up)
    expected = F.silu(gate.double())
    assert torch.allclose(ours.double(), expected, rtol=1e-6, atol=1e-30)
    nan = kernels.SwiGLU.apply(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, float("nan")]))
    assert nan.isnan().all()  # a NaN in either factor is never hidden


def test_rope_rotates_as_the_eager_rotation_does() -> None:
    qkv = torch.randn(3, 7, 4 + 2 * 2, 16, generator=seeded(1))
    cos, sin = eager.rope_tables(16, 7, 100.0)
    ours, theirs = torch.empty(3, 7, 6, 16), torch.empty(3, 7, 6, 16, dtype=torch.float64)
    kernels.rotate_into(ours, qkv[:, :, :6], cos, sin)  # strided input, as in the model
    eager.rotate_into(theirs, qkv[:, :, :6].double(), cos.double(), sin.double())
    assert torch.allclose(ours.double(), theirs, rtol=0, atol=1e-6)


def test_the_model_trains_alike_with_fused_and_eager_kernels() -> None:
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96)
    tokens = torch.randint(0, 257, (2, 33), generator=seeded(2))
    results = {}
    for mode in kernels.MODES:
        kernels.select(mode)
        model = eager.Transformer.build(config, 257, seeded(0))
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        results[mode] = loss.item(), [p.grad for p in model.parameters()]
    assert results["fused"][0] == pytest.approx(results["eager"][0], rel=1e-6)
    for fused, reference in zip(results["fused"][1], results["eager"][1], strict=True):
        assert torch.allclose(fused, reference, rtol=1e-4, atol=1e-6)


def build_variant(tmp_path: Path, *flags: str) -> ctypes.CDLL:
    """kernels.c compiled with the product's flags and then `flags` (a later -O wins)."""
    library = tmp_path / f"variant-{len(list(tmp_path.glob('variant-*.so')))}.so"
    cc = native.compiler()
    assert cc is not None
    subprocess.run([cc, *native.FLAGS, *flags, "-o", str(library), str(kernels.SOURCE), "-lm"], check=True)
    return kernels.declare(ctypes.CDLL(str(library)))


# Sizes with and without an eight-lane tail, and sizes large enough to be split among 4 threads.
NORM_SHAPES = ((33, 256), (17, 75), (301, 257))
SWIGLU_SIZES = (3 * 256 + 13, 70_001)
ROPE_SHAPES = ((2, 5, 3, 12), (3, 50, 4, 128))


def every_kernel(lib: ctypes.CDLL, threads: int = 1) -> list[torch.Tensor]:
    """Each kernel's outputs on one set of inputs, computed with up to `threads` threads."""
    g = seeded(5)
    outputs = []
    for rows, width in NORM_SHAPES:
        x, w, grad = (
            torch.randn(rows, width, generator=g),
            torch.rand(width, generator=g),
            torch.randn(rows, width, generator=g),
        )
        out, rstd, dx, dw = torch.empty_like(x), torch.empty(rows), torch.empty_like(x), torch.empty_like(w)
        lib.bt_rms_norm_forward(
            x.data_ptr(), w.data_ptr(), out.data_ptr(), rstd.data_ptr(), rows, width, 1e-5, threads
        )
        lib.bt_rms_norm_backward(
            grad.data_ptr(),
            x.data_ptr(),
            w.data_ptr(),
            rstd.data_ptr(),
            dx.data_ptr(),
            dw.data_ptr(),
            rows,
            width,
        )
        outputs += [out, rstd, dx, dw]
    for n in SWIGLU_SIZES:
        a, b, grad = torch.randn(n, generator=g) * 6, torch.randn(n, generator=g), torch.randn(n, generator=g)
        out, da, db = torch.empty(n), torch.empty(n), torch.empty(n)
        lib.bt_swiglu_forward(a.data_ptr(), b.data_ptr(), out.data_ptr(), n, threads)
        lib.bt_swiglu_backward(
            grad.data_ptr(), a.data_ptr(), b.data_ptr(), da.data_ptr(), db.data_ptr(), n, threads
        )
        outputs += [out, da, db]
    for B, T, H, hs in ROPE_SHAPES:
        x, (cos, sin) = torch.randn(B, T, H, hs, generator=g), eager.rope_tables(hs, T, 100.0)
        rotated = torch.empty_like(x)
        lib.bt_rope(
            rotated.data_ptr(),
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            B,
            T,
            H,
            hs,
            *x.stride()[:3],
            *rotated.stride()[:3],
            threads,
        )
        outputs.append(rotated)
    for n in SWIGLU_SIZES:
        param, exp_avg, exp_avg_sq = (
            torch.randn(n, generator=g),
            torch.randn(n, generator=g),
            torch.rand(n, generator=g),
        )
        grad = torch.randn(n, generator=g)
        lib.bt_adamw(
            *(t.data_ptr() for t in (param, grad, exp_avg, exp_avg_sq)),
            n,
            0.999,
            0.1,
            0.95,
            0.05,
            0.3,
            1e-8,
            -0.01,
            threads,
        )
        outputs += [param, exp_avg, exp_avg_sq]
    return outputs


def test_the_bits_do_not_depend_on_the_thread_count() -> None:
    """Every kernel at 1, 2, 3, 4 and 8 threads on sizes that are split (checked), bit for bit."""
    lib = kernels.library()
    (rows, width), n, (B, T, H, hs) = NORM_SHAPES[-1], SWIGLU_SIZES[-1], ROPE_SHAPES[-1]
    assert lib.bt_parallel_parts(rows, width, 4) == 4  # the library was built with OpenMP
    assert lib.bt_parallel_parts(n, 1, 4) == 4
    assert lib.bt_parallel_parts(B * T, H * hs, 4) == 4
    assert lib.bt_parallel_parts(NORM_SHAPES[0][0], NORM_SHAPES[0][1], 4) == 1  # too small to split
    one = every_kernel(lib, threads=1)
    for threads in (2, 3, 4, 8):
        for ours, theirs in zip(one, every_kernel(lib, threads), strict=True):
            assert torch.equal(ours, theirs), threads


def test_the_bits_depend_on_the_source_not_on_vector_width_or_optimizer(tmp_path: Path) -> None:
    """The library steps load (vector clones on x86-64 Linux, OpenMP, 4 threads) against a
    baseline-only build and an unvectorized one, both without OpenMP: the same bits, as kernels.c's
    ordering rules promise."""
    loaded = every_kernel(kernels.library(), threads=4)
    for flags in (("-DBT_BASELINE_ONLY",), ("-O1", "-fno-tree-vectorize", "-DBT_BASELINE_ONLY")):
        for ours, theirs in zip(
            loaded, every_kernel(build_variant(tmp_path, *flags), threads=4), strict=True
        ):
            assert torch.equal(ours, theirs), flags


def fresh_cache(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    native.load.cache_clear()


def test_a_damaged_cached_library_is_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh_cache(monkeypatch, tmp_path)
    native.load(kernels.SOURCE)
    (library,) = (tmp_path / "buildtrain" / "kernels").glob("*.so")
    built = library.read_bytes()
    library.write_bytes(built[:-1] + bytes([built[-1] ^ 1]))
    native.load.cache_clear()
    native.load(kernels.SOURCE)
    assert library.read_bytes() == built  # not loaded: rebuilt, and the record agrees with it
    native.load.cache_clear()


def test_a_compiler_that_fails_stops_the_step_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh_cache(monkeypatch, tmp_path)
    failing = tmp_path / "broken-cc"
    failing.write_text("#!/bin/sh\necho 'broken-cc: cannot find crt1.o' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with pytest.raises(
        StepFailed,
        match=r"could not build kernels.c \(exit 1\): broken-cc: cannot find crt1.o;.*numerics.kernels = 'eager'",
    ):
        native.load(kernels.SOURCE)
    assert list((tmp_path / "buildtrain" / "kernels").iterdir()) == []  # nothing half-written
    native.load.cache_clear()


def test_a_compiler_without_openmp_builds_single_threaded_kernels_with_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that refuses -fopenmp (as clang without libomp does) still builds the kernels:
    one range per call, the same bits as the threaded build."""
    fresh_cache(monkeypatch, tmp_path)
    cc = native.compiler()
    without = tmp_path / "cc-without-openmp"
    without.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "unsupported: $a" >&2; exit 1; }}; done\n'
        f'exec {cc} "$@"\n'
    )
    without.chmod(0o755)
    monkeypatch.setenv("CC", str(without))
    single = kernels.declare(native.load(kernels.SOURCE))
    native.load.cache_clear()
    assert single.bt_parallel_parts(10**6, 1, 4) == 1
    for ours, theirs in zip(every_kernel(kernels.library(), 4), every_kernel(single, 4), strict=True):
        assert torch.equal(ours, theirs)


def test_the_fingerprint_records_which_kernels_a_cpu_step_computes_with() -> None:
    def facts(kernels_setting: str, machine_kernels: str, device: str = "cpu") -> dict[str, object]:
        machine = Machine(
            torch="2.13.0",
            cpu={},
            target="x86_64-avx2",
            gpu={},
            cores=2,
            tokenizers="0.22",
            kernels=machine_kernels,
        )
        numerics = NumericsConfig(kernels=kernels_setting, device=device)
        return fingerprint(KINDS["train"].computes, numerics, torch=True, machine=machine)

    assert facts("auto", "fused")["kernels"] == "fused"
    assert facts("auto", "eager")["kernels"] == "eager"  # no compiler there: torch's operations
    assert facts("eager", "fused")["kernels"] == "eager"
    assert facts("fused", "eager")["kernels"] == "fused"  # asked for: that step fails there, clearly
    assert "kernels" not in facts("auto", "fused", device="cuda")


def test_without_a_compiler_auto_resolves_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert native.compiler() is None
    assert Machine.here(cuda=False).kernels == "eager"


def test_an_unwritable_kernel_cache_stops_the_step_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    fresh_cache(monkeypatch, blocked)
    with pytest.raises(StepFailed, match=r"cannot build kernels.c into .*a-file.*; set XDG_CACHE_HOME"):
        native.load(kernels.SOURCE)
    native.load.cache_clear()


# -- end to end: the plan's hash names the kernels, the step computes with those ---------------------


def train_step(store: Path, *overrides: str, env: dict[str, str] | None = None) -> tuple[str, Step]:
    planned = plan_hash(run_bt("plan", str(MICRO), *overrides, store=store, env=env))
    (step,) = [s for s in load_plan(Store(store), planned).steps if s.kind == "train"]
    return planned, step


def test_fused_and_eager_plans_are_other_steps_that_train_alike(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    fused_plan, fused = train_step(store)
    eager_plan, eager_step = train_step(store, "--set", "numerics.kernels=eager")
    assert (fused.toolchain["kernels"], eager_step.toolchain["kernels"]) == ("fused", "eager")
    assert fused.hash != eager_step.hash
    for planned in (fused_plan, eager_plan):
        assert run_bt("run", planned, store=store).returncode == 0
    digests = step_digests(store, fused_plan), step_digests(store, eager_plan)
    assert digests[0]["train:main"] != digests[1]["train:main"]  # other bits, as the hashes say
    losses = [final_loss(store.parent / "experiments", planned) for planned in (fused_plan, eager_plan)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)


def final_loss(records: Path, planned: str) -> float:
    import json

    (record,) = records.glob(f"*-{planned[:12]}")
    events = [json.loads(line) for line in (record / "train.log").read_text().splitlines()]
    assert any(e["event"] == "kernels_selected" for e in events)
    return [e["loss"] for e in events if e["event"] == "train_step"][-1]


def test_a_plan_made_without_a_compiler_is_refused_where_one_would_change_the_bits(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    planned, step = train_step(store, env={"CC": "no-such-compiler-here"})
    assert step.toolchain["kernels"] == "eager"
    refused = run_bt("run", planned, store=store)
    assert refused.returncode == 6 and "kernels" in refused.stderr, refused.stderr


def test_fused_kernels_without_a_compiler_fail_the_step_in_one_line(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    # native: a portable process on a non-Intel CPU needs the compiler first for MKL's shim
    # (test_mkl.py), and would fail on that before it reached the kernels
    planned, _ = train_step(store, "--set", "numerics.kernels=fused", "--set", "numerics.profile=native")
    failed = run_bt("run", planned, store=store, env={"CC": "no-such-compiler-here"})
    assert failed.returncode == 1, failed.stderr
    assert "no C compiler to build kernels.c" in failed.stderr and "Traceback" not in failed.stderr


def test_mismatched_shapes_are_refused_before_the_c_reads_past_a_tensor() -> None:
    x = torch.randn(2, 7, 3, 16)
    cos, sin = eager.rope_tables(16, 6, 100.0)  # one position short
    with pytest.raises(ValueError, match="RoPE of x"):
        kernels.rotate_into(torch.empty_like(x), x, cos, sin)
    with pytest.raises(ValueError, match="RMSNorm weight"):
        kernels.RMSNorm.apply(torch.randn(4, 8), torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="SwiGLU gate"):
        kernels.SwiGLU.apply(torch.randn(10), torch.randn(9))
