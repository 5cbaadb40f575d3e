"""Field helpers for the config classes: a documented field, small validators, cross-field rules.

Validators raise `ValueError` with a message that reads after the key path
("must be > 0 (got -1.0)"); the loader prefixes file and key. A validator method that also reads
other fields is a cross-field rule and says which ones with `@reads(...)`: the loader runs it only
once its own field and every field it reads are valid, so one bad value is reported once, at its
own key, and never again through a rule that reads it (see `validate`).
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

DOC = "buildtrain.doc"
READS = "_buildtrain_reads"

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]
V = TypeVar("V", bound=Validator)

# Names become parts of paths (export folders, step labels, temporary folders), so they are held
# to characters that can neither climb out of a folder nor hide in it.
SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
SAFE_NAME_RULE = "use only letters, digits, '.', '_' and '-' (1 to 100, not starting with '.')"


def name_problem(value: str) -> str | None:
    """Why a preset, stage or step name cannot be part of a path, if it cannot."""
    if SAFE_NAME.fullmatch(value):
        return None
    return f"{value!r} is not a safe name: {SAFE_NAME_RULE}"


def setting(default: Any, doc: str, *validators: Validator, **marks: Any) -> Any:
    """An attrs field that carries its one-line documentation for the preset reference (docs/reference.md)."""
    return attrs.field(default=default, validator=list(validators) or None, metadata={DOC: doc, **marks})


# Field marks the converter reads when it writes a config out (`convert.py`).
SINCE = "buildtrain.since"  # added after plans were hashed: written only when not the default
NEVER_HASHED = "buildtrain.never_hashed"  # a path: never written into a plan or a step's config


def since(field: Any) -> Any:
    """Mark a `setting` as added later: it enters an encoding only when set to another value."""
    field.metadata = types.MappingProxyType({**field.metadata, SINCE: True})
    return field


FORMERLY = "buildtrain.formerly"  # the name a setting had before it was renamed


def renamed_from(old: str, field: Any) -> Any:
    """Mark a `setting` that was called `old`: a preset that still writes `old` is refused with a
    message naming the new key (a silently ignored or defaulted setting would change the run)."""
    field.metadata = types.MappingProxyType({**field.metadata, FORMERLY: old})
    return field


def never_hashed(field: Any) -> Any:
    """Mark a `setting` that names a place (a path): its content enters hashes elsewhere."""
    field.metadata = types.MappingProxyType({**field.metadata, NEVER_HASHED: True})
    return field


@attrs.frozen
class Bound:
    """A range validator (`value > 0`, `value <= 0.5`, ...) that the reference can print."""

    operator: str
    bound: float

    def holds(self, value: Any) -> bool:
        return {
            ">": value > self.bound,
            ">=": value >= self.bound,
            "<": value < self.bound,
            "<=": value <= self.bound,
        }[self.operator]

    def __call__(self, _: Any, __: attrs.Attribute[Any], value: Any) -> None:
        if not self.holds(value):
            raise ValueError(f"must be {self.operator} {self.bound} (got {value!r})")

    def __str__(self) -> str:
        return f"{self.operator} {self.bound}"


def greater_than(bound: float) -> Bound:
    return Bound(">", bound)


def at_least(bound: float) -> Bound:
    return Bound(">=", bound)


def below(bound: float) -> Bound:
    return Bound("<", bound)


def at_most(bound: float) -> Bound:
    return Bound("<=", bound)


@attrs.frozen
class OneOf:
    """A choice validator that keeps its choices readable, for the reference docs."""

    choices: tuple[str, ...]

    def __call__(self, _: Any, __: attrs.Attribute[Any], value: Any) -> None:
        if value not in self.choices:
            listed = ", ".join(repr(c) for c in self.choices)
            raise ValueError(f"must be one of {listed} (got {value!r})")


def one_of(*choices: str) -> OneOf:
    return OneOf(choices)


def reads(*fields: str) -> Callable[[V], V]:
    """Mark a validator method as a cross-field rule that also reads these fields of its class."""

    def mark(method: V) -> V:
        setattr(method, READS, fields)
        return method

    return mark


def validators_of(attribute: attrs.Attribute[Any]) -> tuple[Validator, ...]:
    """A field's validators, each on its own (attrs joins several into one)."""
    validator = attribute.validator
    if validator is None:
        return ()
    return tuple(getattr(validator, "_validators", (validator,)))


def reads_of(validator: Validator) -> tuple[str, ...] | None:
    """The other fields a cross-field rule reads; None for a validator of the field alone."""
    return getattr(validator, READS, None)


def choices_of(attribute: attrs.Attribute[Any]) -> tuple[str, ...] | None:
    """The allowed values of a field validated by `one_of`, if any."""
    for item in validators_of(attribute):
        if isinstance(item, OneOf):
            return item.choices
    return None


def bounds_of(attribute: attrs.Attribute[Any]) -> tuple[Bound, ...]:
    """The range validators of a field, for the reference docs."""
    return tuple(item for item in validators_of(attribute) if isinstance(item, Bound))
