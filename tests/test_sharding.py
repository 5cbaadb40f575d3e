"""Sharded training (`train.sharding = "fsdp"`) on gloo, through torchrun.

FSDP2 shards the weights, gradients and AdamW moments; the gradient is still the canonical
tree's sum, so world sizes 1, 2 and 4 give the same bits, and the same output bytes (its kept
checkpoints are published whole), a run killed at one world size resumes at another from its
sharded checkpoint, and `bt verify` reproduces it at any world size. Without clipping, the
sharded weights are the unsharded ones (the clipping norm is summed in another order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MICRO, plan_hash, run_bt, step_digests
from test_distributed import kill_the_last_rank
from test_resume import resume, train_hash

from buildtrain.errors import ExitCode
from buildtrain.store.store import Store
from buildtrain.store.tensors import combine, safetensors_digests

# Four micro-batches of one sequence per update: world sizes 1, 2 and 4 all divide them.
FSDP = ("--set", "train.micro_batch_size=1", "--set", 'train.sharding="fsdp"')
# The held-out loss during training too: every rank takes part in its forward passes.
EVALUATED = ("--set", "eval.every=4")


def plan(store: Path, *args: str) -> str:
    return plan_hash(run_bt("plan", str(MICRO), *args, store=store))


def build(store: Path, planned: str, *args: str) -> dict[str, str]:
    """Build the train step (and its data) of a plan; the train step's digests."""
    return resume(planned, store, store.parent / "experiments", *args)["train:main"]


def world_sizes(store: Path) -> set[int]:
    """The world sizes the train step ran at, by the `rank_state` events of the run records."""
    found = set()
    for log in (store.parent / "experiments").glob("*/train.log"):
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "rank_state":
                found.add(event["world_size"])
    return found


def published(output: Path) -> dict[str, bytes]:
    """Every file of an output folder by its path in it, the manifests too."""
    return {
        p.relative_to(output).as_posix(): p.read_bytes() for p in sorted(output.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str], dict[str, bytes]]:
    """The sharded plan built on one process: (plan hash, train step digests, output files)."""
    store = tmp_path_factory.mktemp("one-process") / ".bt"
    planned = plan(store, *FSDP, *EVALUATED)
    digests = build(store, planned, "--nproc", "1")
    assert world_sizes(store) == {1}
    output = Store(store).outputs.path(train_hash(store, planned))
    trace = (output / "trace.jsonl").read_text()
    assert trace.count('"eval":') == 3  # after updates 4, 8 and 12, recorded in the trace
    return planned, digests, published(output)


@pytest.mark.parametrize("nproc", [2, 4])
def test_sharded_training_publishes_the_same_bytes_at_any_world_size(
    tmp_path: Path, one_process: tuple[str, dict[str, str], dict[str, bytes]], nproc: int
) -> None:
    """Issue 43: a step's output is a function of its hash at any world size. The ranks write their
    rows of each checkpoint while training (one file per rank); the output holds every kept
    checkpoint whole, in the files of an unsharded one, so two builders of one hash at different
    world sizes publish the same bytes and can attest the same output."""
    planned, reference, files = one_process
    store = tmp_path / ".bt"
    assert plan(store, *FSDP, *EVALUATED, "--nproc", str(nproc)) == planned
    assert build(store, planned, "--nproc", str(nproc)) == reference  # weights, state and trace bits
    assert world_sizes(store) == {nproc}
    output = Store(store).outputs.path(train_hash(store, planned))
    assert published(output) == files  # every file, the manifests and result.json too, byte for byte
    final = output / "checkpoints" / "step-000012"
    assert sorted(p.name for p in final.iterdir()) == [
        "MANIFEST.json",
        "model.safetensors",
        "optimizer.safetensors",
        "trace.jsonl",
        "train_state.json",
    ]
    assert (
        json.loads((output / "result.json").read_text())["weights"]
        == "checkpoints/step-000012/model.safetensors"
    )
    assert combine(safetensors_digests(final / "model.safetensors")) == reference["weights"]


@pytest.mark.parametrize(("killed_at", "resumed_at"), [(2, 4), (4, 1)])
def test_a_sharded_run_killed_at_one_world_size_resumes_at_another(
    tmp_path: Path, one_process: tuple[str, dict[str, str], dict[str, bytes]], killed_at: int, resumed_at: int
) -> None:
    planned, reference, _ = one_process
    store = tmp_path / ".bt"
    plan(store, *FSDP, *EVALUATED)
    kill_the_last_rank(store, planned, killed_at)
    assert "train:main" not in step_digests(store, planned)
    saved = (
        Store(store).outputs.work_dir(train_hash(store, planned)) / "checkpoints" / "step-000004" / "shards"
    )
    assert len(list(saved.iterdir())) == killed_at

    assert build(store, planned, "--nproc", str(resumed_at)) == reference


def test_without_clipping_sharded_and_unsharded_training_give_the_same_weights(tmp_path: Path) -> None:
    """What docs/clusters.md claims: the gradient and the AdamW update are the unsharded ones bit for
    bit; only the clipping norm is summed in another order (so the traces' grad_norm differ). The
    sharded output's kept checkpoints are the files the unsharded run writes, to the byte."""
    unclipped = ("--set", "train.grad_clip=0")
    sharded, unsharded = tmp_path / "sharded" / ".bt", tmp_path / "unsharded" / ".bt"
    digests, kept = {}, {}
    for store, args in (
        (sharded, (*FSDP, *unclipped)),
        (unsharded, ("--set", "train.micro_batch_size=1", *unclipped)),
    ):
        store.parent.mkdir()
        planned = plan(store, *args)
        digests[store] = build(store, planned, "--nproc", "2")
        final = Store(store).outputs.path(train_hash(store, planned)) / "checkpoints" / "step-000012"
        kept[store] = [(final / name).read_bytes() for name in ("model.safetensors", "optimizer.safetensors")]
    assert digests[sharded]["weights"] == digests[unsharded]["weights"]
    assert digests[sharded]["trace"] != digests[unsharded]["trace"]
    assert kept[sharded] == kept[unsharded]


def test_activation_checkpointing_keeps_the_bits_with_dropout(tmp_path: Path) -> None:
    """Recomputed blocks draw their dropout again from a rewound generator: the same masks."""
    dropout = ("--set", "model.dropout=0.1")
    weights = []
    for index, extra in enumerate(((), ("--set", "train.activation_checkpointing=true"))):
        store = tmp_path / str(index) / ".bt"
        store.parent.mkdir()
        weights.append(build(store, plan(store, *FSDP, *dropout, *extra), "--nproc", "2")["weights"])
    assert weights[0] == weights[1]


def test_verify_reproduces_a_sharded_plan_on_two_processes_through_a_kill(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    planned = plan(store, *FSDP)
    build(store, planned, "--nproc", "2")
    result = run_bt("verify", planned, "--nproc", "2", "--resume-at", "6", store=store)
    assert result.returncode == ExitCode.OK, result.stderr
    assert "✓ train:main" in result.stderr and "(killed and resumed at 6)" in result.stderr


def test_verify_on_one_process_reproduces_a_sharded_plan_built_on_two(tmp_path: Path) -> None:
    """Before the output was published whole, this failed: the digests agreed, the shard files
    (one per rank) did not, and verify called it an edit."""
    store = tmp_path / ".bt"
    planned = plan(store, *FSDP)
    build(store, planned, "--nproc", "2")
    result = run_bt("verify", planned, "--nproc", "1", store=store)
    assert result.returncode == ExitCode.OK, result.stderr
    assert "✓ train:main" in result.stderr and "re-sealed" not in result.stderr


def test_sharding_refuses_the_allreduce_reduction_naming_the_key_and_the_fix(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    allreduce = run_bt("plan", str(MICRO), *FSDP, "--set", "train.reduction='allreduce'", store=store)
    assert allreduce.returncode == ExitCode.USAGE
    assert "train.sharding" in allreduce.stderr and 'train.reduction = "invariant"' in allreduce.stderr
    assert "Traceback" not in allreduce.stderr
