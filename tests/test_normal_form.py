"""The normal form a code digest hashes: blind to comments, docstrings, help texts and layout, and
to nothing else (`buildtrain/plan/normal_form.py`)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.plan.normal_form import c_form, python_form

PACKAGE = Path(__file__).resolve().parent.parent / "buildtrain"
MODULES = sorted(PACKAGE.rglob("*.py"))
C_SOURCES = sorted(PACKAGE.rglob("*.c"))


def form(source: str) -> bytes:
    return python_form(ast.parse(source))


SAME = [
    ("x = 1\n", "x = 1  # one\n\n\n"),
    ("def f():\n    return 1\n", 'def f():\n    """Returns one."""\n    return 1\n'),
    ('def f():\n    """Old."""\n', 'def f():\n    """New, longer."""\n'),
    ('def f():\n    """Doc."""\n', "def f():\n    pass\n"),
    ('"""Module."""\nclass A:\n    """A."""\n', "class A:\n    pass\n"),
    (
        "from buildtrain.config.checks import setting\nx: int = setting(1, 'old help', ok)\n",
        "from buildtrain.config.checks import setting\nx: int = setting(1, 'new' ' help', ok)\n",
    ),
    (
        "from buildtrain.config.checks import setting as s\nx = s(1, 'old')\n",
        "from buildtrain.config.checks import setting as s\nx = s(1, 'new')\n",
    ),
    ("p.add_argument('--x', help='old', type=int)\n", "p.add_argument('--x', help='new', type=int)\n"),
    ("argparse.ArgumentParser(description='a')\n", "argparse.ArgumentParser(description='b')\n"),
    ("x = (1 +\n     2)\n", "x = (1 + 2)\n"),
    ("x = 1.0\n", "x = 1.00\n"),  # the same constant, spelled twice
]

DIFFERENT = [
    ("x = 1\n", "x = 2\n"),
    ("x = 'a'\n", "x = 'b'\n"),  # a string that is not a docstring is data
    ("def f():\n    x = 1\n    'a'\n", "def f():\n    x = 1\n    'b'\n"),  # not the first statement
    ("raise ValueError('must be > 0')\n", "raise ValueError('must be > 1')\n"),  # messages stay
    (  # the default of a setting is a number
        "from buildtrain.config.checks import setting\nx = setting(1, 'help')\n",
        "from buildtrain.config.checks import setting\nx = setting(2, 'help')\n",
    ),
    (  # a computed help text stays whole
        "from buildtrain.config.checks import setting\nx = setting(1, f'{a}')\n",
        "from buildtrain.config.checks import setting\nx = setting(1, f'{b}')\n",
    ),
    (
        "def setting(a, b): return b\nx = setting(1, 'a')\n",
        "def setting(a, b): return b\nx = setting(1, 'b')\n",
    ),
    ("f(help='a')\n", "f(help='b')\n"),  # not an argparse call
    ("p.add_argument('--x', default='a')\n", "p.add_argument('--x', default='b')\n"),
]


@pytest.mark.parametrize(("one", "other"), SAME)
def test_what_cannot_change_a_result_leaves_the_form(one: str, other: str) -> None:
    assert form(one) == form(other)


@pytest.mark.parametrize(("one", "other"), DIFFERENT)
def test_what_can_change_a_result_stays_in_the_form(one: str, other: str) -> None:
    assert form(one) != form(other)


def line_ends(source: str) -> list[int]:
    """Offsets where a line ends outside any string: a comment or a blank line fits there."""
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return [
        starts[token.start[0] - 1] + token.start[1]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type in (tokenize.NEWLINE, tokenize.NL) and token.string
    ]


@settings(max_examples=40, deadline=None)
@given(
    path=st.sampled_from(MODULES),
    picks=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=5),
    words=st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=20),
    blank=st.booleans(),
)
def test_comments_and_blank_lines_anywhere_never_change_a_modules_form(
    path: Path, picks: list[float], words: str, blank: bool
) -> None:
    source = path.read_text(encoding="utf-8")
    ends = line_ends(source)
    edited = source
    for at in sorted({ends[int(p * len(ends))] for p in picks}, reverse=True):
        edited = edited[:at] + f"  # {words}" + ("\n" if blank else "") + edited[at:]
    assert form(edited) == form(source)


@settings(max_examples=40, deadline=None)
@given(
    path=st.sampled_from(C_SOURCES),
    picks=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=5),
    words=st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=20),
    style=st.sampled_from(["line", "blank", "spaces"]),
)
def test_comments_and_blank_lines_anywhere_never_change_a_c_sources_form(
    path: Path, picks: list[float], words: str, style: str
) -> None:
    """After any line not continued by a backslash (inside a block comment too: a line comment or
    a blank line added there is still part of it; a block comment is not, its `*/` ends both)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    words = words.replace("*/", "").replace("\\", "")
    added = {"line": f"// {words}", "blank": "", "spaces": " \t "}[style]
    for at in sorted({int(p * len(lines)) for p in picks}, reverse=True):
        if not lines[at].endswith("\\"):
            lines.insert(at + 1, added)
    assert c_form("\n".join(lines).encode()) == c_form(path.read_bytes())


C_SAME = [
    (b"int x = 1; // one\n", b"int  x = 1;\n\n"),
    (b"int x = /* a\nb */ 1;\n", b"int x = 1;\n"),
    (b"/* a */ int x; /* b */\n", b"int x;\n"),
    (b"#define A \\\n  1\n", b"#define A 1\n"),
    (b"\tif (a)  return b;", b"if (a) return b;\n"),
]
C_DIFFERENT = [
    (b"int x = 1;\n", b"int x = 2;\n"),
    (b'char *s = "a  b";\n', b'char *s = "a b";\n'),  # spaces in a literal are data
    (b'char *s = "/* a */";\n', b'char *s = "/* b */";\n'),  # so is a comment in one
    (b"char c = '/'; int x = 1;\n", b"char c = '/'; int x = 2;\n"),
    (b"#define A 1\nint x = A;\n", b"#define A 1 int x = A;\n"),  # a directive ends at its newline
    (b"int a = b/ /c;\n", b"int a = b//c;\n"),
    (b"int x = __LINE__;\n", b"\nint x = __LINE__;\n"),  # line numbers are values here
]


@pytest.mark.parametrize(("one", "other"), C_SAME)
def test_c_comments_and_layout_leave_the_form(one: bytes, other: bytes) -> None:
    assert c_form(one) == c_form(other)


@pytest.mark.parametrize(("one", "other"), C_DIFFERENT)
def test_c_code_and_literals_stay_in_the_form(one: bytes, other: bytes) -> None:
    assert c_form(one) != c_form(other)


def test_a_c_source_the_lexer_cannot_finish_is_hashed_as_its_bytes() -> None:
    assert c_form(b'char *s = "open;\n') == b'char *s = "open;\n'
