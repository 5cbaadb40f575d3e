"""The canonical encoding every hash is computed over: one encoding per value, pinned."""

from __future__ import annotations

import datetime
import random
from pathlib import Path
from typing import Any

import pytest
import tomli
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import emit_float, emit_int, shuffled

from buildtrain.canonical import EncodingError, canonical_bytes, digest

PINNED_VALUE = {
    "name": "pinned",
    "lr": 0.001,
    "steps": 1000,
    "betas": [0.9, 0.95],
    "tied": True,
    "init": None,
    "label": "é",
}
PINNED_BYTES = (
    b'{"betas":[0.9,0.95],"init":null,"label":"\xc3\xa9","lr":0.001,"name":"pinned","steps":1000,"tied":true}'
)
PINNED_PLAN_DIGEST = "7eb36fe85cf66b7c8a472d99e262c89cc08fb49ffbe3cc589f847d53cf6e64df"

JSON_DATA = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=20,
)


def test_pinned_encoding_and_digest() -> None:
    """An accidental change of the encoding (separators, float form, key order, tag) fails here:
    it would silently change every plan and step hash."""
    assert canonical_bytes(PINNED_VALUE) == PINNED_BYTES
    assert digest("plan", PINNED_VALUE) == PINNED_PLAN_DIGEST


def test_digest_is_domain_separated_and_full_length() -> None:
    plan, step = digest("plan", PINNED_VALUE), digest("step", PINNED_VALUE)
    assert plan != step
    assert len(plan) == 64 and int(plan, 16) >= 0


@settings(max_examples=60, deadline=None)
@given(value=JSON_DATA, seed=st.integers(0, 2**16))
def test_key_order_does_not_matter(value: Any, seed: int) -> None:
    assert canonical_bytes(shuffled(value, random.Random(seed))) == canonical_bytes(value)


@settings(max_examples=60, deadline=None)
@given(value=JSON_DATA)
def test_distinct_values_encode_distinctly(value: Any) -> None:
    """The encoding is injective on plain data: decoding gives the value back."""
    import json

    assert json.loads(canonical_bytes(value)) == value


@settings(max_examples=60, deadline=None)
@given(
    number=st.floats(allow_nan=False, allow_infinity=False),
    integer=st.integers(-(2**63), 2**63 - 1),
    seed=st.integers(0, 2**16),
)
def test_number_spelling_does_not_matter(number: float, integer: int, seed: int) -> None:
    """`1e-3`, `0.001`, `10e-4`, `+0.1e-2`; `1000`, `1_000`, `0x3e8`: one encoding each."""
    rng = random.Random(seed)
    parsed = tomli.loads(f"f = {emit_float(number, rng)}\ni = {emit_int(integer, rng)}")
    assert canonical_bytes(parsed) == canonical_bytes({"f": number, "i": integer})


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("1e-3", "0.001"),
        ("1_000", "1000"),
        ("0x3e8", "1000"),
        ("3E-4", "0.0003"),
        ("-0.0", "0.0"),
        ("100.0", "1e2"),
    ],
)
def test_known_spellings_encode_alike(one: str, other: str) -> None:
    assert canonical_bytes(tomli.loads(f"x = {one}")) == canonical_bytes(tomli.loads(f"x = {other}"))


def test_tuples_and_lists_encode_alike_but_types_stay_apart() -> None:
    assert canonical_bytes((0.9, 0.95)) == canonical_bytes([0.9, 0.95])
    assert canonical_bytes(True) != canonical_bytes(1)
    assert canonical_bytes(1) != canonical_bytes(1.0)
    assert canonical_bytes("1") != canonical_bytes(1)
    assert canonical_bytes(None) != canonical_bytes("null")


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), float("-inf"), {"lr": float("nan")}, [1.0, float("inf")]],
    ids=["nan", "inf", "-inf", "nested-nan", "nested-inf"],
)
def test_non_finite_numbers_are_refused(value: Any) -> None:
    with pytest.raises(EncodingError):
        canonical_bytes(value)


@pytest.mark.parametrize(
    "value",
    [
        {1: "x"},
        {"a": {(1, 2): 3}},
        {1, 2},
        b"bytes",
        object(),
        Path("/tmp/x"),
        datetime.date(2024, 1, 1),
        {"nested": [{"deep": object()}]},
    ],
    ids=["int-key", "tuple-key", "set", "bytes", "object", "path", "date", "nested-object"],
)
def test_values_without_an_encoding_are_refused(value: Any) -> None:
    with pytest.raises(EncodingError):
        canonical_bytes(value)


def test_refusal_names_the_path() -> None:
    with pytest.raises(EncodingError, match=r"stages\[1\]\.train\.lr"):
        canonical_bytes({"stages": [{}, {"train": {"lr": float("nan")}}]})
