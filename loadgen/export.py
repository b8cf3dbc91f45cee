"""The load generator's client spans, encoded once per request and sent as OTLP off the loop.

One ``llm.client.request`` span (kind CLIENT) per measured request, in the trace whose
``traceparent`` the request carried: its start is when the request was issued, its end when the
response was complete, and ``tokentrace.client.first_token_time`` marks the first token chunk.
With the server's spans in the same trace, the collector derives the time the client saw but
the server did not, and splits it with what else the span carries (``tokentrace.client.*``:
first byte time, streamed or not, connection reused or its setup time, the wait before sending,
the kernel's read waits and round-trip time) into ``client``, ``connect`` and ``network``. An
attribute is absent when its value is unknown.
"""

from __future__ import annotations

import time
from typing import Final

from tokentrace.agent import semconv
from tokentrace.agent.otlp_config import PROTOCOL_GRPC, OtlpExporterConfig
from tokentrace.agent.otlp_export import OtlpSender
from tokentrace.agent.span_encoding import ResourceScope, encode_span, export_request
from tokentrace.agent.spans import KIND_CLIENT, AttrValue, PlannedSpan
from tokentrace.loadgen.results import RequestResult

DEFAULT_SERVICE_NAME: Final = "tokentrace-load"
_SCOPE_NAME: Final = "tokentrace.load"
_HTTP_METHOD: Final = "POST"
_DEFAULT_FLUSH_SPANS: Final = 128
_DEFAULT_FLUSH_INTERVAL_S: Final = 0.2
_DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 10.0


class ClientSpanExporter:
    """Collects encoded client spans and submits them in batches to a non-blocking
    ``OtlpSender`` (its own thread sends and retries; a full queue drops and counts).

    Batches leave when ``flush_spans`` are pending or ``flush_interval_s`` passed since the last
    one, so the collector sees each client span within about that interval: it must arrive
    before the collector finishes assembling the trace (its quiet period, 2 s by default)."""

    def __init__(
        self,
        config: OtlpExporterConfig,
        *,
        service_name: str = DEFAULT_SERVICE_NAME,
        flush_spans: int = _DEFAULT_FLUSH_SPANS,
        flush_interval_s: float = _DEFAULT_FLUSH_INTERVAL_S,
    ) -> None:
        """Raises ValueError for an invalid ``config``."""
        self._sender = OtlpSender(config, signal="traces")
        if config.protocol == PROTOCOL_GRPC:
            # Imported now, before the run: the sender's thread would import it at the first
            # export, mid-run, holding the GIL while the measured requests wait for the loop.
            import grpc  # noqa: F401
        self._head = ResourceScope(
            resource_attributes={semconv.SERVICE_NAME: service_name}, scope_name=_SCOPE_NAME
        )
        self._pending: list[bytes] = []
        self._flush_spans = flush_spans
        self._flush_interval_s = flush_interval_s
        self._last_flush = time.monotonic()
        self.unsent = 0
        """Spans the sender refused at submission (queue full or shut down)."""

    def add(self, result: RequestResult, *, model: str, path: str) -> None:
        self._pending.append(_encode(result, model=model, path=path))
        now = time.monotonic()
        if (
            len(self._pending) >= self._flush_spans
            or now - self._last_flush >= self._flush_interval_s
        ):
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._pending:
            return
        spans, self._pending = self._pending, []
        if not self._sender.submit(export_request([(self._head, spans)]), len(spans)):
            self.unsent += len(spans)

    def shutdown(self, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> dict[str, int]:
        """Send what is pending (within ``timeout_s``); the sender's counters plus ``unsent``."""
        self.flush()
        self._sender.shutdown(timeout_s)
        stats = self._sender.stats()
        stats["unsent_spans"] = self.unsent
        return stats


def _encode(result: RequestResult, *, model: str, path: str) -> bytes:
    attributes: dict[str, AttrValue] = {
        semconv.GEN_AI_OPERATION_NAME: result.operation,
        semconv.GEN_AI_REQUEST_MODEL: model,
        semconv.HTTP_REQUEST_METHOD: _HTTP_METHOD,
        semconv.URL_PATH: path,
    }
    known: tuple[tuple[str, AttrValue | None], ...] = (
        (semconv.HTTP_RESPONSE_STATUS_CODE, result.status),
        (semconv.CLIENT_FIRST_TOKEN_TIME, result.first_token_ns),
        (semconv.GEN_AI_USAGE_INPUT_TOKENS, result.prompt_tokens),
        (semconv.GEN_AI_USAGE_OUTPUT_TOKENS, result.output_tokens),
        (semconv.CLIENT_FIRST_BYTE_TIME, result.first_byte_ns),
        (semconv.CLIENT_STREAM, result.stream),
        (semconv.CLIENT_CONNECTION_REUSED, result.connection_reused),
        (semconv.CLIENT_CONNECT_NS, result.connect_ns),
        (semconv.CLIENT_SEND_WAIT_NS, result.send_wait_ns),
        (semconv.CLIENT_FIRST_TOKEN_READ_WAIT_NS, result.first_token_read_wait_ns),
        (semconv.CLIENT_READ_WAIT_NS, result.read_wait_ns),
        (semconv.CLIENT_RTT_NS, result.rtt_ns),
    )
    for name, value in known:
        if value is not None:
            attributes[name] = value
    planned = PlannedSpan(
        0, -1, semconv.SPAN_CLIENT_REQUEST, KIND_CLIENT,
        result.start_ns, result.end_ns, attributes, result.error,
    )  # fmt: skip
    return encode_span(
        planned, trace_id=bytes.fromhex(result.trace_id), span_id=bytes.fromhex(result.span_id)
    )
