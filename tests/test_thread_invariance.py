"""The portable profile gives the same bits at any thread count; native does not (and says so).

Op level: every building block of an update, computed the way a portable step process computes
it (`numerics.apply_after_import` with the requested thread count), on tensors large enough for
ATen to split them across threads (above 32,768 elements), gives the bits of one thread. The
negative controls show the sizes are large enough: with that many intra-op threads, the model's
forward and backward do change.

End to end: tests/presets/wide.toml trained at 1, 3, 4, 7, 8 and 16 threads gives identical
digests (through `bt run` and `bt verify --threads`), and the same preset under `native` gives
different weights at 1 and 4 threads, which is why native pins its thread count in the hash.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, computing_with, plan_hash, run_bt, step_digests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buildtrain.config import preflight, shape
from buildtrain.config.schema import BYTE_VOCAB_SIZE, EvalConfig, ModelConfig
from buildtrain.executor.process import numerics
from buildtrain.executor.process.launch import SINGLE_PROCESS
from buildtrain.executor.process.policy import step_launch
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.stored import load_plan
from buildtrain.steps.train.heldout import evaluate
from buildtrain.steps.train.model import Transformer
from buildtrain.steps.train.optimizer import AdamW
from buildtrain.steps.train.reduce import gradients_to_vector, tree_sum
from buildtrain.steps.train.state import digests
from buildtrain.store.store import Store

WIDE = REPO / "tests" / "presets" / "wide.toml"
THREADS = [2, 3, 4, 7, 8, 16]
SPLIT = 32_768  # ATen's grain size: below it, work stays on one thread whatever the setting


def under(profile: str, threads: int, compute: Callable[[], Any]) -> Any:
    """`compute()` with torch set up as a step process of `profile` asking for `threads`."""
    before = torch.get_num_threads()
    try:
        numerics.apply_after_import(torch, profile, "cpu", threads)
        return compute()
    finally:
        torch.set_num_threads(before)


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for key in sorted(value):
            yield from tensors_of(value[key])
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_of(item)


def same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and not any(isinstance(v, torch.Tensor | dict) for v in a.values()):
        return a == b  # plain results (digests, evaluation figures)
    pairs = list(zip(tensors_of(a), tensors_of(b), strict=True))
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def wide_model(dim: int, seed: int) -> Transformer:
    config = ModelConfig(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=dim * 11 // 4)
    return Transformer.build(config, BYTE_VOCAB_SIZE, generator(seed))


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, BYTE_VOCAB_SIZE, (batch, length + 1), generator=generator(seed))


# -- the building blocks of an update, as the trainer computes them ---------------------------------


def forward_backward(dim: int, batch: int, length: int, seed: int) -> dict[str, Any]:
    model = wide_model(dim, seed)
    rows = tokens(batch, length, seed + 1)
    logits = model(rows[:, :-1])  # (B, T, vocab)
    loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten()) / 2
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads}


def loss_only(batch: int, length: int, seed: int) -> torch.Tensor:
    logits = torch.randn(batch, length, BYTE_VOCAB_SIZE, generator=generator(seed), requires_grad=True)
    targets = tokens(batch, length - 1, seed + 1)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / 4
    loss.backward()
    assert logits.grad is not None
    return torch.cat([loss.detach().reshape(1), logits.grad.flatten()])


def gradient_tree(micro_batches: int, size: int, seed: int) -> torch.Tensor:
    parameters = [
        torch.zeros(size // 2, requires_grad=True),
        torch.zeros(size - size // 2, requires_grad=True),
    ]

    def leaf(micro: int) -> torch.Tensor:
        for index, parameter in enumerate(parameters):
            parameter.grad = torch.randn(parameter.shape, generator=generator(seed + 2 * micro + index))
        return gradients_to_vector(parameters, torch.tensor(float(micro)))

    return tree_sum((0, micro_batches), leaf)


def clipping(size: int, max_norm: float, seed: int) -> list[torch.Tensor]:
    parameters = [torch.zeros(size), torch.zeros(size // 3, 7), torch.zeros(61)]
    for index, parameter in enumerate(parameters):
        parameter.grad = torch.randn(parameter.shape, generator=generator(seed + index))
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return [norm, *(p.grad for p in parameters if p.grad is not None)]


def adamw(size: int, updates: int, seed: int) -> dict[str, Any]:
    matrix = torch.randn(size // 64, 64, generator=generator(seed)).requires_grad_()
    gains = torch.ones(64).requires_grad_()
    optimizer = AdamW(
        [{"params": [matrix], "weight_decay": 0.1}, {"params": [gains], "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for update in range(updates):
        matrix.grad = torch.randn(matrix.shape, generator=generator(seed + 100 + update))
        gains.grad = torch.randn(gains.shape, generator=generator(seed + 200 + update))
        optimizer.update()
    return {"matrix": matrix.detach(), "gains": gains.detach(), "state": list(optimizer.state.values())}


def digest_block(size: int, seed: int) -> dict[str, str]:
    named = {
        "model.big": torch.randn(size, generator=generator(seed)),
        "model.matrix": torch.randn(size // 128, 128, generator=generator(seed + 1)),
        "optimizer.step": torch.tensor(3.0),
    }
    return digests(named)


class Stream:
    """A held-out split in memory, with the two methods `evaluate` reads."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def read(self, start: int, length: int) -> torch.Tensor:
        return self.values[start : start + length]


def heldout(dim: int, length: int, seed: int) -> dict[str, Any]:
    model = wide_model(dim, seed)
    stream = Stream(tokens(1, 6 * (length + 1), seed + 1).flatten())
    config = EvalConfig(seq_len=length, batch_size=3, max_batches=2)
    return evaluate(model, stream, config, torch.device("cpu"))  # type: ignore[arg-type]


def sizes(draw: st.DrawFn) -> int:
    return draw(st.integers(SPLIT, 8 * SPLIT))


def widths(draw: st.DrawFn) -> int:
    return draw(st.sampled_from([96, 128]))


# Each entry draws its shapes first, then returns the computation to repeat at each thread count.
BLOCKS: dict[str, Callable[[st.DrawFn], Callable[[], Any]]] = {
    "model forward and backward": lambda draw: functools.partial(
        forward_backward, widths(draw), draw(st.integers(1, 3)), widths(draw), 1
    ),
    "loss": lambda draw: functools.partial(
        loss_only, draw(st.integers(1, 3)), draw(st.sampled_from([64, 128, 200])), 2
    ),
    "gradient tree": lambda draw: functools.partial(gradient_tree, draw(st.integers(1, 6)), sizes(draw), 3),
    "clipping": lambda draw: functools.partial(
        clipping, sizes(draw), draw(st.sampled_from([0.5, 1.0, float("inf")])), 4
    ),
    "adamw": lambda draw: functools.partial(adamw, sizes(draw), draw(st.integers(1, 3)), 5),
    "digests": lambda draw: functools.partial(digest_block, sizes(draw), 6),
    "held-out evaluation": lambda draw: functools.partial(heldout, widths(draw), widths(draw), 7),
}


@pytest.mark.parametrize("block", sorted(BLOCKS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), threads=st.sampled_from(THREADS))
def test_portable_building_block_gives_the_bits_of_one_thread(block: str, data: Any, threads: int) -> None:
    compute = BLOCKS[block](data.draw)
    reference = under("portable", 1, compute)
    assert same_bits(under("portable", threads, compute), reference), f"{block} at {threads} threads"


@pytest.mark.parametrize("threads", [3, 4, 16])
def test_native_model_differs_with_threads_so_the_sizes_split(threads: int) -> None:
    """Negative control: the same block with that many intra-op threads changes its bits, computed
    by torch's operations throughout (the fused kernels give one thread's bits at any count, so
    with them the model changed at 4 threads but not at 3 or 16)."""

    def compute() -> dict[str, Any]:
        with computing_with("eager"):
            return forward_backward(128, 2, 128, 1)

    assert not same_bits(under("native", threads, compute), under("native", 1, compute))


# -- end to end ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, dict[str, str]]]:
    store = tmp_path_factory.mktemp("wide-1-thread") / ".bt"
    planned = plan_hash(run_bt("plan", str(WIDE), store=store))
    result = run_bt("run", planned, "--threads", "1", store=store)
    assert result.returncode == 0, result.stderr
    return store, planned, step_digests(store, planned)


@pytest.mark.parametrize("threads", [4, 7, 16])
def test_portable_train_step_gives_identical_weights_at_any_thread_count(
    wide_built: tuple[Path, str, dict[str, dict[str, str]]], tmp_path: Path, threads: int
) -> None:
    _, reference_plan, reference = wide_built
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(WIDE), store=store))
    assert planned == reference_plan  # the thread count is not part of a portable hash
    result = run_bt("run", planned, "--threads", str(threads), "--target", "train:main", store=store)
    assert result.returncode == 0, result.stderr
    built = step_digests(store, planned)
    assert built["train:main"] == reference["train:main"]
    assert built["data:main"] == reference["data:main"]


@pytest.mark.parametrize("threads", [3, 8])
def test_verify_at_other_thread_counts_passes_on_a_plan_built_at_one(
    wide_built: tuple[Path, str, dict[str, dict[str, str]]], tmp_path: Path, threads: int
) -> None:
    built_store, planned, _ = wide_built
    store = tmp_path / ".bt"
    shutil.copytree(built_store, store, symlinks=True)
    result = run_bt("verify", planned, "--threads", str(threads), store=store)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 of 4 steps match" in result.stdout + result.stderr


def test_native_weights_depend_on_the_thread_count_and_so_does_its_hash(tmp_path: Path) -> None:
    weights, hashes = [], []
    for threads in (1, 4):
        store = tmp_path / f"native-{threads}" / ".bt"
        store.parent.mkdir()
        overrides = ["--set", "numerics.profile=native", "--set", f"numerics.threads={threads}"]
        planned = plan_hash(run_bt("plan", str(WIDE), *overrides, store=store))
        result = run_bt("run", planned, "--target", "train:main", store=store)
        assert result.returncode == 0, result.stderr
        hashes.append(planned)
        weights.append(step_digests(store, planned)["train:main"]["weights"])
    assert hashes[0] != hashes[1]
    assert weights[0] != weights[1]


@pytest.mark.parametrize(
    ("overrides", "threads", "expected"),
    [
        (["train.steps=5000"], 4, 4),  # large: the cores become ranks, as many as divide 4 micro-batches
        (["train.steps=5000"], 3, 2),
        (["train.steps=5000"], 16, 4),
        (["train.steps=5000"], 1, 1),
        ([], 16, 1),  # small: start-up would cost more than it saves
        (["train.steps=5000", "train.reduction=allreduce"], 4, 1),  # world size fixed by the hash
        (["train.steps=5000", "numerics.profile=native"], 4, 1),  # native: threads, not ranks
    ],
)
def test_portable_train_steps_share_cores_as_ranks_when_large(
    tmp_path: Path, overrides: list[str], threads: int, expected: int
) -> None:
    plan = stored_plan(tmp_path, *overrides)
    settings = plan.numerics
    assert step_launch(settings, step_of(plan, "train"), threads, SINGLE_PROCESS).nproc == expected
    assert step_launch(settings, step_of(plan, "eval"), threads, SINGLE_PROCESS) == SINGLE_PROCESS


def test_portable_ranks_stay_within_the_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = stored_plan(tmp_path, "train.steps=5000")
    train = step_of(plan, "train")
    per_rank = 1 << 30
    monkeypatch.setattr(shape, "memory_estimate", lambda *_: per_rank)
    monkeypatch.setattr(preflight, "machine_memory", lambda: 3 * per_rank)  # 80%: room for 2 ranks
    assert step_launch(plan.numerics, train, 16, SINGLE_PROCESS).nproc == 2
    monkeypatch.setattr(preflight, "machine_memory", lambda: per_rank)
    assert step_launch(plan.numerics, train, 16, SINGLE_PROCESS).nproc == 1


def stored_plan(tmp_path: Path, *overrides: str) -> Plan:
    """The wide preset with `overrides`, planned by `bt` and read back from its store."""
    store = tmp_path / ".bt"
    sets = [arg for override in overrides for arg in ("--set", override)]
    return load_plan(Store(store), plan_hash(run_bt("plan", str(WIDE), *sets, store=store)))


def step_of(plan: Plan, kind: str) -> Step:
    return next(step for step in plan.steps if step.kind == kind)
