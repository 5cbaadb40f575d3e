"""The one cattrs converter that turns plain data into config objects and back.

Strict about types on purpose: TOML already tells integers, floats, strings and booleans apart, so
`steps = 1.5` or `lr = "fast"` is a mistake to report, not a value to coerce.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from typing import Any

import attrs
import cattrs
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override


def describe(value: Any) -> str:
    """A value as a user wrote it, with its TOML type, for error messages."""
    kind = {
        bool: "boolean",
        int: "integer",
        float: "float",
        str: "string",
        list: "array",
        dict: "table",
    }.get(type(value), type(value).__name__)
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"{shown} ({kind})"


INT64 = range(-(2**63), 2**63)


def _strict_int(value: Any, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {describe(value)}")
    if value not in INT64:  # TOML integers are 64-bit; tomli accepts more, arithmetic would overflow
        raise ValueError(f"must be a 64-bit integer (got {describe(value)})")
    return value


def _strict_float(value: Any, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {describe(value)}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {describe(value)}")
    return float(value)


def _strict_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {describe(value)}")
    return value


def _strict_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {describe(value)}")
    return value


def _is_tuple(cls: Any) -> bool:
    return typing.get_origin(cls) is tuple


def _tuple_hook(converter: cattrs.Converter, cls: Any) -> Any:
    args = typing.get_args(cls)
    homogeneous = len(args) == 2 and args[1] is Ellipsis

    def structure(value: Any, _: type) -> tuple[Any, ...]:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected an array, got {describe(value)}")
        if not homogeneous and len(value) != len(args):
            raise TypeError(f"expected an array of {len(args)} values, got {len(value)}")
        items, errors = [], []
        for index, item in enumerate(value):
            item_type = args[0] if homogeneous else args[index]
            try:
                items.append(converter.structure(item, item_type))
            except Exception as exc:  # collected and re-raised as a group below
                exc.__notes__ = [
                    *getattr(exc, "__notes__", []),
                    IterableValidationNote(f"Structuring {cls} @ index {index}", index, item_type),
                ]
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"While structuring {cls}", errors, cls)
        return tuple(items)

    return structure


def _table_hook(converter: cattrs.Converter, cls: type) -> Any:
    """Structure a nested section only from a table, so `synthetic = 3` says what a table is."""
    inner = make_dict_structure_fn(cls, converter)

    def structure(value: Any, _: type) -> Any:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table, got {describe(value)}")
        return inner(value, cls)

    return structure


def _is_str_or_table(cls: Any) -> bool:
    """`str | SomeTable`: a setting written either as a word or as a table (data.tokenizer)."""
    args = typing.get_args(cls)
    return (
        typing.get_origin(cls) in (typing.Union, types.UnionType)
        and len(args) == 2
        and args[0] is str
        and attrs.has(args[1])
    )


def _str_or_table_hook(converter: cattrs.Converter, cls: Any) -> Any:
    table = typing.get_args(cls)[1]

    def structure(value: Any, _: type) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a string or a table, got {describe(value)}")
        return converter.structure(value, table)

    return structure


def _marked(cls: type, mark: str) -> list[str]:
    return [field.name for field in attrs.fields(cls) if field.metadata.get(mark)]


def _unstructure_hook(converter: cattrs.Converter, cls: type) -> Any:
    """A class written out as a dict, less its marked fields (`checks.since`, `never_hashed`): a
    key added to the language enters the dict only when set, so every plan made before it keeps
    its hash, and a path never enters at all (its content does, elsewhere)."""
    from buildtrain.config.checks import NEVER_HASHED, SINCE  # convert.py must not import schema

    overrides = {name: override(omit_if_default=True) for name in _marked(cls, SINCE)}
    overrides.update({name: override(omit=True) for name in _marked(cls, NEVER_HASHED)})
    return make_dict_unstructure_fn(cls, converter, **overrides)


def make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    # Primitive hooks first: the generated class hooks look them up when they are built.
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(float, _strict_float)
    converter.register_structure_hook(str, _strict_str)
    converter.register_structure_hook(bool, _strict_bool)
    converter.register_structure_hook_factory(_is_tuple, lambda cls: _tuple_hook(converter, cls))
    converter.register_structure_hook_factory(attrs.has, lambda cls: _table_hook(converter, cls))
    converter.register_unstructure_hook_factory(attrs.has, lambda cls: _unstructure_hook(converter, cls))
    converter.register_structure_hook_factory(
        _is_str_or_table, lambda cls: _str_or_table_hook(converter, cls)
    )
    return converter


converter = make_converter()
