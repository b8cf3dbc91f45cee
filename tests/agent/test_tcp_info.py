"""The TCP_INFO reader (``agent/tcp_info.py``) against real loopback sockets."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import Iterator

import pytest

from tokentrace.agent import tcp_info
from tokentrace.agent.tcp_info import TcpFacts, read_tcp_info

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO: Linux")


@pytest.fixture(autouse=True, params=["C", "Python"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs against the C function on the descriptor and against its Python twin."""
    if request.param == "C" and tcp_info._C_TCP_INFO is None:
        pytest.skip("the C extension is not built here (or TOKENTRACE_PURE_PYTHON is set)")
    if request.param == "Python":
        monkeypatch.setattr(tcp_info, "_C_TCP_INFO", None)
    return str(request.param)


_IDLE_S = 0.2
_NS_PER_MS = 1_000_000
_TICK_NS = 10 * _NS_PER_MS
"""The kernel's TCP timestamps are in jiffies: 10 ms at the coarsest (HZ=100)."""


@pytest.fixture
def connected() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(client, server) ends of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    with client, server:
        yield client, server


def test_last_data_recv_is_how_long_ago_data_arrived_and_rtt_is_measured(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    client, server = connected
    sent = time.monotonic_ns()
    client.sendall(b"request")
    time.sleep(_IDLE_S)
    facts = read_tcp_info(server)
    since_sent = time.monotonic_ns() - sent
    assert isinstance(facts, TcpFacts)
    # The kernel counts in ticks: at least the idle time less a tick, at most the time since
    # the data was sent plus a tick, however long a loaded machine slept.
    assert _IDLE_S * 1e9 - _TICK_NS <= facts.last_data_recv_ns <= since_sent + _TICK_NS
    assert facts.rtt_ns > 0
    assert server.recv(16) == b"request"
    replied = time.monotonic_ns()
    server.sendall(b"response")
    assert client.recv(16) == b"response"
    fresh = read_tcp_info(client)
    assert fresh is not None
    assert fresh.last_data_recv_ns <= time.monotonic_ns() - replied + _TICK_NS


def test_asyncio_transport_sockets_are_read_too() -> None:
    async def scenario() -> tuple[TcpFacts | None, TcpFacts | None]:
        served: list[TcpFacts | None] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(16)
            served.append(read_tcp_info(writer.get_extra_info("socket")))
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname())
            writer.write(b"hello")
            await writer.drain()
            await reader.read()  # the server's close
            client = read_tcp_info(writer.get_extra_info("socket"))
            writer.close()
            await writer.wait_closed()
        return served[0], client

    served, client = asyncio.run(scenario())
    assert served is not None and served.rtt_ns > 0
    assert client is not None and client.rtt_ns > 0


def test_a_udp_socket_has_no_tcp_info() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert read_tcp_info(udp) is None


def test_a_closed_socket_has_no_tcp_info(connected: tuple[socket.socket, socket.socket]) -> None:
    client, _ = connected
    client.close()
    assert read_tcp_info(client) is None


def test_a_failing_or_short_getsockopt_and_no_socket_give_none() -> None:
    class Refusing:
        def getsockopt(self, level: int, option: int, size: int) -> bytes:
            raise OSError(95, "Operation not supported")

    class Short:
        def getsockopt(self, level: int, option: int, size: int) -> bytes:
            return b"\x01" * 16

    assert read_tcp_info(Refusing()) is None
    assert read_tcp_info(Short()) is None
    assert read_tcp_info(None) is None
