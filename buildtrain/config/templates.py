"""Jinja templates from untrusted files (chat templates, lm-eval task fields), rendered as data.

A template compiles in Jinja's immutable sandbox, so it can format the values it is given and
reach nothing else (no `__globals__`, no `os`, no mutation). The sandbox bounds what a template
may touch, not what it may cost, so a render here is also bounded:

- time: `RENDER_SECONDS` per render, by an interval timer (SIGALRM) in the main thread, and by a
  clock read at each output chunk, operator and call everywhere (a thread cannot take a signal);
- size: `RENDER_CHARACTERS` of output, and operators, string methods and filters that would build a
  longer value (`'x' * 10**10`, `'{:>9999999999}'.format(1)`, `' '|indent(10**10)`) are refused
  before they allocate;
- memory: while it renders, the address space may grow by at most `RENDER_MEMORY` (RLIMIT_AS),
  a backstop for whatever the checks above do not foresee.

Every failure, the template's own or a bound's, is a `TemplateRefused` with one line saying why.
Imports jinja2 only when a template is compiled.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

RENDER_SECONDS = 10.0  # one render; an honest chat template renders a record in well under 1 ms
RENDER_CHARACTERS = 16 << 20  # the output of one render, and any one value built while rendering
RENDER_MEMORY = 1 << 30  # growth of the address space allowed while a template renders
TEMPLATE_CHARACTERS = 1 << 20  # a template's own text
WIDE_NUMBER = re.compile(r"\d{7,}")  # a format width of a million or more: more than any honest one
NESTED_FIELD = re.compile(
    r"\{[^{}]*:[^{}]*\{"
)  # str.format's width from an argument: '{:>{}}'.format('x', 10**9)
WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})


class TemplateRefused(Exception):
    """A template that does not compile, or a render that failed or passed a bound (one line)."""


def compile_template(source: str, filters: dict[str, Any] | None = None, **options: Any) -> Any:
    """`source` compiled in the bounded sandbox (with these extra `filters`, resolved when it
    compiles); TemplateRefused naming why not."""
    from jinja2 import TemplateError

    if len(source) > TEMPLATE_CHARACTERS:
        raise TemplateRefused(f"the template is {len(source)} characters, more than {TEMPLATE_CHARACTERS}")
    environment = _environment(**options)
    environment.filters.update(filters or {})
    try:
        return environment.from_string(source)
    except TemplateError as exc:
        raise TemplateRefused(f"not a Jinja template ({one_line(exc)})") from None
    except (RecursionError, MemoryError, ValueError, OverflowError, SyntaxError) as exc:
        # SyntaxError: Python's own limits on the code Jinja makes of it (20 nested loops,
        # 100 levels of indentation), IndentationError among them.
        raise TemplateRefused(
            f"the template cannot be compiled ({type(exc).__name__}: {one_line(exc)})"
        ) from None


def unsafe_names(source: str) -> list[str]:
    """The attributes and keys starting with '_' that `source` names (`cycler.__init__`): the
    sandbox refuses them when they render; this finds them before anything renders."""
    from jinja2 import TemplateError, nodes

    try:
        tree = _environment().parse(source)
    except (TemplateError, RecursionError, MemoryError, ValueError) as exc:
        return [f"not a Jinja template ({one_line(exc)})"]
    found = [node.attr for node in tree.find_all(nodes.Getattr) if node.attr.startswith("_")]
    for node in tree.find_all(nodes.Getitem):
        if isinstance(node.arg, nodes.Const) and str(node.arg.value).startswith("_"):
            found.append(str(node.arg.value))
    return found


def render(template: Any, variables: dict[str, Any]) -> str:
    """`template` rendered with `variables`, within the bounds of this module's docstring."""
    pieces, size = [], 0
    with _bounded(template.environment):
        try:
            for piece in template.generate(**variables):
                size += len(piece)
                if size > RENDER_CHARACTERS:
                    raise TemplateRefused(f"renders more than {RENDER_CHARACTERS} characters")
                template.environment.tick()
                pieces.append(piece)
        except TemplateRefused:
            raise
        except MemoryError:
            raise TemplateRefused(f"needs more than {RENDER_MEMORY >> 20} MiB to render") from None
        except Exception as exc:  # the template's own failure: its message, on one line
            raise TemplateRefused(f"{type(exc).__name__}: {one_line(exc)}") from None
    return "".join(pieces)


def one_line(exc: object) -> str:
    """An exception's (or any value's) text on one line, at most 300 characters."""
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def _environment(**options: Any) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):  # type: ignore[misc]
        intercepted_binops = frozenset({"*", "**", "%", "+"})
        deadline = float("inf")

        def tick(self) -> None:
            if time.monotonic() > self.deadline:
                raise TemplateRefused(f"ran past {RENDER_SECONDS:g} s")

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            self.tick()
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            __self.tick()
            _check_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj: Any, attribute: str) -> Any:
            self.tick()
            return super().getattr(obj, attribute)

    environment = Bounded(**options)
    for name in ("center", "indent", "format", "join", "replace", "tojson"):
        environment.filters[name] = _bounded_filter(environment.filters[name])
    return environment


def _too_long(length: int, why: str) -> None:
    if length > RENDER_CHARACTERS:
        raise TemplateRefused(f"{why} would build {length} characters, more than {RENDER_CHARACTERS}")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would pass the size bound, before it allocates."""
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if hasattr(seq, "__len__") and isinstance(count, int):
                _too_long(len(seq) * max(count, 0), "'*'")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        _too_long(max(right, 0) * left.bit_length() // 8, "'**'")
    elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
        _too_long(len(left) + len(right), "'+'")
    elif operator == "%" and isinstance(left, str):
        _check_format(left, right if isinstance(right, tuple) else (right,))


def _check_format(text: str, values: Any) -> None:
    if WIDE_NUMBER.search(text):
        raise TemplateRefused("a format width or precision of a million or more is refused")
    if "*" in text and any(isinstance(v, int) and abs(v) > RENDER_CHARACTERS for v in values):
        raise TemplateRefused("a '*' width of more than the output bound is refused")


def _check_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a string method call that would build a value past the size bound."""
    method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, (str, bytes)):
        return
    values = [*args, *kwargs.values()]
    if name in WIDTH_METHODS:
        _too_long(max([v for v in values if isinstance(v, int)] or [0]), f"str.{name}")
        _too_long(len(owner) * 8, f"str.{name}")
    elif name in ("format", "format_map"):
        _check_format(owner, values)
        if NESTED_FIELD.search(owner):
            sizes = [*values, *(v for m in values if isinstance(m, dict) for v in m.values())]
            if any(isinstance(v, int) and abs(v) > RENDER_CHARACTERS for v in sizes):
                raise TemplateRefused("a format width from an argument past the output bound is refused")
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        count = owner.count(args[0]) if args[0] else len(owner) + 1
        _too_long(len(owner) + count * max(len(args[1]) - len(args[0]), 0), "str.replace")
    elif name == "join" and isinstance(args[0] if args else None, (list, tuple)):
        items = args[0]
        _too_long(sum(len(str(i)) for i in items) + len(owner) * len(items), "str.join")


def _bounded_filter(function: Any) -> Any:
    """A built-in filter that first refuses an argument that would build a value past the bound."""

    def bounded(*args: Any, **kwargs: Any) -> Any:
        values = [*args, *kwargs.values()]
        if any(isinstance(v, int) and not isinstance(v, bool) and v > RENDER_CHARACTERS for v in values):
            raise TemplateRefused(f"the filter '{function.__name__}' was given a size past the bound")
        if function.__name__ == "do_format" and args and isinstance(args[0], str):
            _check_format(args[0], args[1:])
        result = function(*args, **kwargs)
        if isinstance(result, str):
            _too_long(len(result), f"the filter '{function.__name__}'")
        return result

    for attribute in ("jinja_pass_arg",):  # the filter's context or environment argument
        if hasattr(function, attribute):
            setattr(bounded, attribute, getattr(function, attribute))
    bounded.__name__ = function.__name__
    return bounded


@contextmanager
def _bounded(environment: Any) -> Iterator[None]:
    """A deadline for `environment` (and SIGALRM in the main thread) and the memory backstop."""
    environment.deadline = time.monotonic() + RENDER_SECONDS
    with _alarm(), _address_space():
        try:
            yield
        finally:
            environment.deadline = float("inf")


@contextmanager
def _alarm() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # the deadline's clock readings bound it (a thread cannot take a signal)
        return

    def expired(number: int, frame: Any) -> None:
        raise TemplateRefused(f"ran past {RENDER_SECONDS:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    before = signal.setitimer(signal.ITIMER_REAL, RENDER_SECONDS)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if before[0] > 0:  # someone else's timer, given back what is left of it
            signal.setitimer(signal.ITIMER_REAL, *before)


@contextmanager
def _address_space() -> Iterator[None]:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        size = _address_space_now()
    except (ImportError, OSError, ValueError):
        yield  # no such limit here: the size checks still hold
        return
    limit = size + RENDER_MEMORY
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft <= limit:
        yield  # a tighter limit is already set
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _address_space_now() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        pages = int(handle.read().split()[0])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")
