"""The admin HTTP listener of the collector and the node agent: ``/healthz``, ``/readyz``,
``/metrics`` on one port (13133 in ``deploy/``).

- ``/healthz``: 200 ``ok`` while the process serves (the listener's own thread answers, so a
  wedged pipeline still looks alive: liveness is about the process, readiness about the data).
- ``/readyz``: 200 when every readiness check passes, else 503; both with a JSON body naming each
  check, its outcome and, for a failed one, one short reason
  (``{"ready": false, "checks": {"store": {"ok": false, "detail": "..."}}}``).
- ``/metrics``: whatever the owner's ``metrics`` callable renders (the Prometheus text format,
  from a ``prometheus-client`` registry of the owner's own).

Unauthenticated by design: operators scrape it from inside the cluster, and a NetworkPolicy
limits who reaches the port. Standard library only (``http.server``, one thread per request,
bounded by the socket timeout), so the node agent can serve it without the collector's web stack
and the in-process agent never loads any of it. The owner parses its endpoint and hands the
host and port in (port 0: any free port, read back from ``port``).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

_log = logging.getLogger(__name__)

DEFAULT_ADMIN_PORT: Final = 13133
"""The admin listener's port in ``deploy/`` (the OpenTelemetry Collector's health-check port)."""
PATH_HEALTH: Final = "/healthz"
PATH_READY: Final = "/readyz"
PATH_METRICS: Final = "/metrics"
_REQUEST_TIMEOUT_S: Final = 10.0
"""A client that sends nothing for this long is dropped (its thread with it)."""
_JSON: Final = "application/json"
_TEXT: Final = "text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class ReadinessCheck:
    """One readiness condition at one instant: ``detail`` says why it failed (or what it saw)."""

    name: str
    ok: bool
    detail: str = ""


Readiness = Callable[[], Sequence[ReadinessCheck]]
MetricsRenderer = Callable[[], tuple[bytes, str]]
"""The ``/metrics`` body and its content type."""


def readiness_body(checks: Sequence[ReadinessCheck]) -> tuple[bool, bytes]:
    """Whether every check passed, and the JSON ``/readyz`` answers with."""
    ready = all(check.ok for check in checks)
    body = {
        "ready": ready,
        "checks": {
            check.name: {"ok": check.ok, **({"detail": check.detail} if check.detail else {})}
            for check in checks
        },
    }
    return ready, (json.dumps(body, sort_keys=True) + "\n").encode()


class AdminHttpServer:
    """``/healthz``, ``/readyz`` and ``/metrics`` on ``host:port`` (module docstring)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        readiness: Readiness,
        metrics: MetricsRenderer,
    ) -> None:
        self._host = host
        self._requested_port = port
        self._readiness = readiness
        self._metrics = metrics
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("admin listener not started")
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Bind and serve on a thread of its own; OSError when the address cannot be bound."""
        handler = _handler(self._readiness, self._metrics)
        server_class: Any = _IPv6Server if ":" in self._host else _IPv4Server
        server: ThreadingHTTPServer = server_class((self._host, self._requested_port), handler)
        self._server = server
        self._port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="tokentrace-admin-http",
            daemon=True,
        )
        self._thread.start()

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Stop serving and close the socket. Idempotent."""
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout_s)


class _IPv4Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _IPv6Server(_IPv4Server):
    address_family = socket.AF_INET6


def _handler(readiness: Readiness, metrics: MetricsRenderer) -> type[BaseHTTPRequestHandler]:
    class AdminHandler(BaseHTTPRequestHandler):
        timeout = _REQUEST_TIMEOUT_S
        server_version = "tokentrace-admin"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == PATH_HEALTH:
                self._answer(200, b"ok\n", _TEXT)
            elif path == PATH_READY:
                self._ready()
            elif path == PATH_METRICS:
                self._render_metrics()
            else:
                self._answer(404, b"not found: try /healthz, /readyz or /metrics\n", _TEXT)

        def do_HEAD(self) -> None:
            self.do_GET()

        def _ready(self) -> None:
            try:
                checks = list(readiness())
            except Exception as error:  # a broken check is a not-ready answer, never a crash
                _log.warning("admin: a readiness check failed to run", exc_info=True)
                checks = [ReadinessCheck("readiness", False, f"the checks failed: {error!r}")]
            ready, body = readiness_body(checks)
            self._answer(200 if ready else 503, body, _JSON)

        def _render_metrics(self) -> None:
            try:
                body, content_type = metrics()
            except Exception:
                _log.exception("admin: rendering /metrics failed")
                self._answer(500, b"rendering the metrics failed (see the log)\n", _TEXT)
                return
            self._answer(200, body, content_type)

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            # A probe every few seconds would flood the log; keep it at debug.
            _log.debug("admin %s: " + format, self.address_string(), *args)

    return AdminHandler
