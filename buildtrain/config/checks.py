"""Field helpers for the config classes: a documented field and small validators.

Validators raise `ValueError` with a message that reads after the key path
("must be > 0 (got -1.0)"); the loader prefixes file and key. They are run by the loader's
collecting pass, so one bad value never hides another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

DOC = "buildtrain.doc"

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def setting(default: Any, doc: str, *validators: Validator, **kwargs: Any) -> Any:
    """An attrs field that carries its one-line documentation for `--help` and the README."""
    return attrs.field(
        default=default,
        validator=list(validators) or None,
        metadata={DOC: doc},
        **kwargs,
    )


def greater_than(bound: float) -> Validator:
    def check(_: Any, __: attrs.Attribute[Any], value: Any) -> None:
        if not value > bound:
            raise ValueError(f"must be > {bound} (got {value!r})")

    return check


def at_least(bound: float) -> Validator:
    def check(_: Any, __: attrs.Attribute[Any], value: Any) -> None:
        if not value >= bound:
            raise ValueError(f"must be >= {bound} (got {value!r})")

    return check


def below(bound: float) -> Validator:
    def check(_: Any, __: attrs.Attribute[Any], value: Any) -> None:
        if not value < bound:
            raise ValueError(f"must be < {bound} (got {value!r})")

    return check


def at_most(bound: float) -> Validator:
    def check(_: Any, __: attrs.Attribute[Any], value: Any) -> None:
        if not value <= bound:
            raise ValueError(f"must be <= {bound} (got {value!r})")

    return check


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
