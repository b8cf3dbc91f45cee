"""What the HTTP server span (``agent/frameworks/asgi.py``) adds to each request an app serves.

The same FastAPI app, streaming ``--chunks`` SSE events per request the way vLLM's completions
route does, is called straight through ASGI (no sockets: only the app and the middleware run),
bare (A) and wrapped by the tracing middleware (B), in interleaved rounds A B A B ... Each
traced request reads two clocks, parses ``traceparent``, sets a context variable and hands a
planning closure to a list standing in for the emitter's queue; the span itself is planned and
encoded later, on the emitter's thread, and is not counted here (``bench/span_building.py``
measures that).

Printed: µs per request for A and B (medians over rounds), B - A per request and per chunk, and
the ratio B/A.

    python bench/http_span.py                 # ~10 s
    python bench/http_span.py --rounds 20 --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tokentrace.agent.frameworks.asgi import HttpServerTracer
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix

_TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def streaming_app(chunks: int) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            for index in range(chunks):
                yield b'data: {"choices": [{"text": "%d"}]}\n\n' % index
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def serve(app: Any, requests: int) -> float:
    """Seconds for ``requests`` sequential requests through the ASGI app."""
    scope_base = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"traceparent", _TRACEPARENT)],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }

    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        # Starlette listens for a disconnect while it streams: after the body, block as a
        # server does until the client leaves (never, here).
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    start = time.perf_counter()
    for _ in range(requests):
        await app(dict(scope_base), receive, send)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=1000, help="per round and side")
    parser.add_argument("--chunks", type=int, default=64, help="SSE events per response")
    args = parser.parse_args()

    bare = streaming_app(args.chunks)
    submitted: list[Any] = []
    tracer = HttpServerTracer(submitted.append, guard=HookGuard(), to_unix=MonotonicToUnix())
    traced_app = streaming_app(args.chunks)
    traced = tracer.middleware(traced_app, enabled=lambda: True)

    async def run() -> tuple[list[float], list[float]]:
        await serve(bare, 50)  # warm-up: routing caches, first-call costs
        await serve(traced, 50)
        bare_us, traced_us = [], []
        for _ in range(args.rounds):
            bare_us.append(await serve(bare, args.requests) / args.requests * 1e6)
            submitted.clear()
            traced_us.append(await serve(traced, args.requests) / args.requests * 1e6)
            assert len(submitted) == args.requests, "the middleware traced nothing"
        return bare_us, traced_us

    bare_us, traced_us = asyncio.run(run())
    a, b = statistics.median(bare_us), statistics.median(traced_us)
    added = [t - u for u, t in zip(bare_us, traced_us, strict=True)]
    print(f"{args.rounds} rounds x {args.requests} requests, {args.chunks} chunks each")
    print(f"A bare:   {a:8.1f} us/request (median of rounds)")
    print(f"B traced: {b:8.1f} us/request")
    print(
        f"B - A:    {statistics.median(added):8.1f} us/request "
        f"(rounds {min(added):.1f}..{max(added):.1f}), "
        f"{statistics.median(added) / (args.chunks + 1):.2f} us per chunk sent; B/A {b / a:.3f}"
    )


if __name__ == "__main__":
    main()
