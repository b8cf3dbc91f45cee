"""One simulated request's recorded life, and how its span ids are laid out.

``SimulatedRequest`` is what ``simulation`` produces and ``emit`` turns into spans; it lives
apart from both so that emission does not depend on the engine model. Its
``finished_request()`` is the ``FinishedRequest`` the real agent would record for the request,
parented on the simulated HTTP server span, hence the span-id layout here.

Standard library and the agent's stdlib-only ``finished_request`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from tokentrace.agent.finished_request import FinishedRequest, PrefillChunk

__all__ = [
    "CLIENT_SPAN_OFFSET",
    "FIRST_SUBTREE_SPAN_OFFSET",
    "HTTP_SPAN_OFFSET",
    "SimulatedRequest",
    "span_id_bytes",
]

# The server's request subtree is the agent's own (``spans.plan_spans`` over the request's
# ``FinishedRequest``); replay adds what surrounds it in a real deployment: the HTTP server span
# and the load generator's client span. Simulated span ids are ``span_id_base + k``: the client
# span, the HTTP span, then the subtree in plan order.
CLIENT_SPAN_OFFSET: Final = 0
HTTP_SPAN_OFFSET: Final = 1
FIRST_SUBTREE_SPAN_OFFSET: Final = 2


def span_id_bytes(number: int) -> bytes:
    return number.to_bytes(8, "big")


@dataclass(slots=True)
class SimulatedRequest:
    """One request's recorded life, every timestamp in absolute Unix nanoseconds.

    Server-side order: ``server_start_ns <= arrival_ns <= first_scheduled_ns <= first_token_ns
    <= last_token_ns <= end_ns <= server_end_ns``; preempted intervals lie inside
    ``[first_scheduled_ns, last_token_ns]``. Client times are ``None`` without a client span.
    """

    index: int
    request_id: str
    trace_id: bytes
    span_id_base: int
    """Span ids of this request are ``span_id_base + k`` (unique within the trace)."""
    model: str
    operation: str
    url_path: str
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    finish_reason: str
    prefix_hash: str | None
    server_start_ns: int
    arrival_ns: int
    first_scheduled_ns: int
    first_token_ns: int
    last_token_ns: int
    end_ns: int
    server_end_ns: int
    token_offsets_us: list[int]
    """Every output token's emission time in µs after the first (first entry 0; not capped)."""
    prefill_chunks: list[PrefillChunk]
    preempted: list[tuple[int, int]]
    requests_ahead: int
    running_at_arrival: int
    max_running: int
    outlier_steps_with_prefill: int
    ready_ns: int | None = None
    """When the server became ready, for requests that arrived during its cold start."""
    client_start_ns: int | None = None
    client_first_token_ns: int | None = None
    client_end_ns: int | None = None

    @property
    def ttft_ns(self) -> int:
        """Server-side time to first token: first token - engine arrival."""
        return self.first_token_ns - self.arrival_ns

    @property
    def queue_ns(self) -> int:
        """Engine arrival to first scheduled (includes any cold-start wait)."""
        return self.first_scheduled_ns - self.arrival_ns

    @property
    def e2e_ns(self) -> int:
        """Engine arrival to response complete."""
        return self.end_ns - self.arrival_ns

    @property
    def preempted_ns(self) -> int:
        """Total time spent evicted."""
        return sum(end - start for start, end in self.preempted)

    def finished_request(self) -> FinishedRequest:
        """What the agent records for this request; its parent is the simulated HTTP server
        span (span id ``span_id_base + 1``)."""
        return FinishedRequest(
            trace_id=self.trace_id,
            parent_span_id=span_id_bytes(self.span_id_base + HTTP_SPAN_OFFSET),
            request_id=self.request_id,
            model=self.model,
            operation=self.operation,
            arrival_ns=self.arrival_ns,
            end_ns=self.end_ns,
            first_scheduled_ns=self.first_scheduled_ns,
            first_token_ns=self.first_token_ns,
            last_token_ns=self.last_token_ns,
            token_offsets_us=self.token_offsets_us,
            prefill_chunks=self.prefill_chunks,
            preempted=self.preempted,
            ready_ns=self.ready_ns,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            cached_tokens=self.cached_tokens,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            finish_reason=self.finish_reason,
            requests_ahead=self.requests_ahead,
            running_at_arrival=self.running_at_arrival,
            max_running=self.max_running,
            prefix_hash=self.prefix_hash,
            outlier_steps_with_prefill=self.outlier_steps_with_prefill,
        )
