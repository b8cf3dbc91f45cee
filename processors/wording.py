"""How diagnosis sentences word segments and numbers: labels, durations, shares and counts.

Shared by the per-request verdicts (``verdict.py``), the rules' evidence (``diagnosis.py``),
the window findings (``window/findings.py``) and the CLI's comparison text, so that every sentence
names a segment and writes a duration the same way. Standard library and the contract only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from tokentrace.agent import semconv

SEGMENT_LABELS: Final[Mapping[str, str]] = {
    semconv.SEGMENT_CLIENT: "the client's own delay",
    semconv.SEGMENT_CONNECT: "connection setup",
    semconv.SEGMENT_NETWORK: "network",
    semconv.SEGMENT_HTTP: "HTTP handling",
    semconv.SEGMENT_COLD_START: "cold start",
    semconv.SEGMENT_QUEUE: "queue wait",
    semconv.SEGMENT_PREFILL: "prefill",
    semconv.SEGMENT_PREEMPTED: "preemption",
    semconv.SEGMENT_DECODE: "decode",
    semconv.SEGMENT_INTERFERENCE: "interference from co-scheduled prefills",
    semconv.SEGMENT_STALL: "decode stalls",
    semconv.SEGMENT_POSTPROCESS: "post-processing",
    semconv.SEGMENT_UNATTRIBUTED: "unattributed",
}
"""How sentences name each segment."""


def segment_label(segment: str) -> str:
    """How sentences name ``segment`` (its own name when it has no label)."""
    return SEGMENT_LABELS.get(segment, segment)


def format_ms(ms: float | None) -> str:
    """``format_duration`` of a figure already in ms."""
    return format_duration(None if ms is None else ms * 1e6)


def format_duration(ns: int | float | None) -> str:
    """``410 ms``, ``41.2 ms``, ``0.412 ms``, ``1.23 s``: three significant digits."""
    if ns is None or not math.isfinite(ns):
        return "unknown"
    ms = ns / 1e6
    if abs(ms) >= 1000:
        return f"{_three_digits(ms / 1000)} s"
    return f"{_three_digits(ms)} ms"


def _three_digits(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 100 or magnitude == 0:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def format_share(share: float) -> str:
    """A share as sentences say it: ``42%``, ``<1%``, ``>99%``."""
    percent = share * 100
    if 0 < percent < 1:
        return "<1%"
    if 99 < percent < 100:
        return ">99%"
    return f"{percent:.0f}%"


def plural(count: int, noun: str) -> str:
    """``1 request``, ``1,024 requests``."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"
