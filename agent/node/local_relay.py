"""The node agent's end of the agent's local socket (``agent/local_relay.py``): batches of
finished requests as plain data in, their spans out to the node agent's relay.

One thread per connection (a node has one connection per instrumented server process, each
sending a batch every 200 ms or so), capped at ``max_connections``: beyond it a connection is
closed at once and that process exports OTLP itself. Each connection's hello fixes its resource
and scope, encoded once; each batch is converted (``recorder.to_finished_request`` with the
sender's clock offset), planned and encoded as the agent would (``SpanBatchEncoder``), and the
resulting ``ExportTraceServiceRequest`` goes to ``consume`` (``NodeAgent.consume_traces``), so
GPU enrichment and routing apply as to OTLP received. A batch is answered once ``consume`` took
it (``ACK_TAKEN``), could not (``ACK_BUSY``: the hold queue is full or the node agent is
stopping; the agent counts it as dropped) or could not be read (``ACK_REJECTED``).

The socket file is made readable and writable by everyone (0666), as pods run as any user:
who can reach it is who can mount its directory (a ``hostPath`` volume, which a cluster's pod
security admission restricts). It accepts what the OTLP receivers accept: spans, relayed under
the node agent's credentials.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import threading
from collections.abc import Callable
from typing import Any, Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.agent.local_relay import (
    ACK_BUSY,
    ACK_REJECTED,
    ACK_TAKEN,
    read_batch,
    read_frame,
    read_hello,
)
from tokentrace.agent.otlp_export import RateLimitedWarning
from tokentrace.agent.recorder import to_finished_request
from tokentrace.agent.span_encoding import SpanBatchEncoder
from tokentrace.collector.consumer import Overloaded, Unavailable

_log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS: Final = 256
_SOCKET_MODE: Final = 0o666
_MAX_SOCKET_PATH: Final = 107
"""``sun_path`` holds 108 bytes with its terminating NUL."""
_BACKLOG: Final = 128
_WARNING_INTERVAL_S: Final = 60.0

Consume = Callable[..., None]
"""``NodeAgent.consume_traces(request, encoded=bytes)``: raises ``Overloaded`` / ``Unavailable``."""


def validate_socket_path(path: str) -> None:
    """ValueError unless ``path`` can name a Unix socket."""
    if not os.path.isabs(path):
        raise ValueError(f"local_socket: {path!r} is not an absolute path")
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise ValueError(f"local_socket: {path!r} is longer than {_MAX_SOCKET_PATH} bytes")


class _FrameOffset:
    """The sending process's Unix-minus-monotonic offset for one batch: the clock
    ``to_finished_request`` converts its timers with."""

    __slots__ = ("_offset_ns",)

    def __init__(self, offset_ns: int) -> None:
        self._offset_ns = offset_ns

    def offset_ns(self) -> int:
        return self._offset_ns


class LocalSocketReceiver:
    """The node agent's Unix socket for its agents' finished requests (module docstring): a
    receiver beside the OTLP ones, started and stopped with them."""

    def __init__(
        self, path: str, consume: Consume, *, max_connections: int = DEFAULT_MAX_CONNECTIONS
    ) -> None:
        validate_socket_path(path)
        self.path = path
        self._consume = consume
        self._max_connections = max_connections
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._stopping = False
        self.accepted_connections = 0
        self.refused_connections = 0
        """Connections closed at once: ``max_connections`` were open."""
        self.taken_requests = 0
        """Finished requests and span jobs of the batches taken."""
        self.busy_requests = 0
        """Requests answered ``ACK_BUSY`` (the agent drops and counts them)."""
        self.rejected_frames = 0
        """Frames that could not be read (malformed hello or batch); the agent counts them."""
        self.skipped_requests = 0
        """Requests of taken batches the encoder left out (malformed values)."""
        self.accepted_spans = 0
        """Spans of taken batches (the OTLP receivers' counter of the same name)."""
        self._warning = RateLimitedWarning(interval_s=_WARNING_INTERVAL_S, log=_log)

    @property
    def listening(self) -> str:
        """Where it listens, for people (the receivers' property of the same name)."""
        return self.path

    def start(self) -> None:
        """Bind and listen (OSError when the path is taken by a live listener or cannot be
        made), then accept on a thread."""
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        self._remove_stale_socket()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            os.chmod(self.path, _SOCKET_MODE)
            listener.listen(_BACKLOG)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        thread = threading.Thread(
            target=self._accept_loop, name="tokentrace-node-local", daemon=True
        )
        thread.start()
        self._accept_thread = thread

    def _remove_stale_socket(self) -> None:
        """A socket file left by a node agent that is gone is removed; one that still answers
        is another node agent's (OSError)."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise OSError(f"{self.path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.path)
        except OSError:
            os.unlink(self.path)  # nobody listens: stale
            return
        finally:
            probe.close()
        raise OSError(f"{self.path}: another process listens on it")

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed by shutdown
                return
            with self._lock:
                if self._stopping or len(self._connections) >= self._max_connections:
                    self.refused_connections += 1
                    connection.close()
                    continue
                thread = threading.Thread(
                    target=self._serve,
                    args=(connection,),
                    name="tokentrace-node-local-conn",
                    daemon=True,
                )
                self._connections[connection] = thread
                self.accepted_connections += 1
            thread.start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            encoder = self._read_hello(connection)
            if encoder is not None:
                while (message := read_frame(connection)) is not None:
                    connection.sendall(self._take(message, encoder))
        except ValueError as error:  # not the protocol: this connection cannot go on
            self._count(rejected_frames=1)
            self._warning.warn("tokentrace node agent: a local connection was refused: %s", error)
        except OSError as error:
            if not self._stopping:
                self._warning.warn("tokentrace node agent: a local connection failed: %s", error)
        finally:
            with self._lock:
                self._connections.pop(connection, None)
            connection.close()

    def _read_hello(self, connection: socket.socket) -> SpanBatchEncoder | None:
        message = read_frame(connection)
        if message is None:
            return None
        hello = read_hello(message)
        try:
            return SpanBatchEncoder(
                resource_attributes=hello.resource,
                scope_name=hello.scope_name,
                scope_version=hello.scope_version,
                max_token_offsets=hello.max_token_offsets,
            )
        except (TypeError, ValueError) as error:  # a resource OTLP cannot carry
            raise ValueError(f"hello refused: {error}") from None

    def _take(self, message: Any, encoder: SpanBatchEncoder) -> bytes:
        """One batch: its spans to ``consume``; the answer for the agent."""
        try:
            offset_ns, timers, jobs = read_batch(message)
            offset = _FrameOffset(offset_ns)
            finished = [to_finished_request(timer, offset) for timer in timers]
        except (TypeError, ValueError, OverflowError) as error:
            self._count(rejected_frames=1)
            self._warning.warn("tokentrace node agent: a local batch was refused: %r", error)
            return ACK_REJECTED
        requests = len(timers) + len(jobs)
        skipped_before = encoder.skipped  # the connection's own encoder: this thread's alone
        payload, spans = encoder.encode(finished, jobs)
        skipped = encoder.skipped - skipped_before
        if spans:
            try:
                self._consume(ExportTraceServiceRequest.FromString(payload), encoded=payload)
            except (Overloaded, Unavailable):
                self._count(busy_requests=requests, skipped_requests=skipped)
                return ACK_BUSY
        self._count(taken_requests=requests, skipped_requests=skipped, accepted_spans=spans)
        return ACK_TAKEN

    def _count(self, **increments: int) -> None:
        """Add to counters that every connection's thread writes."""
        with self._lock:
            for name, increment in increments.items():
                setattr(self, name, getattr(self, name) + increment)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Stop accepting, close every connection (their agents export OTLP from then on) and
        remove the socket file."""
        with self._lock:
            self._stopping = True
            connections = dict(self._connections)
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):  # wakes the blocked accept (close does not)
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        for thread in [self._accept_thread, *connections.values()]:
            if thread is not None:
                thread.join(timeout_s)

    def stats(self) -> dict[str, int]:
        with self._lock:
            open_connections = len(self._connections)
        return {
            "connections": open_connections,
            "accepted_connections": self.accepted_connections,
            "refused_connections": self.refused_connections,
            "taken_requests": self.taken_requests,
            "busy_requests": self.busy_requests,
            "rejected_frames": self.rejected_frames,
            "skipped_requests": self.skipped_requests,
            "accepted_spans": self.accepted_spans,
        }
