"""``tokentrace node-agent``: the per-node GPU sampler, span enricher and OTLP relay.

Every option has an environment variable (for a DaemonSet manifest) and a default; flags win.
The standard ``OTEL_EXPORTER_OTLP_*`` variables describe the upstream as for any OTLP exporter.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

_OFF = ("", "off", "none")
_ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_ENDPOINT"
_TRACES_ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
_METRICS_ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"


class NodeAgentCommand:
    name = "node-agent"
    help = "run the node agent: sample GPUs (NVML), add them to the node's spans, relay OTLP"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        env = os.environ.get
        parser.add_argument(
            "--grpc-endpoint",
            default=env("TOKENTRACE_NODE_GRPC_ENDPOINT", "127.0.0.1:4317"),
            metavar="HOST:PORT",
            help="OTLP/gRPC receiver, 'off' to disable (TOKENTRACE_NODE_GRPC_ENDPOINT; "
            "default 127.0.0.1:4317)",
        )
        parser.add_argument(
            "--http-endpoint",
            default=env("TOKENTRACE_NODE_HTTP_ENDPOINT", "127.0.0.1:4318"),
            metavar="HOST:PORT",
            help="OTLP/HTTP receiver, 'off' to disable (TOKENTRACE_NODE_HTTP_ENDPOINT; "
            "default 127.0.0.1:4318)",
        )
        parser.add_argument(
            "--upstream",
            metavar="URL",
            help="where enriched spans go: the collector (OTEL_EXPORTER_OTLP_ENDPOINT; default "
            "http://tokentrace-collector:4317, the Service in deploy/)",
        )
        parser.add_argument(
            "--metrics-endpoint",
            metavar="URL",
            help="OTLP endpoint for GPU metrics (OTEL_EXPORTER_OTLP_METRICS_ENDPOINT; default: "
            "not exported)",
        )
        parser.add_argument(
            "--protocol",
            choices=("grpc", "http/protobuf"),
            help="OTLP protocol upstream (OTEL_EXPORTER_OTLP_PROTOCOL; default grpc)",
        )
        parser.add_argument(
            "--sample-interval",
            type=float,
            metavar="SECONDS",
            help="GPU sampling interval (TOKENTRACE_NODE_SAMPLE_INTERVAL; default 0.1)",
        )
        parser.add_argument(
            "--metrics-interval",
            type=float,
            metavar="SECONDS",
            help="GPU metrics export interval (TOKENTRACE_NODE_METRICS_INTERVAL; default 10)",
        )
        parser.add_argument(
            "--max-hold",
            type=float,
            metavar="SECONDS",
            help="longest a span waits for the samples of its window (TOKENTRACE_NODE_MAX_HOLD;"
            " default 1)",
        )
        parser.add_argument(
            "--stats-interval",
            type=float,
            default=60.0,
            metavar="SECONDS",
            help="print counters this often, 0 never (default 60)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from tokentrace.collector.receivers import ReceiverStartError

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        try:
            config = config_from_args(args, os.environ)
            from tokentrace.agent.node.service import NodeAgent

            agent = NodeAgent(config)
        except ValueError as error:
            print(f"tokentrace node-agent: configuration error: {error}", file=sys.stderr)
            return 2
        try:
            agent.start()
        except ReceiverStartError as error:
            print(f"tokentrace node-agent: cannot start: {error}", file=sys.stderr)
            return 1
        gpus = agent.sampler.devices
        listening = ", ".join(
            f"{type(r).__name__.removeprefix('Otlp').removesuffix('Receiver')} "
            f"{r.endpoint.rpartition(':')[0]}:{r.port}"
            for r in agent.receivers
        )
        print(
            f"tokentrace node-agent: receiving OTLP on {listening}; "
            + (
                f"sampling {len(gpus)} GPU(s) every {config.sample_interval_s:g} s"
                if agent.sampler.available
                else "no NVML on this node, relaying spans unchanged"
            )
            + f"; relaying to {config.exporter.endpoint_for('traces')}",
            flush=True,
        )
        stop = threading.Event()

        def request_stop(signum: int, frame: Any) -> None:
            stop.set()

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)
        interval = args.stats_interval if args.stats_interval > 0 else None
        while not stop.wait(interval):
            stats = agent.stats()
            print(
                "tokentrace node-agent: "
                + " ".join(f"{key}={value}" for key, value in stats.items() if value),
                flush=True,
            )
        print("tokentrace node-agent: shutting down (relaying held spans)", flush=True)
        agent.shutdown()
        return 0


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """The ``NodeAgentConfig`` of flags over environment over defaults; ValueError if invalid."""
    from tokentrace.agent.node.service import DEFAULT_UPSTREAM, NodeAgentConfig
    from tokentrace.agent.otlp_config import PROTOCOL_GRPC, OtlpExporterConfig, options_from_env

    # The default upstream stands in for an unset endpoint variable, so that the other
    # OTEL_EXPORTER_OTLP_* variables (headers, timeout, compression) still apply.
    variables = dict(environ)
    if not (variables.get(_ENDPOINT_VARIABLE) or variables.get(_TRACES_ENDPOINT_VARIABLE)):
        variables[_ENDPOINT_VARIABLE] = DEFAULT_UPSTREAM
    traces = options_from_env(variables, signal="traces") or {}
    traces.pop("metrics_endpoint", None)
    if args.upstream:
        traces["endpoint"], traces["traces_endpoint"] = args.upstream, ""
    protocol = args.protocol or traces.get("protocol") or PROTOCOL_GRPC
    traces["protocol"] = protocol
    # GPU metrics only to a metrics endpoint of their own (the collector takes traces only),
    # with the same headers, timeout and compression variables as any OTLP exporter.
    if args.metrics_endpoint:
        variables[_METRICS_ENDPOINT_VARIABLE] = args.metrics_endpoint
    metrics = None
    if variables.get(_METRICS_ENDPOINT_VARIABLE):
        options = options_from_env(variables, signal="metrics") or {}
        options.update(endpoint="", traces_endpoint="")
        options["protocol"] = args.protocol or options.get("protocol") or protocol
        metrics = OtlpExporterConfig(**options)

    def number(flag: float | None, variable: str, default: float) -> float:
        if flag is not None:
            return flag
        raw = environ.get(variable, "").strip()
        try:
            return float(raw) if raw else default
        except ValueError:
            raise ValueError(f"{variable}: {environ.get(variable)!r} is not a number") from None

    defaults = NodeAgentConfig()
    config = NodeAgentConfig(
        grpc_endpoint=None if args.grpc_endpoint.strip().lower() in _OFF else args.grpc_endpoint,
        http_endpoint=None if args.http_endpoint.strip().lower() in _OFF else args.http_endpoint,
        exporter=OtlpExporterConfig(**traces),
        metrics_exporter=metrics,
        sample_interval_s=number(
            args.sample_interval, "TOKENTRACE_NODE_SAMPLE_INTERVAL", defaults.sample_interval_s
        ),
        metrics_interval_s=number(
            args.metrics_interval, "TOKENTRACE_NODE_METRICS_INTERVAL", defaults.metrics_interval_s
        ),
        max_hold_s=number(args.max_hold, "TOKENTRACE_NODE_MAX_HOLD", defaults.max_hold_s),
        auth_token=environ.get("TOKENTRACE_NODE_AUTH_TOKEN") or None,
    )
    config.validate()
    return config
