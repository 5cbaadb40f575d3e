"""A fuzzer over the whole preset language and `--set`, through the command line.

Whatever a preset says (valid, subtly wrong, garbled, hostile names, deep `extends`, `extends`
diamonds, FIFOs and links wherever a path is read, huge numbers, hostile tokenizer files), `bt
plan` answers with exit 0 or 2 in bounded time and never a traceback; and valid micro presets,
spelled in any of the ways the language allows, run to the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import string
import tempfile
from pathlib import Path
from typing import Any

import attrs
from conftest import run_bt, summaries, time_bound
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from strategies import (
    KEYS,
    TOML_DOCS,
    TOML_VALUES,
    TOMLISH,
    UNSAFE_NAMES,
    emit,
    emit_value,
    layout,
    leaves,
    micro_specs,
    mutated_docs,
    preset_specs,
    set_key,
    write_preset,
)

from buildtrain import cli
from buildtrain.config.schema import SECTIONS
from buildtrain.errors import ExitCode

# One `bt plan` of a small preset takes milliseconds; anything near this is a hang.
CASE_SECONDS = 10


@attrs.frozen
class Special:
    """A path that is not a regular file: a FIFO (`target` None) or a symbolic link to `target`."""

    target: str | None = None


FIFO = Special()
# What can stand where a file is read: each blocks, never ends or fails a naive reader.
SPECIALS = {
    "fifo": FIFO,
    "dev-zero": Special("/dev/zero"),
    "link-to-fifo": Special("pipe"),
    "dangling-link": Special("nowhere"),
    "link-to-folder": Special("data"),
}
Files = dict[str, "bytes | Special"]


def materialize(root: Path, files: Files) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == FIFO:
            os.mkfifo(path)
        elif isinstance(content, Special):
            path.symlink_to(content.target)
        else:
            path.write_bytes(content)


def bt_plan(preset: Path, overrides: list[str], store: Path, nproc: int = 1) -> tuple[int, str]:
    """`bt plan` in this process (milliseconds instead of a process start): exit code and stderr."""
    argv = ["--store", str(store), "plan", "-q", str(preset), "--nproc", str(nproc)]
    for assignment in overrides:
        argv.append(f"--set={assignment}")
    err = io.StringIO()
    with (
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
        time_bound(CASE_SECONDS, "bt plan"),
    ):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            code = exc.code if isinstance(exc.code, int) else ExitCode.USAGE
    return code, err.getvalue()


@st.composite
def valid_overrides(draw: st.DrawFn, doc: dict[str, Any]) -> list[str]:
    """`--set` of existing keys to values of any kind (right, wrong, hostile), or of new keys."""
    found = leaves(doc)
    out = []
    for _ in range(draw(st.integers(0, 3))):
        rng = random.Random(draw(st.integers(0, 2**16)))
        kind = draw(st.sampled_from(["leaf", "new", "name", "garbled"]))
        if kind == "leaf" and found:
            path, _ = draw(st.sampled_from(found))
            value = draw(TOML_VALUES)
            out.append(f"{set_key(path)}={emit_value(value, rng)}")
        elif kind == "new":
            out.append(f"{draw(KEYS)}.{draw(KEYS)}={emit_value(draw(TOML_VALUES), rng)}")
        elif kind == "name":
            key = draw(st.sampled_from(["name", "stages[0].name", "stages.0.name"]))
            out.append(f"{key}={emit_value(draw(UNSAFE_NAMES), rng)}")
        else:
            out.append(draw(st.text(alphabet=string.printable, max_size=20)))
    return out


KINDS = [
    *("valid", "mutated", "random", "garbled", "extends", "unsafe-name"),
    *("diamond", "special-path", "huge-number", "hostile-tokenizer"),
]


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, Files, list[str]]:
    """Files of a preset folder (`p.toml` is the preset) and the `--set` overrides."""
    rng = random.Random(draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from(KINDS))
    files: Files = {}
    doc: dict[str, Any] = {}
    if kind in ("valid", "extends", "unsafe-name", "diamond", "huge-number"):
        spec = draw(preset_specs(max_stages=2))
        files.update(spec.files)
        doc = layout(spec, rng)
        if kind == "unsafe-name":
            doc["name"] = draw(UNSAFE_NAMES)
        text = emit(doc, rng)
        if kind == "extends":  # a chain of bases, possibly too deep, cyclic or naming a folder
            depth = draw(st.sampled_from([1, 3, 40]))
            target = draw(st.sampled_from(["base0.toml", "p.toml", "data", "missing.toml"]))
            files["data/keep"] = b""
            for level in range(depth):
                files[f"base{level}.toml"] = f'extends = "base{level + 1}.toml"\n'.encode()
            files[f"base{depth}.toml"] = text.encode()
            text = f'extends = "{target}"\n'
        elif kind == "diamond":
            files.update(draw(diamonds(text)))
            return kind, {**files, "p.toml": b'extends = "d0.toml"\n'}, []
        elif kind == "huge-number":
            return kind, {**files, "p.toml": text.encode()}, draw(huge_numbers())
        files["p.toml"] = text.encode()
    elif kind == "special-path":
        files.update(draw(special_paths()))
    elif kind == "hostile-tokenizer":
        files["tok.json"] = draw(hostile_tokenizers())
        files["p.toml"] = b'data = { tokenizer = { file = "tok.json" } }\n'
    elif kind == "mutated":
        doc = draw(mutated_docs())
        files["p.toml"] = emit(doc, rng).encode()
    elif kind == "random":
        doc = draw(TOML_DOCS)
        files["p.toml"] = emit(doc, rng).encode()
    else:
        content = draw(st.binary(max_size=200) | TOMLISH)
        files["p.toml"] = content if isinstance(content, bytes) else content.encode()
    return kind, files, draw(valid_overrides(doc))


@st.composite
def diamonds(draw: st.DrawFn, text: str) -> Files:
    """Up to 31 bases `d0` .. `dN`, each extending the next two: every base is reached along
    exponentially many paths (2**29 for 31). The last holds the preset; sometimes one more edge
    closes a cycle or names a file that is missing."""
    count = draw(st.integers(2, 31))
    bases = {i: [f"d{j}.toml" for j in (i + 1, i + 2) if j < count] for i in range(count)}
    if draw(st.integers(0, 2)) == 0:
        names = [f"d{j}.toml" for j in range(count)] + ["gone.toml"]
        bases[draw(st.integers(0, count - 1))].append(draw(st.sampled_from(names)))
    files: Files = {
        f"d{i}.toml": f"extends = {bases[i]}\n[train]\nseed = {i}\n".encode() for i in range(count)
    }
    files[f"d{count - 1}.toml"] = f"extends = {bases[count - 1]}\n{text}".encode()
    return files


NUL_PATHS = {
    "extends": 'extends = "a\\u0000b"\n',
    "data.files": '[data]\nsource = "files"\nfiles = ["a\\u0000b"]\n',
    "tokenizer.file": 'data.tokenizer.file = "a\\u0000b"\n',
}


@st.composite
def special_paths(draw: st.DrawFn) -> Files:
    """A FIFO or a link (to /dev/zero, a FIFO, nowhere, a folder) where `extends`, `data.files` or
    `data.tokenizer.file` reads a file."""
    place = draw(st.sampled_from(["extends", "data.files", "tokenizer.file"]))
    special = SPECIALS[draw(st.sampled_from(sorted(SPECIALS)))]
    files: Files = {"pipe": FIFO, "data/a.txt": b"hello"}
    if draw(st.integers(0, 4)) == 0:  # a path no system call takes: it holds a NUL byte
        return {**files, "p.toml": NUL_PATHS[place].encode()}
    if place == "extends":
        files["base.toml"] = special
        files["p.toml"] = b'extends = "base.toml"\n'
    elif place == "data.files":
        files["data/b.txt"] = special
        pattern = draw(st.sampled_from(["data/*.txt", "data/b.txt", "data/**"]))
        files["p.toml"] = f'[data]\nsource = "files"\nfiles = ["{pattern}"]\n'.encode()
    else:
        files["tok.json"] = special
        files["p.toml"] = b'data = { tokenizer = { file = "tok.json" } }\n'
    return files


# Every numeric key of a preset, and values at and past every limit a parser or a C type has.
NUMERIC_KEYS = [
    f"{section}.{field.name}"
    for section, cls in SECTIONS.items()
    for field in attrs.fields(cls)
    if field.type in ("int", "float")
] + ["data.synthetic.documents", "data.synthetic.lines", "data.synthetic.seed", "data.tokenizer.vocab_size"]
HUGE_NUMBERS = st.sampled_from(
    [
        str(2**62),
        str(2**63 - 1),
        str(2**63),
        str(-(2**63)),
        str(2**64),
        "1" + "0" * 400,
        "1e308",
        "-1e308",
        "inf",
        "nan",
        "5e-324",
    ]
)


@st.composite
def huge_numbers(draw: st.DrawFn) -> list[str]:
    keys = draw(st.lists(st.sampled_from(NUMERIC_KEYS), min_size=1, max_size=3, unique=True))
    return [f"{key}={draw(HUGE_NUMBERS)}" for key in keys]


def _sparse_tokenizer(largest: int) -> bytes:
    vocab = {chr(0x100 + i): i for i in range(256)} | {"<|endoftext|>": largest}
    return json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": []}}).encode()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def hostile_tokenizers(draw: st.DrawFn) -> bytes:
    """A tokenizer.json that is sparse (one id up to past uint32), nested too deep, of the wrong
    shape (the model's vocab any JSON value) or not JSON at all."""
    kind = draw(st.sampled_from(["sparse", "deep", "shape", "bytes"]))
    if kind == "sparse":
        return _sparse_tokenizer(
            draw(st.integers(0, 2**70) | st.sampled_from([50_000_000, 2**32 - 1, 2**32]))
        )
    if kind == "deep":
        depth = draw(st.sampled_from([1_000, 100_000]))
        return b'{"model": {"vocab": ' + b"[" * depth + b"]" * depth + b"}}"
    if kind == "shape":
        value = draw(JSON_VALUES)
        return json.dumps({"model": {"vocab": value}, "added_tokens": draw(JSON_VALUES)}).encode()
    return draw(st.binary(max_size=200))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(), nproc=st.sampled_from([1, 1, 3]))
def test_bt_plan_answers_every_preset_with_0_or_2_in_bounded_time(
    case: tuple[str, Files, list[str]], nproc: int
):
    kind, files, overrides = case
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        materialize(root, files)
        code, err = bt_plan(root / "p.toml", overrides, root / ".bt", nproc)
    event(f"{kind}: exit {code}")
    assert code in (ExitCode.OK, ExitCode.USAGE), (code, err)
    assert "Traceback" not in err
    if code == ExitCode.USAGE:
        assert err.strip(), "a refusal says why"


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=micro_specs(), seed=st.integers(0, 2**16))
def test_generated_micro_presets_run_to_the_end(spec, seed):
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        write_preset(root / "p.toml", spec, random.Random(seed))
        store = root / ".bt"
        result = run_bt("run", str(root / "p.toml"), "--progress", "off", store=store, timeout=240)
        assert result.returncode == ExitCode.OK, result.stderr
        assert "Traceback" not in result.stderr
        (summary,) = summaries(root / "experiments")
        assert summary["outcome"] == "done" and summary["exit_code"] == 0
        labels = [step["label"] for step in summary["steps"]]
        assert "eval" in labels and ("export" in labels) == spec.values["export"]["enabled"], json.dumps(
            summary
        )
        assert summary["executed"] + summary["cached"] == len(labels)
