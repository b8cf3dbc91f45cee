"""``tokentrace replay``: send simulated LLM-serving traces to an OTLP endpoint.

The spans go through the official OpenTelemetry SDK and OTLP exporter (gRPC or HTTP/protobuf)
with a ``BatchSpanProcessor``, so whatever receives them is exercised by a real OTLP client.
Only the standard library is imported at module level (``tokentrace --help`` stays fast); the
SDK and exporters are imported when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, cast
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from collections.abc import Sequence

    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from tokentrace.loadgen.replay.request import SimulatedRequest

PROTOCOL_GRPC: Final = "grpc"
PROTOCOL_HTTP: Final = "http/protobuf"
PROTOCOLS: Final = (PROTOCOL_GRPC, PROTOCOL_HTTP)

_DEFAULT_SCENARIO: Final = "mixed"
_DEFAULT_REQUESTS: Final = 300
_DEFAULT_SERVICE: Final = "vllm-demo"
_DEFAULT_CLIENT_SERVICE: Final = "tokentrace-replay-client"
_DEFAULT_TIMEOUT_S: Final = 10.0
_DEFAULT_PORTS: Final = {PROTOCOL_GRPC: 4317, PROTOCOL_HTTP: 4318}
_HTTP_TRACES_PATH: Final = "/v1/traces"
_MAX_REQUESTS: Final = 50_000
"""The simulation keeps every request (about 8 KB each, 13 KB at peak) in memory until it is
sent; larger loads are several runs with different seeds."""
_MAX_REQUESTS_PER_FLUSH: Final = 1_000
"""Spans are queued and flushed in slices, which bounds the span processor's queue."""
_PROGRESS_STEPS: Final = 10
_EXPORT_BATCH_SPANS: Final = 512
_SCHEDULE_DELAY_MS: Final = 100
_CONNECT_TIMEOUT_S: Final = 3.0
_OTEL_LOGGER: Final = "opentelemetry"

_ENV_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_ENDPOINT"
_ENV_TRACES_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
_ENV_PROTOCOL: Final = "OTEL_EXPORTER_OTLP_PROTOCOL"


class ReplayError(Exception):
    """A problem reported to the user as one line (no traceback)."""


@dataclass(slots=True)
class ExportStats:
    """What the exporters reported, across the server and client exporters."""

    exported_spans: int = 0
    failed_spans: int = 0
    errors: list[str] = field(default_factory=list)
    """The first few distinct error messages (exporter exceptions and logged errors)."""

    def add_error(self, message: str) -> None:
        if message not in self.errors and len(self.errors) < 5:
            self.errors.append(message)


class _ErrorCapture(logging.Handler):
    """Collects the OpenTelemetry exporters' warnings and errors instead of printing them
    (their retry warnings and tracebacks would bury the one-line summary)."""

    def __init__(self, stats: ExportStats) -> None:
        super().__init__(level=logging.WARNING)
        self._stats = stats

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self._stats.add_error(record.getMessage())


def _recording_exporter(inner: SpanExporter, stats: ExportStats) -> SpanExporter:
    """Wrap ``inner`` so that every export's outcome is counted in ``stats``."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class RecordingSpanExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            try:
                result = inner.export(spans)
            except Exception as error:  # an exporter bug must not kill the processor thread
                stats.add_error(f"{type(error).__name__}: {error}")
                result = SpanExportResult.FAILURE
            if result is SpanExportResult.SUCCESS:
                stats.exported_spans += len(spans)
            else:
                stats.failed_spans += len(spans)
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            return inner.force_flush(timeout_millis)

    return RecordingSpanExporter()


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to export."""

    endpoint: str
    """What the exporter is given (for HTTP: the full traces URL)."""
    protocol: str
    host: str
    port: int


def resolve_target(endpoint: str | None, protocol: str | None) -> Target:
    """The export target from the options, else the standard OTLP environment variables."""
    protocol = protocol or os.environ.get(_ENV_PROTOCOL) or PROTOCOL_GRPC
    if protocol not in PROTOCOLS:
        raise ReplayError(f"unsupported protocol {protocol!r} (use {' or '.join(PROTOCOLS)})")
    full_url = False
    if not endpoint:
        endpoint = os.environ.get(_ENV_TRACES_ENDPOINT)
        full_url = bool(endpoint)  # the per-signal variable is used as is (OTLP spec)
    if not endpoint:
        endpoint = os.environ.get(_ENV_ENDPOINT) or f"http://127.0.0.1:{_DEFAULT_PORTS[protocol]}"
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ReplayError(f"invalid endpoint {endpoint!r} (expected http[s]://HOST:PORT)")
    try:
        port = parts.port or (443 if parts.scheme == "https" else _DEFAULT_PORTS[protocol])
    except ValueError as error:
        raise ReplayError(f"invalid endpoint {endpoint!r}: {error}") from None
    if protocol == PROTOCOL_HTTP and not full_url and parts.path in ("", "/"):
        endpoint = endpoint.rstrip("/") + _HTTP_TRACES_PATH
    return Target(endpoint=endpoint, protocol=protocol, host=parts.hostname, port=port)


def _check_reachable(target: Target) -> None:
    """Fail fast with a clear message instead of after the exporter's retries."""
    try:
        with socket.create_connection((target.host, target.port), timeout=_CONNECT_TIMEOUT_S):
            pass
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        raise ReplayError(f"cannot reach {target.host}:{target.port}: {reason}") from None


def _make_exporter(target: Target, timeout_s: float) -> SpanExporter:
    if target.protocol == PROTOCOL_GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter(endpoint=target.endpoint, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter(endpoint=target.endpoint, timeout=timeout_s)


def _make_provider(
    service: str, target: Target, timeout_s: float, stats: ExportStats, max_queue: int
) -> TracerProvider:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from tokentrace.agent import semconv

    resource = Resource.create(
        {
            semconv.SERVICE_NAME: service,
            semconv.HOST_NAME: socket.gethostname(),
            semconv.PROCESS_PID: os.getpid(),
        }
    )
    provider = TracerProvider(resource=resource)
    exporter = _recording_exporter(_make_exporter(target, timeout_s), stats)
    provider.add_span_processor(
        BatchSpanProcessor(
            exporter,
            max_queue_size=max_queue,
            max_export_batch_size=_EXPORT_BATCH_SPANS,
            schedule_delay_millis=_SCHEDULE_DELAY_MS,
            export_timeout_millis=int(timeout_s * 1000),
        )
    )
    return provider


def _slices(requests: list[SimulatedRequest]) -> list[list[SimulatedRequest]]:
    """About one slice per progress step, none larger than ``_MAX_REQUESTS_PER_FLUSH``."""
    size = max(1, min(math.ceil(len(requests) / _PROGRESS_STEPS), _MAX_REQUESTS_PER_FLUSH))
    return [requests[start : start + size] for start in range(0, len(requests), size)]


def run_replay(
    *,
    target: Target,
    scenario: str,
    requests: int,
    seed: int,
    dialect: str,
    service: str,
    client_service: str,
    timeout_s: float,
    stats: ExportStats,
    progress: bool = True,
) -> int:
    """Simulate and export; returns the number of spans emitted (``stats``: what the exporters
    said). Raises ``ReplayError`` when the endpoint cannot be reached or an export fails."""
    from tokentrace.loadgen.replay.emit import DIALECTS, Dialect, emit_sdk, span_count
    from tokentrace.loadgen.replay.simulation import simulate

    if dialect not in DIALECTS:
        raise ReplayError(f"unknown dialect {dialect!r} (known: {', '.join(DIALECTS)})")
    dialect_value = cast("Dialect", dialect)
    try:
        simulated = simulate(scenario, requests=requests, seed=seed)
    except ValueError as error:
        raise ReplayError(str(error)) from None
    slices = _slices(simulated)
    largest_slice = max((sum(span_count(r, dialect_value) for r in s) for s in slices), default=0)
    _check_reachable(target)

    # The queue holds one slice (flushed before the next), so nothing is ever dropped.
    max_queue = max(largest_slice + 1, _EXPORT_BATCH_SPANS)
    server = _make_provider(service, target, timeout_s, stats, max_queue)
    client = _make_provider(client_service, target, timeout_s, stats, max_queue)
    flush_timeout_ms = int((timeout_s * (largest_slice // _EXPORT_BATCH_SPANS + 2)) * 1000)
    emitted = 0
    done = 0
    try:
        for requests_slice in slices:
            emitted += emit_sdk(
                requests_slice,
                server,
                dialect=dialect_value,
                client_tracer_provider=client,
            )
            flushed = server.force_flush(flush_timeout_ms) and client.force_flush(flush_timeout_ms)
            done += len(requests_slice)
            if stats.failed_spans or not flushed:
                raise ReplayError(_failure_message(stats, flushed, target))
            if progress:
                percent = 100 * done // len(simulated)
                print(
                    f"replay: {done}/{len(simulated)} requests ({percent}%), "
                    f"{stats.exported_spans} spans exported",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        server.shutdown()
        client.shutdown()
    return emitted


def _failure_message(stats: ExportStats, flushed: bool, target: Target) -> str:
    where = f"{target.endpoint} ({target.protocol})"
    if stats.failed_spans:
        message = f"export to {where} failed: {stats.failed_spans} spans not accepted"
    else:
        message = f"export to {where} did not finish in time"
    if stats.errors:
        message += f" ({stats.errors[0]})"
    return message


class ReplayCommand:
    """``tokentrace replay``: realistic simulated traces sent by the OpenTelemetry SDK."""

    name = "replay"
    help = (
        "send realistic simulated LLM-serving traces (queueing, prefill, decode, preemption, "
        "cold start, network) to an OTLP endpoint through the OpenTelemetry SDK"
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        # Standard library only (see ``tokentrace.loadgen.replay``): safe for ``--help``.
        from tokentrace.loadgen.replay.emit import DIALECTS
        from tokentrace.loadgen.replay.scenarios import SCENARIOS

        parser.add_argument(
            "--endpoint",
            help=f"OTLP endpoint (default: ${_ENV_ENDPOINT}, else http://127.0.0.1:4317 for "
            "grpc, :4318 for http/protobuf)",
        )
        parser.add_argument(
            "--protocol",
            choices=PROTOCOLS,
            help=f"OTLP transport (default: ${_ENV_PROTOCOL}, else grpc)",
        )
        scenario_help = "; ".join(f"{name}: {s.description}" for name, s in SCENARIOS.items())
        parser.add_argument(
            "--scenario",
            choices=sorted(SCENARIOS),
            default=_DEFAULT_SCENARIO,
            metavar="NAME",
            help=f"workload preset (default: {_DEFAULT_SCENARIO}). {scenario_help}",
        )
        parser.add_argument(
            "--requests",
            type=int,
            default=_DEFAULT_REQUESTS,
            metavar="N",
            help=f"requests to simulate (default: {_DEFAULT_REQUESTS})",
        )
        parser.add_argument(
            "--seed",
            type=int,
            metavar="S",
            help="random seed; the same seed gives the same traces (default: a fresh one, "
            "printed in the summary)",
        )
        parser.add_argument(
            "--dialect",
            choices=DIALECTS,
            default=DIALECTS[0],
            help="span layout: tokentrace's span tree, or vLLM's built-in one span per request",
        )
        parser.add_argument(
            "--service",
            default=_DEFAULT_SERVICE,
            metavar="NAME",
            help=f"service.name of the simulated server (default: {_DEFAULT_SERVICE})",
        )
        parser.add_argument(
            "--client-service",
            default=_DEFAULT_CLIENT_SERVICE,
            metavar="NAME",
            help=f"service.name of the simulated load generator's client spans "
            f"(default: {_DEFAULT_CLIENT_SERVICE})",
        )
        parser.add_argument(
            "--timeout",
            type=float,
            default=_DEFAULT_TIMEOUT_S,
            metavar="SECONDS",
            help=f"export timeout per batch (default: {_DEFAULT_TIMEOUT_S:g})",
        )
        parser.add_argument(
            "--quiet", action="store_true", help="no progress lines, only the summary"
        )
        parser.add_argument(
            "--verbose",
            action="store_true",
            help="let the OpenTelemetry exporters log their warnings and errors",
        )

    def run(self, args: argparse.Namespace) -> int:
        if not 0 < args.requests <= _MAX_REQUESTS:
            print(
                f"tokentrace replay: --requests must be 1..{_MAX_REQUESTS} (for more, run it "
                "again with another --seed)",
                file=sys.stderr,
            )
            return 2
        if args.timeout <= 0:
            print("tokentrace replay: --timeout must be > 0", file=sys.stderr)
            return 2
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
        otel_logger = logging.getLogger(_OTEL_LOGGER)
        propagate = otel_logger.propagate
        stats = ExportStats()
        capture = None if args.verbose else _ErrorCapture(stats)
        started = time.perf_counter()
        try:
            target = resolve_target(args.endpoint, args.protocol)
            if capture is not None:
                otel_logger.addHandler(capture)
                otel_logger.propagate = False
            emitted = run_replay(
                target=target,
                scenario=args.scenario,
                requests=args.requests,
                seed=seed,
                dialect=args.dialect,
                service=args.service,
                client_service=args.client_service,
                timeout_s=args.timeout,
                stats=stats,
                progress=not args.quiet,
            )
        except ReplayError as error:
            print(f"tokentrace replay: {error}", file=sys.stderr)
            return 1
        except Exception as error:  # a clear line instead of a traceback
            print(f"tokentrace replay: failed: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
        finally:
            if capture is not None:
                otel_logger.removeHandler(capture)
                otel_logger.propagate = propagate
        elapsed = time.perf_counter() - started
        print(
            f"replay: {args.requests} requests (scenario {args.scenario}, seed {seed}, dialect "
            f"{args.dialect}), {emitted} spans in {elapsed:.2f} s ({emitted / elapsed:,.0f} "
            f"spans/s) to {target.endpoint} via {target.protocol}: export succeeded "
            f"({stats.exported_spans} spans accepted)"
        )
        return 0
