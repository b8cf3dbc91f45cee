"""The whole loop on the real llama-cpp-python server: ``tokentrace load`` -> ``python -m
llama_cpp.server`` under ``tokentrace run`` -> the collector's store -> ``tokentrace explain`` /
the API.

One server for the module, on a tiny random Llama GGUF file (`tiny_gguf`), with prompts
evaluated ``N_BATCH`` tokens per ``llama_decode`` call (a long prompt is prefilled in chunks) and
``interrupt_requests`` off (the default cuts a running stream whenever another request arrives,
so concurrent streams would break; a second server with it on shows what that looks like in the
trace). tokentrace is installed into the server's own environment the way a user would
(`tokentrace_site`). The collector also forwards everything to a test-owned OTLP receiver
(`UpstreamOtlp`), where the spans that are no request of their own (the cold start) and the
prefill chunks are read.

The issue's measures: the budget partitions the client's E2E (within 2 %), the client's and the
collector's TTFT and ITL agree (within 5 % at the median, with a millisecond of slack for the
loopback hop), the queue wait on the model lock grows with concurrency, cached prompt tokens and
the cold start are recorded, and explain and the API show the requests like vLLM's.
"""

from __future__ import annotations

import json
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import stored_requests
from tests.collector.upstream import UpstreamOtlp
from tests.llama_cpp.shared_server import (
    N_BATCH,
    LlamaCppServer,
    llamacpp_python,
    running_llama_cpp_server,
    tiny_gguf,
)
from tests.loadgen.load_loop import outside_ns, run_load, stored_documents, stored_records
from tests.request_views import shown_like_vllm
from tests.sglang.shared_server import tokentrace_site
from tests.sglang.streaming import stream_completion
from tests.storing_collector import storing_collector
from tokentrace.agent import semconv
from tokentrace.agent.frameworks.llama_cpp_requests import (
    ERROR_INTERRUPTED,
    FINISH_ABORT,
    NOT_REPORTED,
    NOT_REPORTED_BY,
)
from tokentrace.collector.service import Collector
from tokentrace.collector.store.document import RequestDocument

pytestmark = pytest.mark.slow

_SLO_FILE = """\
targets:
  - {name: ttft-p95, metric: ttft, percentile: 95, threshold: 300ms}
  - {name: e2e-p95, metric: e2e, percentile: 95, threshold: 60s}
"""
_SPAN_WAIT_S = 30.0
_TRACE_COMMAND = (sys.executable, "-m", "tokentrace.agent.cli", "run", "--")


@dataclass(frozen=True)
class LlamaCppLoop:
    server: LlamaCppServer
    collector: Collector
    upstream: UpstreamOtlp
    store_path: Path
    slo_path: Path
    workdir: Path
    model_path: Path
    env: dict[str, str]
    """The server's environment: the collector's endpoint, tokentrace on its path."""

    @property
    def otlp_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.collector.grpc_port}"


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppLoop]:
    python = llamacpp_python()
    workdir = tmp_path_factory.mktemp("llama-cpp-loop")
    site = tokentrace_site(python, workdir / "tokentrace")
    model_path = tiny_gguf(python, workdir / "tiny-llama.gguf")
    with (
        UpstreamOtlp() as upstream,
        storing_collector(workdir, _SLO_FILE, forward_to=upstream.grpc_endpoint) as stored,
    ):
        collector, store_path, slo_path = stored.collector, stored.store_path, stored.slo_path
        env = stored.agent_environment(service_name="llama-cpp-loop", site=site)
        with running_llama_cpp_server(
            python,
            model_path,
            log_path=workdir / "server.log",
            env=env,
            command_prefix=_TRACE_COMMAND,
        ) as server:
            yield LlamaCppLoop(
                server, collector, upstream, store_path, slo_path, workdir, model_path, env
            )


def stored_document(loop: LlamaCppLoop, trace_id: str) -> RequestDocument:
    """The stored request of ``trace_id``, once the collector has stored it."""
    return stored_requests.stored_document(
        loop.store_path, trace_id, timeout_s=_SPAN_WAIT_S, context=loop.server.log_tail
    )


def upstream_spans(loop: LlamaCppLoop, name: str) -> list[Any]:
    return [
        span
        for request in loop.upstream.trace_requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
        if span.name == name
    ]


def _load(
    loop: LlamaCppLoop, name: str, concurrency: int, capsys: Any, *, prompt_tokens: str
) -> Any:
    # The load generator counts about four characters a token; this model's tokens are
    # characters, so its prompts are about four times as long in tokens.
    return run_load(
        loop,
        name,
        "--concurrency", str(concurrency),
        "--requests", str(4 * concurrency + 8),
        "--prompt-tokens", prompt_tokens,
        "--output-tokens", "fixed:48",
        "--api", "completions",
        "--seed", "7",
        "--warmup", "2",
        capsys=capsys,
    )  # fmt: skip


def test_the_budget_partitions_the_clients_e2e_and_ttft_and_itl_agree_with_the_client(
    loop: LlamaCppLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    with capsys.disabled():
        print(f"llama-cpp-python server ready in {loop.server.started_in_s:.2f} s")
    # Prompts of 130-260 tokens: a TTFT of tens of milliseconds, next to which the load
    # generator's own lateness on this shared machine (about a millisecond) is small.
    record = _load(loop, "agree", 1, capsys, prompt_tokens="uniform:32:64")
    stored = stored_records(loop, record)
    client_ttft, server_ttft, client_itl, server_itl = [], [], [], []
    for result in record.results:
        collected = stored[result.trace_id]
        client_e2e = result.end_ns - result.start_ns
        # The segments sum to the client's E2E: server-seen E2E + the time outside the server.
        assert abs(sum(collected.budget.segments.values()) - client_e2e) <= 0.02 * client_e2e
        assert outside_ns(collected) >= 0
        # The stream ends with a chunk that carries only the finish reason: the client counts
        # it as a chunk (the server sends no usage in a stream), the server as no token.
        assert collected.timeline.output_tokens == 48
        assert result.output_tokens == 48 + 1
        assert result.ttft_ns is not None and collected.metrics.ttft is not None
        budget = collected.budget
        assert budget.client_ttft_ns is not None
        assert abs(budget.client_ttft_ns - result.ttft_ns) <= 0.02 * result.ttft_ns
        client_ttft.append(result.ttft_ns)
        server_ttft.append(
            sum(
                ns
                for segment, ns in budget.client_ttft_segments.items()
                if segment not in semconv.CLIENT_SIDE_SEGMENTS
            )
        )
        # The client's last gap is the one to the finish-reason chunk: no token.
        client_itl.extend(result.chunk_gaps_ns[:-1])
        server_itl.extend(collected.metrics.itl)
    show = (
        f"TTFT p50: client {statistics.median(client_ttft) / 1e6:.2f} ms, the server's part "
        f"{statistics.median(server_ttft) / 1e6:.2f} ms; ITL p50: client "
        f"{statistics.median(client_itl) / 1e6:.3f} ms, "
        f"server {statistics.median(server_itl) / 1e6:.3f} ms"
    )
    with capsys.disabled():
        print(show)
    for client, server in ((client_ttft, server_ttft), (client_itl, server_itl)):
        client_p50 = statistics.median(client)
        server_p50 = statistics.median(server)
        assert abs(client_p50 - server_p50) <= 0.05 * client_p50 + 1_000_000, show


def test_the_queue_wait_on_the_model_lock_grows_with_concurrency(
    loop: LlamaCppLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    queue_ms: dict[int, list[float]] = {}
    for concurrency in (1, 4):
        record = _load(
            loop, f"queue-c{concurrency}", concurrency, capsys, prompt_tokens="uniform:8:24"
        )
        documents = stored_documents(loop, record)
        queue_ms[concurrency] = [doc["budget"].get(semconv.SEGMENT_QUEUE, 0.0) for doc in documents]
        if concurrency == 4:
            # The server computes one request at a time; with four clients most arrive to
            # find it busy and others waiting.
            ahead = [doc["context"]["requests_ahead"] for doc in documents]
            running = [doc["context"]["running_at_arrival"] for doc in documents]
            assert max(ahead) >= 1 and max(running) == 1, (ahead, running)
    medians = {c: statistics.median(q) for c, q in queue_ms.items()}
    with capsys.disabled():
        print(f"queue wait p50 (ms): c=1 {medians[1]:.2f}, c=4 {medians[4]:.2f}")
    # One at a time: at c=4 a request waits for about three others' whole generations.
    assert medians[4] > 4 * medians[1] + 1.0, queue_ms


def test_a_long_prompt_is_prefilled_in_chunks_and_a_repeated_one_comes_from_the_context(
    loop: LlamaCppLoop,
) -> None:
    prompt = "".join(chr(ord("a") + i % 26) for i in range(150))  # one token per character
    with httpx.Client(base_url=loop.server.base_url, timeout=120.0) as http:
        first = stream_completion(http, model=loop.server.model_name, max_tokens=4, prompt=prompt)
        second = stream_completion(http, model=loop.server.model_name, max_tokens=4, prompt=prompt)
    first_doc = stored_document(loop, first.trace_id)
    second_doc = stored_document(loop, second.trace_id)
    chunks = [
        span
        for span in upstream_spans(loop, semconv.SPAN_PREFILL_CHUNK)
        if span.trace_id.hex() == first.trace_id
    ]
    tokens = [
        next(kv.value.int_value for kv in span.attributes if kv.key == semconv.PREFILL_CHUNK_TOKENS)
        for span in chunks
    ]
    assert len(tokens) >= 3 and all(0 < count <= N_BATCH for count in tokens), tokens
    # The chunks computed what the context did not hold; the same prompt again reused all of
    # it but its last token (llama-cpp-python re-evaluates one to refresh the logits).
    input_tokens = first_doc["tokens"]["input"]
    assert sum(tokens) + (first_doc["tokens"]["cached"] or 0) == input_tokens
    assert second_doc["tokens"]["input"] == input_tokens
    assert second_doc["tokens"]["cached"] == input_tokens - 1


def test_the_cold_start_is_one_trace_from_the_server_process_to_the_loaded_model(
    loop: LlamaCppLoop,
) -> None:
    deadline = time.monotonic() + _SPAN_WAIT_S
    while time.monotonic() < deadline and not upstream_spans(loop, semconv.SPAN_COLD_START):
        time.sleep(0.5)
    (root,) = upstream_spans(loop, semconv.SPAN_COLD_START)
    (weights,) = upstream_spans(loop, semconv.SPAN_COLD_START_WEIGHT_LOAD)
    (imports,) = upstream_spans(loop, semconv.SPAN_COLD_START_IMPORT)
    assert imports.trace_id == root.trace_id
    assert imports.end_time_unix_nano <= weights.start_time_unix_nano
    assert weights.trace_id == root.trace_id and weights.parent_span_id == root.span_id
    assert root.start_time_unix_nano <= weights.start_time_unix_nano
    assert weights.end_time_unix_nano <= root.end_time_unix_nano
    weight_bytes = next(
        kv.value.int_value for kv in weights.attributes if kv.key == semconv.MODEL_WEIGHT_BYTES
    )
    # The tensors' bytes (llama_model_size): the file less its header and vocabulary.
    assert 0.8 * loop.model_path.stat().st_size < weight_bytes < loop.model_path.stat().st_size


def test_explain_and_the_api_show_a_llama_cpp_request_like_a_vllm_one(
    loop: LlamaCppLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    with httpx.Client(base_url=loop.server.base_url, timeout=120.0) as http:
        result = stream_completion(http, model=loop.server.model_name, max_tokens=12)
    doc = stored_document(loop, result.trace_id)
    assert doc["service"] == "llama-cpp-loop" and doc["model"] == loop.server.model_name
    text, explained, detail = shown_like_vllm(loop.store_path, result.trace_id, capsys)
    assert "tiny-llama / text_completion" in text
    assert "output 12" in text
    assert NOT_REPORTED_BY in text, text
    assert explained["tokens"]["output"] == 12
    assert list(NOT_REPORTED) == detail["request"]["not_reported"]["items"], detail["request"]


def test_a_chat_request_is_traced_as_chat(loop: LlamaCppLoop) -> None:
    trace_id = secrets.token_hex(16)
    body = {
        "model": loop.server.model_name,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
    }
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    with httpx.Client(base_url=loop.server.base_url, timeout=120.0) as http:
        response = http.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    doc = stored_document(loop, trace_id)
    assert doc["operation"] == semconv.OPERATION_CHAT
    assert doc["tokens"]["output"] == usage["completion_tokens"] == 6
    assert doc["tokens"]["input"] == usage["prompt_tokens"]
    assert doc["finish_reason"] == "length" and doc["status_error"] is None


def test_with_interrupt_requests_on_a_second_request_cuts_the_running_stream(
    loop: LlamaCppLoop,
) -> None:
    """The server's default: a stream stops (``[DONE]`` after fewer tokens than asked for, no
    finish reason) as soon as another request waits for the model; its trace says so."""
    with running_llama_cpp_server(
        llamacpp_python(),
        loop.model_path,
        log_path=loop.workdir / "interrupting.log",
        interrupt_requests=True,
        env={**loop.env, "OTEL_SERVICE_NAME": "llama-cpp-interrupting"},
        command_prefix=_TRACE_COMMAND,
    ) as server:
        cut_trace = secrets.token_hex(16)
        body = {"model": server.model_name, "prompt": "hello", "max_tokens": 3000, "stream": True}
        received: list[str] = []
        newer_trace: list[str] = []

        def newer_request() -> None:
            with httpx.Client(base_url=server.base_url, timeout=120.0) as other:
                result = stream_completion(other, model=server.model_name, max_tokens=4)
            newer_trace.append(result.trace_id)

        newer = threading.Thread(target=newer_request)
        headers = {"traceparent": f"00-{cut_trace}-{secrets.token_hex(8)}-01"}
        cut_off = False
        with (
            httpx.Client(base_url=server.base_url, timeout=120.0) as http,
            http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
        ):
            try:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        received.append(line.removeprefix("data: "))
                    if len(received) == 4 and newer.ident is None:
                        newer.start()
            except httpx.RemoteProtocolError:
                # The server cancels the response after its [DONE]: the connection closes
                # without the chunked body's end.
                cut_off = True
        newer.join(timeout=60)
    assert cut_off
    assert received[-1] == "[DONE]"
    chunks = [json.loads(data) for data in received[:-1]]
    assert len(chunks) < 3000 and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    doc = stored_document(loop, cut_trace)
    assert doc["finish_reason"] == FINISH_ABORT
    assert doc["status_error"] == ERROR_INTERRUPTED
    assert 0 < (doc["tokens"]["output"] or 0) < 3000
    assert newer_trace and stored_document(loop, newer_trace[0])["finish_reason"] == "length"
