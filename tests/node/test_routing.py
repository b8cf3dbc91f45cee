"""The node agent's trace-ID routing over several collector replicas (``agent/node/routing.py``).

Unit tests of the rendezvous choice (the same in every process, balanced, stable when an
endpoint leaves), of splitting a request by owner, and of re-routing a leaving endpoint's queue;
then end to end with real sockets on 127.0.0.1: the official OTLP/gRPC exporter sends to the
node agent's receiver, and the node agent routes to two or three real ``OtlpGrpcReceiver``s.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from tests.collector.consumers import RecordingConsumer
from tokentrace.agent import semconv
from tokentrace.agent.node.routing import (
    EndpointHashes,
    TraceRouter,
    address_endpoint,
    parse_dns_target,
    split_by_owner,
)
from tokentrace.agent.node.sampler import NvmlSampler
from tokentrace.agent.node.service import NodeAgent, NodeAgentConfig
from tokentrace.agent.node_cli import NodeAgentCommand, config_from_args
from tokentrace.agent.otlp_config import OtlpExporterConfig, RetryConfig
from tokentrace.agent.otlp_export import OtlpSender
from tokentrace.collector.receivers.otlp_grpc import OtlpGrpcReceiver

REPO = Path(__file__).resolve().parents[2]
ENDPOINTS = ("http://10.0.0.1:4317", "http://10.0.0.2:4317", "http://10.0.0.3:4317")


def _trace_ids(n: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


# -- the rendezvous choice ---------------------------------------------------------------------


def test_the_owner_is_the_same_in_every_process_and_for_any_order_of_the_set() -> None:
    trace_ids = _trace_ids(200)
    owners = [EndpointHashes(ENDPOINTS).owner(t) for t in trace_ids]
    assert owners == [EndpointHashes(reversed(ENDPOINTS)).owner(t) for t in trace_ids]
    assert set(owners) == set(ENDPOINTS)
    # Another interpreter, with another str hash seed: a node agent on another node.
    script = (
        "import sys\n"
        "from tokentrace.agent.node.routing import EndpointHashes\n"
        f"hashes = EndpointHashes({ENDPOINTS!r})\n"
        "for line in sys.stdin.read().split():\n"
        "    print(hashes.owner(bytes.fromhex(line)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        input="\n".join(t.hex() for t in trace_ids),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        timeout=60,
    )
    assert result.stdout.split() == owners


@pytest.mark.parametrize("n", [2, 3, 4])
def test_trace_ids_spread_evenly_over_the_endpoints(n: int) -> None:
    endpoints = [f"http://10.0.0.{i}:4317" for i in range(1, n + 1)]
    hashes = EndpointHashes(endpoints)
    counts = Counter(hashes.owner(t) for t in _trace_ids(10_000, seed=n))
    assert set(counts) == set(endpoints)
    expected = 10_000 / n
    # Binomial: one standard deviation is ~50 here; 10% is at least 5 of them.
    for endpoint in endpoints:
        assert abs(counts[endpoint] - expected) < 0.1 * expected, counts


@pytest.mark.parametrize("removed", range(4))
def test_removing_an_endpoint_moves_only_its_trace_ids(removed: int) -> None:
    endpoints = [f"http://10.0.0.{i}:4317" for i in range(1, 5)]
    before = EndpointHashes(endpoints)
    gone = endpoints[removed]
    after = EndpointHashes(e for e in endpoints if e != gone)
    moved: Counter[str] = Counter()
    for trace_id in _trace_ids(10_000, seed=removed):
        old, new = before.owner(trace_id), after.owner(trace_id)
        if old != gone:
            assert new == old
        else:
            moved[new] += 1
    # The leaving endpoint's ~1/4 spread over the three others.
    assert set(moved) == set(endpoints) - {gone}
    assert 2000 < sum(moved.values()) < 3000


def test_dns_targets_and_the_endpoints_of_resolved_addresses() -> None:
    assert parse_dns_target("dns:///tokentrace-collector-headless.tokentrace.svc:4317") == (
        "tokentrace-collector-headless.tokentrace.svc",
        4317,
    )
    assert parse_dns_target("collectors:4317") == ("collectors", 4317)
    for bad in ("collectors", "http://collectors:4317", "dns:///collectors"):
        with pytest.raises(ValueError, match="expected dns:///HOST:PORT or HOST:PORT"):
            parse_dns_target(bad)
    plaintext = OtlpExporterConfig(endpoint="http://collector:4317", protocol="grpc")
    assert address_endpoint(plaintext, "10.1.2.3", 4317) == "http://10.1.2.3:4317"
    assert address_endpoint(plaintext, "fd00::5", 4317) == "http://[fd00::5]:4317"
    tls = OtlpExporterConfig(endpoint="collector:4317", protocol="grpc")
    assert address_endpoint(tls, "10.1.2.3", 4317) == "10.1.2.3:4317"
    https = OtlpExporterConfig(endpoint="https://collector:4318", protocol="http/protobuf")
    assert address_endpoint(https, "10.1.2.3", 4318) == "https://10.1.2.3:4318"


# -- splitting ---------------------------------------------------------------------------------


def _request(trace_ids: list[bytes], spans_per_scope: int = 6) -> ExportTraceServiceRequest:
    """Two resources with two scopes each, attributes and schema URLs everywhere, and spans of
    ``trace_ids`` in turn."""
    request = ExportTraceServiceRequest()
    n = 0
    for r in range(2):
        resource_spans = request.resource_spans.add(schema_url=f"https://schema/{r}")
        resource_spans.resource.attributes.add(key="service.name").value.string_value = f"svc{r}"
        resource_spans.resource.attributes.add(key="pod").value.int_value = r
        for s in range(2):
            scope_spans = resource_spans.scope_spans.add(schema_url=f"https://scope/{r}/{s}")
            scope_spans.scope.name = f"scope-{r}-{s}"
            scope_spans.scope.version = "1.0"
            scope_spans.scope.attributes.add(key="lib").value.string_value = f"lib{s}"
            for _ in range(spans_per_scope):
                span = scope_spans.spans.add(name=f"span-{n}")
                span.trace_id = trace_ids[n % len(trace_ids)]
                span.span_id = n.to_bytes(8, "big")
                span.attributes.add(key="n").value.int_value = n
                n += 1
    return request


def _spans_with_context(request: ExportTraceServiceRequest) -> list[tuple[bytes, bytes, bytes]]:
    """(resource, scope with schema URLs, span), serialised: what must survive a split."""
    return [
        (
            rs.resource.SerializeToString() + rs.schema_url.encode(),
            ss.scope.SerializeToString() + ss.schema_url.encode(),
            span.SerializeToString(),
        )
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]


def test_a_split_keeps_every_span_under_its_own_resource_and_scope() -> None:
    hashes = EndpointHashes(ENDPOINTS)
    request = _request(_trace_ids(9))
    parts = split_by_owner(request, hashes.owner)
    assert set(parts) == set(ENDPOINTS)  # nine traces: each endpoint owns some
    recombined = []
    for endpoint, (part, spans) in parts.items():
        assert part is not None
        part_spans = _spans_with_context(part)
        assert spans == len(part_spans)
        for rs in part.resource_spans:
            for ss in rs.scope_spans:
                assert ss.spans  # no empty scope or resource in a part
                assert {hashes.owner(span.trace_id) for span in ss.spans} == {endpoint}
        recombined += part_spans
    assert sorted(recombined) == sorted(_spans_with_context(request))


def test_a_request_of_one_owner_is_not_split() -> None:
    hashes = EndpointHashes(ENDPOINTS)
    trace_ids = _trace_ids(50)
    owner = hashes.owner(trace_ids[0])
    same_owner = [t for t in trace_ids if hashes.owner(t) == owner][:3]
    request = _request(same_owner)
    assert split_by_owner(request, hashes.owner) == {owner: (None, 24)}


# -- re-routing a leaving endpoint's queue (recording senders) --------------------------------


@dataclass(eq=False)
class _QueueingSender:
    """Keeps what it is given queued, as a sender whose upstream does not answer."""

    endpoint: str
    queued: list[tuple[bytes, int]] = field(default_factory=list)
    closed: bool = False

    def submit(self, payload: bytes, items: int) -> bool:
        self.queued.append((payload, items))
        return True

    def take_queued(self) -> list[tuple[bytes, int]]:
        taken, self.queued = self.queued, []
        return taken

    def force_flush(self, timeout_s: float) -> bool:
        return not self.queued

    def shutdown(self, timeout_s: float) -> None:
        self.closed = True

    def stats(self) -> dict[str, int]:
        items = sum(n for _, n in self.queued)
        return {"sent_spans": 0, "dropped_spans": 0, "rejected_spans": 0, "retries": 0,
                "queue_len": items}  # fmt: skip


def _queueing_sender(config: OtlpExporterConfig) -> Any:
    return _QueueingSender(config.endpoint)


def _queued_spans(sender: _QueueingSender) -> list[bytes]:
    return [
        span.span_id
        for payload, _ in sender.queued
        for rs in ExportTraceServiceRequest.FromString(payload).resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]


def test_a_leaving_endpoints_queue_is_routed_again_over_the_new_set() -> None:
    senders: dict[str, _QueueingSender] = {}

    def factory(config: OtlpExporterConfig) -> Any:
        sender = senders[config.endpoint] = _QueueingSender(config.endpoint)
        return sender

    router = TraceRouter(
        OtlpExporterConfig(endpoint="http://unused:4317", protocol="grpc"),
        endpoints=ENDPOINTS,
        sender_factory=factory,
    )
    trace_ids = _trace_ids(30)
    requests = [_request(trace_ids[i : i + 6], spans_per_scope=3) for i in range(0, 30, 6)]
    assert sum(router.route(request) for request in requests) == 5 * 12
    gone = ENDPOINTS[1]
    leaving = senders[gone]
    leaving_spans = _queued_spans(leaving)
    assert leaving_spans
    kept = {e: _queued_spans(senders[e]) for e in ENDPOINTS if e != gone}

    router.set_endpoints(e for e in ENDPOINTS if e != gone)

    assert leaving.queued == []
    assert router.endpoints == tuple(e for e in ENDPOINTS if e != gone)
    now = {e: _queued_spans(senders[e]) for e in kept}
    # Every span that was queued for the leaving endpoint is queued once with its new owner;
    # what the others had stays as it was.
    added = [s for e in kept for s in now[e][len(kept[e]) :]]
    assert sorted(added) == sorted(leaving_spans)
    for endpoint in kept:
        assert now[endpoint][: len(kept[endpoint])] == kept[endpoint]
        for payload, _ in senders[endpoint].queued:
            for rs in ExportTraceServiceRequest.FromString(payload).resource_spans:
                for ss in rs.scope_spans:
                    assert {router.owner(span.trace_id) for span in ss.spans} == {endpoint}
    routing = router.routing_stats()
    assert routing["rerouted_spans"] == len(leaving_spans)
    assert routing["endpoint_set_changes"] == 1
    assert routing["endpoints"] == 2
    assert sum(routing[f"routed_spans.{e}"] for e in kept) == 60
    router.shutdown(1.0)
    assert leaving.closed and all(sender.closed for sender in senders.values())


def test_a_failing_or_empty_dns_answer_keeps_the_last_set_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers: list[Any] = [[("10.0.0.1", 4317), ("10.0.0.2", 4317)]]

    def resolver(host: str, port: int) -> list[tuple[str, int]]:
        assert (host, port) == ("collectors.test", 4317)
        answer = answers[0]
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    router = TraceRouter(
        OtlpExporterConfig(endpoint="http://collectors.test:4317", protocol="grpc"),
        dns_target="dns:///collectors.test:4317",
        resolver=resolver,
        resolve_interval_s=3600,
        sender_factory=_queueing_sender,
    )
    # Before the first answer: the name itself.
    assert router.endpoints == ("http://collectors.test:4317",)
    router.start()
    try:
        two = ("http://10.0.0.1:4317", "http://10.0.0.2:4317")
        assert router.endpoints == two
        caplog.set_level(logging.WARNING, logger="tokentrace.agent.node.routing")
        answers[0] = socket.gaierror(-2, "Name or service not known")
        assert router.refresh() is False
        answers[0] = []
        assert router.refresh() is False
        assert router.endpoints == two
        assert router.routing_stats()["resolve_failures"] == 2
        assert len([r for r in caplog.records if "collectors.test" in r.getMessage()]) == 1
        answers[0] = [("10.0.0.2", 4317), ("10.0.0.3", 4317), ("10.0.0.2", 4317)]
        assert router.refresh() is True
        assert router.endpoints == ("http://10.0.0.2:4317", "http://10.0.0.3:4317")
        # The first answer replaced the name; only this one changed a known set.
        assert router.routing_stats()["endpoint_set_changes"] == 1
    finally:
        router.shutdown(1.0)


def test_take_queued_returns_what_waits_without_counting_it_dropped() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sender = OtlpSender(
        OtlpExporterConfig(
            endpoint=f"http://127.0.0.1:{port}",
            protocol="grpc",
            retry=RetryConfig(initial_interval_s=0.05, max_interval_s=0.1, max_elapsed_s=30),
        ),
        signal="traces",
    )
    try:
        for n in (1, 2, 3):
            assert sender.submit(bytes([n]), n)
        assert _wait_for(lambda: sender.stats()["queue_len"] == 5)  # 1 in flight, retrying
        assert sender.take_queued() == [(b"\x02", 2), (b"\x03", 3)]
        stats = sender.stats()
        assert (stats["queue_len"], stats["dropped_spans"]) == (0, 0)
    finally:
        sender.shutdown(0.2)
    assert sender.stats()["dropped_spans"] == 1  # the request in flight, given up at shutdown


def test_spans_routed_after_shutdown_are_counted_dropped() -> None:
    router = TraceRouter(
        OtlpExporterConfig(endpoint="http://unused:4317", protocol="grpc"), endpoints=ENDPOINTS
    )
    router.shutdown(0.5)
    request = _request(_trace_ids(9))
    assert router.route(request) == 0
    assert router.stats()["dropped_spans"] == 24
    assert router.stats()["queue_len"] == 0


# -- configuration -------------------------------------------------------------------------------


def test_routing_options_are_validated_in_one_line() -> None:
    exporter = OtlpExporterConfig(endpoint="http://collector:4317", protocol="grpc")
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"upstream_endpoints": ("http://a:4317",), "upstream_dns": "b:4317"},
            "upstream_endpoints/upstream_dns: give one or the other",
        ),
        ({"upstream_dns": "collectors"}, "upstream_dns: expected dns:///HOST:PORT"),
        ({"upstream_endpoints": ("http://a:4317", " ")}, "upstream_endpoints: an endpoint"),
        ({"upstream_endpoints": ("ftp://a:4317",)}, "upstream_endpoints: 'ftp://a:4317': "),
        ({"upstream_dns": "b:4317", "upstream_resolve_interval_s": 0.0}, "upstream_resolve"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message) as raised:
            NodeAgentConfig(exporter=exporter, **options).validate()
        assert "\n" not in str(raised.value)


def _parse(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    NodeAgentCommand().add_arguments(parser)
    return parser.parse_args(list(args))


def test_flags_and_variables_choose_the_replicas() -> None:
    config = config_from_args(
        _parse(
            "--upstream-route", "http://a:4317,http://b:4317", "--upstream-route", "http://c:4317"
        ),
        {"TOKENTRACE_NODE_ROUTE_ENDPOINTS": "http://ignored:4317"},
    )
    assert config.upstream_endpoints == ("http://a:4317", "http://b:4317", "http://c:4317")
    assert config.upstream_dns is None
    config = config_from_args(
        _parse(), {"TOKENTRACE_NODE_ROUTE_DNS": "dns:///collectors.test.svc:4317"}
    )
    assert (config.upstream_endpoints, config.upstream_dns) == (
        (),
        "dns:///collectors.test.svc:4317",
    )
    config = config_from_args(_parse(), {"TOKENTRACE_NODE_ROUTE_ENDPOINTS": " http://a:4317, "})
    assert config.upstream_endpoints == ("http://a:4317",)
    config = config_from_args(_parse(), {})
    assert (config.upstream_endpoints, config.upstream_dns) == ((), None)
    with pytest.raises(ValueError, match="give one or the other, not both"):
        config_from_args(
            _parse("--upstream-route-dns", "collectors:4317"),
            {"TOKENTRACE_NODE_ROUTE_ENDPOINTS": "http://a:4317"},
        )
    parser = argparse.ArgumentParser()
    NodeAgentCommand().add_arguments(parser)
    help_text = parser.format_help()
    for text in ("--upstream-route ENDPOINT", "--upstream-route-dns HOST:PORT"):
        assert text in help_text
    for variable in ("TOKENTRACE_NODE_ROUTE_ENDPOINTS", "TOKENTRACE_NODE_ROUTE_DNS"):
        assert variable in " ".join(help_text.split())


def test_the_command_names_a_bad_routing_option_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TOKENTRACE_"))}
    result = subprocess.run(
        [sys.executable, "-m", "tokentrace.agent.cli", "node-agent"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**env, "TOKENTRACE_NODE_ROUTE_DNS": "collectors.tokentrace.svc"},
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "tokentrace node-agent: configuration error: upstream_dns: expected dns:///HOST:PORT "
        "or HOST:PORT, got 'collectors.tokentrace.svc'"
    ]


# -- end to end: the OTLP exporter -> node agent -> real receivers --------------------------------


class _NoNvml(NvmlSampler):
    """A CPU node: spans are relayed unchanged, at once."""

    def open(self) -> bool:
        self.unavailable_reason = "test: no NVML"
        return False


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def receivers() -> Iterator[list[tuple[OtlpGrpcReceiver, RecordingConsumer]]]:
    """Three collector replicas: real OTLP/gRPC receivers on 127.0.0.1, recording."""
    started = []
    try:
        for _ in range(3):
            consumer = RecordingConsumer()
            receiver = OtlpGrpcReceiver(consumer, endpoint="127.0.0.1:0")
            receiver.start()
            started.append((receiver, consumer))
        yield started
    finally:
        for receiver, _ in started:
            receiver.shutdown(0.5)


def _sdk_traces(traces: int, seed: int) -> list[ReadableSpan]:
    """``traces`` traces of an app's client span (resource ``app``) with two engine spans under
    it (resource ``engine``, another scope), shuffled."""
    app_spans, engine_spans = InMemorySpanExporter(), InMemorySpanExporter()
    app = TracerProvider(resource=Resource.create({"service.name": "app"}))
    app.add_span_processor(SimpleSpanProcessor(app_spans))
    engine = TracerProvider(resource=Resource.create({"service.name": "engine"}))
    engine.add_span_processor(SimpleSpanProcessor(engine_spans))
    app_tracer, engine_tracer = app.get_tracer("app.client"), engine.get_tracer("engine", "2.0")
    for n in range(traces):
        with app_tracer.start_as_current_span("client", attributes={"n": n}):
            for name in ("llm.prefill", "llm.decode"):
                with engine_tracer.start_as_current_span(name, attributes={"n": n}):
                    pass
    app.shutdown()
    engine.shutdown()
    spans = list(app_spans.get_finished_spans()) + list(engine_spans.get_finished_spans())
    random.Random(seed).shuffle(spans)
    return spans


def _export(spans: list[ReadableSpan], port: int, batch: int = 25) -> None:
    """Many export requests, each with spans of many traces, each trace over several."""
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True)
    try:
        for i in range(0, len(spans), batch):
            assert exporter.export(spans[i : i + batch]) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()


@dataclass(frozen=True)
class _Received:
    trace_id: bytes
    span_id: bytes
    name: str
    service: str
    scope: str


def _received(consumer: RecordingConsumer) -> list[_Received]:
    return [
        _Received(
            span.trace_id,
            span.span_id,
            span.name,
            next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name"),
            ss.scope.name,
        )
        for request in list(consumer.requests)
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]


def _routing_agent(port_of_upstream: str, **options: Any) -> NodeAgent:
    config = NodeAgentConfig(
        grpc_endpoint="127.0.0.1:0",
        http_endpoint=None,
        exporter=OtlpExporterConfig(
            endpoint=port_of_upstream,
            protocol="grpc",
            retry=RetryConfig(initial_interval_s=0.05, max_interval_s=0.2, max_elapsed_s=60),
        ),
        max_hold_s=0.0,
        **{k: v for k, v in options.items() if k != "resolver"},
    )
    agent = NodeAgent(
        config,
        sampler=_NoNvml(),
        environ={"K8S_NODE_NAME": "gpu-node-1"},
        resolver=options.get("resolver"),
    )
    agent.start()
    return agent


def _check_placement(
    spans: list[ReadableSpan],
    received: dict[str, list[_Received]],
    owner: Callable[[bytes], str],
) -> None:
    """Every span arrived once, at its trace's owner, under its own resource and scope."""
    everything = [r for rs in received.values() for r in rs]
    assert len(everything) == len({r.span_id for r in everything}) == len(spans)
    assert {r.span_id for r in everything} == {s.context.span_id.to_bytes(8, "big") for s in spans}
    for endpoint, spans_there in received.items():
        for r in spans_there:
            assert owner(r.trace_id) == endpoint
            assert (r.service, r.scope) == (
                ("app", "app.client") if r.name == "client" else ("engine", "engine")
            )


def test_each_trace_goes_whole_to_the_replica_owning_it(
    receivers: list[tuple[OtlpGrpcReceiver, RecordingConsumer]],
) -> None:
    endpoints = {f"http://127.0.0.1:{receiver.port}": c for receiver, c in receivers[:2]}
    agent = _routing_agent("http://unused.invalid:4317", upstream_endpoints=tuple(endpoints))
    router = agent.trace_sender
    assert isinstance(router, TraceRouter)
    spans = _sdk_traces(200, seed=1)
    try:
        _export(spans, agent.receivers[0].port)
        assert _wait_for(lambda: sum(len(_received(c)) for c in endpoints.values()) >= len(spans))
        assert router.force_flush(5.0)
    finally:
        agent.shutdown(2.0)
    received = {e: _received(c) for e, c in endpoints.items()}
    _check_placement(spans, received, router.owner)
    assert all(len(r) > 100 for r in received.values())  # both replicas got a share
    stats = agent.stats()
    for endpoint, spans_there in received.items():
        assert stats[f"route.routed_spans.{endpoint}"] == len(spans_there)
    assert stats["sender.sent_spans"] == stats["relayed_spans"] == len(spans)
    assert stats["sender.dropped_spans"] == 0


def test_a_replica_leaving_the_dns_answer_gets_its_queued_spans_routed_to_the_others(
    receivers: list[tuple[OtlpGrpcReceiver, RecordingConsumer]],
) -> None:
    ports = [receiver.port for receiver, _ in receivers]
    answer = [("127.0.0.1", port) for port in ports]
    by_endpoint = {f"http://127.0.0.1:{r.port}": c for r, c in receivers}
    agent = _routing_agent(
        "http://collectors.test:4317",
        upstream_dns="dns:///collectors.test:4317",
        upstream_resolve_interval_s=3600.0,  # the test refreshes when it changes the answer
        resolver=lambda host, port: list(answer),
    )
    router = agent.trace_sender
    assert isinstance(router, TraceRouter)
    try:
        assert router.endpoints == tuple(sorted(by_endpoint))
        first = _sdk_traces(300, seed=2)
        _export(first, agent.receivers[0].port)
        assert _wait_for(lambda: sum(len(_received(c)) for c in by_endpoint.values()) >= len(first))
        _check_placement(first, {e: _received(c) for e, c in by_endpoint.items()}, router.owner)
        owner_before = EndpointHashes(router.endpoints).owner

        # The third replica goes away: its sender retries one request, the rest wait queued.
        gone_receiver, gone_consumer = receivers[2]
        gone = f"http://127.0.0.1:{gone_receiver.port}"
        gone_receiver.shutdown(0.5)
        counted_before = {e: len(_received(c)) for e, c in by_endpoint.items()}
        second = _sdk_traces(300, seed=3)
        _export(second, agent.receivers[0].port)
        assert _wait_for(lambda: agent.stats()["relayed_spans"] == len(first) + len(second))
        gone_sender = router.sender(gone)
        assert gone_sender is not None
        assert _wait_for(lambda: gone_sender.stats()["queue_len"] > 0)
        queued_for_gone = gone_sender.stats()["queue_len"]
        owned_by_gone = sum(
            1 for s in second if owner_before(s.context.trace_id.to_bytes(16, "big")) == gone
        )
        in_flight = owned_by_gone - queued_for_gone

        del answer[2]
        assert router.refresh()
        assert router.endpoints == tuple(sorted(set(by_endpoint) - {gone}))
        assert router.routing_stats()["rerouted_spans"] == queued_for_gone
        remaining = {e: c for e, c in by_endpoint.items() if e != gone}
        expected_now = len(second) - in_flight
        assert _wait_for(
            lambda: (
                sum(len(_received(c)) - counted_before[e] for e, c in remaining.items())
                >= expected_now
            )
        )
        assert router.force_flush(5.0)
    finally:
        agent.shutdown(1.0)

    second_ids = {s.context.span_id.to_bytes(8, "big") for s in second}
    arrived = [
        r
        for e, c in remaining.items()
        for r in _received(c)[counted_before[e] :]
        if r.span_id in second_ids
    ]
    arrived_ids = [r.span_id for r in arrived]
    assert len(arrived_ids) == len(set(arrived_ids))  # none twice
    missing = [s for s in second if s.context.span_id.to_bytes(8, "big") not in set(arrived_ids)]
    # Only the request that was in flight to the stopped replica is missing, counted dropped.
    assert len(missing) == in_flight
    assert all(owner_before(s.context.trace_id.to_bytes(16, "big")) == gone for s in missing)
    assert agent.stats()["sender.dropped_spans"] == in_flight
    assert len(_received(gone_consumer)) == counted_before[gone]  # nothing reached it after
    # The traces that stayed with their replica were not moved; the moved ones went to their
    # owner in the new set.
    for endpoint, consumer in remaining.items():
        for r in _received(consumer)[counted_before[endpoint] :]:
            assert router.owner(r.trace_id) == endpoint
            assert owner_before(r.trace_id) in (endpoint, gone)


def test_metrics_show_the_spans_routed_to_each_replica() -> None:
    replicas = []
    for _ in range(2):
        consumer = RecordingConsumer()
        receiver = OtlpGrpcReceiver(consumer, endpoint="127.0.0.1:0")
        receiver.start()
        replicas.append((receiver, consumer))
    endpoints = {f"http://127.0.0.1:{r.port}": c for r, c in replicas}
    agent = NodeAgent(
        NodeAgentConfig(
            grpc_endpoint="127.0.0.1:0",
            http_endpoint=None,
            exporter=OtlpExporterConfig(endpoint="http://unused.invalid:4317", protocol="grpc"),
            upstream_endpoints=tuple(endpoints),
            admin_endpoint="127.0.0.1:0",
            max_hold_s=0.0,
        ),
        sampler=_NoNvml(),
        environ={},
    )
    agent.start()
    try:
        spans = _sdk_traces(50, seed=4)
        _export(spans, agent.receivers[0].port)
        assert _wait_for(lambda: sum(len(_received(c)) for c in endpoints.values()) >= len(spans))
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.admin_port}/metrics") as response:
            text = response.read().decode()
    finally:
        agent.shutdown(2.0)
        for receiver, _ in replicas:
            receiver.shutdown(0.5)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    routed = families[semconv.PROM_METRIC_NODE_ROUTED_SPANS.removesuffix("_total")]
    by_endpoint = {
        s.labels[semconv.PROM_LABEL_ENDPOINT]: s.value
        for s in routed.samples
        if s.name.endswith("_total")
    }
    assert by_endpoint == {e: len(_received(c)) for e, c in endpoints.items()}
    endpoints_gauge = families[semconv.PROM_METRIC_NODE_UPSTREAM_ENDPOINTS]
    assert endpoints_gauge.samples[0].value == 2
