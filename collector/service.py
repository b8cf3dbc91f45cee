"""The collector service: builds the components from a config and runs them.

Start order is downstream first (store and exporters, then the pipeline worker, then the
receivers), shutdown is upstream first (receivers stop taking data, the pipeline finishes every
pending trace, the exporters flush), so nothing accepted is lost on a clean stop.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

from tokentrace.collector.config import (
    CollectorConfig,
    ConfigError,
    ReceiverConfig,
    load_config,
)
from tokentrace.collector.pipeline import Pipeline, TraceSink

_log = logging.getLogger(__name__)

_DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
# Each request allocates a few hundred short-lived containers; with CPython's default gen-0
# threshold (700) the collector spent ~15% of its time in the cyclic GC scanning live traces.
_GC_THRESHOLDS = (50_000, 20, 20)


def tune_gc_for_throughput() -> None:
    """Fewer cyclic-GC passes for a long-running collector process (not for library use)."""
    gc.freeze()  # what start-up allocated lives for the whole process: never scan it again
    gc.set_threshold(*_GC_THRESHOLDS)


class Collector:
    """Every component of one collector, started downstream first, stopped upstream first."""

    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        self.sinks: list[TraceSink] = []
        self.pipeline: Pipeline | None = None
        self.receivers: list[Any] = []
        self.ui: Any = None
        """The ``ui`` extension's ApiServer when configured (``ui_url``)."""

    @property
    def grpc_port(self) -> int | None:
        return self._receiver_port("OtlpGrpcReceiver")

    @property
    def http_port(self) -> int | None:
        return self._receiver_port("OtlpHttpReceiver")

    @property
    def ui_url(self) -> str | None:
        return None if self.ui is None else str(self.ui.url)

    def _receiver_port(self, kind: str) -> int | None:
        for receiver in self.receivers:
            if type(receiver).__name__ == kind:
                port: int = receiver.port
                return port
        return None

    def start(self) -> None:
        from tokentrace.collector.exporters.store_sink import StoreSink
        from tokentrace.collector.exporters.upstream_sink import UpstreamSink

        config = self.config
        try:
            store_sink: StoreSink | None = None
            if config.store is not None:
                store_sink = StoreSink(
                    config.store, slo_targets=config.slo_targets, diagnosis=config.diagnosis
                )
                self.sinks.append(store_sink)
            for upstream in config.upstream:
                self.sinks.append(UpstreamSink(upstream))
            # Late spans join their request through the spans the store holds for its trace.
            self.pipeline = Pipeline(
                config,
                sinks=self.sinks,
                earlier_spans=None if store_sink is None else store_sink.stored_spans,
            )
            self.pipeline.start()
            self._start_ui()
            self._start_receivers(self.pipeline)
        except Exception:
            self.shutdown(timeout_s=1.0)
            raise

    def _start_ui(self) -> None:
        """The drill-down API + web UI over the store the store sink has just opened."""
        ui, store = self.config.ui, self.config.store
        if ui is None or store is None:
            return
        from tokentrace.collector.api import ApiSettings, create_app
        from tokentrace.collector.api.server import ApiServer

        app = create_app(
            ApiSettings(store_path=store.path, auth_token=ui.auth_token, trace_link=ui.trace_link)
        )
        server = ApiServer(
            app,
            endpoint=ui.endpoint,
            tls_cert_file=ui.tls_cert_file,
            tls_key_file=ui.tls_key_file,
        )
        server.start()
        self.ui = server

    def _start_receivers(self, pipeline: Pipeline) -> None:
        from tokentrace.collector.receivers.otlp_grpc import OtlpGrpcReceiver
        from tokentrace.collector.receivers.otlp_http import OtlpHttpReceiver

        config = self.config
        receivers: list[OtlpGrpcReceiver | OtlpHttpReceiver] = []
        if config.grpc is not None:
            receivers.append(
                OtlpGrpcReceiver(
                    pipeline,
                    max_recv_msg_size=config.grpc.max_message_size,
                    **_receiver_options(config.grpc),
                )
            )
        if config.http is not None:
            receivers.append(
                OtlpHttpReceiver(
                    pipeline,
                    max_request_body_size=config.http.max_message_size,
                    **_receiver_options(config.http),
                )
            )
        for receiver in receivers:
            receiver.start()
            self.receivers.append(receiver)
            pipeline.add_stats_source(type(receiver).__name__, receiver.stats)

    def flush(self) -> None:
        """Finish and export every pending trace now (tests, the demo, shutdown)."""
        if self.pipeline is not None:
            self.pipeline.process_once(flush_all=True)
            self.pipeline.housekeeping()

    def shutdown(self, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        if self.pipeline is not None:
            self.pipeline.stop_accepting()
        for receiver in reversed(self.receivers):
            try:
                receiver.shutdown()
            except Exception:
                _log.exception("stopping %s failed", type(receiver).__name__)
        self.receivers.clear()
        if self.ui is not None:
            try:
                self.ui.shutdown()
            except Exception:
                _log.exception("stopping the ui extension failed")
            self.ui = None
        if self.pipeline is not None:
            self.pipeline.shutdown(timeout_s)
            self.pipeline = None
        else:
            for sink in self.sinks:
                sink.shutdown(timeout_s)
        self.sinks.clear()

    def stats(self) -> dict[str, Any]:
        return self.pipeline.stats_snapshot() if self.pipeline else {}


def _receiver_options(config: ReceiverConfig) -> dict[str, Any]:
    return {
        "endpoint": config.endpoint,
        "auth_token": config.auth_token,
        "tls_cert_file": config.tls_cert_file,
        "tls_key_file": config.tls_key_file,
    }


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


def describe_config(
    config: CollectorConfig, *, ports: Mapping[str, Any] | None = None
) -> list[str]:
    """What a configuration runs: before anything binds, or with the ports it bound."""
    lines = []
    for protocol, receiver in (("gRPC", config.grpc), ("HTTP", config.http)):
        if receiver is None:
            continue
        host, _, port = receiver.endpoint.rpartition(":")
        bound = (ports or {}).get(protocol)
        address = f"{host}:{bound if bound is not None else port}"
        if protocol == "HTTP":
            address = f"http://{address}/v1/traces"
        auth = ", bearer token required" if receiver.auth_token else ""
        tls = ", TLS" if receiver.tls_cert_file else ""
        verb = "listening on" if ports else "on"
        lines.append(f"OTLP/{protocol} receiver {verb} {address}{tls}{auth}")
    lines.append(f"processors: {', '.join(config.processors)}")
    if config.slo_targets:
        lines.append(f"SLO targets: {', '.join(target.name for target in config.slo_targets)}")
    if config.store is not None:
        lines.append(f"request store: {os.path.abspath(config.store.path)}")
    for upstream in config.upstream:
        exporter = upstream.exporter
        target = exporter.endpoint_for("traces") or exporter.endpoint
        protocol = exporter.protocol
        lines.append(f"{upstream.name}: enriched spans and metrics to {target} ({protocol})")
    if not config.upstream:
        lines.append("no upstream export (set OTEL_EXPORTER_OTLP_ENDPOINT or an otlp exporter)")
    if config.ui is not None:
        ui = config.ui
        address = (ports or {}).get(
            "UI"
        ) or f"{'https' if ui.tls_cert_file else 'http'}://{ui.endpoint}"
        auth = ", bearer token required" if ui.auth_token else ""
        lines.append(f"web UI and API {'at' if ports else 'on'} {address}/{auth}")
    return lines


def describe(collector: Collector) -> list[str]:
    ports: dict[str, Any] = {"gRPC": collector.grpc_port, "HTTP": collector.http_port}
    if collector.ui_url is not None:
        ports["UI"] = collector.ui_url
    return describe_config(collector.config, ports=ports)
