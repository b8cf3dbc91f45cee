"""Span attributes in C (agent/_wire.c) against their pure-Python twins in span_encoding, and the
C TCP_INFO read against its twin in tcp_info."""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import span_encoding, tcp_info

_wire = pytest.importorskip("tokentrace.agent._wire") if span_encoding.BUILT else None
pytestmark = pytest.mark.skipif(_wire is None, reason="the C encoding is not built here")

_INT = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(min_value=0, max_value=2**35),  # the twin's int-array fast path
    st.sampled_from([2**63, -(2**63) - 1, 2**64]),  # beyond int64: the twin's ValueError
)
_TEXT = st.text(max_size=12) | st.sampled_from(["\ud800", "é✓", ""])  # a lone surrogate too
_SCALAR = st.one_of(_INT, st.floats(allow_nan=True), _TEXT, st.booleans(), st.just(None))
_NESTED = st.recursive(
    _SCALAR,
    lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=3).map(tuple),
    max_leaves=6,
)
_VALUE = st.one_of(
    _SCALAR,
    st.lists(_INT, max_size=20),  # an int array
    st.lists(st.one_of(_INT, st.booleans(), _TEXT), max_size=4),  # a list the twin rejects
    st.lists(_TEXT, max_size=3).map(tuple),  # a string array
    _NESTED,
    st.just(b"bytes"),  # a type OTLP attributes here cannot carry
)
_KEY = st.one_of(_TEXT, st.just(7))
_PAIRS = st.lists(st.tuples(_KEY, _VALUE), max_size=6)


def _python(attributes: Any) -> bytes | Exception:
    parts: list[bytes] = []
    try:
        span_encoding._WRITER.attributes_python(attributes, parts.append)
    except (ValueError, TypeError, AttributeError, UnicodeEncodeError) as error:
        return error
    return b"".join(parts)


def _parsed(entries: bytes) -> Span:
    span = Span()
    span.MergeFromString(entries)
    return span


@settings(max_examples=600, deadline=None)
@given(_PAIRS)
def test_c_encodes_exactly_what_the_twin_encodes(pairs: list[tuple[Any, Any]]) -> None:
    assert _wire is not None
    expected = _python(pairs)
    encoded = _wire.attributes(pairs)
    if isinstance(expected, Exception):
        assert encoded is None  # the twin then raises its error for the caller
        return
    assert encoded is not None
    assert _parsed(encoded) == _parsed(expected)
    if not any(type(value) is list for _, value in pairs):
        # The twin writes int arrays with fixed 5-byte varints (valid, not the shortest form);
        # everything else byte for byte as C.
        assert encoded == expected
    assert _wire.attributes(tuple(pairs)) == encoded
    by_key = dict(pairs)
    if len(by_key) == len(pairs):
        assert _wire.attributes(by_key) == encoded


def test_the_public_encoder_gives_the_twins_answer_where_c_declines() -> None:
    # Deeper than C nests, and pairs as lists: the twin answers; a bad value: the twin's error.
    deep: Any = "leaf"
    for _ in range(40):
        deep = (deep,)
    assert _wire is not None
    assert _wire.attributes([("k", deep)]) is None
    assert span_encoding.span_attributes([("k", deep)]) == _python([("k", deep)])
    assert _wire.attributes([["k", 1]]) is None
    assert span_encoding.span_attributes([["k", 1]]) == _python([("k", 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="int64"):
        span_encoding.span_attributes([("k", 2**63)])
    with pytest.raises(TypeError, match="bytes"):
        span_encoding.span_attributes([("k", b"x")])  # type: ignore[list-item]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3), st.binary(max_size=300))
def test_length_delimited_matches_its_twin(tag: bytes, payload: bytes) -> None:
    assert _wire is not None
    expected = span_encoding.length_delimited_python(tag, payload)
    assert _wire.length_delimited(tag, payload) == expected
    assert span_encoding.length_delimited(tag, payload) == expected
    with pytest.raises(TypeError):
        _wire.length_delimited(tag, bytearray(payload))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO: Linux")
def test_tcp_info_reads_the_facts_its_twin_reads() -> None:
    assert _wire is not None
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    with client, server:
        client.sendall(b"request")
        time.sleep(0.05)
        through_c = tcp_info.read_tcp_info(server)
        twin = tcp_info._read_with_getsockopt(server)
        assert through_c is not None and twin is not None
        assert through_c.rtt_ns == twin.rtt_ns > 0
        # Read a moment apart: the kernel's ms count may tick between them.
        assert 0 <= twin.last_data_recv_ns - through_c.last_data_recv_ns <= 10_000_000
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert _wire.tcp_info(udp.fileno()) is None  # not TCP
    assert _wire.tcp_info(-1) is None and _wire.tcp_info(2**70) is None  # no descriptor
    assert tcp_info.read_tcp_info(server) is None  # closed: fileno() is -1
