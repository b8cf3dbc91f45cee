"""Received export requests read from their wire bytes, in C (``agent/_wire.c``).

Two uses of the bytes a receiver parsed a request from: each span's own bytes, which the
exporters send on as received instead of re-serialising the span (``SpanRef.wire``), and the
receiver's cheap per-span checks, run over the bytes so that ``validate`` looks only at the spans
they single out. Without the C functions (not built, or ``TOKENTRACE_PURE_PYTHON``) both answer
None and the collector works from the parsed message alone, with the same results.
"""

from __future__ import annotations

from typing import Any, Final

from tokentrace.agent import compiled

_WIRE: Final[Any] = compiled.load("tokentrace.agent._wire")
BUILT: Final = _WIRE is not None
"""Whether the C functions run here."""


def span_entries(request: bytes) -> list[bytes] | None:
    """Each span of a serialised ``ExportTraceServiceRequest`` as its ``ScopeSpans.spans``
    entry (tag, length, the span's bytes as received), in the order the protobuf parser lists
    the spans; None without C or for input the walk does not take."""
    if _WIRE is None:
        return None
    entries: list[bytes] | None = _WIRE.span_entries(request)
    return entries


def unclean_spans(
    request: bytes, fast_path_bytes: int, min_time_ns: int, max_time_ns: int
) -> list[tuple[int, int, int]] | None:
    """The (resource_spans, scope_spans, span) indices of the spans of a serialised
    ``ExportTraceServiceRequest`` that fail the receiver's cheap checks (16- and 8-byte ids not
    all zero, an 8-byte non-zero parent or none, ``min_time_ns <= start <= end < max_time_ns``,
    no events or links, at most ``fast_path_bytes`` long): only those need ``validate``'s own.
    None without C, for input the walk does not take or for bounds beyond 64 bits."""
    if _WIRE is None:
        return None
    unclean: list[tuple[int, int, int]] | None = _WIRE.unclean_spans(
        request, fast_path_bytes, min_time_ns, max_time_ns
    )
    return unclean
