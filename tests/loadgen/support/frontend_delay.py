"""Test support: an ASGI middleware that makes vLLM's API server busy on request.

vLLM loads it with ``--middleware frontend_delay.FrontendDelay`` (this folder on ``PYTHONPATH``).
A request carrying ``X-Test-Frontend-Delay-Ms: N`` blocks the server's event loop for N ms before
the app sees it, the way a CPU-bound frontend (templating, tokenisation, other streams' output
processing) holds a request back: inside the server, after the HTTP server took it, before the
engine. Requests without the header pass untouched.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

HEADER = "X-Test-Frontend-Delay-Ms"
_HEADER_KEY = HEADER.lower().encode("latin-1")

Scope = MutableMapping[str, Any]
App = Callable[[Scope, Any, Any], Awaitable[None]]


class FrontendDelay:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == _HEADER_KEY:
                    time.sleep(int(value) / 1000)  # blocking on purpose: a busy event loop
        await self.app(scope, receive, send)
