"""Serving the API + UI app over HTTP on a thread: inside the collector or for `tokentrace ui`.

The socket is bound before the server thread starts, so the port (``:0`` gives a free one) is
known at once, a taken port fails in the caller with a clear error, and nothing races.
uvicorn on a thread other than the main one leaves SIGINT/SIGTERM to the host process.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Any, Final

from tokentrace.collector.receivers import join_endpoint, split_endpoint

_log = logging.getLogger(__name__)

_DEFAULT_START_TIMEOUT_S: Final = 10.0
_DEFAULT_STOP_TIMEOUT_S: Final = 5.0
_LISTEN_BACKLOG: Final = 128
_START_POLL_S: Final = 0.005


class ApiServerStartError(RuntimeError):
    """The API server could not bind or start; the message says why."""


class ApiServer:
    """One uvicorn server for one ASGI app on a pre-bound socket, on a daemon thread."""

    def __init__(
        self,
        app: Any,
        *,
        endpoint: str,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        self._app = app
        self._host, self._requested_port = split_endpoint(endpoint)
        self._tls = (tls_cert_file, tls_key_file) if tls_cert_file and tls_key_file else None
        self._socket: socket.socket | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self._tls else "http"
        return f"{scheme}://{join_endpoint(self._host, self.port or 0)}"

    def start(self, *, timeout_s: float = _DEFAULT_START_TIMEOUT_S) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._requested_port))
            sock.listen(_LISTEN_BACKLOG)
        except OSError as error:
            sock.close()
            raise ApiServerStartError(
                f"cannot listen on {self._host}:{self._requested_port}: {error.strerror or error}"
            ) from None
        self._socket = sock
        self.port = int(sock.getsockname()[1])
        options: dict[str, Any] = {}
        if self._tls is not None:
            cert, key = self._tls
            try:  # fail here, in the caller, rather than in the server thread
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
            except (OSError, ssl.SSLError) as error:
                self._close_socket()
                raise ApiServerStartError(f"cannot load TLS certificate/key: {error}") from None
            options = {"ssl_certfile": cert, "ssl_keyfile": key}
        config = uvicorn.Config(
            self._app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            server_header=False,
            **options,
        )
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="tokentrace-api", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.shutdown()
                raise ApiServerStartError(f"the API server did not start within {timeout_s:g} s")
            time.sleep(_START_POLL_S)

    def shutdown(self, *, timeout_s: float = _DEFAULT_STOP_TIMEOUT_S) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                _log.warning("the API server did not stop within %.1f s", timeout_s)
            self._thread = None
        self._server = None
        self._close_socket()

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
