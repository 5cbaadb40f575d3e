"""A fuzzer over the whole preset language and `--set`, through the command line.

Whatever a preset says (valid, subtly wrong, garbled, hostile names, deep `extends`), `bt plan`
answers with exit 0 or 2 in bounded time and never a traceback; and valid micro presets, spelled
in any of the ways the language allows, run to the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import string
import tempfile
from pathlib import Path
from typing import Any

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
from buildtrain.errors import ExitCode

# One `bt plan` of a small preset takes milliseconds; anything near this is a hang.
CASE_SECONDS = 10


def bt_plan(preset: Path, overrides: list[str], store: Path) -> tuple[int, str]:
    """`bt plan` in this process (milliseconds instead of a process start): exit code and stderr."""
    argv = ["--store", str(store), "plan", "-q", str(preset)]
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


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, bytes], list[str]]:
    """Files of a preset folder (`p.toml` is the preset) and the `--set` overrides."""
    rng = random.Random(draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from(["valid", "mutated", "random", "garbled", "extends", "unsafe-name"]))
    files: dict[str, bytes] = {}
    doc: dict[str, Any] = {}
    if kind in ("valid", "extends", "unsafe-name"):
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
        files["p.toml"] = text.encode()
    elif kind == "mutated":
        doc = draw(mutated_docs())
        files["p.toml"] = emit(doc, rng).encode()
    elif kind == "random":
        doc = draw(TOML_DOCS)
        files["p.toml"] = emit(doc, rng).encode()
    else:
        content = draw(st.binary(max_size=200) | TOMLISH)
        files["p.toml"] = content if isinstance(content, bytes) else content.encode()
    return files, draw(valid_overrides(doc))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_bt_plan_answers_every_preset_with_0_or_2_in_bounded_time(case: tuple[dict[str, bytes], list[str]]):
    files, overrides = case
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for name, content in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(content)
        code, err = bt_plan(root / "p.toml", overrides, root / ".bt")
    event(f"exit {code}")
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
