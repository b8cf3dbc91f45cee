"""The load generator's HTTP client against real servers on loopback: uvicorn + Starlette for the
ordinary path, raw asyncio servers for the byte-exact edge cases."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tokentrace.loadgen import http_response
from tokentrace.loadgen.http import HttpClient, HttpError, Response, parse_base_url

_T = TypeVar("_T")
_NS_PER_MS = 1_000_000

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _run(coro: Awaitable[_T]) -> _T:
    async def main() -> _T:
        return await coro

    return asyncio.run(main())


def _counting_clock() -> Callable[[], int]:
    """A clock that ticks once per call: equal timestamps mean "the same socket read"."""
    return itertools.count(1).__next__


# --- uvicorn + Starlette -------------------------------------------------------------------------
async def _stream(request: Request) -> StreamingResponse:
    gaps_ms: list[int] = (await request.json())["gaps_ms"]

    async def events() -> AsyncIterator[bytes]:
        for index, gap_ms in enumerate(gaps_ms):
            await asyncio.sleep(gap_ms / 1000)
            yield f"data: {json.dumps({'index': index})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse(
        {
            "path": request.url.path,
            "headers": dict(request.headers),
            "body": (await request.body()).decode(),
        }
    )


@pytest.fixture(scope="module")
def app_url() -> Iterator[str]:
    app = Starlette(
        routes=[
            Route("/v1/stream", _stream, methods=["POST"]),
            Route("/v1/echo", _echo, methods=["POST"]),
        ]
    )
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)


def test_sse_stream_from_uvicorn(app_url: str) -> None:
    gaps_ms = [0, 5, 50, 5]

    async def scenario() -> tuple[Response, list[tuple[int, str]]]:
        async with HttpClient(app_url) as client:
            body = json.dumps({"gaps_ms": gaps_ms}).encode()
            async with await client.post("/stream", body) as response:
                return response, [event async for event in response.events()]

    response, events = _run(scenario())
    assert response.status == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    expected = [json.dumps({"index": index}) for index in range(len(gaps_ms))] + ["[DONE]"]
    assert [data for _, data in events] == expected
    stamps = [at_ns for at_ns, _ in events]
    assert response.sent_ns <= response.first_byte_ns <= response.headers_ns <= stamps[0]
    assert stamps == sorted(stamps)
    spaced = gaps_ms.index(50)  # the server slept 50 ms before this event
    assert stamps[spaced] - stamps[spaced - 1] >= 45 * _NS_PER_MS


@pytest.mark.parametrize(("reuse", "opened"), [(True, 1), (False, 5)])
def test_connection_reuse_against_uvicorn(app_url: str, reuse: bool, opened: int) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], dict[str, int], list[Response]]:
        echoes = []
        responses = []
        async with HttpClient(
            app_url, reuse_connections=reuse, headers={"Authorization": "Bearer t"}
        ) as client:
            for index in range(5):
                response = await client.post("/echo", f'{{"n": {index}}}'.encode())
                assert response.status == 200
                echoes.append(json.loads(await response.read()))
                responses.append(response)
            return echoes, client.stats(), responses

    echoes, stats, responses = _run(scenario())
    assert stats["connections_opened"] == opened
    assert stats["connections_reused"] == 5 - opened
    assert stats["stale_retries"] == 0
    # Each response says whether its connection was opened for it, and how long that took.
    assert [response.connection_reused for response in responses] == [False] + [reuse] * 4
    for response in responses:
        assert (response.connect_ns is None) is response.connection_reused
        assert response.connect_ns is None or response.connect_ns > 0
        assert response.sent_ns <= response.first_byte_ns <= response.headers_ns
        facts = response.end_tcp_facts  # taken when the body was complete
        assert facts is not None and facts.rtt_ns > 0 and facts.last_data_recv_ns >= 0
    for index, echo in enumerate(echoes):
        assert echo["path"] == "/v1/echo"
        assert echo["body"] == f'{{"n": {index}}}'
        headers = echo["headers"]
        assert headers["user-agent"] == "tokentrace-load"
        assert headers["content-type"] == "application/json"
        assert headers["authorization"] == "Bearer t"
        assert (headers.get("connection") == "close") is not reuse


# --- raw asyncio servers -------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def _raw_server(handler: Handler) -> AsyncIterator[str]:
    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client hung up, which several tests make it do
        finally:
            writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    request_line, *lines = head.split("\r\n")
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return request_line, headers, body


async def _events_from(
    handler: Handler, *, clock: Callable[[], int] = time.monotonic_ns
) -> list[tuple[int, str]]:
    """The events of one streamed response from a raw server running ``handler``."""
    async with _raw_server(handler) as url, HttpClient(url, clock=clock) as client:
        response = await client.post("/", b"{}")
        async with response:
            return [event async for event in response.events()]


async def _write_slowly(writer: asyncio.StreamWriter, data: bytes) -> None:
    """One byte per write, yielding to the event loop in between."""
    for index in range(len(data)):
        writer.write(data[index : index + 1])
        await writer.drain()
        await asyncio.sleep(0)


def _chunked(body: bytes, size: int) -> bytes:
    """``body`` in ``size``-byte chunks, every other one with an extension, then trailers."""
    out = []
    for number, start in enumerate(range(0, len(body), size)):
        chunk = body[start : start + size]
        extension = ";note=x" if number % 2 else ""
        out.append(f"{len(chunk):X}{extension}\r\n".encode() + chunk + b"\r\n")
    out.append(b"0\r\nX-Checksum: abc\r\n\r\n")
    return b"".join(out)


def _framed(body: bytes, framing: str, content_type: str = "text/event-stream") -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\n"
    if framing == "chunked":
        return f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + _chunked(body, 7)
    if framing == "length":
        return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
    return f"{head}Connection: close\r\n\r\n".encode() + body  # ends at EOF


_SSE_BODY = (
    b": keep-alive comment\n\n"
    b"data: first\n\n"
    b"event: message\nid: 7\nretry: 100\ndata:second\n\n"
    b"data: multi\n: a comment inside\ndata: line\n\n"
    b"data: [DONE]\n\n"
)
_SSE_EXPECTED = ["first", "second", "multi\nline", "[DONE]"]


@pytest.mark.parametrize("framing", ["chunked", "length", "eof"])
def test_events_split_byte_by_byte(framing: str) -> None:
    wire = _framed(_SSE_BODY, framing)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await _write_slowly(writer, wire)

    events = _run(_events_from(handler, clock=_counting_clock()))
    assert [data for _, data in events] == _SSE_EXPECTED
    stamps = [at_ns for at_ns, _ in events]
    # Each event was completed by its own read, and the byte-by-byte writes made many reads.
    assert stamps == sorted(set(stamps))
    assert stamps[-1] > len(_SSE_BODY) // 2


def test_events_in_one_write_share_the_read_timestamp() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await asyncio.sleep(0.02)
        batch = b"data: a\n\ndata: b\n\ndata: c\n\n"
        writer.write(b"%x\r\n%s\r\n" % (len(batch), batch))
        await asyncio.sleep(0.02)
        writer.write(b"9\r\ndata: d\n\n\r\n0\r\n\r\n")
        await writer.drain()

    events = _run(_events_from(handler, clock=_counting_clock()))
    assert [data for _, data in events] == ["a", "b", "c", "d"]
    stamps = [at_ns for at_ns, _ in events]
    assert stamps[0] == stamps[1] == stamps[2] < stamps[3]


@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_stopping_at_done_keeps_a_complete_body_reusable(framing: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await _read_request(reader)
            writer.write(_framed(b"data: a\n\ndata: [DONE]\n\n", framing))  # one write
            await writer.drain()

    async def scenario() -> dict[str, int]:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            for _ in range(2):
                response = await client.post("/", b"{}")
                async with response:
                    async for _, data in response.events():
                        if data == "[DONE]":
                            break  # the framing after it was already buffered
            return client.stats()

    stats = _run(scenario())
    assert stats["connections_opened"] == 1
    assert stats["connections_reused"] == 1


def test_events_crlf_cr_and_a_last_event_without_blank_line() -> None:
    # SSE allows \r\n, \n and \r line ends; the \r\n pairs below are also split across writes.
    writes = [
        b"data: one\r",
        b"\ndata: more\r\n\r",
        b"\n:comment\r\ndata:two\r\ndata:  three\r\n\r\n",
        b"data: cr\r\r",
        b"id: 1\r\n\r\n",  # no data: no event
        b"data: tail",  # the stream ends without the blank line
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        for data in writes:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0.005)

    events = _run(_events_from(handler))
    assert [data for _, data in events] == ["one\nmore", "two\n three", "cr", "tail"]


def test_chunked_extensions_and_trailers_then_reuse() -> None:
    bodies = [b'{"first": true, "padding": "' + b"x" * 100 + b'"}', b'{"second": true}']

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for body in bodies:  # both requests on this one connection
            await _read_request(reader)
            writer.write(_framed(body, "chunked", "application/json"))
            await writer.drain()

    async def scenario() -> tuple[list[bytes], dict[str, int]]:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            received = [await (await client.post("/", b"{}")).read() for _ in bodies]
            return received, client.stats()

    received, stats = _run(scenario())
    assert received == bodies
    # The trailers were consumed exactly: the second response parsed on the same connection.
    assert stats["connections_opened"] == 1
    assert stats["connections_reused"] == 1


def test_request_format_and_content_length_response() -> None:
    seen: dict[str, Any] = {}

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["request_line"], seen["headers"], seen["body"] = await _read_request(reader)
        writer.write(
            b"HTTP/1.1 201 Created Here\r\nX-Custom-Name: v\r\nSet-Thing: a\r\n"
            b"Set-Thing: b\r\nContent-Length: 5\r\n\r\nhello"
        )
        await writer.drain()

    async def scenario() -> tuple[Response, bytes, dict[str, int], int]:
        async with (
            _raw_server(handler) as url,
            HttpClient(f"{url}/base/", headers={"X-Client": "c"}) as client,
        ):
            response = await client.post(
                "v1/completions", b'{"x": 1}', headers={"content-type": "text/plain"}
            )
            body = await response.read()
            return response, body, client.stats(), int(url.rsplit(":", 1)[1])

    response, body, stats, port = _run(scenario())
    assert seen["request_line"] == "POST /base/v1/completions HTTP/1.1"
    headers = seen["headers"]
    assert headers["host"] == f"127.0.0.1:{port}"
    assert headers["content-length"] == "8"
    assert headers["content-type"] == "text/plain"
    assert headers["user-agent"] == "tokentrace-load"
    assert headers["x-client"] == "c"
    assert "connection" not in headers
    assert seen["body"] == b'{"x": 1}'
    assert (response.status, response.reason) == (201, "Created Here")
    assert response.headers["x-custom-name"] == "v"
    assert response.headers["set-thing"] == "a, b"
    assert body == b"hello"
    assert stats["idle"] == 1  # fully read: back in the pool without an explicit aclose


def test_body_until_eof() -> None:
    pieces = [b"alpha-", b"beta-", b"gamma"]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n")
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.005)

    async def scenario() -> tuple[bytes, dict[str, int]]:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            body = await (await client.post("/", b"{}")).read()
            return body, client.stats()

    body, stats = _run(scenario())
    assert body == b"".join(pieces)
    assert stats["idle"] == 0  # an EOF-delimited body cannot leave a reusable connection


@pytest.mark.parametrize(
    ("head", "partial"),
    [
        (b"Content-Length: 100\r\n", b"only ten b"),
        (b"Transfer-Encoding: chunked\r\n", b"20\r\nnot thirty-two bytes"),
        (b"Transfer-Encoding: chunked\r\n", b"5\r\nfive!\r\n"),  # ends before the last chunk
    ],
)
@pytest.mark.parametrize("how", ["read", "events"])
def test_server_closing_mid_body(head: bytes, partial: bytes, how: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n" + partial)
        await writer.drain()

    async def scenario() -> dict[str, int]:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            response = await client.post("/", b"{}")
            with pytest.raises(HttpError, match="mid-body") as caught:
                if how == "read":
                    await response.read()
                else:
                    _ = [event async for event in response.events()]
            assert url.removeprefix("http://") in str(caught.value)
            return client.stats()

    assert _run(scenario())["idle"] == 0


def test_stale_keep_alive_is_retried_once() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        first_connection = connections == 1
        _, _, body = await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        if first_connection:
            # The keep-alive timeout fires as the next request arrives: close without answering.
            await _read_request(reader)

    async def scenario() -> tuple[list[bytes], dict[str, int], Response]:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            first = await (await client.post("/", b"0")).read()
            retried = await client.post("/", b"1")
            return [first, await retried.read()], client.stats(), retried

    bodies, stats, retried = _run(scenario())
    assert bodies == [b"0", b"1"]
    assert stats["stale_retries"] == 1
    assert stats["connections_opened"] == 2
    assert stats["connections_reused"] == 1
    # The response describes the connection that carried it: the fresh one.
    assert retried.connection_reused is False
    assert retried.connect_ns is not None and retried.connect_ns > 0


def test_idle_connection_closed_by_server_is_not_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()  # and the connection closes right away

    async def scenario() -> tuple[list[bytes], dict[str, int]]:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            first = await (await client.post("/", b"{}")).read()
            await asyncio.sleep(0.05)  # the server's close reaches the pooled connection
            second = await (await client.post("/", b"{}")).read()
            return [first, second], client.stats()

    bodies, stats = _run(scenario())
    assert bodies == [b"ok", b"ok"]
    assert stats["connections_opened"] == 2
    # Seen closed while idle (discarded) or found stale on use (retried): one of them, once.
    assert stats["idle_discarded"] + stats["stale_retries"] == 1


def test_server_that_never_answers_times_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.Event().wait()

    async def scenario() -> tuple[HttpError, float, str]:
        async with _raw_server(handler) as url, HttpClient(url, timeout_s=0.3) as client:
            started = time.monotonic()
            with pytest.raises(HttpError) as caught:
                await client.post("/", b"{}")
            return caught.value, time.monotonic() - started, url

    error, elapsed, url = _run(scenario())
    assert "timed out after 0.3s" in str(error)
    assert url.removeprefix("http://") in str(error)
    assert 0.25 <= elapsed < 1.5


def test_stream_that_stalls_times_out_and_drops_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\ndata: first\n\n")
        await writer.drain()
        await asyncio.Event().wait()

    async def scenario() -> tuple[list[str], dict[str, int]]:
        received: list[str] = []
        async with _raw_server(handler) as url, HttpClient(url, timeout_s=0.2) as client:
            response = await client.post("/", b"{}")
            with pytest.raises(HttpError, match="timed out"):
                async for _, data in response.events():
                    received.append(data)
            return received, client.stats()

    received, stats = _run(scenario())
    assert received == ["first"]
    assert stats["idle"] == 0


def test_oversize_header_block() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\n\r\n")
        await writer.drain()

    async def scenario() -> dict[str, int]:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            with pytest.raises(HttpError, match="header block"):
                await client.post("/", b"{}")
            return client.stats()

    stats = _run(scenario())
    assert stats["limit_exceeded"] == 1
    assert stats["idle"] == 0


def test_oversize_event_and_body(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_response, "_MAX_EVENT_BYTES", 1024)
    monkeypatch.setattr(http_response, "_MAX_BODY_BYTES", 4096)
    big_event = b"data: " + b"e" * 3000 + b"\n\n"
    responses = [
        _framed(big_event, "chunked"),  # one event over its limit
        _framed(b"b" * 5000, "chunked"),  # a body that only grows past the limit
        _framed(b"b" * 5000, "length"),  # a body declared too large up front
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(responses.pop(0))
        await writer.drain()

    async def scenario() -> dict[str, int]:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            response = await client.post("/", b"{}")
            with pytest.raises(HttpError, match="event is over 1 KiB"):
                _ = [event async for event in response.events()]
            for _ in range(2):
                response = await client.post("/", b"{}")
                with pytest.raises(HttpError, match=r"body .*over 4 KiB"):
                    await response.read()
            return client.stats()

    stats = _run(scenario())
    assert stats["limit_exceeded"] == 3
    assert stats["connections_opened"] == 3  # no connection that hit a limit was reused


@pytest.mark.parametrize(
    "size_line", [b"zz", b"0x5", b"-5", b"+5", b"1_0", b"", b"5 5", b"12345678901234567"]
)
def test_malformed_chunk_size(size_line: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n" + size_line + b"\r\nhello\r\n0\r\n\r\n"
        )
        await writer.drain()

    async def scenario() -> None:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            response = await client.post("/", b"{}")
            with pytest.raises(HttpError, match="malformed chunk size"):
                await response.read()

    _run(scenario())


def test_chunk_longer_than_declared() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n"
        )
        await writer.drain()

    async def scenario() -> None:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            response = await client.post("/", b"{}")
            with pytest.raises(HttpError, match="longer than its declared size"):
                await response.read()

    _run(scenario())


def test_connection_refused_names_host_and_port() -> None:
    with socket.socket() as probe:  # a port that nothing listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario() -> HttpError:
        async with HttpClient(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(HttpError) as caught:
                await client.post("/", b"{}")
        return caught.value

    error = _run(scenario())
    assert f"127.0.0.1:{port}" in str(error)
    assert isinstance(error.__cause__, OSError)


def test_cancelled_reader_and_abandoned_body_close_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # answers every request on the connection with an endless stream
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"9\r\ndata: a\n\n\r\n")
            await writer.drain()

    async def scenario() -> tuple[dict[str, int], dict[str, int]]:
        async with _raw_server(handler) as url, HttpClient(url) as client:
            first_event = asyncio.Event()

            async def consume() -> None:
                response = await client.post("/", b"{}")
                async for _ in response.events():
                    first_event.set()

            task = asyncio.create_task(consume())
            await first_event.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            after_cancel = client.stats()
            response = await client.post("/", b"{}")
            events = response.events()
            assert (await anext(events))[1] == "a"
            await events.aclose()  # abandon the rest of the body
            after_abandon = client.stats()
            await response.aclose()
            await client.aclose()
            with pytest.raises(HttpError, match="closed"):
                await client.post("/", b"{}")
            return after_cancel, after_abandon

    after_cancel, after_abandon = _run(scenario())
    assert after_cancel["idle"] == 0
    assert after_abandon["idle"] == 0
    assert after_abandon["connections_opened"] == 2  # nothing half-read was reused


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8000", ("http", "127.0.0.1", 8000, "")),
        ("https://Example.COM/v1/", ("https", "example.com", 443, "/v1")),
        ("http://[::1]:9000/a/b", ("http", "::1", 9000, "/a/b")),
        ("HTTP://host", ("http", "host", 80, "")),
    ],
)
def test_parse_base_url(url: str, expected: tuple[str, str, int, str]) -> None:
    assert parse_base_url(url) == expected


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("127.0.0.1:8000", "no scheme"),
        ("localhost:8000/v1", "no scheme"),
        ("ftp://host", "unsupported scheme"),
        ("http://host:99999", "bad port"),
        ("http://host:abc", "bad port"),
        ("http://host:0", "bad port"),
        ("http://host/v1?x=1", "query or fragment"),
        ("http://host/#top", "query or fragment"),
        ("http://", "no host"),
        ("http://user:secret@host", "credentials"),
    ],
)
def test_parse_base_url_rejects(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_base_url(url)


def test_invalid_request_headers_are_rejected() -> None:
    with pytest.raises(ValueError, match="line break"):
        HttpClient("http://127.0.0.1:1", headers={"X-Evil": "a\r\nInjected: 1"})
    with pytest.raises(ValueError, match="header name"):
        HttpClient("http://127.0.0.1:1", headers={"Bad Name": "v"})
