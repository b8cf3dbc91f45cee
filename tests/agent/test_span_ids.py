"""Trace and span ids as they travel between processes (agent/span_ids.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokentrace.agent.span_ids import format_ids, parse_ids

_SIZES = (16, 8, 8)


def _reference(value: object, *sizes: int) -> tuple[bytes, ...] | None:
    """The definition: ``-``-separated parts of exactly two hex digits per byte."""
    if not isinstance(value, str):
        return None
    parts = value.strip().split("-")
    if len(parts) != len(sizes):
        return None
    if any(len(part) != 2 * size for part, size in zip(parts, sizes, strict=True)):
        return None
    if any(c not in "0123456789abcdefABCDEF" for c in "".join(parts)):
        return None
    return tuple(bytes.fromhex(part) for part in parts)


@given(st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8))
def test_formatted_ids_parse_back(trace_id: bytes, span_id: bytes) -> None:
    assert parse_ids(format_ids(trace_id, span_id, span_id), *_SIZES) == (
        trace_id,
        span_id,
        span_id,
    )


_HEX_OR_NOT = st.text(alphabet="0123456789abcdefABCDEF -\t\nxg\u0660", max_size=40)


@given(st.lists(_HEX_OR_NOT, min_size=1, max_size=4).map("-".join))
def test_anything_else_parses_as_the_definition_says(value: str) -> None:
    assert parse_ids(value, 4, 8, 2) == _reference(value, 4, 8, 2)


@given(
    st.binary(min_size=16, max_size=16),
    st.integers(min_value=1, max_value=30),
    st.sampled_from([" ", "\t", "\n", "\x0b", "\x0c", "\r"]),
)
def test_whitespace_inside_an_id_is_refused(trace_id: bytes, at: int, space: str) -> None:
    text = trace_id.hex()
    # Whitespace replacing a digit or inserted: either way not two digits per byte.
    assert parse_ids(text[:at] + space + text[at + 1 :], 16) is None
    assert parse_ids(text[:at] + space + text[at:], 16) is None
    assert parse_ids(text, 16) == (trace_id,)
