"""``agent/_wire.c``'s ``trace_request`` against its twin, ``encode_trace_request_python``: the
same bytes for received traces with their enrichment, and for generated ones (resources and
scopes shared or not, spans without their bytes, ids given twice or not at all, appended bytes
for some spans, more groups than C's tables hold)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import compiled
from tokentrace.agent.span_encoding import length_delimited
from tokentrace.collector.config import parse_config
from tokentrace.collector.encoding import encode_trace_request, encode_trace_request_python
from tokentrace.collector.pipeline import Pipeline, group_by_trace
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate
from tokentrace.processors.enrich import enrichment_attributes
from tokentrace.processors.model import SpanRef

_WIRE: Any = compiled.load("tokentrace.agent._wire")
pytestmark = pytest.mark.skipif(_WIRE is None, reason="agent/_wire.c is not built here")


def test_received_traces_with_their_enrichment_are_written_alike() -> None:
    pipeline = Pipeline(parse_config({}, environ={}))
    for message in to_otlp_requests(simulate("mixed", requests=200, seed=11)):
        received = message.SerializeToString()
        groups, count = group_by_trace(type(message).FromString(received), encoded=received)
        pipeline.assembler.add(groups, count)
    traces = pipeline.assembler.pop_finished(flush_all=True)
    assert len(traces) == 200
    for trace in traces:
        processed = pipeline.process_trace(trace)
        assert processed is not None
        appended = {r.timeline.span_id: enrichment_attributes(r) for r in processed.records}
        for extra in (appended, None, {}):
            written = _WIRE.trace_request(trace.spans, extra)
            assert written is not None  # every span came with its bytes
            assert written == encode_trace_request_python(trace.spans, appended=extra)
        assert processed.otlp == encode_trace_request_python(trace.spans, appended=appended)


def _entry(body: bytes) -> bytes:
    return length_delimited(b"\x12", body)


_IDS = st.binary(min_size=8, max_size=8)


@st.composite
def _traces(draw: st.DrawFn) -> tuple[list[SpanRef], dict[Any, bytes] | None]:
    resources = [
        Resource(attributes=[KeyValue(key="n", value=AnyValue(int_value=i))])
        for i in range(draw(st.integers(1, 20)))
    ]
    scopes = [InstrumentationScope(name=f"s{i}") for i in range(draw(st.integers(1, 5)))]
    refs = []
    ids = []
    for _ in range(draw(st.integers(0, 90))):
        span_id = draw(_IDS)
        body = Span(
            trace_id=b"t" * 16, name=draw(st.sampled_from(["a", "bb", ""]))
        ).SerializeToString()
        how = draw(st.sampled_from(["id", "id", "twice", "none"]))
        if how == "id":
            body = Span(trace_id=b"t" * 16, span_id=span_id).SerializeToString() + body
        elif how == "twice":  # the parser keeps the last
            body += (
                Span(span_id=draw(_IDS)).SerializeToString()
                + Span(span_id=span_id).SerializeToString()
            )
        span = Span.FromString(body)
        ids.append(span.span_id)
        resource = draw(st.sampled_from(resources))
        scope = draw(st.sampled_from(scopes))
        refs.append(
            SpanRef(
                span,
                resource,
                scope,
                "svc",
                _entry(body) if draw(st.integers(0, 30)) else None,
                resource.SerializeToString() if draw(st.integers(0, 30)) else None,
                scope.SerializeToString() if draw(st.integers(0, 30)) else None,
            )
        )
    if draw(st.booleans()):
        return refs, None
    keys = st.sampled_from(ids) if ids else _IDS
    appended: dict[Any, bytes] = draw(
        st.dictionaries(st.one_of(keys, _IDS, st.just(b"")), st.binary(max_size=40), max_size=12)
    )
    if draw(st.integers(0, 20)) == 0:
        appended["not bytes"] = b"x"
    return refs, appended


@settings(max_examples=300, deadline=None)
@given(_traces())
def test_generated_traces_are_written_alike(trace: tuple[list[SpanRef], Any]) -> None:
    refs, appended = trace
    expected = encode_trace_request_python(refs, appended=appended)
    assert encode_trace_request(refs, appended=appended) == expected
    written = _WIRE.trace_request(refs, appended)
    if written is not None:
        assert written == expected
    groups = {(id(r.resource), id(r.scope)) for r in refs}
    if (
        all(r.wire and r.resource_wire is not None and r.scope_wire is not None for r in refs)
        and len({id(r.resource) for r in refs}) <= 16
        and len(groups) <= 64
        and not (appended and any(type(k) is not bytes for k in appended))
    ):
        assert written is not None  # the fast path took it


def test_input_outside_the_fast_path_is_left_to_the_twin() -> None:
    span = Span(trace_id=b"t" * 16, span_id=b"s" * 8)
    body = span.SerializeToString()
    resource, scope = Resource(), InstrumentationScope()
    ref = SpanRef(span, resource, scope, "svc", _entry(body), b"", b"")
    assert _WIRE.trace_request([ref], None) is not None
    assert _WIRE.trace_request((ref,), None) is None  # not a list
    assert _WIRE.trace_request([ref], {b"s" * 8: "text"}) is None  # a value that is not bytes
    assert _WIRE.trace_request([SpanRef(span, resource, scope, "svc", b"\x12\x05ab")], None) is None
    assert (
        _WIRE.trace_request([SpanRef(span, resource, scope, "svc", body, b"", b"")], None) is None
    )
    with pytest.raises(TypeError):
        _WIRE.trace_request([ref])
    with pytest.raises(AttributeError):
        _WIRE.trace_request([object()], None)
