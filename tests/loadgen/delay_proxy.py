"""A delaying TCP proxy on loopback: inject a known network delay without root or netns.

``DelayProxy`` listens on ``127.0.0.1:<port 0>`` and forwards every accepted connection to an
upstream ``(host, port)``, holding every byte for ``one_way_delay_s`` in each direction - like
``netem delay`` on both ends of a link, so a request/response round trip gains ``2 x delay``.

Timing model (what tests of the ``network`` latency segment rely on):

- A chunk read at loop time ``t`` is written at ``t + delay``: each chunk carries its own
  deadline, so back-to-back messages are not delayed by ``delay`` after the previous chunk's
  write (no accumulation). Ordering within a direction is preserved; throughput is not limited.
- EOF (a half-close) is forwarded ``delay`` after it was read, like the data before it.
- Connection setup is NOT delayed: the upstream connection is opened as soon as a client is
  accepted (the client's TCP handshake with the proxy completes at once anyway). The delay
  applies to data, which is what client-minus-server request timing measures.
- A read error (e.g. a reset) is queued behind the data read before it and, once those are
  written, aborts both sides without further delay; a write error aborts both sides at once.

Memory is bounded: each direction queues at most ``max_queued_chunks`` chunks of at most
``chunk_size`` bytes; when a queue is full its reader waits (TCP backpressure towards the
sender) and ``stats()["backpressure_waits"]`` counts it.

Usage::

    with DelayProxy(("127.0.0.1", server_port), one_way_delay_s=0.05) as proxy:
        client = httpx.Client(base_url=proxy.url)
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from types import TracebackType

_DEFAULT_MAX_QUEUED_CHUNKS = 1024
_DEFAULT_CHUNK_SIZE = 64 * 1024
_DEFAULT_START_TIMEOUT_S = 5.0
_DEFAULT_STOP_TIMEOUT_S = 5.0
_CLOSE_GRACE_S = 0.5
"""How long ``stop()`` lets closed transports flush before aborting them."""
_LISTEN_HOST = "127.0.0.1"

_log = logging.getLogger(__name__)

_QueuedChunk = tuple[float, bytes | Exception | None]
"""``(loop time read, chunk)``; ``None`` is EOF, an exception is a read error."""


class _Counters:
    """Written only on the proxy's loop thread; read (copied) from any thread."""

    __slots__ = (
        "backpressure_waits",
        "bytes_down",
        "bytes_up",
        "connections",
        "open_connections",
        "upstream_connect_failures",
    )

    def __init__(self) -> None:
        self.connections = 0
        self.open_connections = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.upstream_connect_failures = 0
        self.backpressure_waits = 0

    def snapshot(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class DelayProxy:
    """Forwards TCP from ``127.0.0.1:<port>`` to ``upstream``, delaying each direction.

    Every byte is held ``one_way_delay_s`` in each direction (see the module docstring for the
    exact timing model). Runs its own asyncio loop on a daemon thread between ``start()`` and
    ``stop()``; all public methods are safe to call from any other thread.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        one_way_delay_s: float,
        max_queued_chunks: int = _DEFAULT_MAX_QUEUED_CHUNKS,
        chunk_size: int = _DEFAULT_CHUNK_SIZE,
    ) -> None:
        if one_way_delay_s < 0:
            raise ValueError(f"one_way_delay_s must be >= 0, got {one_way_delay_s}")
        if max_queued_chunks < 1 or chunk_size < 1:
            raise ValueError("max_queued_chunks and chunk_size must be >= 1")
        self._upstream_host, self._upstream_port = upstream
        self._delay_s = one_way_delay_s
        self._max_queued_chunks = max_queued_chunks
        self._chunk_size = chunk_size
        self._counters = _Counters()
        self._lifecycle_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._stopped = False
        # Loop-thread state: the task and both stream writers of every open connection.
        self._connections: dict[asyncio.Task[None], list[asyncio.StreamWriter]] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Binds ``127.0.0.1`` port 0 on the proxy's own thread; returns once listening."""
        with self._lifecycle_lock:
            if self._loop is not None or self._stopped:
                raise RuntimeError("DelayProxy.start() may be called only once")
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=loop.run_forever, name=f"delay-proxy-{id(self):x}", daemon=True
            )
            thread.start()
            self._loop, self._thread = loop, thread
            try:
                server = asyncio.run_coroutine_threadsafe(self._listen(), loop).result(
                    timeout=_DEFAULT_START_TIMEOUT_S
                )
            except BaseException:
                self._shut_down_loop()
                raise
            self._server = server
            self._port = server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Closes the listener and every open connection, then joins the thread. Idempotent."""
        with self._lifecycle_lock:
            if self._stopped:
                return
            self._stopped = True
            if self._loop is None:
                return
            try:
                asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(
                    timeout=_DEFAULT_STOP_TIMEOUT_S
                )
            except Exception:  # a stuck close must not keep the thread alive
                _log.warning("delay proxy: closing connections failed", exc_info=True)
            self._shut_down_loop()

    def __enter__(self) -> DelayProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- observation -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("DelayProxy is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{_LISTEN_HOST}:{self.port}"

    @property
    def one_way_delay_s(self) -> float:
        return self._delay_s

    def stats(self) -> dict[str, int]:
        """``connections`` (accepted), ``bytes_up`` / ``bytes_down`` (forwarded to upstream /
        to clients), ``open_connections``, ``upstream_connect_failures``,
        ``backpressure_waits``."""
        return self._counters.snapshot()

    # -- loop thread -------------------------------------------------------------------------

    def _shut_down_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=_DEFAULT_STOP_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._on_client, _LISTEN_HOST, 0, limit=self._chunk_size)

    def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback (not a coroutine) so that the proxy owns, and can cancel, the task.
        writers = [writer]
        task = asyncio.get_running_loop().create_task(self._serve_connection(reader, writers))
        self._connections[task] = writers
        task.add_done_callback(self._forget_connection)

    def _forget_connection(self, task: asyncio.Task[None]) -> None:
        self._connections.pop(task, None)

    async def _serve_connection(
        self, client_reader: asyncio.StreamReader, writers: list[asyncio.StreamWriter]
    ) -> None:
        """Pipes one client connection both ways; ``writers`` starts as ``[client_writer]``."""
        counters = self._counters
        counters.connections += 1
        counters.open_connections += 1
        client_writer = writers[0]
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(
                    self._upstream_host, self._upstream_port, limit=self._chunk_size
                )
            except OSError:
                counters.upstream_connect_failures += 1
                _log.debug("delay proxy: upstream connect failed", exc_info=True)
                return
            writers.append(upstream_writer)
            up = asyncio.ensure_future(self._pipe(client_reader, upstream_writer, upstream=True))
            down = asyncio.ensure_future(self._pipe(upstream_reader, client_writer, upstream=False))
            try:
                # Both directions run to their own EOF; the first error ends both, undelayed.
                done, _ = await asyncio.wait((up, down), return_when=asyncio.FIRST_EXCEPTION)
                for finished in done:
                    error = finished.exception()
                    if error is not None:
                        _log.debug("delay proxy: connection error", exc_info=error)
                        for writer in writers:
                            writer.transport.abort()
            finally:
                for pipe in (up, down):
                    pipe.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
        except asyncio.CancelledError:
            pass  # stop(): _close_all() closes the transports
        except Exception:  # never let one connection's failure reach the loop
            _log.debug("delay proxy: unexpected connection failure", exc_info=True)
        finally:
            counters.open_connections -= 1
            for writer in writers:
                writer.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        """One direction: a reader task stamps chunks, this coroutine writes each when due."""
        queue: asyncio.Queue[_QueuedChunk] = asyncio.Queue(self._max_queued_chunks)
        reading = asyncio.ensure_future(self._read_into(reader, queue))
        loop = asyncio.get_running_loop()
        counters = self._counters
        try:
            while True:
                stamp, chunk = await queue.get()
                if isinstance(chunk, Exception):
                    raise chunk  # the read side failed after everything read before it
                due = stamp + self._delay_s
                # Loop until due: a timer may fire a hair early and the delay is a lower bound.
                while (remaining := due - loop.time()) > 0:
                    await asyncio.sleep(remaining)
                if chunk is None:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                # Counted before the write: a peer that has the bytes must see them in stats().
                if upstream:
                    counters.bytes_up += len(chunk)
                else:
                    counters.bytes_down += len(chunk)
                writer.write(chunk)
                await writer.drain()
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    async def _read_into(
        self, reader: asyncio.StreamReader, queue: asyncio.Queue[_QueuedChunk]
    ) -> None:
        """Queues ``(arrival time, chunk)``; ends with ``None`` (EOF) or the read error."""
        loop = asyncio.get_running_loop()
        while True:
            item: bytes | Exception | None
            try:
                item = await reader.read(self._chunk_size) or None
            except Exception as error:  # e.g. ConnectionResetError: delivered in order
                item = error
            stamp = loop.time()  # stamped on arrival, before any backpressure wait
            if queue.full():
                self._counters.backpressure_waits += 1
            await queue.put((stamp, item))
            if not isinstance(item, bytes):
                return

    async def _close_all(self) -> None:
        server = self._server
        if server is not None:
            server.close()
        tasks = list(self._connections)
        writers = [writer for owned in self._connections.values() for writer in owned]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in writers:
            writer.close()
        # Let closed transports flush and send FIN; abort whatever a stalled peer holds up.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True),
                timeout=_CLOSE_GRACE_S,
            )
        for writer in writers:
            writer.transport.abort()  # a no-op for a transport that has finished closing
        if server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), timeout=_CLOSE_GRACE_S)
