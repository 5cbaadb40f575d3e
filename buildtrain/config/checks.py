"""Field helpers for the config classes: a documented field and small validators.

Validators raise `ValueError` with a message that reads after the key path
("must be > 0 (got -1.0)"); the loader prefixes file and key. They are run by the loader's
collecting pass, so one bad value never hides another.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs

DOC = "buildtrain.doc"

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

# Names become parts of paths (export folders, step labels, temporary folders), so they are held
# to characters that can neither climb out of a folder nor hide in it.
SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
SAFE_NAME_RULE = "use only letters, digits, '.', '_' and '-' (1 to 100, not starting with '.')"


def name_problem(value: str) -> str | None:
    """Why a preset, stage or step name cannot be part of a path, if it cannot."""
    if SAFE_NAME.fullmatch(value):
        return None
    return f"{value!r} is not a safe name: {SAFE_NAME_RULE}"


def setting(default: Any, doc: str, *validators: Validator, **kwargs: Any) -> Any:
    """An attrs field that carries its one-line documentation for `--help` and the README."""
    return attrs.field(
        default=default,
        validator=list(validators) or None,
        metadata={DOC: doc},
        **kwargs,
    )


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


def choices_of(attribute: attrs.Attribute[Any]) -> tuple[str, ...] | None:
    """The allowed values of a field validated by `one_of`, if any."""
    validator = attribute.validator
    found = getattr(validator, "_validators", (validator,))
    for item in found:
        if isinstance(item, OneOf):
            return item.choices
    return None


def bounds_of(attribute: attrs.Attribute[Any]) -> tuple[Bound, ...]:
    """The range validators of a field, for the reference docs."""
    validator = attribute.validator
    found = getattr(validator, "_validators", (validator,))
    return tuple(item for item in found if isinstance(item, Bound))
