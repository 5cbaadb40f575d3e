"""Documents out of data files: plain text, JSONL and Parquet, streamed.

A plain text file is one document, read in chunks; a JSONL line or a Parquet row is one document.
Nothing is read whole: JSONL goes line by line, Parquet record batch by record batch within each row
group, so memory is bounded by the largest document (or batch), never by the corpus. A malformed
line, a missing key or column, or a value that is not a string stops the step with the file, the
line or row group and the key (bytes that are not UTF-8 and records nested too deep to read
included); the step's output folder is discarded, so nothing half-written reaches the store. Only
regular files are opened (`open_regular`): a data file swapped for a FIFO or a link to /dev/zero
after planning is refused, never read forever. Needs no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.errors import StepFailed
from buildtrain.steps.sources import open_source, private_copy

if TYPE_CHECKING:
    from buildtrain.config.steps import TextSettings

READ_CHUNK = 1 << 20
PARQUET_BATCH_ROWS = 4096  # rows per record batch: a few MB of text at most


def text_chunks(path: Path) -> Iterator[bytes]:
    with open_source(path) as handle:
        while chunk := handle.read(READ_CHUNK):
            yield chunk


def documents(text: TextSettings, sources: list[Path]) -> Iterator[tuple[str, Iterator[bytes]]]:
    """(where, chunks) per document of every source file, in plan order. `where` names the file (and
    the line or row group) for error messages; it never reaches a hash."""
    for path in sources:
        if text.format == "text":
            yield str(path), text_chunks(path)
        elif text.format == "jsonl":
            yield from jsonl_documents(path, text.text_field)
        else:
            yield from parquet_documents(path, text.text_column)


def _utf8(text: str, where: str, key: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise StepFailed(
            f"{where}: key '{key}' holds a lone surrogate, which is not text; fix the record"
        ) from None


def jsonl_documents(path: Path, field: str) -> Iterator[tuple[str, Iterator[bytes]]]:
    """One document per non-blank line: the string at `field` of the JSON object on that line."""
    with open_source(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue  # a trailing newline or blank separator line is not a record
            where = f"{path}: line {number}"
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise StepFailed(f"{where}: not valid JSON ({exc}); fix or remove the line") from None
            except RecursionError:  # Python's parser recurses per level: 100,000 `[` exhaust the stack
                raise StepFailed(f"{where}: nested too deep to read; fix or remove the line") from None
            if not isinstance(record, dict):
                raise StepFailed(
                    f"{where}: expected a JSON object with key '{field}', got {type(record).__name__}"
                )
            if field not in record:
                keys = ", ".join(sorted(record)[:8]) or "none"
                raise StepFailed(
                    f"{where}: no key '{field}' (keys: {keys}); set data.text_field to the key that holds the text"
                )
            text = record[field]
            if not isinstance(text, str):
                raise StepFailed(f"{where}: key '{field}' is {type(text).__name__}, not a string")
            yield where, iter((_utf8(text, where, field),))


def parquet_documents(path: Path, column: str) -> Iterator[tuple[str, Iterator[bytes]]]:
    """One document per row: the string in `column`, read a record batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    readable = private_copy(path)  # checked against the plan before Parquet reads it
    try:
        parquet = pq.ParquetFile(readable)
    except (pa.ArrowException, OSError) as exc:
        raise StepFailed(f"{path}: not a readable Parquet file ({exc})") from None
    yield from _parquet_rows(parquet, path, column)


def _parquet_rows(parquet: Any, path: Path, column: str) -> Iterator[tuple[str, Iterator[bytes]]]:
    import pyarrow as pa

    schema = parquet.schema_arrow
    if column not in schema.names:
        names = ", ".join(schema.names[:8]) or "none"
        raise StepFailed(
            f"{path}: no column '{column}' (columns: {names}); set data.text_column to the column that holds the text"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise StepFailed(f"{path}: column '{column}' is {kind}, not a string column")
    for group in range(parquet.num_row_groups):
        where = f"{path}: row group {group}"
        try:
            batches = parquet.iter_batches(
                batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[column]
            )
            row = 0
            for batch in batches:
                values = batch.column(0)
                if values.null_count:
                    raise StepFailed(
                        f"{where}: column '{column}' has {values.null_count} null value(s); drop or fill them"
                    )
                for text in _texts(values, where, column, row):
                    yield where, iter((_utf8(text, where, column),))
                row += len(values)
        except pa.ArrowException as exc:
            raise StepFailed(f"{where}: cannot be read ({exc})") from None


def _texts(values: Any, where: str, column: str, first_row: int) -> list[str]:
    """A batch's strings; Arrow stores string columns unchecked, so bytes that are not UTF-8 only
    show when decoded: name the first such row."""
    try:
        return values.to_pylist()
    except UnicodeDecodeError:
        for index in range(len(values)):
            try:
                values[index].as_py()
            except UnicodeDecodeError as exc:
                raise StepFailed(
                    f"{where}: column '{column}', row {first_row + index} of the group: not UTF-8 text "
                    f"(byte {exc.object[exc.start]:#04x} at {exc.start}); fix or drop the row"
                ) from None
        raise
