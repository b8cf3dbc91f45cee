"""A consumer that stands behind the collector's receivers in their tests: it records what they
hand on and can be told to fail the next calls."""

from __future__ import annotations

import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span


class RecordingConsumer:
    """Records every request (and the bytes it came as, when the receiver passed them); can be
    told to refuse or fail the next N calls.

    ``never_blocks`` (False unless set): whether it declares that it never blocks, which lets
    the HTTP receiver call it on its event loop; a subclass that waits must leave it False.
    """

    def __init__(self, *, never_blocks: bool = False) -> None:
        self.never_blocks = never_blocks
        self.requests: list[ExportTraceServiceRequest] = []
        self.encoded: list[bytes | None] = []
        self.calls = 0
        self.threads: list[str] = []
        """The name of the thread each call ran on."""
        self._lock = threading.Lock()
        self.failures: list[Exception] = []

    def fail_next(self, *errors: Exception) -> None:
        self.failures.extend(errors)

    def consume_traces(
        self, request: ExportTraceServiceRequest, *, encoded: bytes | None = None
    ) -> None:
        with self._lock:
            self.calls += 1
            self.threads.append(threading.current_thread().name)
            if self.failures:
                raise self.failures.pop(0)
            self.requests.append(request)
            self.encoded.append(encoded)

    def spans(self) -> list[Span]:
        return [
            span
            for request in self.requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]

    def span_names(self) -> list[str]:
        return [span.name for span in self.spans()]

    def resource_attributes(self) -> list[dict[str, str]]:
        return [
            {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for request in self.requests
            for resource_spans in request.resource_spans
        ]
