"""``tokentrace node-agent``: the per-node GPU sampler, span enricher and OTLP relay.

Every option has an environment variable (for a DaemonSet manifest) and a default; flags win.
The standard ``OTEL_EXPORTER_OTLP_*`` variables describe the upstream as for any OTLP exporter.

The receivers take the collector's receiver options: a bearer token (read from a file, a
Secret mount, and never printed) and TLS. A receiver on a non-loopback address without a token
is refused unless ``--allow-unauthenticated`` says so. ``--admin-endpoint`` serves ``/healthz``,
``/readyz`` and Prometheus ``/metrics`` (unauthenticated, off unless set). With several
collector replicas, ``--upstream-route`` (a list) or ``--upstream-route-dns`` (a headless Service)
sends every span of a trace to the same replica (``agent/node/routing.py``).
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
TOKEN_FILE_VARIABLE = "TOKENTRACE_NODE_AUTH_TOKEN_FILE"
TOKEN_VARIABLE = "TOKENTRACE_NODE_AUTH_TOKEN"
TLS_CERT_VARIABLE = "TOKENTRACE_NODE_TLS_CERT_FILE"
TLS_KEY_VARIABLE = "TOKENTRACE_NODE_TLS_KEY_FILE"
ALLOW_UNAUTHENTICATED_VARIABLE = "TOKENTRACE_NODE_ALLOW_UNAUTHENTICATED"
ADMIN_ENDPOINT_VARIABLE = "TOKENTRACE_NODE_ADMIN_ENDPOINT"
LOCAL_SOCKET_VARIABLE = "TOKENTRACE_NODE_LOCAL_SOCKET"
ROUTE_ENDPOINTS_VARIABLE = "TOKENTRACE_NODE_ROUTE_ENDPOINTS"
ROUTE_DNS_VARIABLE = "TOKENTRACE_NODE_ROUTE_DNS"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


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
            "--upstream-route",
            action="append",
            metavar="ENDPOINT",
            help="a collector replica (repeat, or separate by commas): each span goes to the one "
            "owning its trace id, with --upstream's options and scheme "
            f"({ROUTE_ENDPOINTS_VARIABLE}, comma-separated; default: --upstream alone)",
        )
        parser.add_argument(
            "--upstream-route-dns",
            metavar="HOST:PORT",
            help="a headless Service (or dns:///HOST:PORT) whose every address is a collector "
            "replica, re-resolved every 5 s; each span goes to the replica owning its trace id, "
            f"with --upstream's options and scheme ({ROUTE_DNS_VARIABLE}; default: --upstream "
            "alone)",
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
            "--auth-token-file",
            metavar="PATH",
            help="file holding the bearer token the receivers require, e.g. a Secret mount; "
            f"surrounding whitespace is ignored ({TOKEN_FILE_VARIABLE}; {TOKEN_VARIABLE} holds "
            "the token itself; default: no token, loopback only)",
        )
        parser.add_argument(
            "--tls-cert-file",
            metavar="PATH",
            help=f"PEM certificate the receivers serve TLS with ({TLS_CERT_VARIABLE}; needs "
            "--tls-key-file; default: plaintext)",
        )
        parser.add_argument(
            "--tls-key-file",
            metavar="PATH",
            help=f"PEM private key of --tls-cert-file ({TLS_KEY_VARIABLE})",
        )
        parser.add_argument(
            "--allow-unauthenticated",
            action="store_true",
            default=None,
            help="let a receiver listen on a non-loopback address without a token: anyone who "
            f"reaches it can relay spans to the collector ({ALLOW_UNAUTHENTICATED_VARIABLE}=true)",
        )
        parser.add_argument(
            "--local-socket",
            metavar="PATH",
            help="also take finished requests as plain data on this Unix socket from agents "
            f"with TOKENTRACE_NODE_SOCKET set, and build their spans here ({LOCAL_SOCKET_VARIABLE}"
            "; deploy/ uses /var/run/tokentrace/node.sock; default: off)",
        )
        parser.add_argument(
            "--admin-endpoint",
            metavar="HOST:PORT",
            help="serve /healthz, /readyz and Prometheus /metrics here, unauthenticated: bind it "
            f"where only the kubelet and the scraper reach it ({ADMIN_ENDPOINT_VARIABLE}; "
            "deploy/ uses $(POD_IP):13133; default: off)",
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
            from tokentrace.agent.node.routing import TraceRouter
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
            f"{type(r).__name__.removeprefix('Otlp').removesuffix('Receiver')} {r.listening}"
            for r in agent.receivers
        )
        security = ("TLS" if config.tls_cert_file else "plaintext") + (
            ", bearer token required" if config.auth_token else ", no token"
        )
        router = agent.trace_sender
        if isinstance(router, TraceRouter):
            upstream = f"routing by trace id to {router.endpoint} ({', '.join(router.endpoints)})"
        else:
            upstream = f"relaying to {config.exporter.endpoint_for('traces')}"
        print(
            f"tokentrace node-agent: receiving OTLP on {listening} ({security}); "
            + (
                f"sampling {len(gpus)} GPU(s) every {config.sample_interval_s:g} s"
                if agent.sampler.available
                else "no NVML on this node, relaying spans unchanged"
            )
            + f"; {upstream}"
            + (
                f"; /healthz, /readyz, /metrics on port {agent.admin_port}"
                if agent.admin_port is not None
                else ""
            ),
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
    tls_cert_file, tls_key_file = _tls_files(args, environ)
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
        auth_token=_auth_token(args, environ),
        tls_cert_file=tls_cert_file,
        tls_key_file=tls_key_file,
        allow_unauthenticated=_allow_unauthenticated(args, environ),
        admin_endpoint=_admin_endpoint(args, environ),
        local_socket=_setting(args.local_socket, environ, LOCAL_SOCKET_VARIABLE),
        **_routing(args, environ),
    )
    config.validate()
    return config


def _setting(flag: str | None, environ: Mapping[str, str], variable: str) -> str | None:
    """The flag, else the variable; None when neither is set (empty counts as unset)."""
    if flag is not None:
        return flag
    return environ.get(variable, "").strip() or None


def _auth_token(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The receivers' bearer token: from ``--auth-token-file`` / its variable, else from
    ``TOKENTRACE_NODE_AUTH_TOKEN``. Errors name the file, never its content."""
    path = _setting(args.auth_token_file, environ, TOKEN_FILE_VARIABLE)
    if path is None:
        return environ.get(TOKEN_VARIABLE, "").strip() or None
    if args.auth_token_file is None and environ.get(TOKEN_VARIABLE, "").strip():
        raise ValueError(f"{TOKEN_FILE_VARIABLE} and {TOKEN_VARIABLE}: set one, not both")
    try:
        with open(path, "rb") as file:
            raw = file.read(64 * 1024 + 1)
    except OSError as error:
        raise ValueError(
            f"auth token file {path}: cannot read it ({error.strerror or error})"
        ) from None
    if len(raw) > 64 * 1024:
        raise ValueError(f"auth token file {path}: larger than 64 KiB, not a token")
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"auth token file {path}: not ASCII text") from None
    if not token:
        raise ValueError(f"auth token file {path}: is empty")
    if not all("!" <= char <= "~" for char in token):
        raise ValueError(
            f"auth token file {path}: the token must be printable ASCII without spaces"
        )
    return token


def _tls_files(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[str | None, str | None]:
    """The receivers' TLS certificate and key files, checked now: both or neither, readable,
    and a certificate with its key. Errors name the files, never the key."""
    cert = _setting(args.tls_cert_file, environ, TLS_CERT_VARIABLE)
    key = _setting(args.tls_key_file, environ, TLS_KEY_VARIABLE)
    if cert is None and key is None:
        return None, None
    if cert is None or key is None:
        cert_option = f"--tls-cert-file ({TLS_CERT_VARIABLE})"
        key_option = f"--tls-key-file ({TLS_KEY_VARIABLE})"
        given, missing = (cert_option, key_option) if key is None else (key_option, cert_option)
        raise ValueError(f"{given} needs {missing} as well (TLS takes a certificate and its key)")
    for what, path in (("TLS certificate file", cert), ("TLS key file", key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as error:
            raise ValueError(f"{what} {path}: cannot read it ({error.strerror or error})") from None
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password callback, so that an encrypted key fails here instead of prompting.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, ValueError) as error:
        reason = getattr(error, "reason", None) or type(error).__name__
        raise ValueError(
            f"TLS files {cert} and {key}: not a PEM certificate and its unencrypted private key "
            f"({reason})"
        ) from None
    return cert, key


def _admin_endpoint(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """``--admin-endpoint``, else its variable; None (off) when unset, empty or ``off``."""
    endpoint = _setting(args.admin_endpoint, environ, ADMIN_ENDPOINT_VARIABLE)
    if endpoint is None or endpoint.strip().lower() in _OFF:
        return None
    return endpoint.strip()


def _routing(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """``upstream_endpoints`` / ``upstream_dns`` from the flags, else their variables."""
    flags = [e for value in args.upstream_route or () for e in value.split(",")]
    listed = flags if args.upstream_route else environ.get(ROUTE_ENDPOINTS_VARIABLE, "").split(",")
    endpoints = tuple(e.strip() for e in listed if e.strip())
    dns = _setting(args.upstream_route_dns, environ, ROUTE_DNS_VARIABLE)
    dns = dns.strip() if dns is not None and dns.strip() else None
    if endpoints and dns is not None:
        raise ValueError(
            f"--upstream-route ({ROUTE_ENDPOINTS_VARIABLE}) and --upstream-route-dns "
            f"({ROUTE_DNS_VARIABLE}): give one or the other, not both"
        )
    if args.upstream_route and not endpoints:
        raise ValueError("--upstream-route: no endpoint given")
    return {"upstream_endpoints": endpoints, "upstream_dns": dns}


def _allow_unauthenticated(args: argparse.Namespace, environ: Mapping[str, str]) -> bool:
    if args.allow_unauthenticated:
        return True
    raw = environ.get(ALLOW_UNAUTHENTICATED_VARIABLE, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{ALLOW_UNAUTHENTICATED_VARIABLE}: {raw!r} is not true or false")
