"""TensorBoard event files, written without TensorBoard or TensorFlow.

An event file is a sequence of TFRecords (length, masked CRC32C of the length, payload, masked
CRC32C of the payload) whose payloads are `Event` protocol buffers. Scalars need only five
fields (Event.wall_time, .step, .file_version, .summary; Summary.Value.tag, .simple_value), so
they are encoded here by hand: `bt run` keeps its dependencies, and tests read the files back
with TensorBoard's own reader to prove the framing. Event files are records, never hashed.

A simple value is a float32. A finite value past float32's range (the perplexity of a diverged
evaluation, e**88.8 and up; `train.lr = 1e308`) is written as the float32 conversion gives it,
an infinity of its sign, as TensorBoard's own writer does: the value is a measurement to record
(the run's metrics.jsonl keeps it exactly), not a failure of the run (it was an OverflowError that
ended the run in a traceback and left the export unbuilt).
"""

from __future__ import annotations

import math
import struct
import time
from pathlib import Path
from typing import BinaryIO

from buildtrain.store.objects import append_flushed

FILE_VERSION = b"brain.Event:2"
_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected
_MASK_DELTA = 0xA282EAD8


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masking: rotate right by 15 and add a constant, so CRCs of CRCs stay strong."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def tfrecord(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return length + struct.pack("<I", masked_crc(length)) + payload + struct.pack("<I", masked_crc(payload))


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 fields encode negatives as 10-byte two's complement
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def float32(value: float) -> bytes:
    """`value` as a little-endian float32, rounded as a C cast rounds it: past the range, an
    infinity of its sign (`struct` raises OverflowError there instead)."""
    try:
        return struct.pack("<f", value)
    except OverflowError:
        return struct.pack("<f", math.copysign(math.inf, value))


def scalar_event(wall_time: float, step: int, values: dict[str, float]) -> bytes:
    """An `Event` with a `Summary` of simple values (one per tag), encoded as protobuf."""
    summary = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + b"\x15" + float32(value))
        for tag, value in values.items()
    )
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + _bytes_field(5, summary)


def version_event(wall_time: float) -> bytes:
    return b"\x09" + struct.pack("<d", wall_time) + _bytes_field(3, FILE_VERSION)


class EventWriter:
    """Appends scalar events to `events.out.tfevents.<time>.buildtrain` in a run record folder.

    The file is opened on the first scalar, so a null build leaves no empty event file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._file: BinaryIO | None = None

    @property
    def path(self) -> Path | None:
        return Path(self._file.name) if self._file is not None else None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not values:
            return
        now = time.time()
        if self._file is None:
            name = f"events.out.tfevents.{int(now)}.buildtrain"
            self._file = open(self.folder / name, "ab")  # noqa: SIM115 - closed in close()
            append_flushed(self._file, tfrecord(version_event(now)))
        append_flushed(self._file, tfrecord(scalar_event(now, step, values)))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
