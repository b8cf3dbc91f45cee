"""OTLP encoding of assembled spans, done once per trace and shared by every exporter."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span

from tokentrace.processors.model import SpanRef


def encode_trace_request(spans: Sequence[SpanRef]) -> bytes:
    """One serialised ExportTraceServiceRequest, grouping spans by their shared Resource and
    InstrumentationScope objects (identity, not content: the receiver shares them)."""
    groups: dict[tuple[int, int], tuple[Resource, InstrumentationScope, list[Span]]] = {}
    for ref in spans:
        key = (id(ref.resource), id(ref.scope))
        group = groups.get(key)
        if group is None:
            group = groups[key] = (ref.resource, ref.scope, [])
        group[2].append(ref.span)
    request = ExportTraceServiceRequest()
    by_resource: dict[int, ResourceSpans] = {}
    for resource, scope, group_spans in groups.values():
        resource_spans = by_resource.get(id(resource))
        if resource_spans is None:
            resource_spans = by_resource[id(resource)] = request.resource_spans.add()
            resource_spans.resource.CopyFrom(resource)
        scope_spans = resource_spans.scope_spans.add()
        scope_spans.scope.CopyFrom(scope)
        scope_spans.spans.extend(group_spans)
    return request.SerializeToString()
