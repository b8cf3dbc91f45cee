"""One request's tokentrace spans: the layout, before ids and encoding.

The agent turns each ``FinishedRequest`` into the span subtree of the span contract
(docs/architecture.md) once, off the serving thread (``tokentrace replay`` does the same
with its simulated requests)::

    llm.request             arrival -> response complete; parent: the incoming HTTP server span
      llm.queue             engine arrival (queued; else arrival) -> first scheduled
      llm.prefill           first scheduled -> first output token
        llm.prefill.chunk   one per engine step of a chunked prefill (only with > 1 chunk)
      llm.preempted         one per interval the request was evicted
      llm.decode            first -> last output token, with the first ``max_token_offsets``
                            token offsets (the collector computes inter-token gaps from them)
      llm.postprocess       last output token -> response complete

Phases the request never reached are left out. A phase is present when its start is known and
lasts until the next known boundary, at the latest the request's end: the rule the collector's
budget uses for missing boundaries. A request aborted while queued is ``llm.request`` +
``llm.queue`` up to its end; one aborted mid-decode (``last_token_ns`` None: it never produced
its last token) has ``llm.decode`` up to its end and no ``llm.postprocess``. ``llm.request``
ends with an ERROR status carrying ``FinishedRequest.status_error`` when that is set.
Attributes whose value is unknown (None) are absent.

This module is the span contract's shape and nothing else: ``span_encoding`` writes planned
spans as OTLP protobuf (the hot path, tuned for speed) with ids from ``span_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final, NamedTuple, TypeAlias

from tokentrace.agent import semconv
from tokentrace.agent.finished_request import FinishedRequest

__all__ = [
    "DEFAULT_MAX_TOKEN_OFFSETS",
    "KIND_CLIENT",
    "KIND_INTERNAL",
    "KIND_SERVER",
    "PREFILL_LOCAL_ID",
    "AttrValue",
    "DeferredSpans",
    "PlannedSpan",
    "SpanJob",
    "count_spans",
    "plan_spans",
]

AttrValue: TypeAlias = "str | int | float | bool | list[int] | tuple[str, ...]"
"""An attribute value: a scalar, an int array (a list: token offsets) or a string array (a
tuple: hashable, so its encoding can be cached)."""

# OTLP span kinds (``opentelemetry.proto.trace.v1.Span.SpanKind``) as plain ints.
KIND_INTERNAL: Final = 1
KIND_SERVER: Final = 2
KIND_CLIENT: Final = 3

DEFAULT_MAX_TOKEN_OFFSETS: Final = 1024
"""Default cap on ``DECODE_TOKEN_OFFSETS`` entries (``DECODE_TOKEN_OFFSETS_DROPPED`` counts the
rest); public so that configuration and ``tokentrace replay`` share it."""
PREFILL_LOCAL_ID: Final = 2
"""``plan_spans`` numbers ``llm.prefill`` 2 when the request has one (after request and queue)."""


class PlannedSpan(NamedTuple):
    """One span of a request's layout, before it has ids.

    ``local_id`` is the span's position in its plan (parents come before their children);
    ``parent_local_id`` is -1 for the subtree's root, whose parent is the request's external
    parent (``FinishedRequest.parent_span_id``).
    """

    local_id: int
    parent_local_id: int
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, AttrValue]
    status_error: str | None = None
    """Set: the span ends with an ERROR status and this message."""
    links: tuple[tuple[bytes, bytes], ...] = ()
    """(trace id, span id) of each span this one links to."""


DeferredSpans: TypeAlias = "Callable[[], Sequence[SpanJob]]"
"""Plans ``SpanJob``s when called: the serving path hands the emitter this, not the spans."""


class SpanJob(NamedTuple):
    """Spans planned outside a finished request (engine steps, cold start phases), for the
    emitter: ``spans`` numbered like ``plan_spans``' output; each root (``parent_local_id`` -1)
    is a child of ``parent_span_id`` (empty: a trace root); ``fixed_ids`` gives some spans an id
    chosen in advance (another process parents its spans under it), by ``local_id``."""

    trace_id: bytes
    parent_span_id: bytes
    spans: Sequence[PlannedSpan]
    fixed_ids: Mapping[int, bytes] | None = None


# --- the layout ---------------------------------------------------------------------------------


def plan_spans(
    finished: FinishedRequest, *, max_token_offsets: int = DEFAULT_MAX_TOKEN_OFFSETS
) -> Iterator[PlannedSpan]:
    """The span subtree of ``finished``, parents before children (see the module docstring).

    The ``llm.request`` span comes first (``local_id`` 0). Decode keeps the first
    ``max_token_offsets`` token offsets and records how many it left out.
    """
    if max_token_offsets < 0:
        raise ValueError("max_token_offsets must be >= 0")
    internal = KIND_INTERNAL
    arrival = finished.arrival_ns
    end = max(finished.end_ns, arrival)
    # Boundaries from other processes' clocks are clamped into time order inside the request,
    # so a child span never starts before its parent or before the phase it follows.
    scheduled, first_token, last_token = _in_order(
        arrival,
        end,
        finished.first_scheduled_ns,
        finished.first_token_ns,
        finished.last_token_ns,
    )
    # Each phase lasts until the next known boundary.
    decode_end = end if last_token is None else last_token
    prefill_end = decode_end if first_token is None else first_token
    queue_end = prefill_end if scheduled is None else scheduled
    # The engine queues the request after the hand-off from the API server; the gap before it
    # is the collector's http segment. Clamped into [arrival, queue_end] (clock skew).
    queued = finished.queued_ns
    queue_start = arrival if queued is None else min(max(queued, arrival), queue_end)

    yield PlannedSpan(
        0, -1, semconv.SPAN_REQUEST, internal, arrival, end,
        _request_attributes(finished), finished.status_error,
        () if finished.cold_start_link is None else (finished.cold_start_link,),
    )  # fmt: skip
    yield PlannedSpan(1, 0, semconv.SPAN_QUEUE, internal, queue_start, queue_end, {})
    local_id = 2
    if scheduled is not None:
        chunks = finished.prefill_chunks
        prefill_attributes: dict[str, AttrValue] = {}
        if chunks:
            prefill_attributes[semconv.PREFILL_CHUNK_TOKENS] = sum(chunk.tokens for chunk in chunks)
        prefill_id = local_id  # == PREFILL_LOCAL_ID
        yield PlannedSpan(
            prefill_id, 0, semconv.SPAN_PREFILL, internal, scheduled, prefill_end,
            prefill_attributes,
        )  # fmt: skip
        local_id += 1
        if len(chunks) > 1:
            for chunk in chunks:
                start, stop = _clamp(chunk.start_ns, chunk.end_ns, scheduled, prefill_end)
                yield PlannedSpan(
                    local_id, prefill_id, semconv.SPAN_PREFILL_CHUNK, internal, start, stop,
                    {semconv.PREFILL_CHUNK_TOKENS: chunk.tokens},
                )  # fmt: skip
                local_id += 1
    for interval_start, interval_end in finished.preempted:
        start, stop = _clamp(interval_start, interval_end, arrival, end)
        yield PlannedSpan(local_id, 0, semconv.SPAN_PREEMPTED, internal, start, stop, {})
        local_id += 1
    if first_token is not None:
        yield PlannedSpan(
            local_id, 0, semconv.SPAN_DECODE, internal, first_token, decode_end,
            _decode_attributes(finished, max_token_offsets),
        )  # fmt: skip
        local_id += 1
    if last_token is not None:
        yield PlannedSpan(local_id, 0, semconv.SPAN_POSTPROCESS, internal, last_token, end, {})


def _in_order(start: int, end: int, *boundaries: int | None) -> list[int | None]:
    """Each known boundary clamped into [previous known boundary, end]; unknown stay None."""
    previous = start
    ordered: list[int | None] = []
    for boundary in boundaries:
        if boundary is None:
            ordered.append(None)
            continue
        previous = min(max(boundary, previous), end)
        ordered.append(previous)
    return ordered


def count_spans(finished: FinishedRequest) -> int:
    """How many spans ``plan_spans(finished)`` yields."""
    count = 2  # llm.request, llm.queue
    if finished.first_scheduled_ns is not None:
        chunks = len(finished.prefill_chunks)
        count += 1 + (chunks if chunks > 1 else 0)
    count += len(finished.preempted)
    count += finished.first_token_ns is not None
    count += finished.last_token_ns is not None
    return count


def _clamp(start: int, end: int, low: int, high: int) -> tuple[int, int]:
    """``[start, end]`` moved inside ``[low, high]``: a child never leaves its parent."""
    start = min(max(start, low), high)
    return start, min(max(end, start), high)


def _request_attributes(finished: FinishedRequest) -> dict[str, AttrValue]:
    attributes: dict[str, AttrValue] = {
        semconv.GEN_AI_OPERATION_NAME: finished.operation,
        semconv.GEN_AI_REQUEST_MODEL: finished.model,
        semconv.REQUEST_ID: finished.request_id,
    }
    # One test per optional value: this runs once per request and dominates plan_spans' cost.
    if finished.max_tokens is not None:
        attributes[semconv.GEN_AI_REQUEST_MAX_TOKENS] = finished.max_tokens
    if finished.temperature is not None:
        attributes[semconv.GEN_AI_REQUEST_TEMPERATURE] = finished.temperature
    if finished.top_p is not None:
        attributes[semconv.GEN_AI_REQUEST_TOP_P] = finished.top_p
    if finished.input_tokens is not None:
        attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] = finished.input_tokens
    if finished.output_tokens is not None:
        attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = finished.output_tokens
    if finished.cached_tokens is not None:
        attributes[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = finished.cached_tokens
    if finished.finish_reason is not None:
        attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (finished.finish_reason,)
    if finished.requests_ahead is not None:
        attributes[semconv.QUEUE_REQUESTS_AHEAD] = finished.requests_ahead
    if finished.running_at_arrival is not None:
        attributes[semconv.QUEUE_RUNNING_AT_ARRIVAL] = finished.running_at_arrival
    if finished.max_running is not None:
        attributes[semconv.QUEUE_MAX_RUNNING] = finished.max_running
    if finished.prefix_hash is not None:
        attributes[semconv.PROMPT_PREFIX_HASH] = finished.prefix_hash
    if finished.ready_ns is not None:
        attributes[semconv.COLD_START_READY_TIME] = finished.ready_ns
    if finished.not_reported:
        attributes[semconv.NOT_REPORTED] = finished.not_reported
        if finished.not_reported_by is not None:
            attributes[semconv.NOT_REPORTED_BY] = finished.not_reported_by
    return attributes


def _decode_attributes(finished: FinishedRequest, max_token_offsets: int) -> dict[str, AttrValue]:
    attributes: dict[str, AttrValue] = {}
    offsets = finished.token_offsets_us
    dropped = len(offsets) - max_token_offsets
    kept = offsets[:max_token_offsets] if dropped > 0 else offsets
    if kept:
        attributes[semconv.DECODE_TOKEN_OFFSETS] = kept
    if dropped > 0:
        attributes[semconv.DECODE_TOKEN_OFFSETS_DROPPED] = dropped
    if finished.outlier_steps_with_prefill is not None:
        attributes[semconv.DECODE_OUTLIER_STEPS_WITH_PREFILL] = finished.outlier_steps_with_prefill
    return attributes
