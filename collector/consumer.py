"""The one-method consumer every pipeline component hands data to (as in the OTel Collector).

Shared by the collector's pipeline and the node agent's relay, which both receive OTLP through
the receivers next to it (``collector/receivers/``).

A receiver that serves on an event loop (OTLP/HTTP) calls ``consume_traces`` on the loop itself
only when the consumer declares that it never blocks (``never_blocks``): a call that waits for
an fsync or a full queue there would stall every connection. Any other consumer is called on a
worker thread, which costs two thread switches per request.
"""

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
    def consume_traces(
        self, request: ExportTraceServiceRequest, *, encoded: bytes | None = None
    ) -> None:
        """Take ownership of ``request`` (already validated). May raise Overloaded/Unavailable.

        ``encoded``, when given, is ``request`` serialised: the protobuf bytes the receiver
        decoded it from, which validation left as they were. A consumer that keeps or forwards
        the request's bytes uses them instead of serialising it again. They parse to the same
        message, though ``request.SerializeToString()`` may order or encode fields otherwise.
        """


def never_blocks(consumer: object) -> bool:
    """Whether ``consumer`` declares, with a true ``never_blocks`` attribute or property, that
    ``consume_traces`` never waits: no disk or network I/O, no sleep, no lock held for long.
    Undeclared means it may block."""
    return getattr(consumer, "never_blocks", False) is True
