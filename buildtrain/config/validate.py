"""Structure and validate one section of a preset, finding every problem with it, each once.

Two passes, so that one bad value is reported once, at its own key:

1. per field: its type (the strict converter) and its own validators (ranges, choices), which
   read nothing but the field;
2. cross-field rules (validator methods marked `@reads` in the schema), each run only when the
   field it guards and every field it reads passed the first pass. A rule over an invalid value
   could only repeat that problem: `train.steps = -1` is reported at `train.steps`, and does not
   also make `warmup_steps` "exceed train.steps -1".

A rule that failed does not make the fields it guards invalid for other rules: `n_heads` not
dividing `dim` and `n_kv_heads` not dividing `n_heads` are two problems, each with its own fix.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, TypeVar

import attrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)

from buildtrain.config.checks import FORMERLY, reads_of, validators_of
from buildtrain.config.convert import converter, describe
from buildtrain.config.problems import KeyPath, key_text, unknown_key

T = TypeVar("T")


@attrs.frozen
class Finding:
    """A problem at a key path, before it is blamed on a file: `involves` holds every key whose
    value it depends on, its own first (see `provenance.blame`)."""

    key: KeyPath
    message: str
    involves: tuple[KeyPath, ...]


def finding(key: KeyPath, message: str, *reads: KeyPath) -> Finding:
    return Finding(key=key, message=message, involves=(key, *reads))


def structure_section(raw: Any, cls: type[T], key: KeyPath) -> tuple[T | None, list[Finding]]:
    """The section at `key` as an instance of `cls` if it is valid, and every problem with it."""
    if not isinstance(raw, dict):
        return None, [finding(key, f"expected a table, got {describe(raw)}")]
    found: list[Finding] = []
    with attrs.validators.disabled():  # validators run below, all of them, not up to the first failure
        try:
            instance = converter.structure(raw, cls)
        except Exception as exc:  # cattrs groups every structuring error; all are reported
            found = [finding(k, m) for k, m in _walk_structure_error(exc, key)]
            # Structure the rest, each key that failed left at its default, so one wrong type
            # does not hide the other problems of the section.
            failed = {_named_prefix(f.key[len(key) :]) for f in found}
            try:
                instance = converter.structure(_without(raw, failed), cls)
            except Exception:  # a failure that cannot be isolated: report what was found
                return None, found
    found += validate(instance, key, [f.key for f in found])
    return (None if found else instance), found


def validate(instance: Any, key: KeyPath, failed: Collection[KeyPath] = ()) -> list[Finding]:
    """Both passes over an attrs instance at `key` and the instances inside it. The fields at (or
    under) `failed` keys did not structure: they hold defaults, and nothing reads them."""
    own = _field_pass(instance, key, failed)
    return own + _rule_pass(instance, key, [*failed, *(f.key for f in own)])


def _touches(key: KeyPath, bad: Collection[KeyPath]) -> bool:
    """Whether a problem was found at `key`, inside it or at a table that holds it."""
    return any(k[: len(key)] == key or key[: len(k)] == k for k in bad)


def _field_pass(instance: Any, key: KeyPath, failed: Collection[KeyPath]) -> list[Finding]:
    found: list[Finding] = []
    for field in attrs.fields(type(instance)):
        path, value = (*key, field.name), getattr(instance, field.name)
        if attrs.has(type(value)):
            found += _field_pass(value, path, failed)
            continue
        for index, item in _tables_in(value):  # an array of tables (eval.suites): each checked
            found += _field_pass(item, (*path, index), failed)
        if not _touches(path, failed):
            for check in validators_of(field):
                if reads_of(check) is not None:
                    continue
                try:
                    check(instance, field, value)
                except (ValueError, TypeError) as exc:
                    found.append(finding(path, str(exc)))
                    break  # one problem per value: the first validator that fails says it
    return found


def _rule_pass(instance: Any, key: KeyPath, bad: Collection[KeyPath]) -> list[Finding]:
    found: list[Finding] = []
    for field in attrs.fields(type(instance)):
        path, value = (*key, field.name), getattr(instance, field.name)
        if attrs.has(type(value)):
            found += _rule_pass(value, path, bad)
            continue
        for index, item in _tables_in(value):
            found += _rule_pass(item, (*path, index), bad)
        for check in validators_of(field):
            names = reads_of(check)
            if names is None:
                continue
            reads = tuple((*key, name) for name in names)
            if any(_touches(k, bad) for k in (path, *reads)):
                continue
            try:
                check(instance, field, value)
            except (ValueError, TypeError) as exc:
                found.append(finding(path, str(exc), *reads))
                break
    return found


def _tables_in(value: Any) -> list[tuple[int, Any]]:
    """(index, table) of each attrs instance in an array value."""
    if not isinstance(value, tuple):
        return []
    return [(index, item) for index, item in enumerate(value) if attrs.has(type(item))]


def _walk_structure_error(exc: BaseException, key: KeyPath) -> list[tuple[KeyPath, str]]:
    """Flatten cattrs' grouped errors into (key path, message) pairs."""
    if isinstance(exc, ForbiddenExtraKeysError):
        fields = [a.name for a in attrs.fields(exc.cl)]
        renamed = {a.metadata[FORMERLY]: a.name for a in attrs.fields(exc.cl) if FORMERLY in a.metadata}
        return [
            ((*key, extra), _renamed(key, renamed[extra]) if extra in renamed else unknown_key(extra, fields))
            for extra in sorted(exc.extra_fields)
        ]
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        found: list[tuple[KeyPath, str]] = []
        for sub in exc.exceptions:
            sub_key = key
            for note in getattr(sub, "__notes__", []):
                if isinstance(note, AttributeValidationNote):
                    sub_key = (*key, note.name)
                elif isinstance(note, IterableValidationNote):
                    sub_key = (*key, note.index)
            found.extend(_walk_structure_error(sub, sub_key))
        return found
    return [(key, "is required" if isinstance(exc, KeyError) else str(exc))]


def _renamed(key: KeyPath, new: str) -> str:
    """A key that was renamed: refused (never read as the new one) with the name to write instead."""
    return f"was renamed to {key_text((*key, new))}; write {new} instead"


def _named_prefix(key: KeyPath) -> tuple[str, ...]:
    """The part of a key path before its first array index (`betas[0]` -> `betas`)."""
    named: list[str] = []
    for part in key:
        if not isinstance(part, str):
            break
        named.append(part)
    return tuple(named)


def _without(raw: Mapping[str, Any], paths: set[tuple[str, ...]]) -> dict[str, Any]:
    """A copy of a table with the given key paths removed."""
    out = dict(raw)
    for name in {path[0] for path in paths if path}:
        deeper = {path[1:] for path in paths if path and path[0] == name}
        if () in deeper or not isinstance(out.get(name), Mapping):
            out.pop(name, None)
        else:
            out[name] = _without(out[name], deeper)
    return out
