"""The whole loop on the real ``transformers serve``: ``tokentrace load`` -> the server under
``tokentrace run`` -> the collector's store -> ``tokentrace explain`` / the API.

Two servers, one per mode, each started once for the module (`shared_server.py`):

- **plain** (one ``generate()`` at a time on the inference thread), started without a model: the
  first request loads it, so it waits for the cold start and is linked to it;
- **continuous batching** (``--continuous-batching``), with the model preloaded (the cold start
  ends before the server listens) and steps of at most 64 tokens (``--cb-max-batch-tokens``), so
  a long prompt is prefilled in several engine steps.

The issue's measures: the budget partitions the client's E2E (within 2 %); the client's TTFT
(less the delays the client measured in itself) and the server's part of it agree within 5 % at
the median, with a millisecond of slack for the loopback hop; the mean inter-token gap agrees
within 5 % (the server streams a token that completes no character with the next one, so the
client's gaps are compared as a whole, from the first token's hand-over, over the requests the
client read on time); queue wait appears where the engine queues; the cold
start is recorded; ``explain`` and the API show the requests as they show a vLLM one; a client
that goes away leaves an aborted request.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import stored_requests
from tests.loadgen.load_loop import outside_ns, run_load, stored_documents, stored_records
from tests.request_views import shown_like_vllm
from tests.transformers.shared_server import (
    ServeLoop,
    Streamed,
    running_traced_loop,
    stream_completion,
)
from tokentrace.agent import semconv
from tokentrace.agent.cli import main as tokentrace_main
from tokentrace.collector.store.document import RequestDocument

pytestmark = pytest.mark.slow

_CB_BATCH_TOKENS = 64
_SLO_FILE = """\
targets:
  - {name: ttft-p95, metric: ttft, percentile: 95, threshold: 10s}
  - {name: e2e-p95, metric: e2e, percentile: 95, threshold: 60s}
"""
_SPAN_WAIT_S = 30.0
_CLIENT_LATE_NS = 2_000_000
"""A request whose first token the client read later than this (its own account) is left out
of the decode comparison."""


@pytest.fixture(scope="module")
def plain(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServeLoop, Streamed]]:
    """The plain server and its first request (the one that loaded the model)."""
    with running_traced_loop(
        tiny_model_dir,
        tmp_path_factory.mktemp("transformers-plain"),
        slo_file=_SLO_FILE,
        service_name="transformers-plain",
        preload=False,
    ) as loop:
        first = stream_completion(loop.server.base_url, model=loop.model_name, max_tokens=4)
        yield loop, first


@pytest.fixture(scope="module")
def continuous(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeLoop]:
    with running_traced_loop(
        tiny_model_dir,
        tmp_path_factory.mktemp("transformers-cb"),
        slo_file=_SLO_FILE,
        service_name="transformers-cb",
        preload=True,
        extra_args=["--continuous-batching", "--cb-max-batch-tokens", str(_CB_BATCH_TOKENS)],
    ) as loop:
        yield loop


def stored_document(loop: ServeLoop, trace_id: str) -> RequestDocument:
    return stored_requests.stored_document(
        loop.store_path, trace_id, timeout_s=_SPAN_WAIT_S, context=loop.log_tail
    )


def check_budget_and_agreement(
    loop: ServeLoop, name: str, capsys: pytest.CaptureFixture[str], *, concurrency: int
) -> list[int]:
    """A load run; asserts the issue's measures; returns each request's queue wait (ns)."""
    record = run_load(
        loop,
        name,
        "--concurrency", str(concurrency),
        "--requests", "12",
        "--prompt-tokens", "uniform:16:48",
        "--output-tokens", "uniform:8:24",
        "--api", "completions",
        "--model", loop.model_name,
        "--no-ignore-eos",
        "--seed", "7",
        "--warmup", "1",
        capsys=capsys,
    )  # fmt: skip
    stored = stored_records(loop, record)
    client_ttft, server_ttft, client_itl, server_itl, queues = [], [], [], [], []
    client_decode: list[int] = []
    server_decode: list[int] = []
    decode_gaps = 0
    for result in record.results:
        collected = stored[result.trace_id]
        client_e2e = result.end_ns - result.start_ns
        assert abs(sum(collected.budget.segments.values()) - client_e2e) <= 0.02 * client_e2e
        assert outside_ns(collected) >= 0
        assert collected.timeline.output_tokens == result.output_tokens
        budget = collected.budget
        assert result.ttft_ns is not None and budget.client_ttft_ns is not None
        assert abs(budget.client_ttft_ns - result.ttft_ns) <= 0.02 * result.ttft_ns
        # Less the client's own delays, as it measured them (sending late, reading late: its
        # ``client`` segment): on this shared 2-core machine the load generator is sometimes
        # late by milliseconds, which is no part of what the server measured. What remains
        # apart from the server's part is the wire (connect, network): near zero on loopback
        # unless the server's times were off.
        client_ttft.append(
            result.ttft_ns - budget.client_ttft_segments.get(semconv.SEGMENT_CLIENT, 0)
        )
        server_ttft.append(
            sum(
                ns
                for segment, ns in budget.client_ttft_segments.items()
                if segment not in semconv.CLIENT_SIDE_SEGMENTS
            )
        )
        client_itl.extend(result.chunk_gaps_ns)
        server_itl.extend(collected.metrics.itl)
        # The decode as a whole (the sum of the gaps): the server streams a token that completes
        # no character with the next one, and sends the tokens it has together. Both from the
        # first token's hand-over: while generate() holds the GIL, the server's event loop may
        # send a first token milliseconds late (busy with the next request's arrival), which
        # the client sees as TTFT (the budget's ``http``), not decode. A request the client
        # itself read late (its own ``client`` TTFT segment) measured the client: left out.
        timeline = collected.timeline
        assert timeline.server_first_body is not None and timeline.first_token is not None
        if budget.client_ttft_segments.get(semconv.SEGMENT_CLIENT, 0) <= _CLIENT_LATE_NS:
            handed_over_late = max(0, timeline.server_first_body - timeline.first_token)
            client_decode.append(sum(result.chunk_gaps_ns))
            server_decode.append(max(0, sum(collected.metrics.itl) - handed_over_late))
            decode_gaps += len(collected.metrics.itl)
        queues.append(budget.segments.get(semconv.SEGMENT_QUEUE, 0))
    show = (
        f"{name}: TTFT p50 client {statistics.median(client_ttft) / 1e6:.2f} ms, the server's "
        f"part {statistics.median(server_ttft) / 1e6:.2f} ms; ITL p50 client "
        f"{statistics.median(client_itl) / 1e6:.3f} ms, server "
        f"{statistics.median(server_itl) / 1e6:.3f} ms; mean ITL client "
        f"{sum(client_decode) / max(1, decode_gaps) / 1e6:.3f} ms, server "
        f"{sum(server_decode) / max(1, decode_gaps) / 1e6:.3f} ms over {len(client_decode)} "
        f"requests the client read on time; queue (ms) "
        f"{sorted(round(q / 1e6, 1) for q in queues)}"
    )
    with capsys.disabled():
        print(show)
    client_p50 = statistics.median(client_ttft)
    assert abs(client_p50 - statistics.median(server_ttft)) <= 0.05 * client_p50 + 1_000_000, show
    # ITL: the mean gap over the tokens of the requests the client read on time (decode time /
    # gaps), the client's and the server's, within 5 % (the client's gaps may merge tokens:
    # their sum is the same time). Enough gaps for a mean, from at least two requests: on a
    # loaded two-core machine the client reads many first tokens late (3-8 of 12 on time in six
    # runs here, 2 of 12 in one CI run, whose means agreed within 0.8 %).
    assert len(client_decode) >= 2 and decode_gaps >= 20, show
    client_mean = sum(client_decode) / decode_gaps
    server_mean = sum(server_decode) / decode_gaps
    assert abs(client_mean - server_mean) <= 0.05 * client_mean + 100_000, show
    return queues


def test_plain_budget_partitions_the_clients_e2e_and_requests_queue_behind_each_other(
    plain: tuple[ServeLoop, Streamed], capsys: pytest.CaptureFixture[str]
) -> None:
    loop, _ = plain
    queues = check_budget_and_agreement(loop, "plain", capsys, concurrency=2)
    # One generate() at a time: with two clients, most requests wait for the other's.
    assert sum(1 for queue in queues if queue > 1_000_000) >= len(queues) // 2, queues


def test_continuous_batching_budget_partitions_the_clients_e2e_and_queue_grows_with_load(
    continuous: ServeLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    # One client at a time: on this 2-core machine more clients make the load generator late.
    alone = check_budget_and_agreement(continuous, "continuous", capsys, concurrency=1)
    # Steps of 64 tokens fit one new prompt of 48-64 tokens: the others wait to be scheduled.
    record = run_load(
        continuous,
        "continuous-crowded",
        "--concurrency", "6",
        "--requests", "12",
        "--prompt-tokens", "uniform:48:60",
        "--output-tokens", "fixed:16",
        "--api", "completions",
        "--model", continuous.model_name,
        "--no-ignore-eos",
        "--seed", "5",
        capsys=capsys,
    )  # fmt: skip
    crowded = [
        doc["budget"].get(semconv.SEGMENT_QUEUE, 0.0) * 1e6
        for doc in stored_documents(continuous, record)
    ]
    with capsys.disabled():
        print(f"queue (ms) with 6 clients: {sorted(round(q / 1e6, 1) for q in crowded)}")
    assert statistics.median(crowded) > statistics.median(alone), (crowded, alone)


def test_the_first_request_of_a_server_without_a_model_waits_for_the_cold_start(
    plain: tuple[ServeLoop, Streamed],
) -> None:
    loop, first = plain
    doc = stored_document(loop, first.trace_id)
    assert doc["budget"].get(semconv.SEGMENT_COLD_START, 0.0) > 0.0, doc["budget"]
    assert doc["finish_reason"] == "length" and doc["tokens"]["output"] == 4
    (root,) = wait_for_spans(loop, semconv.SPAN_COLD_START)
    (weights,) = loop.upstream_spans(semconv.SPAN_COLD_START_WEIGHT_LOAD)
    assert weights.trace_id == root.trace_id and weights.parent_span_id == root.span_id
    (request,) = [
        span
        for span in loop.upstream_spans(semconv.SPAN_REQUEST)
        if span.trace_id.hex() == first.trace_id
    ]
    assert [(link.trace_id, link.span_id) for link in request.links] == [
        (root.trace_id, root.span_id)
    ]


def test_a_preloaded_model_is_the_cold_start_before_the_server_listens(
    continuous: ServeLoop,
) -> None:
    (root,) = wait_for_spans(continuous, semconv.SPAN_COLD_START)
    (weights,) = continuous.upstream_spans(semconv.SPAN_COLD_START_WEIGHT_LOAD)
    imports = continuous.upstream_spans(semconv.SPAN_COLD_START_IMPORT)
    assert weights.trace_id == root.trace_id and weights.parent_span_id == root.span_id
    assert root.start_time_unix_nano <= weights.start_time_unix_nano
    assert weights.end_time_unix_nano <= root.end_time_unix_nano
    assert [span.trace_id for span in imports] == [root.trace_id]


def test_a_long_prompt_is_prefilled_in_engine_steps_under_its_request(
    continuous: ServeLoop,
) -> None:
    prompt = " ".join(f"word{i}" for i in range(150))  # several steps of 64 tokens
    result = stream_completion(
        continuous.server.base_url, model=continuous.model_name, max_tokens=4, prompt=prompt
    )
    doc = stored_document(continuous, result.trace_id)
    chunks = [
        span
        for span in continuous.upstream_spans(semconv.SPAN_PREFILL_CHUNK)
        if span.trace_id.hex() == result.trace_id
    ]
    assert len(chunks) >= 3, continuous.log_tail()
    tokens = [
        next(kv.value.int_value for kv in span.attributes if kv.key == semconv.PREFILL_CHUNK_TOKENS)
        for span in chunks
    ]
    assert all(0 < count <= _CB_BATCH_TOKENS for count in tokens)
    assert sum(tokens) == doc["tokens"]["input"]


@pytest.mark.parametrize("mode", ["plain", "continuous"])
def test_explain_and_the_api_show_a_transformers_request_like_a_vllm_one(
    mode: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    loop: ServeLoop = (
        request.getfixturevalue("plain")[0]
        if mode == "plain"
        else request.getfixturevalue("continuous")
    )
    result = stream_completion(loop.server.base_url, model=loop.model_name, max_tokens=12)
    doc = stored_document(loop, result.trace_id)
    assert doc["model"] == loop.model_name
    text, _, detail = shown_like_vllm(loop.store_path, result.trace_id, capsys)
    assert f"{loop.model_name} / text_completion" in text
    assert "not reported by transformers serve" in text, text
    assert detail["request"]["not_reported"]["items"], detail["request"]


@pytest.mark.parametrize("mode", ["plain", "continuous"])
def test_a_client_that_goes_away_mid_stream_leaves_an_aborted_request(
    mode: str, request: pytest.FixtureRequest
) -> None:
    loop: ServeLoop = (
        request.getfixturevalue("plain")[0]
        if mode == "plain"
        else request.getfixturevalue("continuous")
    )
    trace_id = os.urandom(16).hex()
    headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
    body = {"model": loop.model_name, "prompt": "hello", "max_tokens": 1000, "stream": True}
    with (
        httpx.Client(base_url=loop.server.base_url, timeout=120.0) as http,
        http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
    ):
        for index, _ in enumerate(response.iter_lines()):
            if index >= 4:
                break
    doc = stored_document(loop, trace_id)
    assert doc["finish_reason"] == "abort", (doc["status_error"], doc["tokens"])
    assert doc["status_error"] == "aborted"
    assert 0 < (doc["tokens"]["output"] or 0) < 1000


def wait_for_spans(loop: ServeLoop, name: str) -> list[object]:
    import time

    deadline = time.monotonic() + _SPAN_WAIT_S
    while time.monotonic() < deadline and not loop.upstream_spans(name):
        time.sleep(0.5)
    return loop.upstream_spans(name)


def test_a_chat_request_is_a_chat_operation_in_the_callers_trace(
    plain: tuple[ServeLoop, Streamed], capsys: pytest.CaptureFixture[str]
) -> None:
    loop, _ = plain
    trace_id = os.urandom(16).hex()
    headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
    body = {
        "model": loop.model_name,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 6,
        "stream": True,
    }
    with (
        httpx.Client(base_url=loop.server.base_url, timeout=120.0) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        response.raise_for_status()
        for _ in response.iter_lines():
            pass
    doc = stored_document(loop, trace_id)
    assert doc["tokens"]["output"] == 6 and doc["finish_reason"] == "length"
    capsys.readouterr()
    assert tokentrace_main(["explain", trace_id, "--store", str(loop.store_path)]) == 0
    assert f"{loop.model_name} / chat" in capsys.readouterr().out
