"""Two facts the Linux kernel keeps about a TCP connection, read with one ``getsockopt``.

Why: a request's bytes can wait in a kernel's receive queue before the process reads them (a
busy event loop, a saturated client). Timestamps taken by the process start only when it reads,
so that wait is invisible to them; the kernel knows when it last received data on the socket
(``tcpi_last_data_recv``) and how long a round trip on the connection takes (``tcpi_rtt``). The
load generator's client spans and the HTTP server span read them at most a few times per
request, never per token: one call costs about 1.5 µs in Python (uvloop's socket stand-in:
2.2 µs, it builds a socket object per call), 0.5 µs through the agent's C extension on the
socket's descriptor (``_wire.tcp_info``; the Python code below is its twin).

``tcpi_last_data_recv`` has the kernel's tick resolution (1-10 ms, by its HZ), and it ages from
the last data segment received: when more bytes arrived after the ones of interest, it is the
wait of those later bytes (an underestimate). On any other system, a socket that is not TCP, a
closed socket or a kernel that answers short, :func:`read_tcp_info` returns None.
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Final, NamedTuple

from tokentrace.agent import compiled

__all__ = ["TcpFacts", "read_tcp_info"]

_TCP_INFO: Final[int | None] = getattr(socket, "TCP_INFO", None)
"""Linux only; elsewhere the option has another number and layout (or does not exist)."""
_U32: Final = 4
# struct tcp_info (linux/tcp.h): 8 u8 fields, then u32 fields; tcpi_last_data_recv is the 12th
# u32 and tcpi_rtt the 16th. Only those two are decoded; the layout is native-endian, unpadded.
_LAST_DATA_RECV_AND_RTT: Final = struct.Struct(f"=8x{11 * _U32}xI{3 * _U32}xI")
_C_TCP_INFO: Final[Any] = getattr(compiled.load("tokentrace.agent._wire"), "tcp_info", None)
_NS_PER_MS: Final = 1_000_000
_NS_PER_US: Final = 1_000


class TcpFacts(NamedTuple):
    last_data_recv_ns: int
    """How long ago the kernel last received data on the connection (millisecond resolution)."""
    rtt_ns: int
    """The kernel's smoothed round-trip time of the connection (microsecond resolution)."""


def read_tcp_info(sock: Any) -> TcpFacts | None:
    """The connection's :class:`TcpFacts`, or None when the kernel cannot tell (never raises for
    a socket that cannot answer). ``sock``: anything with ``socket.getsockopt``'s signature, e.g.
    a ``socket.socket``, the raw socket of a TLS connection, or asyncio's transport socket
    (``transport.get_extra_info("socket")``)."""
    if _TCP_INFO is None or sock is None:
        return None
    if _C_TCP_INFO is not None:
        try:
            fd = sock.fileno()
        except Exception:  # not a socket-like object, or one that cannot say
            fd = None
        if type(fd) is int:
            facts = _C_TCP_INFO(fd)
            return None if facts is None else TcpFacts(facts[0] * _NS_PER_MS, facts[1] * _NS_PER_US)
    return _read_with_getsockopt(sock)


def _read_with_getsockopt(sock: Any) -> TcpFacts | None:
    """``read_tcp_info`` through the object's own ``getsockopt`` (the C function's twin)."""
    size = _LAST_DATA_RECV_AND_RTT.size
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, size)
    except (OSError, ValueError):  # not TCP (EOPNOTSUPP), closed (EBADF; uvloop: ValueError)
        return None
    if not isinstance(info, bytes) or len(info) < size:
        return None
    last_data_recv_ms, rtt_us = _LAST_DATA_RECV_AND_RTT.unpack_from(info)
    return TcpFacts(last_data_recv_ms * _NS_PER_MS, rtt_us * _NS_PER_US)
