"""The one-method consumer every pipeline component hands data to (as in the OTel Collector).

Shared by the collector's pipeline and the node agent's relay, which both receive OTLP through
the receivers next to it (``collector/receivers/``)."""

from __future__ import annotations

from typing import Protocol

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Overloaded(Exception):
    """The consumer cannot take more now; the sender should retry after ``retry_after_s``.

    Receivers turn this into gRPC RESOURCE_EXHAUSTED with RetryInfo / HTTP 429 with Retry-After.
    """

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(Exception):
    """The consumer is shutting down; gRPC UNAVAILABLE / HTTP 503."""


class TraceConsumer(Protocol):
    def consume_traces(self, request: ExportTraceServiceRequest) -> None:
        """Take ownership of ``request`` (already validated). May raise Overloaded/Unavailable."""
