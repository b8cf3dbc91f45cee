"""``agent/plain_marshal.py``: what ``marshal.dumps(value, 0)`` writes for plain data reads back
equal, and nothing else reads at all - whatever the bytes (the node agent reads them from any
sender on its socket)."""

from __future__ import annotations

import marshal
import math
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentrace.agent import plain_marshal

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.binary(max_size=40)
    | st.text(max_size=20)
)
_KEYS = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.binary(max_size=8)
_PLAIN = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(inner, max_size=5).map(tuple)
        | st.dictionaries(_KEYS, inner, max_size=4)
    ),
    max_leaves=30,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN and tuples told from lists."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@given(_PLAIN)
@settings(max_examples=400, deadline=None)
def test_plain_values_read_back_as_marshal_wrote_them(value: Any) -> None:
    data = plain_marshal.dumps(value)
    assert data == marshal.dumps(value, 0)
    assert _same(plain_marshal.loads(data), value)


def _read_or_refused(data: bytes) -> None:
    """``data`` reads as plain data (which writes and reads back the same) or raises ValueError;
    any other exception fails the test."""
    try:
        value = plain_marshal.loads(data)
    except ValueError:
        return
    assert _same(plain_marshal.loads(plain_marshal.dumps(value)), value)


@given(st.binary(max_size=64))
@settings(max_examples=2000, deadline=None)
def test_arbitrary_bytes_read_as_a_value_or_a_value_error(data: bytes) -> None:
    _read_or_refused(data)


@given(_PLAIN, st.data())
@settings(max_examples=400, deadline=None)
def test_damaged_encodings_read_as_a_value_or_a_value_error(
    value: Any, data: st.DataObject
) -> None:
    encoded = bytearray(plain_marshal.dumps(value))
    position = data.draw(st.integers(0, len(encoded) - 1))
    if data.draw(st.booleans()):
        del encoded[position:]  # cut short
    else:
        encoded[position] = data.draw(st.integers(0, 255))
    _read_or_refused(bytes(encoded))


def _nested(depth: int) -> bytes:
    return b"[\x01\x00\x00\x00" * depth + b"N"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (marshal.dumps(compile("1", "x", "eval"), 0), "not plain data"),
        (marshal.dumps({1, 2}, 0), "not plain data"),
        (marshal.dumps(frozenset(), 0), "not plain data"),
        (marshal.dumps(("a", "a"), 4), "not plain data"),  # version 4: references
        (marshal.dumps(1, 0) + b"N", "after the value"),
        (_nested(plain_marshal.MAX_DEPTH + 1), "nested deeper"),
        (b"[" + struct.pack("<i", 1_000_000) + b"N", "a length of 1000000"),
        (b"s" + struct.pack("<i", -1), "a length of -1"),
        (b"l" + struct.pack("<i", 2) + struct.pack("<HH", 5, 0), "a malformed integer"),
        (b"l" + struct.pack("<i", 1) + struct.pack("<H", 1 << 15), "a malformed integer"),
        (b"u" + struct.pack("<i", 1) + b"\xff", "not UTF-8"),
        (b"f\x03abc", "a malformed float"),
        (b"{" + marshal.dumps([], 0) + b"N0", "not hashable"),
        (b"", "ends inside a value"),
    ],
    ids=[
        "code",
        "set",
        "frozenset",
        "a reference",
        "trailing bytes",
        "too deep",
        "a count past the end",
        "a negative length",
        "a leading zero digit",
        "a digit past 15 bits",
        "not UTF-8",
        "not a float",
        "a list as a key",
        "nothing",
    ],
)
def test_what_is_not_plain_data_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plain_marshal.loads(data)


def test_nesting_up_to_the_limit_reads() -> None:
    value = plain_marshal.loads(_nested(plain_marshal.MAX_DEPTH))
    for _ in range(plain_marshal.MAX_DEPTH):
        (value,) = value
    assert value is None


def test_what_marshal_cannot_write_is_a_value_error() -> None:
    class Text(str):
        pass

    with pytest.raises(ValueError):
        plain_marshal.dumps({"model": Text("x")})  # a subclass: how a caller falls back
