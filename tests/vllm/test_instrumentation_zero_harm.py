"""Zero harm on a real vLLM server: a tokentrace hook that raises costs traces, never requests.

Each server runs with the tokentrace plugin and a test-support ``sitecustomize``
(``tests/vllm/support``) that makes hooks raise: the API server's per-step output hook, or
the engine-step hook inside EngineCore (where an exception escaping into vLLM kills the engine)
together with the API server's HTTP-span hook.
Every request must still be served in full and the failure is logged and counted once (the hook
is disabled, not retried). A failed frontend hook stops request tracing instead of leaving
half-built traces; failed engine and HTTP hooks cost the engine steps and the HTTP spans only:
requests are still traced, in the caller's trace.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.collector.upstream import UpstreamOtlp
from tests.vllm.conftest import require_vllm, traced_server_env
from tests.vllm.openai_api import (
    REQUEST_TIMEOUT_S,
    endpoint,
    new_traceparent,
    request_body,
    usage_of,
)
from tests.vllm.traces import exported_spans, request_trees
from tokentrace.agent import semconv
from tokentrace.agent.frameworks.asgi import HOOK_HTTP_SERVER
from tokentrace.agent.frameworks.vllm_engine import HOOK_STEP_DONE
from tokentrace.agent.frameworks.vllm_requests import HOOK_OUTPUTS
from tokentrace.loadgen.local_vllm import VllmServer, running_vllm_server

require_vllm()

pytestmark = pytest.mark.slow

_SUPPORT_DIR = Path(__file__).parent / "support"
_FRONTEND_HOOK = (("_after_outputs",), (HOOK_OUTPUTS,))
_ENGINE_AND_HTTP_HOOKS = (
    ("EngineStepTracer.on_step_done", "HttpServerTracer.begin"),
    (HOOK_STEP_DONE, HOOK_HTTP_SERVER),
)
_EXPORT_SETTLE_S = 1.5
"""Several emitter intervals: long enough for any span that would be sent to arrive."""


# Own servers: fault injection from process start (a failed frontend hook ends all tracing).
@pytest.fixture(
    scope="module", params=[_FRONTEND_HOOK, _ENGINE_AND_HTTP_HOOKS], ids=["frontend", "engine+http"]
)
def failing_hook_server(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[VllmServer, UpstreamOtlp, tuple[str, ...], tuple[str, ...]]]:
    methods, hooks = request.param
    log_path = tmp_path_factory.mktemp("vllm-failing-hook") / "server.log"
    python_path = os.pathsep.join(filter(None, [str(_SUPPORT_DIR), os.environ.get("PYTHONPATH")]))
    with UpstreamOtlp() as upstream:
        env = {
            **traced_server_env(upstream),
            "PYTHONPATH": python_path,
            "TOKENTRACE_TEST_FAIL_HOOK": ",".join(methods),
            "TOKENTRACE_STEP_SAMPLE_RATE": "1",  # every step would be exported
        }
        with running_vllm_server(tiny_model_dir, log_path=log_path, env=env) as server:
            yield server, upstream, methods, hooks


def test_server_keeps_serving_when_a_hook_raises(
    failing_hook_server: tuple[VllmServer, UpstreamOtlp, tuple[str, ...], tuple[str, ...]],
) -> None:
    server, upstream, methods, hooks = failing_hook_server
    max_tokens, concurrency = 6, 8

    # One caller with a traceparent: this server runs without vLLM's own tracing, so the
    # headers reach tokentrace only through the AsyncLLM.add_request wrapper.
    traceparent, trace_id, parent_span_id = new_traceparent()

    async def one(client: httpx.AsyncClient, *, chat: bool, stream: bool) -> int:
        headers = {"traceparent": traceparent} if chat and not stream else {}
        response = await client.post(
            endpoint(server, chat=chat),
            json=request_body(server, chat=chat, stream=stream, max_tokens=max_tokens),
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
                *(one(client, chat=i % 2 == 0, stream=True) for i in range(concurrency))
            )
        return [*sequential, *concurrent]

    assert asyncio.run(load()) == [max_tokens] * (4 + concurrency)
    assert server.process.poll() is None
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        assert client.get(f"{server.base_url}/health").status_code == 200

    log = server.log_path.read_text(encoding="utf-8", errors="replace")
    for method, hook in zip(methods, hooks, strict=True):
        assert f"forced failure of {method}" in log
        # Counted and disabled at the first failure, not raised again for every later call.
        assert log.count(f"hook {hook!r} failed and is now disabled") == 1, server.log_tail()
    assert "EngineDeadError" not in log
    time.sleep(_EXPORT_SETTLE_S)
    steps = [span for _, span in exported_spans(upstream) if span.name == semconv.SPAN_ENGINE_STEP]
    if HOOK_OUTPUTS in hooks:
        # The hook failed at the first request's first step: no request is traced after that.
        assert request_trees(upstream) == {}
    else:
        # The engine's and the HTTP hook's failures cost the engine steps and the HTTP spans;
        # the frontend still traces every request, and vLLM's forwarded headers (through the
        # AsyncLLM.add_request wrapper) still put it in the caller's trace.
        trees = request_trees(upstream)
        assert len(trees) == 4 + concurrency
        assert steps == []
        assert not any(span.kind == span.SPAN_KIND_SERVER for _, span in exported_spans(upstream))
        (joined,) = [tree for tree in trees.values() if tree.root.trace_id == trace_id]
        assert joined.root.parent_span_id == parent_span_id
