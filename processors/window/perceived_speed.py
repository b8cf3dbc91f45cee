"""What users felt beyond the latency metrics, from a window's client spans.

The method's last step (``perceived_speed``): the share of requests that were not streamed
(their first word came with the last), the time to the response's first byte, and how often a
new connection was set up and how long that took; each becomes an ``issue`` when it hurts.
Separate from the window findings (``findings.py``) because it reads client-side facts per
request, not the segments of a metric's budget. Durations are ms rounded to the microsecond.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from tokentrace.processors.durations import ms_of
from tokentrace.processors.model import RequestRecord
from tokentrace.processors.stats import nearest_rank
from tokentrace.processors.wording import format_duration, format_ms, format_share

_NS_PER_MS: Final = 1_000_000
_FIRST_BYTE_HURTS_NS: Final = 100 * _NS_PER_MS
"""Users see nothing until the first byte: a p95 above this is worth fixing."""
_NOT_STREAMED_HURTS_SHARE: Final = 0.1
_NEW_CONNECTION_HURTS_SHARE: Final = 0.2
_CONNECT_HURTS_SHARE_OF_TTFT: Final = 0.05
"""Setup whose p95 is at least this share of the median client TTFT (E2E unstreamed) hurts."""


def perceived_speed(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """What users felt beyond the latency metrics, from the requests with a client span: how
    many were not streamed, the time to the first byte, new connections and their setup; an
    ``issues`` entry for each that hurts (see the module docstring)."""
    clients = [
        record
        for record in records
        if record.timeline.client_start is not None and record.timeline.client_end is not None
    ]
    doc: dict[str, Any] = {"requests": len(clients), "issues": []}
    if not clients:
        return doc
    issues: list[dict[str, Any]] = doc["issues"]
    known_stream = [r for r in clients if r.timeline.client_stream is not None]
    not_streamed = [r for r in known_stream if not r.timeline.client_stream]
    doc["stream_known"] = len(known_stream)
    doc["not_streamed"] = len(not_streamed)
    if known_stream and len(not_streamed) / len(known_stream) >= _NOT_STREAMED_HURTS_SHARE:
        share = len(not_streamed) / len(known_stream)
        p95 = _p95_ms([r.budget.e2e_ns for r in not_streamed])
        issues.append(
            {
                "kind": "not_streamed",
                "share": round(share, 4),
                "p95_ms": p95,
                "sentence": (
                    f"{format_share(share)} of requests were not streamed: the user waited for the "
                    f"whole response (p95 {format_ms(p95)}) before the first word. Stream them."
                ),
            }
        )
    first_bytes = [
        max(0, r.timeline.client_first_byte - (r.timeline.client_start or 0))
        for r in clients
        if r.timeline.client_first_byte is not None
    ]
    if first_bytes:
        doc["first_byte_ms"] = {"p50": _p_ms(first_bytes, 50), "p95": _p95_ms(first_bytes)}
        if nearest_rank(sorted(first_bytes), 95) > _FIRST_BYTE_HURTS_NS:
            p95 = _p95_ms(first_bytes)
            issues.append(
                {
                    "kind": "first_byte",
                    "p95_ms": p95,
                    "sentence": (
                        f"p95 time to the response's first byte is {format_ms(p95)}, over "
                        f"{format_duration(_FIRST_BYTE_HURTS_NS)}: users see nothing for "
                        "that long (the TTFT finding says where that time goes)."
                    ),
                }
            )
    known_reuse = [r for r in clients if r.timeline.client_connection_reused is not None]
    new = [r for r in known_reuse if not r.timeline.client_connection_reused]
    doc["connection_known"] = len(known_reuse)
    doc["new_connections"] = len(new)
    setups = [r.timeline.client_connect_ns for r in new if r.timeline.client_connect_ns is not None]
    if setups:
        doc["connect_ms"] = {"p50": _p_ms(setups, 50), "p95": _p95_ms(setups)}
    if known_reuse and setups and len(new) / len(known_reuse) >= _NEW_CONNECTION_HURTS_SHARE:
        wait = [
            r.budget.client_ttft_ns if r.budget.client_ttft_ns is not None else r.budget.e2e_ns
            for r in clients
        ]
        p95_setup = nearest_rank(sorted(setups), 95)
        if p95_setup >= _CONNECT_HURTS_SHARE_OF_TTFT * nearest_rank(sorted(wait), 50):
            share = len(new) / len(known_reuse)
            issues.append(
                {
                    "kind": "new_connections",
                    "share": round(share, 4),
                    "p95_ms": ms_of(p95_setup),
                    "sentence": (
                        f"a new connection on {format_share(share)} of requests, p95 setup "
                        f"{format_ms(ms_of(p95_setup))}: reuse connections (keep-alive, a "
                        "connection pool)."
                    ),
                }
            )
    return doc


def _p_ms(values_ns: Sequence[int], percentile: float) -> float:
    return ms_of(nearest_rank(sorted(values_ns), percentile))


def _p95_ms(values_ns: Sequence[int]) -> float:
    return _p_ms(values_ns, 95)
