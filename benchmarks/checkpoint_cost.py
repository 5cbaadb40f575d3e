"""Checkpoint cost: buildtrain's atomic checkpoints against torch.save / torch.load, and the share
of a real training run spent checkpointing.

Part 1 builds a full training state with buildtrain's Transformer (weights plus AdamW moments,
float32) of about 10 MB and about 500 MB (--quick: 10 MB and 100 MB) and alternates, per size:

  buildtrain save   buildtrain.steps.train.checkpoint.save: safetensors files, fsync of every file,
                    blake3 manifest, rename, fsync of the folder; with a trace of 200 updates (as
                    presets/tiny.toml writes at its last checkpoint, one digest line per update)
  torch.save        of {"model": state_dict, "optimizer": state_dict}, no fsync (what most
                    training scripts do)
  torch.save+fsync  the same, then fsync (the durability buildtrain pays for)
  buildtrain load   checkpoint.load_newest: re-hash and verify the manifest, then load weights and
                    moments into a fresh model and optimizer
  torch.load        torch.load(weights_only=True) + model/optimizer load_state_dict

Files are written into the temporary directory and stay in the page cache, so loads measure the
code, not the disk.

Part 2 runs presets/tiny.toml with `bt run` (--quick: 100 updates, the same cadence) and reads its
run record: each checkpoint's duration is the time from the train_step event of its update to its
checkpoint_saved event; the share is their sum over the training loop's time (first train_step to
the last checkpoint_saved). Goal: <= 5%.

Part 3, LoRA: a model of about 140 MB with rank-8 adapters on q, k, v and o (0.8 MB), five
checkpoints in a row, alternated: the frozen weights linked from the first checkpoint (what the
trainer does) against written again by every checkpoint (what a checkpoint holding the whole
model costs). Medians of the checkpoints after the first.

Run: python benchmarks/checkpoint_cost.py [--quick]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    TINY,
    Workspace,
    alternate,
    fmt_bytes,
    fmt_ratio,
    fmt_seconds,
    fmt_spread,
    goal_line,
    make_parser,
    median,
    note,
    print_goals,
    print_header,
    print_table,
    ratio,
    rounds,
    workspace,
)

GOAL_SHARE = 0.05
TRACE_UPDATES = 200
MB = 1_000_000


# -- part 1: one checkpoint, side by side ---------------------------------------------------------


def model_config(target_bytes: int) -> Any:
    """A model whose weights and two AdamW moments (12 bytes per parameter) come near the target."""
    from buildtrain.config.schema import ModelConfig
    from buildtrain.config.shape import parameter_count

    small = target_bytes < 50 * MB
    shape = (
        {"dim": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 352}
        if small
        else {"dim": 512, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 1376}
    )
    one, two = (parameter_count(ModelConfig(n_layers=n, **shape)) for n in (1, 2))
    layers = max(1, round((target_bytes / 12 - (one - (two - one))) / (two - one)))
    return ModelConfig(n_layers=layers, **shape)


def training_state(target_bytes: int) -> tuple[Any, Any]:
    """A model and an AdamW optimizer with populated moments, as after a training update."""
    import torch

    from buildtrain.config.schema import BYTE_VOCAB_SIZE
    from buildtrain.steps.train.model import Transformer
    from buildtrain.steps.train.optimizer import AdamW
    from buildtrain.steps.train.trainer import param_groups

    model = Transformer(model_config(target_bytes), BYTE_VOCAB_SIZE)
    generator = torch.Generator().manual_seed(0)
    model.initialize(generator)
    optimizer = AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for parameter in model.parameters():
        parameter.grad = torch.randn(parameter.shape, generator=generator) * 1e-3
    optimizer.update()
    optimizer.zero_grad()
    return model, optimizer


def fake_trace(names: list[str], updates: int) -> list[dict[str, Any]]:
    """Trace lines shaped like the trainer's with digest_every = 1 (digests are made up)."""
    trace = []
    for step in range(1, updates + 1):
        tensors = {
            name: f"{(step * 2654435761 + i * 40503) % (1 << 64):016x}" for i, name in enumerate(names)
        }
        trace.append(
            {
                "step": step,
                "loss": "40a00000",
                "grad_norm": "3f800000",
                "lr": 1e-3,
                "cursor": step * 16,
                "state": f"{step:064x}",
                "tensors": tensors,
            }
        )
    return trace


def measure_size(space: Workspace, target: int, n: int) -> tuple[int, int, dict[str, list[float]]]:
    import torch

    from buildtrain.steps.train import checkpoint
    from buildtrain.steps.train.optimizer import SLOTS
    from buildtrain.steps.train.state import optimizer_tensors, state_tensors

    model, optimizer = training_state(target)
    tensors = state_tensors(model, optimizer)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    lines = fake_trace(sorted(tensors), TRACE_UPDATES)
    trace_bytes = sum(len(json.dumps(line, separators=(",", ":"))) + 1 for line in lines)
    identity = {"step_hash": "benchmark"}
    state = {**identity, "step": TRACE_UPDATES, "cursor": 16 * TRACE_UPDATES, "tokens": 1024 * TRACE_UPDATES}
    fresh_model, fresh_optimizer = training_state(target)
    folder = space.path(f"checkpoints-{target}")
    shutil.rmtree(folder, ignore_errors=True)
    torch_file = space.path(f"state-{target}.pt")

    def bt_save() -> float:
        shutil.rmtree(folder, ignore_errors=True)
        trace = checkpoint.Trace(folder)  # the lines since the previous checkpoint: all of them
        for line in lines:
            trace.append(line)
        started = time.perf_counter()
        checkpoint.save(folder, TRACE_UPDATES, model, optimizer, state, trace)
        return time.perf_counter() - started

    def torch_save(fsync: bool) -> float:
        torch_file.unlink(missing_ok=True)
        started = time.perf_counter()
        with open(torch_file, "wb") as handle:
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer_tensors(model, optimizer)}, handle
            )
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        return time.perf_counter() - started

    def bt_load() -> float:
        started = time.perf_counter()
        resumed = checkpoint.load_newest(folder, fresh_model, fresh_optimizer, identity, on_skip=skipped)
        elapsed = time.perf_counter() - started
        if resumed is None:
            raise RuntimeError("buildtrain did not load the checkpoint it just wrote")
        return elapsed

    def torch_load() -> float:
        started = time.perf_counter()
        loaded = torch.load(torch_file, weights_only=True)
        fresh_model.load_state_dict(loaded["model"])
        moments = loaded["optimizer"]
        for name, parameter in fresh_model.named_parameters():  # the same restore buildtrain does
            fresh_optimizer.state[parameter] = {slot: moments[f"{name}.{slot}"] for slot in SLOTS}
        return time.perf_counter() - started

    results = alternate(
        [
            ("buildtrain save", bt_save),
            ("torch.save", lambda: torch_save(False)),
            ("torch.save + fsync", lambda: torch_save(True)),
            ("buildtrain load", bt_load),
            ("torch.load", torch_load),
        ],
        n,
    )
    shutil.rmtree(folder, ignore_errors=True)
    torch_file.unlink(missing_ok=True)
    return state_bytes, trace_bytes, results


def skipped(path: Path, why: str) -> None:
    raise RuntimeError(f"buildtrain skipped its own checkpoint {path.name}: {why}")


# -- part 2: the share of a real run --------------------------------------------------------------


def seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def checkpoint_share(space: Workspace, index: int, overrides: tuple[str, ...]) -> dict[str, float]:
    store, experiments = space.path(f"store-run-{index}"), space.path(f"experiments-{index}")
    plan = space.plan(TINY, *overrides, store=store)
    space.run_bt("run", plan, "--progress", "off", store=store, experiments=experiments)
    (record,) = experiments.iterdir()
    events = [json.loads(line) for line in (record / "train.log").read_text().splitlines() if line.strip()]
    steps = {e["step"]: seconds(e["timestamp"]) for e in events if e.get("event") == "train_step"}
    saved = {e["step"]: seconds(e["timestamp"]) for e in events if e.get("event") == "checkpoint_saved"}
    spent = [saved[step] - steps[step] for step in saved]
    loop = max(saved.values()) - min(steps.values())
    summary = json.loads((record / "summary.json").read_text())
    train_wall = next(s["duration_s"] for s in summary["steps"] if s["label"].startswith("train"))
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(experiments, ignore_errors=True)
    return {
        "checkpoints": len(spent),
        "per_checkpoint": median(spent),
        "spent": sum(spent),
        "loop": loop,
        "train_wall": train_wall,
        "share_loop": sum(spent) / loop,
        "share_wall": sum(spent) / train_wall,
    }


# -- part 3: LoRA checkpoints, frozen weights linked or written ----------------------------------


def lora_state() -> tuple[Any, Any]:
    """A 140 MB model whose weights are frozen, with adapters that have AdamW moments."""
    import torch

    from buildtrain.config.schema import LoraConfig, ModelConfig
    from buildtrain.steps.train.lora import add_adapters
    from buildtrain.steps.train.model import Transformer
    from buildtrain.steps.train.optimizer import AdamW
    from buildtrain.steps.train.trainer import param_groups

    config = ModelConfig(dim=512, n_layers=6, n_heads=8, n_kv_heads=8, ffn_hidden=1376)
    model = Transformer.build(config, 32_000, torch.Generator().manual_seed(0))
    add_adapters(model, LoraConfig(rank=8), config, torch.Generator().manual_seed(1))
    optimizer = AdamW(param_groups(model, 0.0), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.full_like(parameter, 1e-3)
    optimizer.update()
    return model, optimizer


def lora_checkpoints(space: Workspace, n: int) -> tuple[int, dict[str, list[float]]]:
    from buildtrain.steps.train import checkpoint

    model, optimizer = lora_state()
    frozen_bytes = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    counter = iter(range(1_000_000))
    per_checkpoint: dict[str, list[float]] = {"frozen weights linked": [], "frozen weights written": []}

    def five(name: str) -> float:
        folder = space.path(f"lora-{next(counter)}", "checkpoints")
        frozen = checkpoint.FrozenFile() if name.endswith("linked") else None
        history = checkpoint.Trace(folder)
        for update in range(1, 6):
            history.append({"step": update})
            started = time.perf_counter()
            state = {"step_hash": "benchmark", "step": update}
            checkpoint.save(folder, update, model, optimizer, state, history, frozen=frozen)
            if update > 1:
                per_checkpoint[name].append(time.perf_counter() - started)
            checkpoint.prune(folder, 2)
        shutil.rmtree(folder.parent)
        return 0.0

    alternate([(name, lambda name=name: five(name)) for name in per_checkpoint], n)
    return frozen_bytes, per_checkpoint


def main() -> int:
    parser = make_parser(__doc__)
    args = parser.parse_args()
    sizes = (10 * MB, 100 * MB) if args.quick else (10 * MB, 500 * MB)
    runs = rounds(args, quick=1, full=3)

    with workspace("checkpoint-cost", args) as space:
        print_header("checkpoint cost", args, space)
        space.import_buildtrain()
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        for target in sizes:
            n = rounds(args, quick=5 if target <= 10 * MB else 3, full=7 if target <= 10 * MB else 5)
            note(f"part 1: state of about {fmt_bytes(target)}, {n} alternating rounds")
            state_bytes, trace_bytes, results = measure_size(space, target, n)
            save_base, load_base = median(results["torch.save"]), median(results["torch.load"])
            rows = []
            for name, values in results.items():
                base = load_base if "load" in name else save_base
                rows.append(
                    [
                        name,
                        fmt_seconds(median(values)),
                        fmt_spread(values),
                        fmt_ratio(ratio(median(values), base)),
                        f"{state_bytes / median(values) / 1e9:.2f}",
                    ]
                )
            print_table(
                f"training state of {fmt_bytes(state_bytes)} (weights + AdamW moments; buildtrain also "
                f"writes a {fmt_bytes(trace_bytes)} trace) - median of {n}, alternated",
                ["contender", "median", "min..max", "vs torch.save/.load", "GB/s of state"],
                rows,
            )

        overrides = ("train.steps=100",) if args.quick else ()
        note(f"part 2: {runs} run(s) of presets/tiny.toml {' '.join(overrides)}")
        shares = [checkpoint_share(space, i, overrides) for i in range(runs)]
        share = median([s["share_loop"] for s in shares])
        print_table(
            f"checkpointing during bt run presets/tiny.toml {' '.join(overrides)} (checkpoint_every = 50)",
            [
                "run",
                "checkpoints",
                "per checkpoint",
                "total",
                "training loop",
                "share of loop",
                "share of step",
            ],
            [
                [
                    str(i + 1),
                    str(s["checkpoints"]),
                    fmt_seconds(s["per_checkpoint"]),
                    fmt_seconds(s["spent"]),
                    fmt_seconds(s["loop"]),
                    f"{s['share_loop']:.1%}",
                    f"{s['share_wall']:.1%}",
                ]
                for i, s in enumerate(shares)
            ],
        )
        print_goals(
            [
                goal_line(
                    f"checkpointing <= {GOAL_SHARE:.0%} of training time", share <= GOAL_SHARE, f"{share:.1%}"
                )
            ]
        )
        n = rounds(args, quick=2, full=4)
        note(f"part 3: LoRA checkpoints, {n} alternating rounds of five")
        frozen_bytes, lora = lora_checkpoints(space, n)
        written = median(lora["frozen weights written"])
        print_table(
            f"LoRA checkpoints after the first, frozen weights of {fmt_bytes(frozen_bytes)} "
            f"(median of {4 * n})",
            ["contender", "median", "min..max", "vs written"],
            [
                [name, fmt_seconds(median(v)), fmt_spread(v), fmt_ratio(ratio(median(v), written))]
                for name, v in lora.items()
            ],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
