"""Zero harm on a real vLLM server: a tokentrace hook that raises costs traces, never requests.

One server runs with the tokentrace plugin and a test-support ``sitecustomize``
(``tests/vllm/support``) that makes hooks raise when a switch file names them: first the
engine-step hook inside EngineCore (where an exception escaping into vLLM kills the engine)
together with the API server's HTTP-span hook, then the API server's per-step output hook.
Every request must still be served in full and each failure is logged and counted once (the hook
is disabled, not retried). Failed engine and HTTP hooks cost the engine steps and the HTTP spans
only: requests are still traced, in the caller's trace. A failed frontend hook stops request
tracing instead of leaving half-built traces.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.collector.upstream import UpstreamOtlp
from tests.vllm.openai_api import (
    REQUEST_TIMEOUT_S,
    endpoint,
    new_traceparent,
    request_body,
    usage_of,
)
from tests.vllm.shared_server import require_vllm, traced_server_env
from tests.vllm.traces import exported_spans, request_trees
from tokentrace.agent import semconv
from tokentrace.agent.frameworks.asgi import HOOK_HTTP_SERVER
from tokentrace.agent.frameworks.vllm_engine import HOOK_STEP_DONE
from tokentrace.agent.frameworks.vllm_requests import HOOK_OUTPUTS
from tokentrace.loadgen.local_vllm import VllmServer, running_vllm_server

require_vllm()

pytestmark = pytest.mark.slow

_SUPPORT_DIR = Path(__file__).parent / "support"
# The finish of a request, which the per-step output hook calls (from C where _steps.c is built).
_FRONTEND_HOOK = (("_finish",), (HOOK_OUTPUTS,))
_ENGINE_AND_HTTP_HOOKS = (
    # A request first seen in EngineCore: its record is made inside the C step hook (or the
    # Python one, where _steps.c is not built).
    ("_TrackedRequest.__init__", "HttpServerTracer.begin"),
    (HOOK_STEP_DONE, HOOK_HTTP_SERVER),
)
_EXPORT_SETTLE_S = 1.5
"""Several emitter intervals: long enough for any span that would be sent to arrive."""
_MAX_TOKENS = 6
_CONCURRENCY = 8
_REQUESTS_PER_LOAD = 4 + _CONCURRENCY


@dataclass(frozen=True)
class FailingHookServer:
    server: VllmServer
    upstream: UpstreamOtlp
    switch: Path

    def fail(self, methods: tuple[str, ...]) -> None:
        """From now on, these hook methods raise in every process of the server."""
        self.switch.write_text("\n".join(methods) + "\n", encoding="utf-8")


# Own server: fault injection in every process, switched per phase (the failing hooks stay
# disabled for the server's life, and a failed frontend hook ends all tracing).
@pytest.fixture(scope="module")
def failing_hook_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FailingHookServer]:
    workdir = tmp_path_factory.mktemp("vllm-failing-hook")
    switch = workdir / "failing-hooks"
    switch.write_text("", encoding="utf-8")
    python_path = os.pathsep.join(filter(None, [str(_SUPPORT_DIR), os.environ.get("PYTHONPATH")]))
    with UpstreamOtlp() as upstream:
        env = {
            **traced_server_env(upstream),
            "PYTHONPATH": python_path,
            "TOKENTRACE_TEST_FAIL_HOOK": ",".join((*_ENGINE_AND_HTTP_HOOKS[0], *_FRONTEND_HOOK[0])),
            "TOKENTRACE_TEST_FAIL_SWITCH": str(switch),
            "TOKENTRACE_STEP_SAMPLE_RATE": "1",  # every step would be exported
        }
        with running_vllm_server(
            tiny_model_dir, log_path=workdir / "server.log", env=env
        ) as server:
            yield FailingHookServer(server, upstream, switch)


def serve_mixed_load(server: VllmServer, traceparent: str) -> list[int]:
    """Sequential completions and chats, streamed and not, then concurrent streams; one
    non-streamed chat carries `traceparent`. Returns each request's completion tokens."""

    async def one(client: httpx.AsyncClient, *, chat: bool, stream: bool) -> int:
        headers = {"traceparent": traceparent} if chat and not stream else {}
        response = await client.post(
            endpoint(server, chat=chat),
            json=request_body(server, chat=chat, stream=stream, max_tokens=_MAX_TOKENS),
            headers=headers,
        )
        assert response.status_code == 200, response.text
        return usage_of(response.text, stream=stream)["completion_tokens"]

    async def load() -> list[int]:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            sequential = [
                await one(client, chat=chat, stream=stream)
                for chat in (False, True)
                for stream in (False, True)
            ]
            concurrent = await asyncio.gather(
                *(one(client, chat=i % 2 == 0, stream=True) for i in range(_CONCURRENCY))
            )
        return [*sequential, *concurrent]

    return asyncio.run(load())


def assert_still_serving(
    server: VllmServer, hooks: tuple[tuple[str, ...], tuple[str, ...]]
) -> None:
    """The server is alive and healthy, and each failed hook was logged and disabled once."""
    assert server.process.poll() is None
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        assert client.get(f"{server.base_url}/health").status_code == 200
    log = server.log_path.read_text(encoding="utf-8", errors="replace")
    methods, names = hooks
    for method, hook in zip(methods, names, strict=True):
        assert f"forced failure of {method}" in log
        # Counted and disabled at the first failure, not raised again for every later call.
        assert log.count(f"hook {hook!r} failed and is now disabled") == 1, server.log_tail()
    assert "EngineDeadError" not in log


def test_server_keeps_serving_when_hooks_raise(failing_hook_server: FailingHookServer) -> None:
    server, upstream = failing_hook_server.server, failing_hook_server.upstream
    expected_tokens = [_MAX_TOKENS] * _REQUESTS_PER_LOAD

    # Phase 1: the engine-step hook (inside EngineCore, where an exception escaping into vLLM
    # kills the engine) and the HTTP-span hook fail. They cost the engine steps and the HTTP
    # spans only: the frontend still traces every request, and vLLM's forwarded headers (through
    # the AsyncLLM.add_request wrapper; this server runs without vLLM's own tracing) still put
    # the one with a traceparent in the caller's trace.
    failing_hook_server.fail(_ENGINE_AND_HTTP_HOOKS[0])
    traceparent, trace_id, parent_span_id = new_traceparent()
    assert serve_mixed_load(server, traceparent) == expected_tokens
    assert_still_serving(server, _ENGINE_AND_HTTP_HOOKS)
    time.sleep(_EXPORT_SETTLE_S)
    traced = request_trees(upstream)
    assert len(traced) == _REQUESTS_PER_LOAD
    spans = [span for _, span in exported_spans(upstream)]
    assert not any(span.name == semconv.SPAN_ENGINE_STEP for span in spans)
    assert not any(span.kind == span.SPAN_KIND_SERVER for span in spans)
    (joined,) = [tree for tree in traced.values() if tree.root.trace_id == trace_id]
    assert joined.root.parent_span_id == parent_span_id

    # Phase 2: the frontend's per-step output hook fails at the next request's finish; it stops
    # request tracing instead of leaving half-built traces, and nothing is traced after.
    failing_hook_server.fail(_FRONTEND_HOOK[0])
    assert serve_mixed_load(server, new_traceparent()[0]) == expected_tokens
    assert_still_serving(server, _FRONTEND_HOOK)
    time.sleep(_EXPORT_SETTLE_S)
    assert request_trees(upstream).keys() == traced.keys()
