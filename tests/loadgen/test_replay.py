"""``tokentrace replay``: the simulation's timings, the span layout and its three emission paths."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import socket
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.collector.upstream import UpstreamOtlp
from tokentrace.agent import semconv
from tokentrace.agent.cli import build_parser
from tokentrace.agent.span_encoding import encode_finished_requests
from tokentrace.loadgen.replay.cli import ReplayCommand
from tokentrace.loadgen.replay.emit import emit_sdk, span_count, to_otlp_requests
from tokentrace.loadgen.replay.request import SimulatedRequest
from tokentrace.loadgen.replay.scenarios import SCENARIOS, Scenario
from tokentrace.loadgen.replay.simulation import simulate

T0 = 1_700_000_000_000_000_000
MS = 1_000_000

# One small workload that exercises every part of the span tree: cold start, shared prefixes,
# chunked long prompts, preemptions (tiny KV cache) and client spans.
EVERYTHING = Scenario(
    name="everything",
    description="test workload",
    rate_per_s=20.0,
    cold_start_s=0.5,
    prompt_tokens_max=2048,
    long_prompt_fraction=0.2,
    long_prompt_tokens_median=3000,
    long_prompt_tokens_max=3000,
    max_batched_tokens=1024,
    output_tokens_median=200,
    max_tokens=512,
    kv_cache_tokens=6000,
    shared_prefix_fraction=0.5,
)


@pytest.fixture(scope="module")
def everything() -> list[SimulatedRequest]:
    requests = simulate(EVERYTHING, requests=40, seed=11, start_unix_ns=T0)
    # The fixture must really contain what the layout tests are about.
    assert any(r.preempted for r in requests)
    assert any(len(r.prefill_chunks) > 1 for r in requests)
    assert any(r.ready_ns is not None for r in requests)
    assert any(r.cached_tokens > 0 for r in requests)
    return requests


# --- helpers --------------------------------------------------------------------------------------


def decode(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    assert kind is not None, "an attribute without a value"
    if kind == "array_value":
        return [decode(item) for item in value.array_value.values]
    return getattr(value, kind)


def span_attributes(span: Span) -> dict[str, Any]:
    return {kv.key: decode(kv.value) for kv in span.attributes}


def resource_service(resource: Any) -> str:
    return next(
        kv.value.string_value for kv in resource.attributes if kv.key == semconv.SERVICE_NAME
    )


def otlp_spans(messages: list[ExportTraceServiceRequest]) -> Iterator[tuple[str, str, Span]]:
    """(service, scope, span) of every span in the export requests."""
    for message in messages:
        for resource_spans in message.resource_spans:
            service = resource_service(resource_spans.resource)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    yield service, scope_spans.scope.name, span


def by_trace(messages: list[ExportTraceServiceRequest]) -> dict[bytes, list[Span]]:
    traces: dict[bytes, list[Span]] = defaultdict(list)
    for _, _, span in otlp_spans(messages):
        traces[span.trace_id].append(span)
    return traces


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cold_wait(request: SimulatedRequest) -> int:
    return request.ready_ns - request.arrival_ns if request.ready_ns is not None else 0


def queue_share_of_ttft(request: SimulatedRequest) -> float:
    """Queue wait after the server was ready, as a fraction of TTFT."""
    return (request.first_scheduled_ns - request.arrival_ns - cold_wait(request)) / (
        request.first_token_ns - request.arrival_ns
    )


def prefill_share_of_ttft(request: SimulatedRequest) -> float:
    return (request.first_token_ns - request.first_scheduled_ns) / (
        request.first_token_ns - request.arrival_ns
    )


def inter_token_gaps_us(request: SimulatedRequest) -> list[int]:
    return [b - a for a, b in itertools.pairwise(request.token_offsets_us)]


# --- the simulation -------------------------------------------------------------------------------


def test_same_seed_same_requests_and_different_seed_different_requests() -> None:
    first = simulate("mixed", requests=50, seed=3, start_unix_ns=T0)
    again = simulate("mixed", requests=50, seed=3, start_unix_ns=T0)
    other = simulate("mixed", requests=50, seed=4, start_unix_ns=T0)
    assert first == again
    assert [r.trace_id for r in first] != [r.trace_id for r in other]
    assert [r.ttft_ns for r in first] != [r.ttft_ns for r in other]
    fixed = {"host_name": "h", "pid": 1}
    assert [m.SerializeToString() for m in to_otlp_requests(first, **fixed)] == [
        m.SerializeToString() for m in to_otlp_requests(again, **fixed)
    ]


def test_default_start_time_makes_the_traces_end_about_now() -> None:
    before = time.time_ns()
    requests = simulate("steady", requests=20, seed=1)
    after = time.time_ns()
    last = max(r.client_end_ns or r.server_end_ns for r in requests)
    assert before - 1_000 * MS <= last <= after
    assert min(r.client_start_ns or r.server_start_ns for r in requests) < before - 1_000 * MS


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_timestamp_is_in_order(name: str) -> None:
    requests = simulate(name, requests=60, seed=5, start_unix_ns=T0)
    scenario = SCENARIOS[name]
    assert len(requests) == 60
    assert len({r.trace_id for r in requests}) == 60
    for r in requests:
        server_side = [
            r.server_start_ns,
            r.arrival_ns,
            r.first_scheduled_ns,
            r.first_token_ns,
            r.last_token_ns,
            r.end_ns,
            r.server_end_ns,
        ]
        assert server_side == sorted(server_side), r
        assert r.arrival_ns >= T0
        if scenario.client_spans:
            assert r.client_start_ns is not None and r.client_end_ns is not None
            assert r.client_start_ns <= r.server_start_ns
            assert r.server_end_ns <= r.client_end_ns
            assert r.first_token_ns < (r.client_first_token_ns or 0) <= r.client_end_ns
        previous_end = r.first_scheduled_ns
        for start, end in r.preempted:
            assert previous_end <= start < end <= r.last_token_ns
            previous_end = end
        previous_end = r.first_scheduled_ns
        for chunk in r.prefill_chunks:
            assert previous_end <= chunk.start_ns < chunk.end_ns <= r.first_token_ns
            assert chunk.tokens > 0
            previous_end = chunk.end_ns
        assert r.prefill_chunks[-1].end_ns == r.first_token_ns
        assert sum(c.tokens for c in r.prefill_chunks) >= r.input_tokens - r.cached_tokens
        assert 0 <= r.cached_tokens < r.input_tokens
        assert 1 <= r.output_tokens <= scenario.max_tokens
        assert r.finish_reason == ("length" if r.output_tokens == scenario.max_tokens else "stop")
        offsets = r.token_offsets_us
        assert len(offsets) == r.output_tokens
        assert offsets[0] == 0 and offsets == sorted(offsets)
        assert offsets[-1] == (r.last_token_ns - r.first_token_ns) // 1_000
        if r.ready_ns is not None:
            assert r.arrival_ns < r.ready_ns <= r.first_scheduled_ns
        assert r.requests_ahead >= 0 and 0 <= r.running_at_arrival <= scenario.max_running


def test_closed_loop_clients_never_exceed_the_concurrency() -> None:
    scenario = dataclasses.replace(SCENARIOS["steady"], rate_per_s=None, concurrency=4)
    requests = simulate(scenario, requests=40, seed=2, start_unix_ns=T0)
    events = sorted(
        [(r.client_start_ns, 1) for r in requests] + [(r.client_end_ns, -1) for r in requests],
        key=lambda event: (event[0], event[1]),
    )
    in_flight = list(itertools.accumulate(delta for _, delta in events))
    assert max(in_flight) == 4


def test_scenarios_are_validated() -> None:
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        dataclasses.replace(SCENARIOS["steady"], kv_cache_tokens=1000)
    with pytest.raises(ValueError, match="exactly one"):
        dataclasses.replace(SCENARIOS["steady"], concurrency=3)
    with pytest.raises(ValueError, match="unknown scenario"):
        simulate("no-such-scenario", requests=1)


# --- each scenario's intended cause dominates -----------------------------------------------------


def test_steady_is_decode_bound_without_queueing_or_preemption() -> None:
    requests = simulate("steady", requests=150, seed=1, start_unix_ns=T0)
    assert statistics.median(queue_share_of_ttft(r) for r in requests) < 0.3
    assert not any(r.preempted for r in requests)
    decode_share = [(r.last_token_ns - r.first_token_ns) / r.e2e_ns for r in requests]
    assert statistics.median(decode_share) > 0.8


def test_queue_saturation_makes_ttft_mostly_queue_wait() -> None:
    requests = simulate("queue_saturation", requests=150, seed=1, start_unix_ns=T0)
    assert statistics.median(queue_share_of_ttft(r) for r in requests) > 0.5
    # The queue grows: later arrivals see more requests ahead and a full batch.
    late = requests[-30:]
    assert statistics.median(r.requests_ahead for r in late) > 20
    max_running = SCENARIOS["queue_saturation"].max_running
    assert statistics.median(r.running_at_arrival for r in late) >= max_running - 1


def test_long_prompts_make_ttft_mostly_chunked_prefill() -> None:
    requests = simulate("long_prompts", requests=40, seed=1, start_unix_ns=T0)
    assert statistics.median(prefill_share_of_ttft(r) for r in requests) > 0.5
    assert all(len(r.prefill_chunks) > 1 for r in requests)


def test_cold_start_makes_early_requests_wait_for_the_server() -> None:
    requests = simulate("cold_start", requests=100, seed=1, start_unix_ns=T0)
    waited = [r for r in requests if r.ready_ns is not None]
    assert len(waited) > 80
    assert len({r.ready_ns for r in waited}) == 1
    cold_share = [cold_wait(r) / r.ttft_ns for r in requests]
    assert statistics.median(cold_share) > 0.5


def test_kv_pressure_preempts_and_preemption_outweighs_queue_and_prefill() -> None:
    requests = simulate("kv_pressure", requests=120, seed=1, start_unix_ns=T0)
    preempted = [r for r in requests if r.preempted]
    assert len(preempted) >= 0.2 * len(requests)
    evicted = statistics.median(r.preempted_ns for r in preempted)
    waited = statistics.median(r.first_token_ns - r.arrival_ns for r in preempted)
    assert evicted > waited


def test_interference_spikes_inter_token_latency_at_prefill_steps() -> None:
    def itl_tail_ratio(requests: list[SimulatedRequest]) -> float:
        gaps = [gap for r in requests for gap in inter_token_gaps_us(r)]
        return quantile(gaps, 0.99) / quantile(gaps, 0.5)

    interference = simulate("interference", requests=80, seed=1, start_unix_ns=T0)
    steady = simulate("steady", requests=80, seed=1, start_unix_ns=T0)
    assert itl_tail_ratio(interference) > 2 * itl_tail_ratio(steady)
    short = [r for r in interference if r.input_tokens < 1000 and r.output_tokens > 100]
    assert sum(1 for r in short if r.outlier_steps_with_prefill > 0) > 0.5 * len(short)
    # The marked outliers really are the big gaps of those requests.
    for r in short:
        gaps = inter_token_gaps_us(r)
        big = sum(1 for gap in gaps if gap > 3 * statistics.median(gaps))
        assert r.outlier_steps_with_prefill <= big


def test_network_scenario_adds_twice_the_one_way_delay_around_the_server() -> None:
    requests = simulate("network", requests=80, seed=1, start_unix_ns=T0)
    round_trip = 2 * SCENARIOS["network"].network_one_way_ms * MS
    network = []
    for r in requests:
        assert r.client_start_ns is not None and r.client_end_ns is not None
        network.append(
            (r.client_end_ns - r.client_start_ns) - (r.server_end_ns - r.server_start_ns)
        )
    assert statistics.median(network) == pytest.approx(round_trip, rel=0.05)
    assert all(0.7 * round_trip < n < 1.3 * round_trip for n in network)
    assert statistics.median(network) > statistics.median(r.e2e_ns for r in requests)


def test_mixed_tail_waits_in_the_queue_while_the_median_does_not() -> None:
    requests = simulate("mixed", requests=300, seed=1, start_unix_ns=T0)
    ordered = sorted(requests, key=lambda r: r.ttft_ns)
    median_band = ordered[len(ordered) // 3 : 2 * len(ordered) // 3]
    tail = ordered[int(0.95 * len(ordered)) :]
    assert statistics.median(queue_share_of_ttft(r) for r in median_band) < 0.5
    assert statistics.median(queue_share_of_ttft(r) for r in tail) > 0.5


# --- the tokentrace span layout (to_otlp_requests) ------------------------------------------------


def test_otlp_span_tree_links_up(everything: list[SimulatedRequest]) -> None:
    messages = to_otlp_requests(everything, batch_spans=64)
    traces = by_trace(messages)
    assert len(traces) == len(everything)
    for request in everything:
        spans = traces[request.trace_id]
        assert len(spans) == span_count(request)
        ids = {span.span_id: span for span in spans}
        assert len(ids) == len(spans)
        roots = [span for span in spans if not span.parent_span_id]
        assert [root.name for root in roots] == [semconv.SPAN_CLIENT_REQUEST]
        assert all(span.parent_span_id in ids for span in spans if span.parent_span_id)
        named = Counter(span.name for span in spans)
        (request_span,) = (span for span in spans if span.name == semconv.SPAN_REQUEST)
        http_span = ids[request_span.parent_span_id]
        assert http_span.kind == Span.SPAN_KIND_SERVER
        assert http_span.name == f"POST {request.url_path}"
        assert ids[http_span.parent_span_id].kind == Span.SPAN_KIND_CLIENT
        children = Counter(
            span.name for span in spans if span.parent_span_id == request_span.span_id
        )
        assert (
            children
            == Counter(
                {
                    semconv.SPAN_QUEUE: 1,
                    semconv.SPAN_PREFILL: 1,
                    semconv.SPAN_DECODE: 1,
                    semconv.SPAN_POSTPROCESS: 1,
                    semconv.SPAN_PREEMPTED: len(request.preempted),
                }
            )
            - Counter()
        )  # drop zero counts
        (prefill,) = (span for span in spans if span.name == semconv.SPAN_PREFILL)
        chunks = [span for span in spans if span.parent_span_id == prefill.span_id]
        expected_chunks = request.prefill_chunks if len(request.prefill_chunks) > 1 else []
        assert [
            (c.start_time_unix_nano, c.end_time_unix_nano, span_attributes(c))
            for c in sorted(chunks, key=lambda c: c.start_time_unix_nano)
        ] == [
            (c.start_ns, c.end_ns, {semconv.PREFILL_CHUNK_TOKENS: c.tokens})
            for c in expected_chunks
        ]
        assert named[semconv.SPAN_PREFILL_CHUNK] == len(expected_chunks)
        preempted = sorted(
            (s.start_time_unix_nano, s.end_time_unix_nano)
            for s in spans
            if s.name == semconv.SPAN_PREEMPTED
        )
        assert preempted == request.preempted


def test_request_and_phase_spans_carry_the_simulated_timings(
    everything: list[SimulatedRequest],
) -> None:
    traces = by_trace(to_otlp_requests(everything))
    for request in everything:
        spans = {span.name: span for span in traces[request.trace_id]}

        intervals = {
            name: (span.start_time_unix_nano, span.end_time_unix_nano)
            for name, span in spans.items()
        }
        assert intervals[semconv.SPAN_REQUEST] == (request.arrival_ns, request.end_ns)
        assert intervals[semconv.SPAN_QUEUE] == (request.arrival_ns, request.first_scheduled_ns)
        assert intervals[semconv.SPAN_PREFILL] == (
            request.first_scheduled_ns,
            request.first_token_ns,
        )
        assert intervals[semconv.SPAN_DECODE] == (request.first_token_ns, request.last_token_ns)
        assert intervals[semconv.SPAN_POSTPROCESS] == (request.last_token_ns, request.end_ns)
        client = span_attributes(spans[semconv.SPAN_CLIENT_REQUEST])
        assert client[semconv.CLIENT_FIRST_TOKEN_TIME] == request.client_first_token_ns
        attributes = span_attributes(spans[semconv.SPAN_REQUEST])
        assert attributes[semconv.GEN_AI_REQUEST_MODEL] == EVERYTHING.model
        assert attributes[semconv.GEN_AI_OPERATION_NAME] == request.operation
        assert attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == request.input_tokens
        assert attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == request.output_tokens
        assert attributes[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == request.cached_tokens
        assert attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == [request.finish_reason]
        assert attributes[semconv.REQUEST_ID] == request.request_id
        assert attributes[semconv.QUEUE_REQUESTS_AHEAD] == request.requests_ahead
        assert attributes[semconv.QUEUE_RUNNING_AT_ARRIVAL] == request.running_at_arrival
        assert attributes[semconv.QUEUE_MAX_RUNNING] == EVERYTHING.max_running
        assert attributes.get(semconv.COLD_START_READY_TIME) == request.ready_ns
        prefix = attributes.get(semconv.PROMPT_PREFIX_HASH)
        assert prefix == request.prefix_hash
        if prefix is not None:
            int(prefix, 16)  # a hex hash, never prompt text
        decode = span_attributes(spans[semconv.SPAN_DECODE])
        assert decode[semconv.DECODE_TOKEN_OFFSETS] == request.token_offsets_us
        assert semconv.DECODE_TOKEN_OFFSETS_DROPPED not in decode


def test_server_side_spans_are_the_agents_own_layout(everything: list[SimulatedRequest]) -> None:
    """Replay's request subtree is exactly what the agent encodes from the same finished request."""
    replayed = by_trace(to_otlp_requests(everything, max_token_offsets=64))
    payload, count = encode_finished_requests(
        [request.finished_request() for request in everything],
        resource_attributes={semconv.SERVICE_NAME: "agent"},
        scope_name="agent",
        max_token_offsets=64,
    )
    agent = by_trace([ExportTraceServiceRequest.FromString(payload)])
    assert count == sum(span_count(r) - 2 for r in everything)  # all but client and HTTP spans

    def shape(spans: list[Span]) -> list[tuple[Any, ...]]:
        names = {span.span_id: span.name for span in spans}
        return sorted(
            (
                span.name,
                names.get(span.parent_span_id),
                span.kind,
                span.start_time_unix_nano,
                span.end_time_unix_nano,
                sorted(span_attributes(span).items()),
            )
            for span in spans
        )

    for request in everything:
        spans = replayed[request.trace_id]
        (http,) = (span for span in spans if span.kind == Span.SPAN_KIND_SERVER)
        subtree = [span for span in spans if span.kind == Span.SPAN_KIND_INTERNAL]
        assert request_of(subtree).parent_span_id == http.span_id
        assert request.finished_request().parent_span_id == http.span_id
        assert shape(subtree) == shape(agent[request.trace_id])


def request_of(spans: list[Span]) -> Span:
    (span,) = (span for span in spans if span.name == semconv.SPAN_REQUEST)
    return span


def test_token_offsets_are_capped_with_the_cap_recorded(
    everything: list[SimulatedRequest],
) -> None:
    traces = by_trace(to_otlp_requests(everything, max_token_offsets=16))
    for request in everything:
        (decode,) = (s for s in traces[request.trace_id] if s.name == semconv.SPAN_DECODE)
        attributes = span_attributes(decode)
        assert attributes[semconv.DECODE_TOKEN_OFFSETS] == request.token_offsets_us[:16]
        dropped = attributes.get(semconv.DECODE_TOKEN_OFFSETS_DROPPED, 0)
        assert dropped == max(0, request.output_tokens - 16)


def test_batches_keep_requests_whole_and_separate_client_resources(
    everything: list[SimulatedRequest],
) -> None:
    messages = to_otlp_requests(
        everything, batch_spans=50, service_name="srv", client_service_name="loadgen"
    )
    largest_request = max(span_count(r) for r in everything)
    assert len(messages) > 1
    seen: set[bytes] = set()
    for message in messages:
        spans = list(otlp_spans([message]))
        assert len(spans) < 50 + largest_request
        traces = {span.trace_id for _, _, span in spans}
        assert not traces & seen  # no request straddles two export requests
        seen |= traces
        for service, scope, span in spans:
            assert scope == semconv.REPLAY_SCOPE
            expected = "loadgen" if span.kind == Span.SPAN_KIND_CLIENT else "srv"
            assert service == expected
        resource = message.resource_spans[0].resource
        keys = {kv.key for kv in resource.attributes}
        assert {semconv.SERVICE_NAME, semconv.HOST_NAME, semconv.PROCESS_PID} <= keys


def test_unusual_integer_values_survive_the_wire_encoding() -> None:
    (base,) = simulate("network", requests=1, seed=1, start_unix_ns=T0)
    offsets = [0, 1, 127, 128, 16_383, 16_384, 2**35 - 1]
    request = dataclasses.replace(
        base,
        output_tokens=len(offsets),
        token_offsets_us=offsets,
        requests_ahead=2**40,
        running_at_arrival=0,
    )
    huge = dataclasses.replace(request, token_offsets_us=[0, 2**35, 2**62])
    for candidate in (request, huge):
        (message,) = to_otlp_requests([candidate])
        # Re-parse from bytes: what a receiver sees.
        parsed = ExportTraceServiceRequest.FromString(message.SerializeToString())
        spans = {span.name: span for _, _, span in otlp_spans([parsed])}
        decode = span_attributes(spans[semconv.SPAN_DECODE])
        assert decode[semconv.DECODE_TOKEN_OFFSETS] == candidate.token_offsets_us
        attributes = span_attributes(spans[semconv.SPAN_REQUEST])
        assert attributes[semconv.QUEUE_REQUESTS_AHEAD] == 2**40
        assert attributes[semconv.QUEUE_RUNNING_AT_ARRIVAL] == 0


# --- the SDK path gives the same spans ------------------------------------------------------------


def _canonical(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _sdk_traces(spans: tuple[ReadableSpan, ...]) -> dict[int, list[ReadableSpan]]:
    traces: dict[int, list[ReadableSpan]] = defaultdict(list)
    for span in spans:
        assert span.context is not None
        traces[span.context.trace_id].append(span)
    return traces


def _shape_of_sdk_trace(spans: list[ReadableSpan]) -> list[tuple[Any, ...]]:
    names = {span.context.span_id: span.name for span in spans if span.context}
    return sorted(
        (
            span.name,
            names[span.parent.span_id] if span.parent else None,
            span.kind.name,
            span.start_time,
            span.end_time,
            sorted((k, _canonical(v)) for k, v in (span.attributes or {}).items()),
        )
        for span in spans
    )


def _shape_of_otlp_trace(spans: list[Span]) -> list[tuple[Any, ...]]:
    names = {span.span_id: span.name for span in spans}
    return sorted(
        (
            span.name,
            names[span.parent_span_id] if span.parent_span_id else None,
            Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
            span.start_time_unix_nano,
            span.end_time_unix_nano,
            sorted(span_attributes(span).items()),
        )
        for span in spans
    )


@pytest.mark.parametrize("dialect", ["tokentrace", "vllm"])
def test_sdk_emission_matches_the_otlp_messages(
    everything: list[SimulatedRequest], dialect: Any
) -> None:
    server_exporter, client_exporter = InMemorySpanExporter(), InMemorySpanExporter()
    server = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: "srv"}))
    client = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: "loadgen"}))
    server.add_span_processor(SimpleSpanProcessor(server_exporter))
    client.add_span_processor(SimpleSpanProcessor(client_exporter))
    emitted = emit_sdk(everything, server, dialect=dialect, client_tracer_provider=client)

    sdk_spans = server_exporter.get_finished_spans() + client_exporter.get_finished_spans()
    assert emitted == len(sdk_spans) == sum(span_count(r, dialect) for r in everything)
    for span in client_exporter.get_finished_spans():
        assert span.name == semconv.SPAN_CLIENT_REQUEST
    expected_scope = semconv.VLLM_TRACING_SCOPE if dialect == "vllm" else semconv.REPLAY_SCOPE
    scopes = {s.instrumentation_scope.name if s.instrumentation_scope else "" for s in sdk_spans}
    assert scopes == {expected_scope}
    # Trace ids differ (the SDK's generator); the shapes, times and attributes must not.
    sdk_shapes = sorted(_shape_of_sdk_trace(t) for t in _sdk_traces(sdk_spans).values())
    otlp = by_trace(to_otlp_requests(everything, dialect=dialect))
    otlp_shapes = sorted(_shape_of_otlp_trace(t) for t in otlp.values())
    assert sdk_shapes == otlp_shapes


def test_vllm_dialect_is_one_span_per_request_with_consistent_latencies(
    everything: list[SimulatedRequest],
) -> None:
    messages = to_otlp_requests(everything, dialect="vllm")
    spans = list(otlp_spans(messages))
    assert len(spans) == len(everything)
    by_id = {}
    for _, scope, span in spans:
        assert scope == semconv.VLLM_TRACING_SCOPE
        assert span.name == semconv.VLLM_SPAN_REQUEST
        assert span.kind == Span.SPAN_KIND_SERVER and not span.parent_span_id
        attributes = span_attributes(span)
        by_id[attributes[semconv.VLLM_REQUEST_ID]] = (span, attributes)
    for request in everything:
        span, attributes = by_id[request.request_id]
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (
            request.arrival_ns,
            request.end_ns,
        )
        seconds = 1e-9
        latency = {
            name: attributes[name]
            for name in (
                semconv.VLLM_LATENCY_TTFT,
                semconv.VLLM_LATENCY_E2E,
                semconv.VLLM_LATENCY_QUEUE,
                semconv.VLLM_LATENCY_PREFILL,
                semconv.VLLM_LATENCY_DECODE,
                semconv.VLLM_LATENCY_INFERENCE,
            )
        }
        assert all(isinstance(value, float) for value in latency.values())
        approx = pytest.approx
        assert latency[semconv.VLLM_LATENCY_E2E] == approx(request.e2e_ns * seconds)
        assert latency[semconv.VLLM_LATENCY_TTFT] == approx(request.ttft_ns * seconds)
        assert latency[semconv.VLLM_LATENCY_QUEUE] == approx(request.queue_ns * seconds)
        queue_and_prefill = (
            latency[semconv.VLLM_LATENCY_QUEUE] + latency[semconv.VLLM_LATENCY_PREFILL]
        )
        assert queue_and_prefill == approx(latency[semconv.VLLM_LATENCY_TTFT])
        prefill_and_decode = (
            latency[semconv.VLLM_LATENCY_PREFILL] + latency[semconv.VLLM_LATENCY_DECODE]
        )
        assert prefill_and_decode == approx(latency[semconv.VLLM_LATENCY_INFERENCE])
        assert latency[semconv.VLLM_LATENCY_DECODE] == approx(
            (request.last_token_ns - request.first_token_ns) * seconds
        )
        assert attributes[semconv.VLLM_USAGE_PROMPT_TOKENS] == request.input_tokens
        assert attributes[semconv.VLLM_USAGE_COMPLETION_TOKENS] == request.output_tokens
        assert semconv.GEN_AI_REQUEST_MODEL not in attributes  # vLLM does not set it


# --- the command ----------------------------------------------------------------------------------


def _run(*argv: str) -> int:
    command = ReplayCommand()
    args: argparse.Namespace = build_parser({"replay": command}).parse_args(["replay", *argv])
    return command.run(args)


def test_replay_command_sends_every_span_over_grpc(
    upstream: UpstreamOtlp, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = upstream.grpc_endpoint
    code = _run("--endpoint", endpoint, "--scenario", "steady", "--requests", "25", "--seed", "9")
    out, err = capsys.readouterr()
    expected = simulate("steady", requests=25, seed=9, start_unix_ns=T0)
    spans = list(otlp_spans(upstream.trace_requests))
    assert code == 0, err
    assert len(spans) == sum(span_count(r) for r in expected)
    services = {service for service, _, _ in spans}
    assert services == {"vllm-demo", "tokentrace-replay-client"}
    assert (
        sorted(s.name for _, _, s in spans if s.name == semconv.SPAN_REQUEST)
        == [semconv.SPAN_REQUEST] * 25
    )
    assert "100%" in err
    assert "25 requests" in out and "export succeeded" in out and f"{len(spans)} spans" in out


def test_replay_command_over_http_protobuf_in_vllm_dialect(
    upstream: UpstreamOtlp, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _run(
        "--endpoint", upstream.http_endpoint, "--protocol", "http/protobuf",
        "--requests", "12", "--seed", "1", "--dialect", "vllm", "--quiet",
    )  # fmt: skip
    _, err = capsys.readouterr()
    assert code == 0, err
    assert {(call.transport, call.signal) for call in upstream.calls} == {("http", "traces")}
    spans = list(otlp_spans(upstream.trace_requests))
    assert [span.name for _, _, span in spans] == [semconv.VLLM_SPAN_REQUEST] * 12
    assert err == ""  # --quiet: no progress lines


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_unreachable_endpoint_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = _run("--endpoint", f"http://127.0.0.1:{_free_port()}", "--requests", "5")
    out, err = capsys.readouterr()
    assert code == 1
    assert "cannot reach 127.0.0.1" in err
    assert "Traceback" not in out + err


def test_rejected_export_is_reported_as_a_failure(
    upstream: UpstreamOtlp, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream.fail_next(1_000_000, http_status=400)  # every call
    code = _run(
        "--endpoint", upstream.http_endpoint, "--protocol", "http/protobuf", "--requests", "5",
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1
    assert "failed" in err and "spans not accepted" in err
    assert "Traceback" not in out + err
    assert "export succeeded" not in out


def test_endpoint_defaults_follow_the_otlp_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokentrace.loadgen.replay.cli import ReplayError, resolve_target

    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ):
        monkeypatch.delenv(name, raising=False)
    assert resolve_target(None, None).endpoint == "http://127.0.0.1:4317"
    assert resolve_target(None, "http/protobuf").endpoint == "http://127.0.0.1:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:5555")
    target = resolve_target(None, None)
    assert (target.endpoint, target.host, target.port) == (
        "http://collector:5555",
        "collector",
        5555,
    )
    assert resolve_target(None, "http/protobuf").endpoint == "http://collector:5555/v1/traces"
    assert resolve_target("example:7777", None).endpoint == "http://example:7777"
    with pytest.raises(ReplayError):
        resolve_target("ftp://x:1", None)


def test_replay_is_registered_as_a_tokentrace_command() -> None:
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert 'replay = "tokentrace.loadgen.replay.cli:ReplayCommand"' in pyproject.read_text()


def test_command_module_imports_only_the_standard_library() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from tokentrace.loadgen.replay.cli import ReplayCommand\n"
        "import argparse\n"
        "ReplayCommand().add_arguments(argparse.ArgumentParser())\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'grpc', "
        "'google', 'tokentrace.collector'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
