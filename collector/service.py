"""The collector service: builds the components from a config and runs them.

Components are made by their factories (``factories.py``) in the order the configuration lists
them and started downstream first: the exporters, then the pipeline (with durability ``fsync``
its write-ahead spool is opened and what it kept from the last run is replayed into assembly
first), then the pipeline's worker, then the extensions, then the receivers. Shutdown is
upstream first: receivers stop taking data (in-flight exports are refused with a retry hint),
extensions stop, the pipeline finishes every pending trace and hands the exporters its final
tick, the exporters flush. Nothing accepted is lost on a clean stop, nor (durability ``fsync``)
on a crash: what was acknowledged is in the spool until stored. A start that fails shuts down
what had started.

The ``admin`` extension (``collector/admin.py``) is made before the pipeline and started before
the replay, so ``/healthz`` answers during a long replay (a liveness probe must not kill a
collector that is catching up) while ``/readyz`` says "not ready" until the receivers listen.
The pipeline hands its ``pipeline_sink`` every batch, as it hands the exporters, and its
readiness is this module's ``Collector.readiness``. Every exporter is handed to the pipeline
wrapped in ``_TimedExporter``: each batch's export is timed (the self-telemetry histogram
``export_duration``: the store's write latency) and its last outcome kept for readiness.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

from tokentrace.agent import semconv
from tokentrace.agent.admin_http import ReadinessCheck
from tokentrace.agent.otlp_config import SIGNAL_TRACES
from tokentrace.collector.component import (
    KIND_EXPORTER,
    KIND_EXTENSION,
    KIND_PIPELINE,
    KIND_RECEIVER,
    Component,
    ComponentConfig,
    Factories,
    create_component,
)
from tokentrace.collector.config import CollectorConfig, ConfigError, load_config
from tokentrace.collector.factories import FACTORIES
from tokentrace.collector.memory_limiter import MemoryLimiter
from tokentrace.collector.receivers import (
    is_loopback_endpoint,
    is_wildcard_endpoint,
    join_endpoint,
    split_endpoint,
)
from tokentrace.collector.self_telemetry import Histogram, SelfTelemetry
from tokentrace.collector.store.location import display_location, is_postgresql

if TYPE_CHECKING:
    from typing import Protocol

    from tokentrace.collector.admin import AdminExtension
    from tokentrace.collector.consumer import TraceConsumer
    from tokentrace.collector.pipeline import Pipeline, PipelineTick, ProcessedTrace, TraceSink
    from tokentrace.collector.receivers.otlp import OtlpReceiver
    from tokentrace.collector.spool import Spool

    class Exporter(TraceSink, Component, Protocol):
        """What an exporter factory makes."""


_log = logging.getLogger(__name__)

_DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 10.0
_FAILED_START_SHUTDOWN_S: Final = 1.0
_MIN_STEP_TIMEOUT_S: Final = 0.1
_MEMORY_LIMITER_ID: Final = "memory_limiter"
"""The memory limiter's id in the self-telemetry (a part of the service, like the pipeline)."""
# Each request allocates a few hundred short-lived containers; with CPython's default gen-0
# threshold (700) the collector spent ~15% of its time in the cyclic GC scanning live traces.
_GC_THRESHOLDS = (50_000, 20, 20)
_EXPORT_DURATION_BOUNDS_S: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Up to the store's busy timeout (5 s) and beyond: a locked database shows."""
_ADMIN: Final = "admin"
_MIB: Final = 2**20


class _TimedExporter:
    """An exporter as the pipeline gets it: each batch's export timed, its outcome kept (for
    readiness); everything else is the exporter's own (attributes pass through)."""

    def __init__(self, exporter: Exporter, duration: Histogram) -> None:
        self.exporter = exporter
        self._duration = duration
        self.last_error: str | None = None
        """What the last batch's export raised (one line); None when it went through."""

    def export_traces(self, batch: Sequence[ProcessedTrace]) -> None:
        started = time.perf_counter()
        try:
            self.exporter.export_traces(batch)
        except Exception as error:
            self.last_error = f"{type(error).__name__}: {error}".splitlines()[0]
            raise
        else:
            self.last_error = None
        finally:
            self._duration.record(time.perf_counter() - started)

    def tick(self, tick: PipelineTick) -> None:
        self.exporter.tick(tick)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.exporter, name)


def tune_gc_for_throughput() -> None:
    """Fewer cyclic-GC passes for a long-running collector process (not for library use)."""
    gc.freeze()  # what start-up allocated lives for the whole process: never scan it again
    gc.set_threshold(*_GC_THRESHOLDS)


class Collector:
    """Every component of one collector, started downstream first, stopped upstream first."""

    def __init__(
        self,
        config: CollectorConfig,
        *,
        factories: Factories = FACTORIES,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.telemetry = SelfTelemetry()
        """Every component's self-telemetry (``stats()`` is its snapshot)."""
        self._factories = factories
        self._clock = clock
        self._wall_clock = wall_clock
        self.exporters: dict[str, Exporter] = {}
        self.pipeline: Pipeline | None = None
        self.memory_limiter: MemoryLimiter | None = None
        self.extensions: dict[str, Component] = {}
        self.receivers: dict[str, Component] = {}
        self._timed_exporters: dict[str, _TimedExporter] = {}
        self._stopping = False

    @property
    def grpc_port(self) -> int | None:
        receiver = self._otlp_receiver()
        return None if receiver is None or receiver.grpc is None else receiver.grpc.port

    @property
    def http_port(self) -> int | None:
        receiver = self._otlp_receiver()
        return None if receiver is None or receiver.http is None else receiver.http.port

    @property
    def ui_url(self) -> str | None:
        from tokentrace.collector.api.server import ApiServer

        for extension in self.extensions.values():
            if isinstance(extension, ApiServer):
                return str(extension.url)
        return None

    @property
    def admin(self) -> AdminExtension | None:
        """The running ``admin`` extension, if configured."""
        for component in self.config.extensions:
            if component.type == _ADMIN:
                extension: Any = self.extensions.get(component.id)
                return cast("AdminExtension | None", extension)
        return None

    def _otlp_receiver(self) -> OtlpReceiver | None:
        from tokentrace.collector.receivers.otlp import OtlpReceiver

        for receiver in self.receivers.values():
            if isinstance(receiver, OtlpReceiver):
                return receiver
        return None

    def start(self) -> None:
        from tokentrace.collector.exporters.store_sink import StoreSink
        from tokentrace.collector.pipeline import Pipeline

        config = self.config
        self._stopping = False
        try:
            for component in config.exporters:
                exporter = self._create(component)
                exporter.start()
                self.exporters[component.id] = exporter
            sinks: dict[str, TraceSink] = {}
            for exporter_id, exporter in self.exporters.items():
                timed = _TimedExporter(exporter, self._export_duration(exporter_id))
                self._timed_exporters[exporter_id] = timed
                sinks[exporter_id] = timed
            # Extensions are made now, so that the admin one can be fed by the pipeline and
            # serve /healthz during the replay; the others start where they always did.
            extensions = [(component, self._create(component)) for component in config.extensions]
            for component, extension in extensions:
                if component.type == _ADMIN:
                    extension.readiness = self.readiness
                    extension.start()
                    self.extensions[component.id] = extension
                    sinks[component.id] = extension.pipeline_sink
            # Late spans join their request through the spans the store holds for its trace.
            stores = [e for e in self.exporters.values() if isinstance(e, StoreSink)]
            spool = self._open_spool()
            self.memory_limiter = MemoryLimiter.from_config(
                config.memory_limiter,
                telemetry=self.telemetry.component(_MEMORY_LIMITER_ID, KIND_PIPELINE),
            )
            if self.memory_limiter is not None:
                self.memory_limiter.start()
            self.pipeline = Pipeline(
                config,
                sinks=sinks,
                earlier_spans=stores[0].stored_spans if stores else None,
                stored_traces=stores[0].stored_trace_ids if stores and stores[0].shared else None,
                telemetry=self.telemetry,
                monotonic=self._clock,
                wall_clock=self._wall_clock,
                factories=self._factories,
                spool=spool,
                memory_limiter=self.memory_limiter,
            )
            self.pipeline.replay()  # before any receiver takes new data
            self.pipeline.start()
            for component, extension in extensions:
                if component.id not in self.extensions:
                    extension.start()
                    self.extensions[component.id] = extension
            for component in config.receivers:
                receiver = self._create(component, consumer=self.pipeline)
                receiver.start()
                self.receivers[component.id] = receiver
        except Exception:
            self.shutdown(timeout_s=_FAILED_START_SHUTDOWN_S)
            raise

    def _export_duration(self, exporter_id: str) -> Histogram:
        return self.telemetry.component(exporter_id, KIND_EXPORTER).histogram(
            semconv.SELF_METRIC_EXPORT_DURATION,
            _EXPORT_DURATION_BOUNDS_S,
            description="handing one batch to the exporter",
            unit=semconv.METRIC_UNIT_SECONDS,
        )

    def readiness(self) -> list[ReadinessCheck]:
        """What ``/readyz`` reports: receivers listening, each store writable (its directory
        and file, and its last batch stored), each upstream reachable or buffering (its send
        queue has room for a batch), memory below the limiter's soft limit. Not ready while
        starting (the replay included) and once shutting down."""
        if self._stopping:
            return [ReadinessCheck("collector", False, "shutting down")]
        if self.pipeline is None or not self.receivers:
            return [ReadinessCheck("receivers", False, "not listening yet (starting)")]
        checks = [self._receivers_check()]
        # Copies: the admin thread asks while start() or shutdown() may change them.
        checks += [self._store_check(i) for i, e in list(self.exporters.items()) if _is_store(e)]
        checks += [self._upstream_check(component) for component in self.config.upstream]
        limiter = self.memory_limiter
        if limiter is not None:
            rss, soft = limiter.rss_bytes, limiter.soft_limit_bytes
            checks.append(
                ReadinessCheck(
                    "memory_limiter",
                    rss <= soft,
                    f"{rss / _MIB:.0f} MiB in use, refusing data above {soft / _MIB:.0f} MiB",
                )
            )
        return checks

    def _receivers_check(self) -> ReadinessCheck:
        from tokentrace.collector.receivers.otlp import OtlpReceiver

        listening = []
        for receiver_id, receiver in list(self.receivers.items()):
            if not isinstance(receiver, OtlpReceiver):
                listening.append(receiver_id)
                continue
            for protocol, server in (("grpc", receiver.grpc), ("http", receiver.http)):
                if server is None:
                    continue
                try:
                    listening.append(f"{receiver_id} {protocol} :{server.port}")
                except RuntimeError:  # not bound
                    return ReadinessCheck("receivers", False, f"{receiver_id} {protocol}: down")
        return ReadinessCheck("receivers", True, ", ".join(listening))

    def _store_check(self, exporter_id: str) -> ReadinessCheck:
        name = f"exporter {exporter_id}"
        store = self.config.store
        assert store is not None, "a store exporter has a store config"
        if is_postgresql(store.path):  # a database server: its last batch says it all
            where = display_location(store.path)
        else:
            where = os.path.abspath(store.path)
            directory = os.path.dirname(where)
            if not os.access(directory, os.W_OK | os.X_OK):
                return ReadinessCheck(name, False, f"directory {directory} is not writable")
            if os.path.exists(where) and not os.access(where, os.W_OK):
                return ReadinessCheck(name, False, f"{where} is not writable")
        timed = self._timed_exporters.get(exporter_id)
        last_error = None if timed is None else timed.last_error
        if last_error is not None:
            return ReadinessCheck(name, False, f"the last batch was not stored: {last_error}")
        return ReadinessCheck(name, True, where)

    def _upstream_check(self, component: ComponentConfig) -> ReadinessCheck:
        """Reachable or buffering: the send queue has room for one more batch (a queue that
        filled up means the upstream has not taken spans for a while)."""
        name = f"exporter {component.id}"
        exporter = component.config.exporter
        queued = 0
        for reading in self.telemetry.readings():
            attributes = dict(reading.attributes)
            if (
                reading.name == semconv.SELF_METRIC_QUEUE_LEN
                and attributes.get(semconv.SELF_ATTR_COMPONENT_ID) == component.id
                and attributes.get(semconv.SELF_ATTR_SIGNAL) == SIGNAL_TRACES
                and isinstance(reading.value, int | float)
            ):
                queued = int(reading.value)
        room = exporter.queue_size - queued
        target = exporter.endpoint_for(SIGNAL_TRACES) or exporter.endpoint
        detail = f"{queued} of {exporter.queue_size} spans queued for {target}"
        if room < exporter.max_batch_spans:
            return ReadinessCheck(name, False, f"send queue full ({detail}): upstream unreachable?")
        return ReadinessCheck(name, True, detail)

    def _open_spool(self) -> Spool | None:
        from tokentrace.collector.spool import Spool

        directory = self.config.spool_directory
        if directory is None:
            return None
        durability = self.config.durability
        return Spool(
            directory,
            max_bytes=durability.max_bytes,
            segment_bytes=durability.segment_bytes,
            segment_age_s=durability.segment_age_s,
            clock=self._clock,
            telemetry=self.telemetry.component("traces", KIND_PIPELINE),
        )

    def _create(self, component: ComponentConfig, *, consumer: TraceConsumer | None = None) -> Any:
        return create_component(
            self._factories,
            component,
            telemetry=self.telemetry,
            collector_config=self.config,
            clock=self._clock,
            wall_clock=self._wall_clock,
            consumer=consumer,
        )

    def flush(self) -> None:
        """Finish and export every pending trace now (tests, the demo, shutdown)."""
        if self.pipeline is not None:
            self.pipeline.process_once(flush_all=True)
            self.pipeline.housekeeping()

    def shutdown(self, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Upstream first, within ``timeout_s`` in all (module docstring)."""
        deadline = self._clock() + timeout_s

        def left() -> float:
            return max(_MIN_STEP_TIMEOUT_S, deadline - self._clock())

        self._stopping = True  # /readyz says so at once: the load balancer stops sending

        pipeline, self.pipeline = self.pipeline, None
        if pipeline is not None:
            pipeline.stop_accepting()
        for kind, components in (
            (KIND_RECEIVER, self.receivers),
            (KIND_EXTENSION, self.extensions),
        ):
            for component_id, component in reversed(components.items()):
                try:
                    component.shutdown(timeout_s=left())
                except Exception:
                    _log.exception("stopping the %s %s failed", kind, component_id)
            components.clear()
        if pipeline is not None:
            pipeline.shutdown(timeout_s=left())
        limiter, self.memory_limiter = self.memory_limiter, None
        if limiter is not None:
            limiter.shutdown()
        for component_id, exporter in reversed(self.exporters.items()):
            try:
                exporter.shutdown(timeout_s=left())
            except Exception:
                _log.exception("stopping the %s %s failed", KIND_EXPORTER, component_id)
        self.exporters.clear()
        self._timed_exporters.clear()

    def stats(self) -> dict[str, Any]:
        """The self-telemetry snapshot (what ``tokentrace top`` shows, and the benchmark)."""
        return self.telemetry.snapshot()


def _is_store(exporter: Any) -> bool:
    from tokentrace.collector.exporters.store_sink import StoreSink

    return isinstance(exporter, StoreSink)


def run_from_args(args: argparse.Namespace) -> int:
    """``tokentrace collector``: run until SIGINT/SIGTERM."""
    logging.basicConfig(
        level=os.environ.get("TOKENTRACE_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = load_config(args.config, store_path=args.store)
    except ConfigError as error:
        print(f"tokentrace collector: configuration error: {error}", file=sys.stderr)
        return 2
    if getattr(args, "check_config", False):
        print("configuration OK:")
        for line in describe_config(config):
            print(f"  {line}")
        return 0
    collector = Collector(config)
    try:
        collector.start()
    except Exception as error:  # port taken, unwritable store, bad TLS files...
        print(f"tokentrace collector: cannot start: {error}", file=sys.stderr)
        return 1
    tune_gc_for_throughput()
    for line in describe(collector):
        print(line, flush=True)
    stop = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    stop.wait()
    print("tokentrace collector: shutting down (finishing pending traces)", flush=True)
    collector.shutdown()
    return 0


GRPC_LISTENING_LINE: Final = re.compile(r"OTLP/gRPC receiver listening on (\S+):(\d+)")
"""What ``tokentrace collector`` prints once its gRPC receiver listens (``describe_config``):
the demo and the tests read the host and port it bound from it."""


def _exposure(endpoint: str, auth_token: str | None, what: str) -> str:
    """What a listener beyond loopback exposes, said where the collector says what it runs:
    on every interface, and without a token to anyone who reaches it."""
    if is_loopback_endpoint(endpoint):
        return ""
    where = " (ALL interfaces)" if is_wildcard_endpoint(endpoint) else " (not loopback)"
    if auth_token:
        return where
    return f"{where}: NO bearer token, anyone who reaches it can {what}"


def describe_config(
    config: CollectorConfig, *, ports: Mapping[str, Any] | None = None
) -> list[str]:
    """What a configuration runs: before anything binds, or with the ports it bound."""
    lines = []
    for protocol, receiver in (("gRPC", config.grpc), ("HTTP", config.http)):
        if receiver is None:
            continue
        host, port = split_endpoint(receiver.endpoint)
        bound = (ports or {}).get(protocol)
        address = join_endpoint(host, bound if bound is not None else port)
        if protocol == "HTTP":
            address = f"http://{address}/v1/traces"
        auth = ", bearer token required" if receiver.auth_token else ""
        tls = ", TLS" if receiver.tls_cert_file else ""
        verb = "listening on" if ports else "on"
        exposure = _exposure(receiver.endpoint, receiver.auth_token, "send spans")
        lines.append(f"OTLP/{protocol} receiver {verb} {address}{tls}{auth}{exposure}")
    lines.append(f"processors: {', '.join(config.processor_ids)}")
    if config.slo_targets:
        lines.append(f"SLO targets: {', '.join(target.name for target in config.slo_targets)}")
    if config.store is not None:
        path = config.store.path
        shown = display_location(path) if is_postgresql(path) else os.path.abspath(path)
        lines.append(f"request store: {shown}")
    spool_directory = config.spool_directory
    if spool_directory is None:
        lines.append("durability: none (an acknowledged export is lost if the process dies)")
    else:
        lines.append(f"durability: fsync, write-ahead spool in {os.path.abspath(spool_directory)}")
    limiter = config.memory_limiter
    if limiter.enabled:
        limit = limiter.limit_bytes()
        soft = limit - limiter.spike_limit_bytes(limit)
        lines.append(
            f"memory limit: {limit / 2**20:.0f} MiB (refusing data above {soft / 2**20:.0f} MiB)"
        )
    else:
        lines.append("memory limit: none")
    for upstream in config.upstream:
        exporter = upstream.config.exporter
        target = exporter.endpoint_for("traces") or exporter.endpoint
        protocol = exporter.protocol
        lines.append(f"{upstream.id}: enriched spans and metrics to {target} ({protocol})")
    if not config.upstream:
        lines.append("no upstream export (set OTEL_EXPORTER_OTLP_ENDPOINT or an otlp exporter)")
    if config.admin is not None:
        admin = (ports or {}).get("admin") or f"http://{config.admin.endpoint}"
        lines.append(
            f"health, readiness and Prometheus metrics {'at' if ports else 'on'} {admin}"
            "/healthz, /readyz, /metrics (unauthenticated)"
        )
    if config.ui is not None:
        ui = config.ui
        address = (ports or {}).get(
            "UI"
        ) or f"{'https' if ui.tls_cert_file else 'http'}://{ui.endpoint}"
        auth = ", bearer token required" if ui.auth_token else ""
        exposure = _exposure(ui.endpoint, ui.auth_token, "read every stored request")
        lines.append(f"web UI and API {'at' if ports else 'on'} {address}/{auth}{exposure}")
    return lines


def describe(collector: Collector) -> list[str]:
    ports: dict[str, Any] = {"gRPC": collector.grpc_port, "HTTP": collector.http_port}
    if collector.ui_url is not None:
        ports["UI"] = collector.ui_url
    if collector.admin is not None:
        ports["admin"] = collector.admin.url
    return describe_config(collector.config, ports=ports)
