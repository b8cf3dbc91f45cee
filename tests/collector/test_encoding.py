"""The collector's OTLP encoding (``collector/encoding.py``), written by hand around each span's
own serialisation, against the protobuf library building the same request from objects; and
the enrichment appended as attribute bytes against the enrichment merged into the span."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.collector.config import parse_config
from tokentrace.collector.encoding import encode_trace_request
from tokentrace.collector.pipeline import Pipeline, group_by_trace
from tokentrace.collector.receivers import wire
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate
from tokentrace.processors.enrich import enrich_span, enrichment_attributes, remove_enrichment
from tokentrace.processors.model import AssembledTrace, SpanRef


def _by_protobuf(spans: Sequence[SpanRef]) -> bytes:
    """The request built from protobuf objects, grouped like the encoder groups."""
    request = ExportTraceServiceRequest()
    resources: dict[int, object] = {}
    scopes: dict[tuple[int, int], object] = {}
    for ref in spans:
        resource_spans = resources.get(id(ref.resource))
        if resource_spans is None:
            resource_spans = resources[id(ref.resource)] = request.resource_spans.add()
            resource_spans.resource.CopyFrom(ref.resource)  # type: ignore[attr-defined]
        key = (id(ref.resource), id(ref.scope))
        scope_spans = scopes.get(key)
        if scope_spans is None:
            scope_spans = scopes[key] = resource_spans.scope_spans.add()  # type: ignore[attr-defined]
            scope_spans.scope.CopyFrom(ref.scope)  # type: ignore[attr-defined]
        scope_spans.spans.append(ref.span)  # type: ignore[attr-defined]
    return request.SerializeToString()


def _processed(requests: int, seed: int) -> tuple[Pipeline, list[AssembledTrace]]:
    pipeline = Pipeline(parse_config({}, environ={}))
    for message in to_otlp_requests(simulate("mixed", requests=requests, seed=seed)):
        groups, count = group_by_trace(message)
        pipeline.assembler.add(groups, count)
    return pipeline, pipeline.assembler.pop_finished(flush_all=True)


def test_the_hand_written_request_is_the_protobuf_librarys_byte_for_byte() -> None:
    _, traces = _processed(150, seed=5)
    assert len(traces) == 150
    services = set()
    for trace in traces:
        services.update(ref.service for ref in trace.spans)
        assert encode_trace_request(trace.spans) == _by_protobuf(trace.spans)
    assert len(services) >= 2  # client and server spans: several resources per request


def test_each_resource_and_scope_is_serialised_once_per_received_group() -> None:
    _, traces = _processed(40, seed=6)
    wires_of: dict[int, set[int]] = {}
    for trace in traces:
        for ref in trace.spans:
            assert ref.resource_wire == ref.resource.SerializeToString()
            assert ref.scope_wire == ref.scope.SerializeToString()
            wires_of.setdefault(id(ref.resource), set()).add(id(ref.resource_wire))
        # Spans without them (made elsewhere than the receiver) are serialised the same.
        bare = [replace(ref, resource_wire=None, scope_wire=None) for ref in trace.spans]
        assert encode_trace_request(bare) == encode_trace_request(trace.spans)
    # One bytes object per received resource, shared by its spans (not one per trace).
    assert all(len(wires) == 1 for wires in wires_of.values())


def test_the_encoder_writes_the_resource_bytes_the_receiver_kept() -> None:
    _, traces = _processed(1, seed=7)
    other = Resource(attributes=[KeyValue(key="k", value=AnyValue(string_value="v"))])
    refs = [replace(ref, resource_wire=other.SerializeToString()) for ref in traces[0].spans]
    decoded = ExportTraceServiceRequest.FromString(encode_trace_request(refs))
    assert {rs.resource.attributes[0].key for rs in decoded.resource_spans} == {"k"}


def test_appended_enrichment_parses_as_the_enrichment_merged_into_the_span() -> None:
    pipeline, traces = _processed(60, seed=9)
    compared = 0
    for trace in traces:
        processed = pipeline.process_trace(trace)
        assert processed is not None
        for record in processed.records:
            span_id = record.timeline.span_id
            appended = {span_id: enrichment_attributes(record)}
            encoded = ExportTraceServiceRequest.FromString(
                encode_trace_request(trace.spans, appended=appended)
            )
            (written,) = [
                span
                for resource in encoded.resource_spans
                for scope in resource.scope_spans
                for span in scope.spans
                if span.span_id == span_id
            ]
            (original,) = [ref.span for ref in trace.spans if ref.span.span_id == span_id]
            expected = Span()
            expected.CopyFrom(original)
            enrich_span(expected, record)
            assert written == expected
            keys = [kv.key for kv in written.attributes]
            assert semconv.E2E_NS in keys and semconv.PROMPT_BUCKET in keys
            compared += 1
    assert compared == 60


def test_a_previous_enrichment_is_replaced_not_repeated() -> None:
    pipeline, traces = _processed(5, seed=2)
    processed = pipeline.process_trace(traces[0])
    assert processed is not None
    (record,) = processed.records
    (span,) = [ref.span for ref in traces[0].spans if ref.span.span_id == record.timeline.span_id]
    enrich_span(span, record)
    once = [kv.key for kv in span.attributes]
    enrich_span(span, record)
    assert [kv.key for kv in span.attributes] == once
    remove_enrichment(span)
    assert not any(kv.key.startswith("tokentrace.budget.") for kv in span.attributes)
    assert semconv.E2E_NS not in [kv.key for kv in span.attributes]


def _received(requests: int, seed: int) -> tuple[Pipeline, list[AssembledTrace]]:
    """As ``_processed``, but grouped as a receiver does: each span keeps its received bytes
    where C reads them (``SpanRef.wire``)."""
    pipeline = Pipeline(parse_config({}, environ={}))
    for message in to_otlp_requests(simulate("mixed", requests=requests, seed=seed)):
        received = message.SerializeToString()
        groups, count = group_by_trace(type(message).FromString(received), encoded=received)
        pipeline.assembler.add(groups, count)
    return pipeline, pipeline.assembler.pop_finished(flush_all=True)


def _written_request_spans(otlp: bytes, span_ids: set[bytes]) -> dict[bytes, Span]:
    encoded = ExportTraceServiceRequest.FromString(otlp)
    return {
        span.span_id: span
        for resource in encoded.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
        if span.span_id in span_ids
    }


@pytest.mark.skipif(not wire.BUILT, reason="received bytes are kept only with the C functions")
def test_enrichment_appended_to_the_received_bytes_parses_as_merged_into_the_span() -> None:
    pipeline, traces = _received(40, seed=4)
    originals = {
        ref.span.span_id: ref.span.SerializeToString() for trace in traces for ref in trace.spans
    }
    for trace in traces:
        processed = pipeline.process_trace(trace)
        assert processed is not None and processed.records
        by_id = {record.timeline.span_id: record for record in processed.records}
        refs = [ref for ref in trace.spans if ref.span.span_id in by_id]
        assert all(ref.wire is not None for ref in refs)  # kept: nothing was there to remove
        written = _written_request_spans(processed.otlp, set(by_id))
        for span_id, record in by_id.items():
            expected = Span.FromString(originals[span_id])
            enrich_span(expected, record)
            assert written[span_id] == expected


@pytest.mark.skipif(not wire.BUILT, reason="received bytes are kept only with the C functions")
def test_a_received_span_enriched_before_is_enriched_once_and_loses_its_bytes() -> None:
    pipeline, traces = _processed(3, seed=6)
    processed = pipeline.process_trace(traces[0])
    assert processed is not None
    # The collector's own output received again (a second collector, a replayed export).
    again = ExportTraceServiceRequest.FromString(processed.otlp)
    received = again.SerializeToString()
    groups, count = group_by_trace(again, encoded=received)
    pipeline.assembler.add(groups, count)
    (trace,) = pipeline.assembler.pop_finished(flush_all=True)
    reprocessed = pipeline.process_trace(trace)
    assert reprocessed is not None
    (record,) = reprocessed.records
    (ref,) = [ref for ref in trace.spans if ref.span.span_id == record.timeline.span_id]
    assert ref.wire is None  # changed: re-serialised
    written = _written_request_spans(reprocessed.otlp, {record.timeline.span_id})
    keys = [kv.key for kv in written[record.timeline.span_id].attributes]
    assert keys.count(semconv.E2E_NS) == 1 and keys.count(semconv.PROMPT_BUCKET) == 1
    assert len(keys) == len(set(keys))
