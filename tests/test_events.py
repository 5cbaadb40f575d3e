"""TensorBoard event files: our own writer, read back with TensorBoard's own reader."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from conftest import MICRO, run_bt
from hypothesis import given
from hypothesis import strategies as st
from sweeps_built import BuiltSweep, built_sweep

from buildtrain.errors import ExitCode
from buildtrain.executor.loop.events import EventWriter, crc32c, float32, masked_crc

event_file_loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> BuiltSweep:
    return built_sweep(tmp_path_factory)


def test_crc32c_matches_the_standard_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    assert crc32c(b"") == 0


@given(st.binary(max_size=64))
def test_masked_crc_matches_tensorboards(data: bytes) -> None:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    assert masked_crc(data) == masked_crc32c(data)


def test_scalars_read_back_with_tensorboards_loader(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path)
    values = [5.5, 4.25, 3.0, float(2**-20)]
    for step, value in enumerate(values, 1):
        writer.scalars(step, {"train:main/loss": value, "train:main/lr": step * 1e-3})
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    events = list(event_file_loader.LegacyEventFileLoader(str(path)).Load())
    assert events[0].file_version == "brain.Event:2"
    scalars = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
    expected_lr = [struct.unpack("<f", struct.pack("<f", s * 1e-3))[0] for s in range(1, 5)]
    assert [s for s in scalars if s[1] == "train:main/loss"] == [
        (s, "train:main/loss", v) for s, v in enumerate(values, 1)
    ]
    assert [v for _, tag, v in scalars if tag == "train:main/lr"] == expected_lr


def test_a_writer_without_scalars_leaves_no_file(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path)
    writer.scalars(1, {})
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_bt_run_writes_event_files_tensorboard_reads(sweep: BuiltSweep) -> None:
    files = sorted(sweep.experiments.glob("*/events.out.tfevents.*"))
    assert len(files) == 6  # one per executing run; the null builds wrote none
    multiplexer = event_accumulator.EventAccumulator(str(files[0].parent))
    multiplexer.Reload()
    tags = multiplexer.Tags()["scalars"]
    assert {"train:pretrain/loss", "train:finetune/loss", "train:finetune/lr", "eval/loss"} <= set(tags)
    losses = multiplexer.Scalars("train:pretrain/loss")
    assert [e.step for e in losses] == list(range(1, 9))
    assert all(2.0 < e.value < 6.0 for e in losses)


def test_tensorboard_logdir_experiments_finds_every_training_run(sweep: BuiltSweep) -> None:
    """What `tensorboard --logdir experiments` does: one run per record folder with event files."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer().AddRunsFromDirectory(str(sweep.experiments))
    multiplexer.Reload()
    runs = multiplexer.Runs()
    assert len(runs) == 6
    for run in runs:
        assert "train:finetune/loss" in multiplexer.GetAccumulator(run).Tags()["tensors"]


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_value_is_written_as_its_float32_conversion_even_past_the_range(value: float) -> None:
    """Past float32's range a value becomes an infinity of its sign, as a C cast (and numpy)
    round it; `struct` alone raises OverflowError there."""
    import numpy as np

    with np.errstate(over="ignore"):
        expected = np.float32(value)
    (written,) = struct.unpack("<f", float32(value))
    assert (np.isnan(expected) and np.isnan(written)) or written == expected


def test_a_diverged_evaluation_is_recorded_as_infinity(tmp_path: Path) -> None:
    """The perplexity of a held-out loss past 88.7 overflows float32: recorded, never a crash."""
    writer = EventWriter(tmp_path)
    writer.scalars(5, {"eval/perplexity": 1e50, "eval/loss": 115.1, "train:main/lr": -1e308})
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    events = list(event_file_loader.LegacyEventFileLoader(str(path)).Load())
    values = {v.tag: v.simple_value for e in events[1:] for v in e.summary.value}
    assert values["eval/perplexity"] == float("inf") and values["train:main/lr"] == float("-inf")
    assert values["eval/loss"] == pytest.approx(115.1)


def test_a_learning_rate_of_1e308_ends_the_run_in_one_line(tmp_path: Path) -> None:
    result = run_bt("run", str(MICRO), "--set", "train.lr=1e308", "--progress", "off", store=tmp_path / ".bt")
    assert result.returncode == ExitCode.FAILED
    assert "train:main failed: loss is nan at step 2" in result.stderr
    assert "Traceback" not in result.stderr and "OverflowError" not in result.stderr
