"""Trace and span ids: random ones, their text form between processes, W3C ``traceparent``.

Separate from the span layout (``spans``) and encoding (``span_encoding``): every hook that
joins a request to a trace (HTTP server span, vLLM frontend and engine, cold start, the load
generator's client spans) needs ids, and nothing else of the spans.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from typing import Final, TypeAlias

__all__ = [
    "SPAN_ID_BYTES",
    "TRACE_ID_BYTES",
    "SpanIdSource",
    "format_ids",
    "format_traceparent",
    "parse_ids",
    "parse_traceparent",
    "random_span_id",
    "random_span_id_bytes",
    "random_trace_id",
]

TRACE_ID_BYTES: Final = 16
SPAN_ID_BYTES: Final = 8
SpanIdSource: TypeAlias = "Callable[[], int]"
"""Returns a new span id: a non-zero integer below 2**64."""

# One generator per process, seeded from the OS and re-seeded in forked children so that forked
# workers never repeat each other's ids. ``getrandbits`` is one C call: safe across threads.
_span_id_random: Final = random.Random(os.urandom(32))
_random_bits: Final = _span_id_random.getrandbits


def _reseed_span_ids() -> None:
    _span_id_random.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed_span_ids)


def random_span_id() -> int:
    """A random non-zero 64-bit span id (the default ``SpanIdSource``)."""
    return _random_bits(64) or 1


def random_trace_id() -> bytes:
    """A random non-zero 16-byte trace id (W3C: random, never all zeros)."""
    return (_random_bits(128) or 1).to_bytes(TRACE_ID_BYTES, "big")


def random_span_id_bytes() -> bytes:
    """``random_span_id`` as the 8 bytes of a span id chosen in advance (its expression, not a
    call of it: this runs several times per request on the serving path)."""
    return (_random_bits(64) or 1).to_bytes(SPAN_ID_BYTES, "big")


def format_ids(*ids: bytes) -> str:
    """Trace/span ids as ``-``-joined lowercase hex: how they travel between processes."""
    return "-".join(map(bytes.hex, ids))  # no generator frame: once per request when serving


def parse_ids(value: object, *sizes: int) -> tuple[bytes, ...] | None:
    """``format_ids``' output back to ids of the given byte ``sizes``; None when malformed."""
    if not isinstance(value, str):
        return None
    parts = value.strip().split("-")
    if len(parts) != len(sizes):
        return None
    try:  # map, no generator frame: once per request on the serving path (EngineCore)
        ids = tuple(map(bytes.fromhex, parts))
    except ValueError:
        return None
    # fromhex skips whitespace between bytes; each id of its size and every part of exactly
    # twice that many characters together leave no room for any.
    if tuple(map(len, ids)) != sizes or sum(map(len, parts)) != 2 * sum(sizes):
        return None
    return ids


# W3C Trace Context: version-traceid-parentid-flags, lowercase hex; version 00 has no more
# fields, later versions may append "-..." fields.
_TRACEPARENT: Final = re.compile(
    r"(?P<version>[0-9a-f]{2})-(?P<trace>[0-9a-f]{32})-(?P<span>[0-9a-f]{16})-[0-9a-f]{2}(?P<rest>-.*)?"
)


def format_traceparent(trace_id: bytes, span_id: bytes) -> str:
    """A W3C ``traceparent`` header value (version 00, sampled) naming ``span_id`` as parent."""
    return f"00-{trace_id.hex()}-{span_id.hex()}-01"


def parse_traceparent(value: object) -> tuple[bytes, bytes] | None:
    """(trace id, parent span id) of a W3C ``traceparent`` header; None when it is invalid (the
    request then starts a new trace rather than losing its spans)."""
    if not isinstance(value, str):
        return None
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version = match.group("version")
    if version == "ff" or (version == "00" and match.group("rest")):
        return None
    trace_id = bytes.fromhex(match.group("trace"))
    span_id = bytes.fromhex(match.group("span"))
    if not any(trace_id) or not any(span_id):
        return None
    return trace_id, span_id
