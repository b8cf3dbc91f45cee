"""What the agent knows about one finished request, ready to become spans.

A ``FinishedRequest`` is built once per request, off the serving thread, from the integers the
hot path recorded (see ``recorder.py``); ``spans.py`` lays out their spans and
``span_encoding.py`` turns them into OTLP bytes.
``tokentrace replay`` produces the same ``FinishedRequest``s from its simulation, so the
simulated and the real agent share one span layout.

All times are absolute Unix nanoseconds (the recorder converts its monotonic readings once per
request). ``None`` means the request never reached that point (e.g. aborted while queued).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

DEFAULT_ITL_OUTLIER_RATIO: Final = 3.0
"""An inter-token gap above this many times the request's median gap is an outlier: the agent
exports the engine steps inside it, the collector splits its excess by cause, the UI marks it."""
MIN_GAPS_FOR_OUTLIERS: Final = 2
"""Fewer inter-token gaps than this have no median to compare with: no outliers."""


def gap_median(gaps: Sequence[int]) -> float | None:
    """The median inter-token gap (the mean of the two middle ones for an even count), or None
    below ``MIN_GAPS_FOR_OUTLIERS`` gaps. A gap above ``ratio`` x this is an outlier: the one
    rule by which the agent exports the engine steps around slow tokens and the UI marks them."""
    if len(gaps) < MIN_GAPS_FOR_OUTLIERS:
        return None
    return median_of_sorted(sorted(gaps))


def median_of_sorted(ordered: Sequence[int]) -> float | None:
    """``gap_median`` of gaps already in ascending order (no second sort)."""
    if len(ordered) < MIN_GAPS_FOR_OUTLIERS:
        return None
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return (ordered[middle - 1] + ordered[middle]) / 2


PREFIX_HASH_TOKENS: Final = 256
"""Prompt tokens the prefix hash covers. Shorter prompts get no hash: recomputing fewer tokens
is cheap, and a short prompt's first tokens (a chat template's header) say nothing about a
shared system prompt."""
_PREFIX_HASH_BYTES: Final = 8


def prompt_prefix_hash(token_ids: Sequence[int] | None) -> str | None:
    """A hash of the prompt's first ``PREFIX_HASH_TOKENS`` token ids (never the text), so that
    requests sharing a long prefix are recognisable; None for shorter or unknown prompts."""
    if token_ids is None or len(token_ids) < PREFIX_HASH_TOKENS:
        return None
    try:
        data = array("q", token_ids[:PREFIX_HASH_TOKENS]).tobytes()
    except (TypeError, OverflowError):  # not a list of ints: say nothing rather than guess
        return None
    return hashlib.blake2b(data, digest_size=_PREFIX_HASH_BYTES).hexdigest()


class PrefillChunk(NamedTuple):
    """One engine step's share of a request's prompt."""

    start_ns: int
    end_ns: int
    tokens: int


@dataclass(slots=True, kw_only=True)
class FinishedRequest:
    trace_id: bytes
    """16 bytes: the incoming ``traceparent``'s trace id, or a new one."""
    parent_span_id: bytes = b""
    """8 bytes of the incoming HTTP server span / ``traceparent`` parent; empty for a root."""
    span_id: bytes = b""
    """8 bytes chosen in advance for ``llm.request`` (another process parents spans under it);
    empty: a new random id."""
    prefill_span_id: bytes = b""
    """The same for ``llm.prefill`` (the engine's ``llm.prefill.chunk`` spans are its children)."""
    request_id: str
    model: str
    operation: str

    arrival_ns: int
    """Request arrival at the engine client (after tokenisation): the start of ``llm.request``."""
    end_ns: int
    """Response complete: the end of ``llm.request``."""
    queued_ns: int | None = None
    """Engine arrival: when the engine queued the request; the start of ``llm.queue``. None: same
    as ``arrival_ns``. The time between the two (the hand-off to the engine) is part of the
    collector's ``http`` segment."""
    first_scheduled_ns: int | None = None
    """When the engine first scheduled the request: the end of ``llm.queue``."""
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    token_offsets_us: list[int] = field(default_factory=list)
    """Each output token's time in µs after the first output token (first entry 0), uncapped:
    the span builder keeps the first ``max_token_offsets`` and records how many it left out."""
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    preempted: list[tuple[int, int]] = field(default_factory=list)
    ready_ns: int | None = None
    """When the server became ready, for requests that arrived during its cold start."""
    cold_start_link: tuple[bytes, bytes] | None = None
    """(trace id, span id) of the ``llm.cold_start`` span the request waited for: ``llm.request``
    links to it (a span link: the cold start is its own trace)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    finish_reason: str | None = None
    status_error: str | None = None
    """Why the request did not complete normally (e.g. ``client disconnected``); the span's status
    becomes ERROR with this message."""

    requests_ahead: int | None = None
    running_at_arrival: int | None = None
    max_running: int | None = None
    prefix_hash: str | None = None
    outlier_steps_with_prefill: int | None = None
    not_reported: tuple[str, ...] = ()
    """What this engine's instrumentation cannot measure (``semconv.NOT_REPORTED``)."""
    not_reported_by: str | None = None
    """Whose instrumentation that is (``semconv.NOT_REPORTED_BY``)."""
