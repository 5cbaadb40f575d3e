"""What of a source file can change a result, as bytes to hash: its code without the words around it.

A code digest that hashed bytes moved every plan hash when a help text was reworded or a comment
fixed (the README's tour was regenerated 11 times in three days, mostly with the weights
unchanged). These are the rules instead (`sources_digest.py` hashes what they give):

Python (`python_form`): the module's syntax tree, which holds no comments, blank lines or layout,
written by `ast.dump` without line and column numbers, after three kinds of text leave it:
- docstrings: a string constant standing as the first statement of a module, class or function
  body is dropped (a body it leaves empty gets a `pass`), so adding, editing or removing one is
  the same tree. Python keeps it only as `__doc__`, which no computing module reads (tested);
- setting help: the second positional argument of `setting(...)`, where the module binds that
  name by importing `buildtrain.config.checks.setting`. It becomes the field's `metadata[DOC]`,
  which only the preset reference reads (tested);
- argparse help: the `help=`, `description=` and `epilog=` keywords of a call to `add_argument`,
  `add_parser`, `add_argument_group`, `add_subparsers` or `ArgumentParser`.
Only a plain string constant is blanked (to `PLACEHOLDER`): an f-string, a name, a call or
anything else in those places stays whole, so no computation can hide behind the rule. Every
other string stays, error messages included: a string can be data (a token, a key, a format), and
the messages of a failing step reach its records.

`ast.dump` is stable within one Python minor version and not promised across them (fields come
and go), so the digest that uses these forms names the version (`PYTHON`); CI pins 3.11. Line
numbers leave the hash: they reach tracebacks, never a step's outputs.

C (`c_form`): as a C compiler's translation phases 2 and 3 do, backslash-newlines are spliced and
each comment becomes one space, outside string and character literals; then runs of spaces and
tabs become one space, lines are stripped and blank lines dropped. C tokens part on whether
whitespace is there, never on how much, and preprocessor lines keep their newlines. A source that
names `__LINE__` (a line number as a value) is hashed as its raw bytes.
"""

from __future__ import annotations

import ast
import re
import sys

PLACEHOLDER = "<text>"
PYTHON = f"python {sys.version_info[0]}.{sys.version_info[1]}"

SETTING = ("buildtrain.config.checks", "setting")
ARGPARSE_CALLS = frozenset(
    {"add_argument", "add_parser", "add_argument_group", "add_subparsers", "ArgumentParser"}
)
ARGPARSE_TEXTS = frozenset({"help", "description", "epilog"})

_DEFINITIONS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _is_docstring(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[0], ast.Expr) and _is_text(body[0].value)


def _callee(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _setting_names(tree: ast.Module) -> frozenset[str]:
    """The names this module binds to `buildtrain.config.checks.setting`, wherever it imports it."""
    module, name = SETTING
    return frozenset(
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == module and node.level == 0
        for alias in node.names
        if alias.name == name
    )


def blank_texts(tree: ast.Module) -> ast.Module:
    """`tree` without docstrings and with setting and argparse help texts blanked (in place)."""
    settings = _setting_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, _DEFINITIONS) and _is_docstring(node.body):
            node.body = node.body[1:] or [ast.Pass()]
        if not isinstance(node, ast.Call):
            continue
        callee = _callee(node)
        is_setting = isinstance(node.func, ast.Name) and callee in settings
        if is_setting and len(node.args) >= 2 and _is_text(node.args[1]):
            node.args[1] = ast.Constant(PLACEHOLDER)
        if callee in ARGPARSE_CALLS:
            for keyword in node.keywords:
                if keyword.arg in ARGPARSE_TEXTS and _is_text(keyword.value):
                    keyword.value = ast.Constant(PLACEHOLDER)
    return tree


def python_form(tree: ast.Module) -> bytes:
    """The bytes of a parsed module that a code digest hashes (see the module's rules)."""
    return ast.dump(blank_texts(tree), annotate_fields=True, include_attributes=False).encode()


# One token at a time: a literal (kept whole), a comment, a spliced line, or anything else.
_C_TOKENS = re.compile(
    r"""(?P<literal>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')"""
    r"|(?P<block>/\*.*?\*/)"
    r"|(?P<line>//[^\n]*)"
    r"|(?P<other>[^\"'/]+|/)",
    re.DOTALL,
)
_SPACES = re.compile(r"[ \t\f\v\r]+")


def c_form(source: bytes) -> bytes:
    """The bytes of a C source that a code digest hashes (see the module's rules). A source this
    lexer cannot read to its end (an unclosed comment or literal) is hashed as its raw bytes."""
    text = source.decode("utf-8", errors="surrogateescape").replace("\\\r\n", "").replace("\\\n", "")
    if "__LINE__" in text:
        return source
    parts: list[str] = []
    end = 0
    for match in _C_TOKENS.finditer(text):
        if match.start() != end:
            return source
        end = match.end()
        kind = match.lastgroup
        parts.append(" " if kind in ("block", "line") else match.group())
    if end != len(text):
        return source
    lines = (_collapse(line) for line in "".join(parts).split("\n"))
    return "\n".join(line for line in lines if line).encode("utf-8", errors="surrogateescape")


def _collapse(line: str) -> str:
    """Runs of whitespace outside literals become one space; the line is stripped."""
    pieces = re.split(r"""("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')""", line)
    return "".join(p if i % 2 else _SPACES.sub(" ", p) for i, p in enumerate(pieces)).strip()
