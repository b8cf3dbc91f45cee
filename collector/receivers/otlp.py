"""The ``otlp`` receiver component: its gRPC and HTTP protocols, started and stopped together.

The protocol receivers keep their own counters (the node agent runs them too, without the
collector's registry); this component reports them to the self-telemetry as observed counters,
under the receiver's id with the transport as an attribute (snapshot keys
``OtlpGrpcReceiver.<counter>`` and ``OtlpHttpReceiver.<counter>``).
"""

from __future__ import annotations

import time
from typing import Final

from tokentrace.agent import semconv
from tokentrace.collector.component import CreateSettings
from tokentrace.collector.component_configs import OtlpReceiverConfig
from tokentrace.collector.receivers.otlp_grpc import OtlpGrpcReceiver
from tokentrace.collector.receivers.otlp_http import OtlpHttpReceiver

RECEIVER_COUNTERS: Final = {
    semconv.SELF_METRIC_ACCEPTED_SPANS: "spans handed to the pipeline and taken by it",
    semconv.SELF_METRIC_REJECTED_SPANS: "invalid spans dropped (partial success)",
    semconv.SELF_METRIC_REFUSED_REQUESTS: "exports the pipeline refused (the sender retries)",
    semconv.SELF_METRIC_FAILED_REQUESTS: "exports that failed unexpectedly",
    semconv.SELF_METRIC_MALFORMED_REQUESTS: "undecodable or over-limit exports",
    semconv.SELF_METRIC_UNAUTHENTICATED_REQUESTS: "exports without the right bearer token",
    semconv.SELF_METRIC_REFUSED_CONNECTIONS: "connections refused at max_connections",
}
_GRPC: Final = "grpc"
_HTTP: Final = "http"


class OtlpReceiver:
    def __init__(self, config: OtlpReceiverConfig, settings: CreateSettings) -> None:
        if settings.consumer is None:
            raise ValueError("a receiver needs the consumer it hands data to")
        self.grpc: OtlpGrpcReceiver | None = None
        self.http: OtlpHttpReceiver | None = None
        if config.grpc is not None:
            grpc = config.grpc
            self.grpc = OtlpGrpcReceiver(
                settings.consumer,
                endpoint=grpc.endpoint,
                max_recv_msg_size=grpc.max_message_size,
                auth_token=grpc.auth_token,
                tls_cert_file=grpc.tls_cert_file,
                tls_key_file=grpc.tls_key_file,
                span_limits=config.span_limits,
            )
        if config.http is not None:
            http = config.http
            self.http = OtlpHttpReceiver(
                settings.consumer,
                endpoint=http.endpoint,
                max_request_body_size=http.max_message_size,
                auth_token=http.auth_token,
                tls_cert_file=http.tls_cert_file,
                tls_key_file=http.tls_key_file,
                span_limits=config.span_limits,
            )
        for transport, receiver in self._protocols():
            telemetry = settings.component_telemetry(
                snapshot_prefix=f"{type(receiver).__name__}.",
                attributes={semconv.SELF_ATTR_TRANSPORT: transport},
            )
            telemetry.observe(receiver.stats, counters=RECEIVER_COUNTERS)

    def _protocols(self) -> list[tuple[str, OtlpGrpcReceiver | OtlpHttpReceiver]]:
        pairs: list[tuple[str, OtlpGrpcReceiver | OtlpHttpReceiver | None]] = [
            (_GRPC, self.grpc),
            (_HTTP, self.http),
        ]
        return [(transport, receiver) for transport, receiver in pairs if receiver is not None]

    def start(self) -> None:
        """Bind both; raises ReceiverStartError (the one that started is stopped again)."""
        started: list[OtlpGrpcReceiver | OtlpHttpReceiver] = []
        try:
            for _, receiver in self._protocols():
                receiver.start()
                started.append(receiver)
        except Exception:
            for receiver in reversed(started):
                receiver.shutdown(0)
            raise

    def shutdown(self, *, timeout_s: float) -> None:
        """Stop taking exports; in-flight ones get up to ``timeout_s`` in all to finish."""
        deadline = time.monotonic() + timeout_s
        for _, receiver in reversed(self._protocols()):
            receiver.shutdown(max(0.0, deadline - time.monotonic()))
