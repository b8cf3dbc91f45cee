"""What one load run measured, and its client-side percentiles as ``vllm bench serve`` defines them.

Per successful request (streaming), with ``start`` taken just before the request is issued
(connection setup included, as ``vllm bench serve`` does):

- TTFT = first chunk carrying a choice - start;
- E2E (``vllm bench serve``'s "E2EL") = last chunk carrying a choice - start. The usage chunk
  and ``[DONE]`` after it are not part of it; the client span ends when the response is
  complete, which is what the collector's ``network`` segment uses;
- ITL = every gap between consecutive chunks carrying a choice, pooled across requests;
- TPOT = (E2E - TTFT) / (output tokens - 1), for requests with at least 2 output tokens, where
  output tokens are the server's ``usage.completion_tokens`` (else the chunks counted).

Percentiles interpolate linearly between the two nearest values (``numpy.percentile``'s default,
which ``vllm bench serve`` uses); failed requests are counted, never measured. A non-streaming
request has an E2E (response complete - start) and no TTFT, TPOT or ITL.

Each request also keeps what its client span needs for the collector to split the time the
client saw but the server did not into the client's own delays, connection setup and the
network: when the response's first byte was read, whether the request was streamed, whether
its connection was reused (else how long opening it took), how long the client waited before
handing the request to the socket, how long the first token's and the last bytes had waited in
the client's kernel before it read them, and the connection's round-trip time. These are None
when unknown (the kernel could not tell, the request failed first, or a run record written
before they were kept).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.agent.span_ids import SPAN_ID_BYTES, TRACE_ID_BYTES, parse_ids
from tokentrace.processors.durations import ms_of

DEFAULT_PERCENTILES: Final = (50.0, 90.0, 95.0, 99.0)
CLIENT_METRICS: Final = (
    semconv.METRIC_TTFT,
    semconv.METRIC_TPOT,
    semconv.METRIC_ITL,
    semconv.METRIC_E2E,
)
"""The latency metrics a client measures (the rest need the server's spans)."""
_NS_PER_S: Final = 1_000_000_000


@dataclass(slots=True, kw_only=True)
class RequestResult:
    """One measured request. Times are Unix ns on the load generator's clock."""

    index: int
    trace_id: str
    """32 hex digits: the trace the client span and the server's spans share."""
    span_id: str
    operation: str
    shared_prefix: bool
    max_tokens: int
    start_ns: int
    end_ns: int
    """Response complete (or the failure): the client span's end."""
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    chunk_gaps_ns: list[int] = field(default_factory=list)
    """Gaps between consecutive chunks that carried a choice."""
    status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    """The server's ``usage.prompt_tokens``."""
    output_tokens: int | None = None
    """The server's ``usage.completion_tokens``, else the chunks that carried a choice."""
    first_byte_ns: int | None = None
    """The read that delivered the response's first byte (its status line)."""
    stream: bool | None = None
    """The request asked for a streamed response."""
    connection_reused: bool | None = None
    """The request went over a kept-alive connection (False: the client opened one for it)."""
    connect_ns: int | None = None
    """How long opening the request's connection took; None when it was reused."""
    send_wait_ns: int | None = None
    """Start to the request's bytes handed to the socket, connection setup excluded (>= 0)."""
    first_token_read_wait_ns: int | None = None
    """How long the first token's bytes had waited in the kernel when the client read them
    (TCP_INFO ``last_data_recv``, ms resolution)."""
    read_wait_ns: int | None = None
    """The same for the read that completed the response."""
    rtt_ns: int | None = None
    """The kernel's smoothed round-trip time of the connection when the response was complete."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_ns(self) -> int | None:
        return None if self.first_token_ns is None else self.first_token_ns - self.start_ns

    @property
    def e2e_ns(self) -> int:
        """``vllm bench serve``'s E2E: to the last token chunk when streaming, else to the end."""
        last = self.last_token_ns if self.last_token_ns is not None else self.end_ns
        return last - self.start_ns

    @property
    def tpot_ns(self) -> float | None:
        ttft = self.ttft_ns
        tokens = self.output_tokens
        if ttft is None or tokens is None or tokens < 2:
            return None
        return (self.e2e_ns - ttft) / (tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestResult:
        """Raises KeyError/TypeError/ValueError for a malformed entry (the record reader says
        which one). Fields an older record lacks keep their defaults."""
        result = cls(**{name: data[name] for name in _FIELDS if name in data})
        for name in ("index", "start_ns", "end_ns", "max_tokens"):
            if not isinstance(getattr(result, name), int):
                raise ValueError(f"{name}: expected an integer")
        if not isinstance(result.chunk_gaps_ns, list):
            raise ValueError("chunk_gaps_ns: expected a list")
        for name, size in (("trace_id", TRACE_ID_BYTES), ("span_id", SPAN_ID_BYTES)):
            value = getattr(result, name)
            if parse_ids(value, size) is None:
                raise ValueError(f"{name}: expected {2 * size} hex digits, got {value!r}")
        return result


_FIELDS: Final = tuple(RequestResult.__dataclass_fields__)


def percentile(ordered: Sequence[float], percent: float) -> float:
    """The ``percent`` percentile of sorted values, interpolating linearly between the two
    nearest ranks (``numpy.percentile``'s default). ``ordered`` must not be empty."""
    position = (len(ordered) - 1) * percent / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


def percentile_label(percent: float) -> str:
    """``p50``, ``p99``, ``p99.9``."""
    return f"p{percent:g}"


def summarize_values(values_ns: Iterable[float], percents: Sequence[float]) -> dict[str, Any]:
    """``{count, mean, p50, ...}`` in ms (3 decimals: µs); ``count`` 0 and no values when empty."""
    ordered = sorted(values_ns)
    summary: dict[str, Any] = {"count": len(ordered)}
    if not ordered:
        return summary
    summary["mean"] = ms_of(math.fsum(ordered) / len(ordered))
    for percent in percents:
        summary[percentile_label(percent)] = ms_of(percentile(ordered, percent))
    return summary


def metric_values(results: Iterable[RequestResult]) -> dict[str, list[float]]:
    """metric -> its values in ns over the successful requests (ITL pooled)."""
    values: dict[str, list[float]] = {metric: [] for metric in CLIENT_METRICS}
    for result in results:
        if not result.ok:
            continue
        values[semconv.METRIC_E2E].append(result.e2e_ns)
        ttft = result.ttft_ns
        if ttft is not None:
            values[semconv.METRIC_TTFT].append(ttft)
        tpot = result.tpot_ns
        if tpot is not None:
            values[semconv.METRIC_TPOT].append(tpot)
        values[semconv.METRIC_ITL].extend(result.chunk_gaps_ns)
    return values


def summarize(
    results: Sequence[RequestResult],
    *,
    duration_ns: int,
    percents: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The run's summary: counts, throughput and each client metric's percentiles (ms)."""
    done = [result for result in results if result.ok]
    seconds = duration_ns / _NS_PER_S if duration_ns > 0 else 0.0
    output_tokens = sum(result.output_tokens or 0 for result in done)
    prompt_tokens = sum(result.prompt_tokens or 0 for result in done)
    errors: dict[str, int] = {}
    for result in results:
        if result.error is not None:
            kind = result.error.split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "duration_s": round(seconds, 3),
        "request_throughput": round(len(done) / seconds, 3) if seconds else None,
        "output_token_throughput": round(output_tokens / seconds, 3) if seconds else None,
        "input_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "metrics": {
            metric: summarize_values(values, percents)
            for metric, values in metric_values(results).items()
        },
    }
