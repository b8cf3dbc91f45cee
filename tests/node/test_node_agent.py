"""The node agent end to end: the in-process agent's spans -> node agent -> a test OTLP receiver.

The in-process agent (recorder, emitter, OTLP sender) exports a request's spans to the node
agent's real gRPC receiver; the node agent enriches them with the stand-in GPUs' samples (read
through the real pynvml) and relays them to a real OTLP receiver, where the test checks each
phase span against the samples inside its own window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.collector.upstream import UpstreamOtlp
from tests.node.nvml_stand_in import NvmlStandIn
from tests.spanbuild import decode_value
from tokentrace.agent import semconv
from tokentrace.agent.config import load_agent_config
from tokentrace.agent.node.enrich import ENRICHED_SPANS
from tokentrace.agent.node.sampler import GpuSample, NvmlSampler
from tokentrace.agent.node.service import NodeAgent, NodeAgentConfig
from tokentrace.agent.otlp_config import OtlpExporterConfig
from tokentrace.agent.runtime import AgentRuntime
from tokentrace.agent.span_ids import random_trace_id
from tokentrace.collector.consumer import Overloaded


def relayed(upstream: UpstreamOtlp) -> list[tuple[dict[str, Any], Span]]:
    """(resource attributes, span) of every span the upstream receiver got."""
    return [
        (_attributes(rs.resource.attributes), span)
        for request in upstream.trace_requests
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]


def _attributes(attributes: Any) -> dict[str, Any]:
    return {kv.key: decode_value(kv.value) for kv in attributes}


def _node_agent(upstream: UpstreamOtlp, sampler: NvmlSampler, **options: Any) -> NodeAgent:
    config = NodeAgentConfig(
        grpc_endpoint="127.0.0.1:0",
        http_endpoint="127.0.0.1:0",
        exporter=OtlpExporterConfig(endpoint=upstream.grpc_endpoint, protocol="grpc"),
        **options,
    )
    agent = NodeAgent(
        config, sampler=sampler, environ={"K8S_NODE_NAME": "gpu-node-7", "POD_NAME": "na-x"}
    )
    agent.start()
    return agent


def _expected(samples: list[GpuSample]) -> dict[str, float]:
    """The aggregates of exactly these samples, computed here without the enricher's code."""
    n = len(samples)
    return {
        semconv.GPU_SAMPLES: n,
        semconv.GPU_UTILIZATION_MEAN: sum(s.utilization or 0 for s in samples) / n,
        semconv.GPU_UTILIZATION_MAX: max(s.utilization or 0 for s in samples),
        semconv.GPU_MEMORY_BANDWIDTH_GBPS: sum(s.memory_bandwidth_bps or 0 for s in samples)
        / n
        / 1e9,
        semconv.GPU_MEMORY_USED_BYTES: round(sum(s.memory_used_bytes or 0 for s in samples) / n),
        semconv.GPU_POWER_WATTS: sum(s.power_watts or 0 for s in samples) / n,
    }


@pytest.mark.parametrize("handover", ["otlp", "local socket"])
def test_each_phase_span_carries_the_aggregates_of_the_samples_inside_its_window(
    nvml: NvmlStandIn, upstream: UpstreamOtlp, tmp_path: Path, handover: str
) -> None:
    """The agent exports OTLP to the node agent, or hands it its finished requests over the
    local socket (``agent/local_relay.py``) for the node agent to build their spans: the same
    spans, enriched alike."""
    # Values that change every read, so every window has its own mean and max.
    nvml.set_ramp(0, "gpu_util", 5, 3)
    nvml.set_ramp(0, "dram_bw_util", 10, 2)
    nvml.set_ramp(0, "power_mw", 200_000, 7_000)
    nvml.set_ramp(0, "mem_used", 10 << 30, 1 << 28)
    sampler = NvmlSampler()
    assert sampler.open()
    gpu = sampler.devices[0]
    local_socket = str(tmp_path / "node.sock") if handover == "local socket" else None
    agent = _node_agent(upstream, sampler, local_socket=local_socket)
    environment = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{agent.receivers[0].port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "CUDA_VISIBLE_DEVICES": gpu.uuid,
        "OTEL_SERVICE_NAME": "vllm-test",
    }
    if local_socket is not None:
        environment["TOKENTRACE_NODE_SOCKET"] = local_socket
    runtime = AgentRuntime(load_agent_config(environment))
    try:

        def tick(n: int) -> None:
            for _ in range(n):
                time.sleep(0.002)
                sampler.sample_once()

        tick(2)
        timer = runtime.recorder.begin("req-1")
        assert timer is not None
        timer.trace_id = random_trace_id()
        timer.queued_ns = time.monotonic_ns()
        tick(3)  # queue
        timer.first_scheduled_ns = time.monotonic_ns()
        tick(4)  # prefill
        for _ in range(6):  # decode: a token after every two samples
            timer.token_ns.append(time.monotonic_ns())
            tick(2)
        timer.token_ns.append(time.monotonic_ns())
        runtime.recorder.finish("req-1")
        assert runtime.flush(5.0)
        # The spans end after the newest sample: the node agent holds them for the next one.
        time.sleep(0.3)
        assert relayed(upstream) == []
        tick(1)
        assert upstream.wait_for(lambda: len(relayed(upstream)) >= 4)
        stats = runtime.stats()
        if local_socket is None:
            assert stats["emitter.handed_to_sender_requests"] == 1
        else:
            assert stats["emitter.handed_to_node_requests"] == 1
            assert stats["sender.sent_spans"] == 0  # nothing exported by this process
            assert agent.stats()["LocalSocketReceiver.accepted_spans"] == len(relayed(upstream))
    finally:
        runtime.shutdown(1.0)
        agent.shutdown(2.0)

    ring = sampler.ring(gpu.uuid)
    assert ring is not None
    samples = ring.snapshot()
    by_name = {span.name: (resource, span) for resource, span in relayed(upstream)}
    assert ENRICHED_SPANS & set(by_name) == {
        semconv.SPAN_REQUEST,
        semconv.SPAN_PREFILL,
        semconv.SPAN_DECODE,
    }
    for name in (semconv.SPAN_REQUEST, semconv.SPAN_PREFILL, semconv.SPAN_DECODE):
        resource, span = by_name[name]
        inside = [
            s for s in samples if span.start_time_unix_nano <= s.time_ns <= span.end_time_unix_nano
        ]
        assert len(inside) >= 2, name
        attributes = _attributes(span.attributes)
        for key, value in _expected(inside).items():
            assert attributes[key] == pytest.approx(value), (name, key)
        assert attributes[semconv.GPU_MEMORY_BANDWIDTH_SOURCE] == "gpm"
        assert attributes[semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO] == pytest.approx(
            attributes[semconv.GPU_MEMORY_BANDWIDTH_GBPS] * 1e9 / gpu.peak_bandwidth_bps  # type: ignore[operator,unused-ignore]
        )
        assert resource[semconv.GPU_UUIDS] == [gpu.uuid]
        assert resource[semconv.K8S_NODE_NAME] == "gpu-node-7"
        assert resource[semconv.HOST_NAME] == "gpu-node-7"
        assert resource[semconv.SERVICE_NAME] == "vllm-test"
    # Phases differ: the request's window holds the prefill's and the decode's samples.
    request_samples = _attributes(by_name[semconv.SPAN_REQUEST][1].attributes)[semconv.GPU_SAMPLES]
    prefill_samples = _attributes(by_name[semconv.SPAN_PREFILL][1].attributes)[semconv.GPU_SAMPLES]
    assert request_samples > prefill_samples
    # The queue span is not a GPU phase.
    queue = _attributes(by_name[semconv.SPAN_QUEUE][1].attributes)
    assert semconv.GPU_SAMPLES not in queue
    assert agent.stats()["relayed_spans"] == len(relayed(upstream))


def _request(
    spans: list[Span], *, resource: dict[str, Any] | None = None
) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in (resource or {}).items():
        entry = resource_spans.resource.attributes.add(key=key)
        if isinstance(value, int):
            entry.value.int_value = value
        elif isinstance(value, list):
            for item in value:
                entry.value.array_value.values.add(string_value=item)
        else:
            entry.value.string_value = value
    resource_spans.scope_spans.add().spans.extend(spans)
    return request


def _span(name: str, start: int, end: int, *, trace: bytes = b"t" * 16, **attrs: Any) -> Span:
    """A span with int (or int-array) attributes; ``trace`` is its trace id."""
    span = Span(
        name=name,
        trace_id=trace,
        span_id=b"s" * 8,
        start_time_unix_nano=start,
        end_time_unix_nano=end,
    )
    for key, value in attrs.items():
        entry: KeyValue = span.attributes.add(key=key)
        if isinstance(value, list):
            for item in value:
                entry.value.array_value.values.add(int_value=item)
        else:
            entry.value.int_value = value
    return span


def _fake_clock(start: int = 1_000_000_000) -> Callable[[], int]:
    now = [start]

    def clock() -> int:
        now[0] += 100_000_000  # 100 ms per sample
        return now[0]

    return clock


def test_process_list_maps_a_process_without_gpu_uuids(
    nvml: NvmlStandIn, upstream: UpstreamOtlp
) -> None:
    nvml.add_process(1, pid=31337, used_memory_bytes=1 << 30, sm_util=10, mem_util=5)
    sampler = NvmlSampler(clock=_fake_clock())
    assert sampler.open()
    for _ in range(10):
        sampler.sample_once()
    agent = _node_agent(upstream, sampler)
    try:
        agent.consume_traces(
            _request(
                [_span(semconv.SPAN_REQUEST, 1_050_000_000, 1_650_000_000)],
                resource={semconv.PROCESS_PID: 31337},
            )
        )
        agent.consume_traces(
            _request(
                [_span(semconv.SPAN_REQUEST, 1_050_000_000, 1_650_000_000)],
                resource={semconv.PROCESS_PID: 4},  # not on a GPU
            )
        )
        assert upstream.wait_for(lambda: len(relayed(upstream)) == 2)
    finally:
        agent.shutdown(2.0)
    (mapped_resource, mapped), (unmapped_resource, unmapped) = relayed(upstream)
    assert mapped_resource[semconv.GPU_UUIDS] == [sampler.devices[1].uuid]
    assert _attributes(mapped.attributes)[semconv.GPU_SAMPLES] == 6  # 1.1 s ... 1.6 s
    assert semconv.GPU_UUIDS not in unmapped_resource
    assert semconv.GPU_SAMPLES not in _attributes(unmapped.attributes)
    assert agent.stats()["enricher.unmapped_spans"] == 1


def test_a_short_step_between_two_samples_gets_the_covering_sample(nvml: NvmlStandIn) -> None:
    from tokentrace.agent.node.enrich import SpanEnricher

    nvml.set_ramp(0, "gpu_util", 10, 10)
    sampler = NvmlSampler(clock=_fake_clock())
    assert sampler.open()
    for _ in range(4):  # samples at 1.1, 1.2, 1.3, 1.4 s with 10, 20, 30, 40 %
        sampler.sample_once()
    uuid = sampler.devices[0].uuid
    request = _request(
        [_span(semconv.SPAN_ENGINE_STEP, 1_210_000_000, 1_215_000_000)],
        resource={semconv.GPU_UUIDS: [uuid]},
    )
    SpanEnricher(sampler).enrich(request)
    attributes = _attributes(request.resource_spans[0].scope_spans[0].spans[0].attributes)
    assert attributes[semconv.GPU_SAMPLES] == 0
    assert attributes[semconv.GPU_UTILIZATION_MEAN] == pytest.approx(0.30)  # the 1.3 s sample
    sampler.stop()


def test_tensor_parallel_spans_sum_bandwidth_and_roofline_uses_the_weights(
    nvml: NvmlStandIn,
) -> None:
    from tokentrace.agent.node.enrich import SpanEnricher

    nvml.set(0, "dram_bw_util", 50)
    nvml.set(1, "dram_bw_util", 70)
    sampler = NvmlSampler(clock=_fake_clock())
    assert sampler.open()
    for _ in range(10):
        sampler.sample_once()
    uuids = [d.uuid for d in sampler.devices]
    peak = sum(d.peak_bandwidth_bps or 0 for d in sampler.devices)
    enricher = SpanEnricher(sampler)
    shard = 8_000_000_000  # two workers, 8 GB of weights each
    for pid in (101, 102):
        enricher.enrich(
            _request(
                [
                    _span(
                        semconv.SPAN_COLD_START_WEIGHT_LOAD,
                        0,
                        1,
                        trace=b"c" * 16,
                        **{semconv.MODEL_WEIGHT_BYTES: shard},
                    )
                ],
                resource={semconv.GPU_UUIDS: uuids, semconv.PROCESS_PID: pid},
            )
        )
    assert enricher.weight_bytes(tuple(uuids)) == 2 * shard
    # 11 tokens over 0.5 s: 50 ms per token, against 16 GB / peak at the limit.
    decode = _span(
        semconv.SPAN_DECODE,
        1_150_000_000,
        1_650_000_000,
        **{semconv.DECODE_TOKEN_OFFSETS: list(range(0, 500_001, 50_000))},  # type: ignore[arg-type]
    )
    request = _request([decode], resource={semconv.GPU_UUIDS: uuids, semconv.PROCESS_PID: 100})
    enricher.enrich(request)
    attributes = _attributes(request.resource_spans[0].scope_spans[0].spans[0].attributes)
    assert attributes[semconv.DECODE_ROOFLINE_RATIO] == pytest.approx(2 * shard / peak / 0.05)
    per_gpu_peak = sampler.devices[0].peak_bandwidth_bps or 0
    assert attributes[semconv.GPU_MEMORY_BANDWIDTH_GBPS] == pytest.approx(
        (0.5 + 0.7) * per_gpu_peak / 1e9
    )
    assert attributes[semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO] == pytest.approx(0.6)
    assert attributes[semconv.GPU_SAMPLES] == 10  # five samples in the window on each GPU
    # A new server start on the same GPUs replaces the old workers' weights.
    enricher.enrich(
        _request(
            [
                _span(
                    semconv.SPAN_COLD_START_WEIGHT_LOAD,
                    0,
                    1,
                    trace=b"d" * 16,
                    **{semconv.MODEL_WEIGHT_BYTES: 5},
                )
            ],
            resource={semconv.GPU_UUIDS: uuids, semconv.PROCESS_PID: 300},
        )
    )
    assert enricher.weight_bytes(tuple(uuids)) == 5
    sampler.stop()


def test_held_spans_go_on_after_max_hold_and_a_full_hold_queue_refuses(
    nvml: NvmlStandIn, upstream: UpstreamOtlp
) -> None:
    sampler = NvmlSampler()
    assert sampler.open()
    sampler.sample_once()
    agent = _node_agent(upstream, sampler, max_hold_s=0.3, max_held_spans=2)
    try:
        future = time.time_ns() + 60 * 10**9  # a window the sampler will not reach in time
        uuid = sampler.devices[0].uuid
        resource = {semconv.GPU_UUIDS: [uuid]}
        agent.consume_traces(
            _request([_span(semconv.SPAN_REQUEST, future - 10, future)] * 2, resource=resource)
        )
        with pytest.raises(Overloaded):
            agent.consume_traces(
                _request([_span(semconv.SPAN_REQUEST, future - 10, future)], resource=resource)
            )
        started = time.monotonic()
        assert upstream.wait_for(lambda: len(relayed(upstream)) == 2)
        assert time.monotonic() - started >= 0.2
        stats = agent.stats()
        assert stats["released_unsampled"] == 1
        assert stats["refused_spans"] == 1
    finally:
        agent.shutdown(2.0)


def test_without_nvml_spans_are_relayed_unchanged(
    nvml: NvmlStandIn, upstream: UpstreamOtlp
) -> None:
    nvml.set_init_error(9)  # NVML_ERROR_DRIVER_NOT_LOADED: a CPU node
    agent = _node_agent(upstream, NvmlSampler())
    try:
        assert not agent.sampler.available
        span = _span(semconv.SPAN_DECODE, 1, 2, **{semconv.DECODE_TOKEN_OFFSETS: [0, 5]})  # type: ignore[arg-type]
        agent.consume_traces(_request([span], resource={semconv.PROCESS_PID: 1}))
        assert upstream.wait_for(lambda: len(relayed(upstream)) == 1)
    finally:
        agent.shutdown(2.0)
    resource, passed = relayed(upstream)[0]
    assert passed.attributes == span.attributes
    assert resource == {semconv.PROCESS_PID: 1, **agent.identity}


def test_gpu_metrics_use_hardware_convention_names_and_window_means(
    nvml: NvmlStandIn, upstream: UpstreamOtlp
) -> None:
    nvml.set_ramp(0, "gpu_util", 20, 10)
    nvml.add_process(0, pid=555, used_memory_bytes=7 << 30, sm_util=60, mem_util=30)
    sampler = NvmlSampler()
    assert sampler.open()
    agent = _node_agent(
        upstream,
        sampler,
        metrics_exporter=OtlpExporterConfig(
            metrics_endpoint=upstream.grpc_endpoint, protocol="grpc"
        ),
    )
    try:
        for _ in range(4):  # 20, 30, 40, 50 %
            sampler.sample_once()
        assert agent.export_metrics() > 0
        assert agent.metric_sender is not None and agent.metric_sender.force_flush(5.0)
    finally:
        agent.shutdown(2.0)
    metrics = {
        metric.name: metric
        for request in upstream.metric_requests
        for rm in request.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
    }
    gpu0 = sampler.devices[0].uuid
    utilization = {
        _attributes(p.attributes)[semconv.HW_ID]: p.as_double
        for p in metrics[semconv.METRIC_HW_GPU_UTILIZATION].gauge.data_points
    }
    assert utilization[gpu0] == pytest.approx(0.35)
    limit = metrics[semconv.METRIC_HW_GPU_MEMORY_LIMIT].sum
    assert not limit.is_monotonic
    assert {p.as_int for p in limit.data_points} == {80 << 30}
    io = metrics[semconv.METRIC_HW_GPU_IO].sum
    assert io.is_monotonic
    assert {_attributes(p.attributes)[semconv.NETWORK_IO_DIRECTION] for p in io.data_points} == {
        semconv.NETWORK_IO_DIRECTION_TRANSMIT,
        semconv.NETWORK_IO_DIRECTION_RECEIVE,
    }
    process = metrics[semconv.METRIC_GPU_PROCESS_MEMORY_USAGE].sum.data_points[0]
    assert _attributes(process.attributes)[semconv.PROCESS_PID] == 555
    assert process.as_int == 7 << 30
    assert semconv.METRIC_HW_POWER in metrics
    resource = _attributes(upstream.metric_requests[0].resource_metrics[0].resource.attributes)
    assert resource[semconv.K8S_NODE_NAME] == "gpu-node-7"


def test_when_every_gpu_is_lost_spans_are_not_held(
    nvml: NvmlStandIn, upstream: UpstreamOtlp
) -> None:
    sampler = NvmlSampler()
    assert sampler.open()
    sampler.sample_once()
    nvml.lose_gpu(0)
    nvml.lose_gpu(1)
    sampler.sample_once()
    assert sampler.sampled_gpus == 0
    agent = _node_agent(upstream, sampler, max_hold_s=30.0)
    try:
        future = time.time_ns() + 60 * 10**9
        started = time.monotonic()
        agent.consume_traces(_request([_span(semconv.SPAN_REQUEST, future - 10, future)]))
        assert upstream.wait_for(lambda: len(relayed(upstream)) == 1, timeout_s=5.0)
        assert time.monotonic() - started < 5.0  # not the 30 s hold
    finally:
        agent.shutdown(2.0)


class _FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Blocked:
    """A stage that takes all the time it is given (a receiver whose calls never finish, an
    upstream that never answers): it records the timeout and moves the clock past it."""

    def __init__(self, clock: _FakeClock | None) -> None:
        self.timeouts: list[float] = []
        self._clock = clock

    def shutdown(self, timeout_s: float) -> None:
        self.timeouts.append(timeout_s)
        if self._clock is not None:
            self._clock.now += timeout_s


def test_shutdown_takes_one_deadline_whatever_its_stages_wait_for() -> None:
    clock = _FakeClock()
    config = NodeAgentConfig(
        grpc_endpoint="127.0.0.1:0",
        http_endpoint="127.0.0.1:0",
        exporter=OtlpExporterConfig(endpoint="127.0.0.1:9", protocol="grpc"),
    )
    agent = NodeAgent(config, sampler=NvmlSampler(), environ={}, monotonic=clock)
    receiver, traces, metrics = _Blocked(clock), _Blocked(clock), _Blocked(None)
    agent._receivers.append(receiver)  # no real receiver waits on this clock
    agent.trace_sender = traces  # type: ignore[assignment]
    agent.metric_sender = metrics  # type: ignore[assignment]  # flushes beside the traces
    started = clock.now
    agent.shutdown(5.0)
    assert receiver.timeouts == [2.0]  # its cap
    assert traces.timeouts == metrics.timeouts == [3.0]  # what was left, to both at once
    # The whole shutdown within its timeout (a bound per stage once added up to 12 s here).
    assert clock.now - started == pytest.approx(5.0)
