"""A step reads its data files through a check against the plan (issue 20, item 2): the bytes it
read must be the bytes the plan names (blake3 and size), or it refuses with one line naming the
file and publishes nothing. Files are changed by deterministic hooks (a reader that rewrites the
file after its first chunk), never by timing."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.errors import ExitCode, StepFailed
from buildtrain.executor.process import worker
from buildtrain.executor.process.job import Job, JobNumerics
from buildtrain.plan.planner import plan_preset
from buildtrain.steps import formats, sources
from buildtrain.steps.sources import Source, SourceReader, read_source
from buildtrain.store.store import Store

TEXT = b"".join(f"{a}+{a}={2 * a}\n".encode() for a in range(4000))


def planned(path: Path) -> Source:
    raw = path.read_bytes()
    return Source(path=path, blake3=blake3.blake3(raw).hexdigest(), size=len(raw))


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def bind(self, **_: Any) -> Log:
        return self

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    warning = error = info


@given(st.binary(max_size=300), st.data())
@settings(max_examples=60, deadline=None)
def test_any_changed_byte_or_length_is_refused(raw: bytes, data: st.DataObject) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "f.bin"
        path.write_bytes(raw)
        source = planned(path)
        assert read_source(source) == raw  # unchanged: read as it is
        if raw and data.draw(st.booleans()):
            at = data.draw(st.integers(0, len(raw) - 1))
            changed = raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :]
        else:
            changed = raw + data.draw(st.binary(min_size=1, max_size=5))
        path.write_bytes(changed)
        with pytest.raises(StepFailed, match="changed since it was planned"):
            read_source(source)


def test_a_file_longer_than_planned_is_refused_after_its_planned_size(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(b"abc")
    source = planned(path)
    path.write_bytes(b"abc" + bytes(1 << 20))
    reader = SourceReader(source)
    with reader, pytest.raises(StepFailed, match="changed since it was planned"):
        while reader.read():
            pass
    assert reader.count == source.size + 1  # one byte past the plan, never the rest


def test_a_device_in_place_of_a_source_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(b"abc")
    endless = Source(path=Path("/dev/zero"), blake3=planned(path).blake3, size=3)
    with pytest.raises(StepFailed, match="/dev/zero: is a device, not a regular file"):
        read_source(endless)


class RewritingReader(SourceReader):
    """A reader whose file is rewritten (same size, new bytes from the middle on) right after its
    first chunk was read: a change while the step reads."""

    def __init__(self, source: Source) -> None:
        super().__init__(source)
        self.rewritten = False

    def _rewrite_once(self) -> None:
        if not self.rewritten:
            self.rewritten = True
            raw = bytearray(self.source.path.read_bytes())
            middle = len(raw) // 2
            raw[middle : middle + 100] = b"9" * 100
            with open(self.source.path, "r+b") as handle:  # in place: the reader's file changes
                handle.write(bytes(raw))

    def read(self, size: int = sources.READ_CHUNK) -> bytes:
        chunk = super().read(size)
        self._rewrite_once()
        return chunk

    def readline(self) -> bytes:
        line = super().readline()
        self._rewrite_once()
        return line


@pytest.fixture
def rewritten_while_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def opened(path: Source | Path) -> Any:
        assert isinstance(path, Source), "a step reads planned sources"
        return RewritingReader(path)

    monkeypatch.setattr(formats, "open_source", opened)
    monkeypatch.setattr(formats, "READ_CHUNK", 4096)  # several chunks per file


def text_plan(tmp_path: Path, fmt: str = "text") -> tuple[Store, Any, Path]:
    """A micro plan over one data file; returns the store, the plan and the file."""
    data = tmp_path / "data"
    data.mkdir()
    if fmt == "text":
        path = data / "a.txt"
        path.write_bytes(TEXT)
    else:
        path = data / "a.jsonl"
        path.write_text(
            "".join(json.dumps({"text": TEXT[i : i + 400].decode()}) + "\n" for i in range(0, len(TEXT), 400))
        )
    preset = tmp_path / "p.toml"
    micro = Path(__file__).resolve().parent / "presets" / "micro.toml"
    preset.write_text(
        f'name = "reading"\nextends = {json.dumps(str(micro))}\n\n[data]\nsource = "files"\n'
        f'files = [{json.dumps(str(path))}]\nformat = "{fmt}"\nsplit_block = 64\n',
        encoding="utf-8",
    )
    store = Store(tmp_path / "store")
    return store, plan_preset(preset, [], store).plan, path


def run_data_step(store: Store, plan: Any, path: Path) -> tuple[int, Log]:
    """The data step of `plan` in this process, as a worker runs it, with `path` as its source."""
    step = next(s for s in plan.steps if s.kind == "data")
    job = Job(
        store=str(store.root),
        plan=plan.hash,
        step=step.hash,
        kind="data",
        numerics=JobNumerics(profile="portable", device="cpu", dtype="float32", threads=1),
        sources=(str(path),),
    )
    job_path = path.with_name("job.json")
    job.write(job_path)
    handlers = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
    log = Log()
    try:
        code = worker.run_job(job_path, log)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    return code, log


def failures(log: Log) -> Iterator[str]:
    return (fields["message"] for event, fields in log.events if event == "step_failed")


@pytest.mark.parametrize("fmt", ["text", "jsonl"])
def test_a_source_changed_while_the_data_step_reads_it_is_refused_and_nothing_published(
    tmp_path: Path, fmt: str, rewritten_while_read: None
) -> None:
    store, plan, path = text_plan(tmp_path, fmt)
    code, log = run_data_step(store, plan, path)
    step = next(s for s in plan.steps if s.kind == "data")
    assert code == ExitCode.FAILED
    (message,) = failures(log)
    assert message.startswith(f"{path}: changed since it was planned") and "\n" not in message
    assert not store.outputs.has(step.hash) and not store.outputs.path(step.hash).exists()
    assert not list(store.tmp.glob("data-*")), "the half-built output was removed"


def test_a_source_changed_after_planning_is_refused(tmp_path: Path) -> None:
    store, plan, path = text_plan(tmp_path)
    path.write_bytes(TEXT.replace(b"7", b"8"))  # same size, other bytes
    code, log = run_data_step(store, plan, path)
    assert code == ExitCode.FAILED
    assert [m.split(":")[0] for m in failures(log)] == [str(path)]
    assert not any(store.outputs.path(s.hash).exists() for s in plan.steps)


def test_an_unchanged_source_builds(tmp_path: Path) -> None:
    store, plan, path = text_plan(tmp_path)
    code, _ = run_data_step(store, plan, path)
    step = next(s for s in plan.steps if s.kind == "data")
    assert code == ExitCode.OK and store.outputs.has(step.hash)


def test_parquet_reads_a_private_checked_copy(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    path.write_bytes(TEXT)  # the copy is checked on bytes; Parquet parsing is not involved here
    source = planned(path)
    copy = sources.private_copy(source)
    assert not isinstance(copy, Path) and copy.read() == TEXT
    path.write_bytes(TEXT[:-1] + b"!")
    assert copy.seek(0) == 0 and copy.read() == TEXT  # what the reader sees cannot change under it
    with pytest.raises(StepFailed, match=f"{path}: changed since it was planned"):
        sources.private_copy(source)
    with sources.private_copy(path) as own:  # a library caller's own path is read as it is
        assert own.read() == TEXT[:-1] + b"!"


def test_planned_sources_pair_each_planned_file_with_its_path_in_plan_order() -> None:
    planned_inputs = [{"blake3": "aa", "size": 1}, {"blake3": "bb", "size": 2}]
    found = sources.planned_sources(planned_inputs, ["/x/first", "/y/second"])
    assert found == [
        Source(path=Path("/x/first"), blake3="aa", size=1),
        Source(path=Path("/y/second"), blake3="bb", size=2),
    ]
    assert sources.planned_sources([], []) == []
    with pytest.raises(ValueError):  # a path for every planned file, never fewer
        sources.planned_sources(planned_inputs, ["/x/first"])
