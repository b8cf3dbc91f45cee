"""Request stores for the UI's browser tests.

``real_trace_store``: the loop of ``make demo`` (``collector/demo.py``) on the session's shared
vLLM server: a real ``tokentrace collector`` process with its SQLite store, the demo's concurrent
streaming load with client spans sent to it, and the server's spans (tokentrace's through the
node agent, and vLLM's own) that reached the shared server's receiver passed on to it.

``crafted_store``: spans built here and derived by the collector's own pipeline in-process, for
what real traffic on this machine cannot produce on demand: engine steps and GPU aggregates on
a request with a token-gap spike, and hostile strings (markup, script, ``javascript:`` URLs) in
every string a span or the configuration can carry.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.collector.upstream import UpstreamOtlp
from tests.spanbuild import key_value, request_spans, sid, span, tid, trace
from tests.vllm.shared_server import TracedServer, wait_until_idle
from tokentrace.agent import semconv
from tokentrace.collector.config import parse_config
from tokentrace.collector.exporters.store_sink import StoreSink
from tokentrace.collector.pipeline import Pipeline, PipelineTick, ProcessedTrace
from tokentrace.loadgen import record as run_record
from tokentrace.processors.model import AssembledTrace, Verdict

_NS_PER_MS: Final = 1_000_000
_NS_PER_S: Final = 1_000_000_000
_DEFAULT_VLLM_REQUESTS: Final = 48
_COLLECTOR_STOP_TIMEOUT_S: Final = 30.0
_QUIET_S: Final = 2.0
_QUIET_TIMEOUT_S: Final = 60.0
_FORWARD_TIMEOUT_S: Final = 10.0
_LATE_TOKEN: Final = 1000
"""The token of the long request that came 200 ms late (within the store's token cap)."""
_STALLED_TOKEN: Final = 20
_BEFORE_AGO_S: Final = 90 * 60.0
_AFTER_AGO_S: Final = 10 * 60.0
_ERA_PROCESSING_S: Final = 30.0
"""Seconds into an era at which the pipeline processes its traffic (its percentile clock)."""
_ERA_MARGIN_S: Final = 5 * 60.0
"""The token of the crafted request that came 90 ms late (the others: every 10 ms)."""

# --- hostile strings: each must show up as text and never act ------------------------------------
PWNED_CHECK: Final = "window.__pwned"
SCRIPT_PAYLOAD: Final = "<script>window.__pwned=1</script>"
IMG_PAYLOAD: Final = '<img src=x onerror="window.__pwned=1">'
SVG_PAYLOAD: Final = '"><svg onload="window.__pwned=1">'
JS_URL_PAYLOAD: Final = "javascript:window.__pwned=1//"

PAYLOAD_SERVICE: Final = f"svc{SVG_PAYLOAD}"
PAYLOAD_MODEL: Final = f"model{IMG_PAYLOAD}"
PAYLOAD_REQUEST_ID: Final = f"cmpl-{SCRIPT_PAYLOAD}"
PAYLOAD_SENTENCE: Final = f"verdict {SCRIPT_PAYLOAD} and {IMG_PAYLOAD}"
PAYLOAD_CAUSE: Final = f"cause{SVG_PAYLOAD}"
PAYLOAD_ADVICE: Final = f"{JS_URL_PAYLOAD} advice {IMG_PAYLOAD}"
PAYLOAD_ATTRIBUTE_KEY: Final = "app.note"
PAYLOAD_ATTRIBUTE: Final = f"note {IMG_PAYLOAD}{SCRIPT_PAYLOAD}"
PAYLOAD_URL_ATTRIBUTE_KEY: Final = "app.link"
PAYLOAD_SLO_TARGET: Final = f"ttft{IMG_PAYLOAD}"
PAYLOAD_TRACE_LINK: Final = f"{JS_URL_PAYLOAD}{{trace_id}}"
"""A trace-link template with a ``javascript:`` scheme: the UI must not make it a link."""


@dataclass(frozen=True, slots=True)
class CraftedStore:
    path: Path
    spiky_trace_id: str
    """The request with engine steps, GPU aggregates and hostile strings."""
    long_trace_id: str
    """A request with more tokens than the UI draws ticks for (one late token among them)."""
    before_s: tuple[float, float]
    """(since, until) unix seconds around the "before" traffic."""
    after_s: tuple[float, float]
    """(since, until) unix seconds around the "after" traffic, until now."""


def _gpu_attributes(utilization: float, peak_ratio: float) -> dict[str, float | int | str]:
    return {
        semconv.GPU_UTILIZATION_MEAN: utilization,
        semconv.GPU_UTILIZATION_MAX: min(1.0, utilization + 0.05),
        semconv.GPU_MEMORY_BANDWIDTH_GBPS: round(peak_ratio * 3350.0, 1),
        semconv.GPU_MEMORY_BANDWIDTH_PEAK_GBPS: 3350.0,
        semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO: peak_ratio,
        semconv.GPU_MEMORY_BANDWIDTH_SOURCE: "nvml",
        semconv.GPU_MEMORY_USED_BYTES: 60 * 1024**3,
        semconv.GPU_POWER_WATTS: 540.0,
        semconv.GPU_SAMPLES: 12,
    }


def _spiky_request(start_ns: int, trace_number: int) -> list[Span]:
    """A chat request whose decode has one 90 ms stall (token 20) while a 2048-token prefill
    shared the batch; engine steps every 10 ms under the request span, GPU aggregates on the
    request, its prefill and decode and on every step; hostile strings in its attributes."""
    trace_id = tid(trace_number)
    offsets_us = [index * 10_000 for index in range(_STALLED_TOKEN)]
    offsets_us += [offsets_us[-1] + 90_000 + index * 10_000 for index in range(20)]
    spans = request_spans(
        start_ns=start_ns,
        trace_id=trace_id,
        queue_ns=25 * _NS_PER_MS,
        prefill_ns=50 * _NS_PER_MS,
        token_offsets_us=offsets_us,
        request_attrs={
            semconv.GEN_AI_REQUEST_MODEL: PAYLOAD_MODEL,
            semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_CHAT,
            semconv.REQUEST_ID: PAYLOAD_REQUEST_ID,
            semconv.GEN_AI_USAGE_INPUT_TOKENS: 600,
            PAYLOAD_ATTRIBUTE_KEY: PAYLOAD_ATTRIBUTE,
            PAYLOAD_URL_ATTRIBUTE_KEY: JS_URL_PAYLOAD,
            **_gpu_attributes(0.7, 0.6),
        },
        decode_attrs=_gpu_attributes(0.55, 0.82),
    )
    by_name = {message.name: message for message in spans}
    for key, value in _gpu_attributes(0.93, 0.35).items():
        by_name[semconv.SPAN_PREFILL].attributes.append(key_value(key, value))
    request_span = by_name[semconv.SPAN_REQUEST]
    decode_start = by_name[semconv.SPAN_DECODE].start_time_unix_nano
    ticks = [decode_start + offset * 1000 for offset in offsets_us]
    # One decode step per token; the step that ends at token 20 also ran another request's
    # 2048-token prefill, which is what stalled it.
    for index in range(1, len(ticks)):
        stalled = index == _STALLED_TOKEN
        attributes: dict[str, object] = {
            semconv.ENGINE_STEP_BATCH_SIZE: 33 if stalled else 32,
            semconv.ENGINE_STEP_PREFILL_REQUESTS: 1 if stalled else 0,
            semconv.ENGINE_STEP_DECODE_REQUESTS: 32,
            semconv.ENGINE_STEP_PREFILL_TOKENS: 2048 if stalled else 0,
            semconv.ENGINE_STEP_DECODE_TOKENS: 32,
            semconv.ENGINE_STEP_KV_CACHE_USAGE: 0.62,
            semconv.ENGINE_STEP_WAITING: 3,
            semconv.ENGINE_STEP_RUNNING: 32,
            semconv.ENGINE_STEP_REQUEST_IDS: [PAYLOAD_REQUEST_ID, "cmpl-other"],
            **_gpu_attributes(0.97 if stalled else 0.5, 0.3 if stalled else 0.85),
        }
        spans.append(
            span(
                semconv.SPAN_ENGINE_STEP,
                ticks[index - 1],
                ticks[index],
                span_id=sid(100 + index),
                trace_id=trace_id,
                parent_span_id=request_span.span_id,
                attrs=attributes,  # type: ignore[arg-type]
            )
        )
    return spans


def _long_request(start_ns: int, trace_number: int, *, tokens: int) -> list[Span]:
    offsets_us = [index * 2_000 for index in range(tokens)]
    late = min(tokens // 2, _LATE_TOKEN)
    offsets_us[late:] = [offset + 200_000 for offset in offsets_us[late:]]
    return request_spans(
        start_ns=start_ns,
        trace_id=tid(trace_number),
        token_offsets_us=offsets_us,
        request_attrs={
            semconv.GEN_AI_REQUEST_MODEL: "plain-model",
            semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_TEXT_COMPLETION,
            semconv.REQUEST_ID: "cmpl-long",
        },
    )


def _plain_request(start_ns: int, trace_number: int, *, queue_ms: float, tokens: int) -> list[Span]:
    return request_spans(
        start_ns=start_ns,
        trace_id=tid(trace_number),
        queue_ns=int(queue_ms * _NS_PER_MS),
        prefill_ns=20 * _NS_PER_MS,
        token_offsets_us=[index * 8_000 for index in range(tokens)],
        request_attrs={
            semconv.GEN_AI_REQUEST_MODEL: PAYLOAD_MODEL if trace_number % 2 else "plain-model",
            semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_CHAT,
            semconv.REQUEST_ID: f"cmpl-{trace_number}",
            semconv.GEN_AI_USAGE_INPUT_TOKENS: 64 + 40 * (trace_number % 7),
        },
    )


class _PayloadVerdictSink:
    """Writes through to the store sink, after giving one request a verdict made of hostile
    strings (a verdict sentence normally comes from the diagnosis, never from a span)."""

    def __init__(self, sink: StoreSink, trace_id: bytes) -> None:
        self._sink = sink
        self._trace_id = trace_id

    def export_traces(self, batch: Sequence[ProcessedTrace]) -> None:
        for item in batch:
            if item.trace.trace_id != self._trace_id:
                continue
            for record in item.records:
                record.verdict = Verdict(
                    segment=semconv.SEGMENT_DECODE,
                    cause=PAYLOAD_CAUSE,
                    sentence=PAYLOAD_SENTENCE,
                    advice=PAYLOAD_ADVICE,
                    numbers={"decode_ms": 650.0, "share": 0.8, "note": IMG_PAYLOAD},
                )
        self._sink.export_traces(batch)

    def tick(self, tick: PipelineTick) -> None:
        self._sink.tick(tick)

    def shutdown(self, timeout_s: float) -> None:
        self._sink.shutdown(timeout_s)


def crafted_store(
    path: Path, *, plain_requests: int = 40, long_tokens: int = 5_000
) -> CraftedStore:
    """A store written by the collector's pipeline from crafted traces (see the module doc).

    Two eras of traffic, for comparing windows: "before" (about 90 minutes ago, with a long
    queueing tail) and "after" (about 10 minutes ago, queueing fixed, plus the spiky and the
    long request). The pipeline's percentile clock is set to each era, so its sketch slices
    land in it as they would have on a collector running then.
    """
    config = parse_config(
        {
            "exporters": {"store": {"path": str(path)}},
            "processors": {
                "slo": {
                    "targets": [
                        {
                            "name": PAYLOAD_SLO_TARGET,
                            "metric": "ttft",
                            "percentile": 95,
                            "threshold": "60ms",
                        },
                        {"name": "e2e-p99", "metric": "e2e", "percentile": 99, "threshold": "2s"},
                    ]
                }
            },
        },
        environ={},
    )
    assert config.store is not None and config.percentiles is not None
    now_s = time.time()
    before_s = now_s - _BEFORE_AGO_S
    after_s = now_s - _AFTER_AGO_S
    clock = [before_s]
    spiky_number = 1
    long_number = 2
    sink = _PayloadVerdictSink(
        StoreSink(config.store, slo_targets=config.slo_targets), tid(spiky_number)
    )
    pipeline = Pipeline(config, sinks={"store": sink}, wall_clock=lambda: clock[0])

    def plain_traffic(
        era_s: float, first_number: int, *, queue_tail_ms: float
    ) -> list[AssembledTrace]:
        traces = []
        for index in range(plain_requests):
            spans = _plain_request(
                int(era_s * _NS_PER_S) + index * 900 * _NS_PER_MS,
                first_number + index,
                queue_ms=2.0 + (index % 10) ** 2 * queue_tail_ms,
                tokens=8 + index % 24,
            )
            service = PAYLOAD_SERVICE if index % 3 == 0 else "plain-service"
            traces.append(trace(*spans, service=service))
        return traces

    before = plain_traffic(before_s, 1000, queue_tail_ms=9.0)
    after_start_ns = int(after_s * _NS_PER_S)
    after: list[AssembledTrace] = [
        trace(*_spiky_request(after_start_ns, spiky_number), service=PAYLOAD_SERVICE),
        trace(
            *_long_request(after_start_ns, long_number, tokens=long_tokens),
            service="plain-service",
        ),
        *plain_traffic(after_s, 10, queue_tail_ms=1.0),
    ]
    for era_s, traces in ((before_s, before), (after_s, after)):
        clock[0] = era_s + _ERA_PROCESSING_S
        sink.export_traces([pipeline.process_trace(item) for item in traces])
        sink.tick(pipeline.make_tick(final=True))
    sink.shutdown(1.0)
    return CraftedStore(
        path=path,
        spiky_trace_id=tid(spiky_number).hex(),
        long_trace_id=tid(long_number).hex(),
        before_s=(before_s - _ERA_MARGIN_S, before_s + _ERA_MARGIN_S),
        after_s=(after_s - _ERA_MARGIN_S, now_s),
    )


# --- real traces -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RealStore:
    path: Path
    requests: int


def real_trace_store(
    workdir: Path, traced: TracedServer, model_dir: Path, *, requests: int | None = None
) -> RealStore:
    """The store a real collector process writes from the demo's load on the shared server.

    The shared server exports to its own receiver (``traced.upstream``), so the spans of the
    load's traces are passed on from there once the server is idle and they have all arrived;
    the client spans go to the collector directly, as in ``make demo``."""
    from tokentrace.collector import demo

    store_path = workdir / "store.db"
    config_path = workdir / "collector.yaml"
    config_path.write_text(demo.DEMO_CONFIG.replace("STORE_PATH", str(store_path)), "utf-8")
    collector, port = demo.start_collector(config_path)
    try:
        sent = demo.load_with_client_spans(
            traced.server.base_url,
            port,
            workdir,
            model_dir,
            requests=requests or _DEFAULT_VLLM_REQUESTS,
        )
        if sent == 0:
            raise RuntimeError("no request completed")
        wait_until_idle(traced.server)
        run = run_record.load(workdir / demo.RUN_RECORD_NAME)
        trace_ids = {bytes.fromhex(result.trace_id) for result in run.results}
        wait_for_quiet(traced.upstream)
        forward_traces(traced.upstream.trace_requests, trace_ids, f"127.0.0.1:{port}")
        count = demo.wait_for_requests(store_path, sent)
    finally:
        collector.send_signal(signal.SIGTERM)
        try:
            collector.wait(timeout=_COLLECTOR_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            collector.kill()
            collector.wait()
    if count < sent:
        raise RuntimeError(f"the collector stored {count} of {sent} requests")
    return RealStore(path=store_path, requests=count)


def wait_for_quiet(upstream: UpstreamOtlp) -> None:
    """Until no span has arrived for `_QUIET_S` (the node agent holds a span up to 1 s)."""
    deadline = time.monotonic() + _QUIET_TIMEOUT_S
    count = upstream.span_count
    while time.monotonic() < deadline:
        time.sleep(_QUIET_S)
        if upstream.span_count == count:
            return
        count = upstream.span_count
    raise RuntimeError("spans kept arriving at the shared server's receiver")


def forward_traces(
    received: Sequence[ExportTraceServiceRequest], trace_ids: set[bytes], endpoint: str
) -> None:
    """Send the spans of `trace_ids` among `received` to an OTLP/gRPC receiver, as received
    (resource and scope kept), one export per request received."""
    with grpc.insecure_channel(endpoint) as channel:
        export = trace_service_pb2_grpc.TraceServiceStub(channel).Export
        for request in received:
            kept = ExportTraceServiceRequest()
            kept.CopyFrom(request)
            for resource_spans in kept.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    spans = [s for s in scope_spans.spans if s.trace_id in trace_ids]
                    del scope_spans.spans[:]
                    scope_spans.spans.extend(spans)
            if any(scope.spans for rs in kept.resource_spans for scope in rs.scope_spans):
                export(kept, timeout=_FORWARD_TIMEOUT_S)
