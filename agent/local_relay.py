"""The agent's local channel to the node agent: finished requests as plain data, not spans.

Building and encoding spans and the OTLP export call are about 40 % of tokentrace's share of an
inference server's interpreter time (vLLM's API server: docs/performance.md). With
``TOKENTRACE_NODE_SOCKET`` set, the emitter's thread instead writes each batch as it was recorded
- the finished timers' integers, the span jobs' plans - to the node agent's Unix socket, and the
node agent (``agent/node/local_relay.py``) turns them into spans with the same code
(``recorder.to_finished_request``, ``span_encoding.SpanBatchEncoder``) and relays them like any
OTLP it receives. Where the socket cannot be reached the emitter exports OTLP itself, as without
it, and tries the socket again after ``_RETRY_AFTER_S``.

The protocol, on a stream socket: frames of a 4-byte big-endian length and that many bytes of
plain data in ``marshal`` format version 0, which ``marshal.dumps`` writes in C (a third of
JSON's cost here) and the node agent reads with a reader of its own for that subset
(``plain_marshal``: ``marshal.loads`` is not safe against what any sender on the node may write).
The connection opens with a hello (``hello``: the resource and scope every span of this process
carries); each later frame is a batch (``batch``: the timers and span jobs as ``timer_row`` /
``job_row`` write them) that the node agent answers with one byte: ``ACK_TAKEN`` (queued for
upstream), ``ACK_BUSY`` (its queue is full: dropped, counted by both) or ``ACK_REJECTED``
(malformed). The answer is what makes the hand-off exact: a batch is counted as sent only once
the node agent has it.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
import weakref
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any, Final, NamedTuple

from tokentrace.agent import plain_marshal
from tokentrace.agent.finished_request import FinishedRequest, prompt_prefix_hash
from tokentrace.agent.otlp_export import RateLimitedWarning
from tokentrace.agent.recorder import PROMPT_TOKEN_IDS, RequestTimer
from tokentrace.agent.spans import AttrValue, PlannedSpan, SpanJob

_log = logging.getLogger(__name__)

PROTOCOL_VERSION: Final = 1
MAX_FRAME_BYTES: Final = 8 * 1024 * 1024
"""A frame longer than this is refused (the connection is closed): a bound on the node agent's
memory per connection. A batch of 256 requests of 1,000 tokens each is about 3 MB."""
ACK_TAKEN: Final = b"\x00"
ACK_BUSY: Final = b"\x01"
ACK_REJECTED: Final = b"\x02"
_HEADER: Final = struct.Struct(">I")
_CONNECT_TIMEOUT_S: Final = 1.0
_DEFAULT_ANSWER_TIMEOUT_S: Final = 5.0
"""For the node agent's answer to a batch (it encodes and queues it first: milliseconds)."""
_RETRY_AFTER_S: Final = 5.0
"""After the socket failed, batches go by OTLP for this long before the socket is tried again."""
_FAILURE_WARNING_INTERVAL_S: Final = 300.0
_FINISHED_FIELDS: Final = frozenset(f.name for f in fields(FinishedRequest))
"""The timer attributes ``to_finished_request`` copies onto the request; only those travel."""


# --- rows: what one timer or span job is on the wire --------------------------------------------


def timer_row(timer: RequestTimer) -> tuple[Any, ...]:
    """``timer`` as a row of plain values (``timer_of`` reads it back). The prompt's token ids
    are hashed here (the hash is what the request keeps) rather than shipped. Raises TypeError /
    OverflowError for token times that are not int64s."""
    # Usually the attributes less the prompt (the hooks set no other key), as a subset check in C
    # confirms; otherwise only the request's fields travel.
    attributes = timer.attributes.copy()
    prompt = attributes.pop(PROMPT_TOKEN_IDS, None)
    if not attributes.keys() <= _FINISHED_FIELDS:
        attributes = {k: v for k, v in attributes.items() if k in _FINISHED_FIELDS}
    if prompt is not None and attributes.get("prefix_hash") is None:
        attributes["prefix_hash"] = prompt_prefix_hash(prompt)
    return (
        timer.request_id,
        timer.arrival_ns,
        timer.queued_ns,
        timer.first_scheduled_ns,
        array("q", timer.token_ns).tobytes(),  # the node agent's reader takes it in one call
        timer.prefill_chunks,
        timer.preempted_ns,
        timer.preempted_since_ns,
        timer.end_ns,
        timer.status_error,
        timer.trace_id,
        timer.parent_span_id,
        timer.span_id,
        timer.prefill_span_id,
        timer.ready_ns,
        timer.cold_start_link,
        attributes,
    )


def timer_of(row: Any) -> RequestTimer:
    """The timer ``timer_row`` wrote. Raises ValueError / TypeError for a malformed row."""
    if type(row) is not tuple or len(row) != 17:
        raise ValueError("a timer row is a tuple of 17 fields")
    request_id, arrival, queued, scheduled, tokens, chunks, preempted, since, end = row[:9]
    error, trace_id, parent_id, span_id, prefill_id, ready, link, attributes = row[9:]
    return RequestTimer(
        request_id=_str(request_id),
        arrival_ns=_int(arrival),
        queued_ns=_optional_int(queued),
        first_scheduled_ns=_optional_int(scheduled),
        token_ns=_int64s(tokens),
        prefill_chunks=[(_int(s), _int(e), _int(n)) for s, e, n in _list(chunks)],
        preempted_ns=[(_int(s), _int(e)) for s, e in _list(preempted)],
        preempted_since_ns=_optional_int(since),
        end_ns=_optional_int(end),
        status_error=None if error is None else _str(error),
        trace_id=_bytes(trace_id),
        parent_span_id=_bytes(parent_id),
        span_id=_bytes(span_id),
        prefill_span_id=_bytes(prefill_id),
        ready_ns=_optional_int(ready),
        cold_start_link=None if link is None else (_bytes(link[0]), _bytes(link[1])),
        attributes={
            _str(k): None if v is None else _attribute_value(v)
            for k, v in _dict(attributes).items()
            if k in _FINISHED_FIELDS
        },
    )


def job_row(job: SpanJob) -> tuple[Any, ...]:
    """``job`` as a row of plain values (``job_of`` reads it back): each ``PlannedSpan`` as the
    plain tuple of its fields."""
    return (
        job.trace_id,
        job.parent_span_id,
        [tuple(span) for span in job.spans],
        None if job.fixed_ids is None else dict(job.fixed_ids),
    )


def job_of(row: Any) -> SpanJob:
    """The span job ``job_row`` wrote. Raises ValueError / TypeError for a malformed row."""
    if type(row) is not tuple or len(row) != 4:
        raise ValueError("a span job row is a tuple of 4 fields")
    trace_id, parent_id, spans, fixed_ids = row
    return SpanJob(
        trace_id=_bytes(trace_id),
        parent_span_id=_bytes(parent_id),
        spans=[_planned_span(span) for span in _list(spans)],
        fixed_ids=None
        if fixed_ids is None
        else {_int(k): _bytes(v) for k, v in _dict(fixed_ids).items()},
    )


def _planned_span(row: Any) -> PlannedSpan:
    if type(row) is not tuple or len(row) != 9:
        raise ValueError("a planned span row is a tuple of 9 fields")
    local_id, parent_id, name, kind, start, end, attributes, error, links = row
    if type(links) is not tuple:
        raise TypeError("a span's links are a tuple")
    return PlannedSpan(
        local_id=_int(local_id),
        parent_local_id=_int(parent_id),
        name=_str(name),
        kind=_int(kind),
        start_ns=_int(start),
        end_ns=_int(end),
        attributes={_str(k): _attribute_value(v) for k, v in _dict(attributes).items()},
        status_error=None if error is None else _str(error),
        links=tuple((_bytes(t), _bytes(s)) for t, s in links),
    )


def _attribute_value(value: Any) -> AttrValue:
    """``value`` when it is an attribute value (``AttrValue``: arrays of strings are tuples, int
    arrays lists, as the agent wrote them)."""
    if isinstance(value, str | int | float | list | tuple):
        return value
    raise ValueError(f"unsupported attribute value {type(value).__name__}")


def _int64s(value: Any) -> list[int]:
    """Native int64s (sender and node agent share the machine, so its byte order)."""
    raw = _bytes(value)
    if len(raw) % 8:
        raise ValueError("an int64 array's length is a multiple of 8")
    return array("q", raw).tolist()


def _bytes(value: Any) -> bytes:
    if type(value) is not bytes:
        raise TypeError(f"expected bytes, got {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _optional_int(value: Any) -> int | None:
    return None if value is None else _int(value)


def _str(value: Any) -> str:
    if type(value) is not str:
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _list(value: Any) -> list[Any]:
    if type(value) is not list:
        raise TypeError(f"expected an array, got {type(value).__name__}")
    return value


def _dict(value: Any) -> dict[Any, Any]:
    if type(value) is not dict:
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return value


# --- frames ---------------------------------------------------------------------------------------


def frame(message: Mapping[str, Any]) -> bytes:
    """``message`` as one frame. Raises ValueError when it holds more than plain data."""
    body = plain_marshal.dumps(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(body)} bytes is over {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


def hello(
    *,
    resource: Mapping[str, AttrValue],
    scope_name: str,
    scope_version: str,
    max_token_offsets: int,
) -> dict[str, Any]:
    """The first frame's message: what every span of this connection carries."""
    return {
        "hello": PROTOCOL_VERSION,
        "resource": dict(resource),
        "scope": [scope_name, scope_version],
        "max_token_offsets": max_token_offsets,
    }


class Hello(NamedTuple):
    """What a connection's hello says (``read_hello``)."""

    resource: dict[str, AttrValue]
    scope_name: str
    scope_version: str
    max_token_offsets: int


def read_hello(message: Any) -> Hello:
    """The hello ``hello`` wrote. Raises ValueError for anything else."""
    try:
        if not isinstance(message, dict) or message.get("hello") != PROTOCOL_VERSION:
            raise ValueError(f"not a protocol {PROTOCOL_VERSION} hello")
        scope_name, scope_version = message["scope"]
        return Hello(
            resource={_str(k): _attribute_value(v) for k, v in _dict(message["resource"]).items()},
            scope_name=_str(scope_name),
            scope_version=_str(scope_version),
            max_token_offsets=_int(message["max_token_offsets"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"hello refused: {error}") from None


def batch(
    timers: Sequence[RequestTimer], jobs: Sequence[SpanJob], offset_ns: int
) -> dict[str, Any]:
    """A batch frame's message: ``offset_ns`` is the sender's Unix-minus-monotonic offset, which
    converts its timers."""
    return {
        "offset_ns": offset_ns,
        "timers": [timer_row(timer) for timer in timers],
        "jobs": [job_row(job) for job in jobs],
    }


def read_batch(message: Any) -> tuple[int, list[RequestTimer], list[SpanJob]]:
    """(offset_ns, timers, span jobs) of the batch ``batch`` wrote. Raises ValueError /
    TypeError for a malformed one."""
    if not isinstance(message, dict):
        raise ValueError("a batch is an object")
    try:
        offset_ns, timers, jobs = message["offset_ns"], message["timers"], message["jobs"]
    except KeyError as error:
        raise ValueError(f"a batch without {error}") from None
    return (
        _int(offset_ns),
        [timer_of(row) for row in _list(timers)],
        [job_of(row) for row in _list(jobs)],
    )


def read_frame(connection: socket.socket) -> Any | None:
    """The next frame's message; None at a clean end of stream. Raises ValueError for an
    oversized or malformed frame, OSError for a failed read."""
    header = _read_exactly(connection, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes is over {MAX_FRAME_BYTES}")
    body = _read_exactly(connection, length)
    if body is None:
        raise ValueError("the stream ended inside a frame")
    return plain_marshal.loads(body)


def _read_exactly(connection: socket.socket, count: int) -> bytes | None:
    """``count`` bytes, or None when the stream ends before the first; ValueError mid-way."""
    view = memoryview(bytearray(count))
    got = 0
    while got < count:
        n = connection.recv_into(view[got:], count - got)
        if n == 0:
            if got == 0:
                return None
            raise ValueError("the stream ended inside a frame")
        got += n
    return bytes(view)


# --- the agent's side -----------------------------------------------------------------------------


class RelayUnreachable(Exception):
    """The batch was not delivered: the socket could not be reached or had closed before it was
    written (the caller sends it another way)."""


class RelayRefused(Exception):
    """The node agent answered a batch with ``ACK_BUSY`` or ``ACK_REJECTED`` (``answer``)."""

    def __init__(self, answer: bytes) -> None:
        super().__init__("busy" if answer == ACK_BUSY else "rejected")
        self.answer = answer


class LocalRelayClient:
    """One process's connection to the node agent's socket, used by the emitter's thread only.

    After a socket failure the connection is closed and ``available`` says False for
    ``_RETRY_AFTER_S``. Not thread-safe (one emitter thread); a forked child starts
    disconnected.
    """

    def __init__(
        self,
        path: str,
        *,
        hello_message: Mapping[str, Any],
        answer_timeout_s: float = _DEFAULT_ANSWER_TIMEOUT_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._hello = frame(hello_message)
        self._answer_timeout_s = answer_timeout_s
        self._monotonic = monotonic
        self._socket: socket.socket | None = None
        self._retry_at = 0.0
        self.connects = 0
        self.failures = 0
        """Connections that failed or broke (each sends batches by OTLP for a while)."""
        self._failure_warning = RateLimitedWarning(
            monotonic, interval_s=_FAILURE_WARNING_INTERVAL_S, log=_log
        )
        reference = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(reference))

    @property
    def available(self) -> bool:
        """Connected, or the wait after a failure is over (``send`` will try to connect)."""
        return self._socket is not None or self._monotonic() >= self._retry_at

    def send(self, timers: Sequence[RequestTimer], jobs: Sequence[SpanJob], offset_ns: int) -> None:
        """Hand one batch to the node agent and wait for its answer. Raises TypeError /
        ValueError / OverflowError when the batch cannot be written as a frame, and
        ``RelayUnreachable`` when it was not delivered (in both cases nothing was sent);
        ``RelayRefused`` when the node agent answered no; OSError when the socket failed after
        the batch was written (whether the node agent took it is unknown: the caller counts it
        as lost rather than send it twice)."""
        data = frame(batch(timers, jobs, offset_ns))
        connection = self._socket or self._connect()
        try:
            connection.sendall(data)
        except OSError as error:  # closed by the other end before this batch: not delivered
            self._fail(error)
            raise RelayUnreachable(str(error)) from error
        try:
            answer = connection.recv(1)
        except OSError as error:
            self._fail(error)
            raise
        if not answer:
            closed = ConnectionResetError("the node agent closed the connection")
            self._fail(closed)
            raise closed
        if answer != ACK_TAKEN:
            raise RelayRefused(answer)

    def _connect(self) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(_CONNECT_TIMEOUT_S)
            connection.connect(self.path)
            connection.settimeout(self._answer_timeout_s)
            connection.sendall(self._hello)
        except OSError as error:
            connection.close()
            self._fail(error)
            raise RelayUnreachable(f"{self.path}: {error.strerror or error}") from error
        self._socket = connection
        self.connects += 1
        return connection

    def _fail(self, error: OSError) -> None:
        self.failures += 1
        self._retry_at = self._monotonic() + _RETRY_AFTER_S
        self.close()
        self._failure_warning.warn(
            "tokentrace: the node agent's socket %s: %s; batches go by OTLP meanwhile, the "
            "socket is tried again every %g s (emitter.node_socket_failures: %d)",
            self.path,
            error.strerror or error,
            _RETRY_AFTER_S,
            self.failures,
        )

    def close(self) -> None:
        connection, self._socket = self._socket, None
        if connection is not None:
            connection.close()

    def _forget(self) -> None:
        """In a forked child: the parent's connection is the parent's (closing the child's copy
        of the descriptor leaves it open there)."""
        self.close()
        self._retry_at = 0.0


def _forget_in_child(reference: weakref.ref[LocalRelayClient]) -> None:
    client = reference()
    if client is not None:
        client._forget()
