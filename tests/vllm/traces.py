"""Read what a traced vLLM server exported: tokentrace's request trees and vLLM's own spans.

Shared by the real-vLLM instrumentation tests. Both kinds of span reach one test-owned OTLP
receiver (``tests.collector.upstream.UpstreamOtlp``); these helpers group them per request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.collector.upstream import UpstreamOtlp
from tests.spanbuild import attributes_of
from tokentrace.agent import semconv

_NS_PER_S = 1e9


@dataclass
class RequestTree:
    """One request's ``llm.request`` span and its children, by name."""

    root: Span
    children: dict[str, list[Span]] = field(default_factory=dict)
    parent: Span | None = None
    """The span ``llm.request`` is a child of, when it was exported (the HTTP server span)."""

    @property
    def attributes(self) -> dict[str, object]:
        return attributes_of(self.root)

    def child(self, name: str) -> Span:
        spans = self.children.get(name, [])
        assert len(spans) == 1, f"{name}: {len(spans)} spans"
        return spans[0]


def exported_spans(upstream: UpstreamOtlp) -> Iterable[tuple[str, Span]]:
    """(instrumentation scope name, span) for every span the receiver accepted."""
    for request in upstream.trace_requests:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    yield scope_spans.scope.name, span


def request_trees(upstream: UpstreamOtlp) -> dict[str, RequestTree]:
    """tokentrace's request trees keyed by the request id on ``llm.request``."""
    spans = [span for _, span in exported_spans(upstream)]
    roots = {span.span_id: RequestTree(span) for span in spans if span.name == semconv.SPAN_REQUEST}
    by_id = {(span.trace_id, span.span_id): span for span in spans}
    for span in spans:
        tree = roots.get(span.parent_span_id)
        if tree is not None and span.trace_id == tree.root.trace_id:
            tree.children.setdefault(span.name, []).append(span)
    for tree in roots.values():
        tree.parent = by_id.get((tree.root.trace_id, tree.root.parent_span_id))
    return {str(tree.attributes[semconv.REQUEST_ID]): tree for tree in roots.values()}


def vllm_request_spans(upstream: UpstreamOtlp) -> dict[str, Span]:
    """vLLM's own ``llm_request`` spans keyed by ``gen_ai.request.id``."""
    return {
        str(attributes_of(span)[semconv.VLLM_REQUEST_ID]): span
        for scope, span in exported_spans(upstream)
        if scope == semconv.VLLM_TRACING_SCOPE and span.name == semconv.VLLM_SPAN_REQUEST
    }


def find_request(ids: Iterable[str], marker: str) -> str:
    """The one request id that contains ``marker`` (the test's ``X-Request-Id``)."""
    matches = [request_id for request_id in ids if marker in request_id]
    assert len(matches) == 1, (marker, matches)
    return matches[0]


def duration_s(span: Span) -> float:
    return (span.end_time_unix_nano - span.start_time_unix_nano) / _NS_PER_S


@dataclass(frozen=True)
class Agreement:
    """tokentrace's timings minus vLLM's for one request, in seconds."""

    start: float
    end: float
    ttft: float
    queue: float
    prefill: float
    decode: float
    inference: float
    e2e: float

    def worst(self, *names: str) -> float:
        return max(abs(getattr(self, name)) for name in names)


def agreement(tree: RequestTree, vllm_span: Span) -> Agreement:
    """Compare one tokentrace tree with vLLM's span of the same request.

    Both queues run from EngineCore's QUEUED event to its first SCHEDULED (``llm.request``
    starts earlier, at arrival: the hand-off to EngineCore lies between the two starts). vLLM's
    TTFT and E2E are taken when the API server begins processing the step's outputs;
    tokentrace's first token carries the engine step's own timestamp and its end is read after
    that processing.
    """
    theirs = attributes_of(vllm_span)
    root = tree.root
    first_token = tree.child(semconv.SPAN_DECODE).start_time_unix_nano
    return Agreement(
        start=(root.start_time_unix_nano - vllm_span.start_time_unix_nano) / _NS_PER_S,
        end=(root.end_time_unix_nano - vllm_span.end_time_unix_nano) / _NS_PER_S,
        ttft=(first_token - root.start_time_unix_nano) / _NS_PER_S
        - float(theirs[semconv.VLLM_LATENCY_TTFT]),  # type: ignore[arg-type]
        queue=duration_s(tree.child(semconv.SPAN_QUEUE))
        - float(theirs[semconv.VLLM_LATENCY_QUEUE]),  # type: ignore[arg-type]
        prefill=duration_s(tree.child(semconv.SPAN_PREFILL))
        - float(theirs[semconv.VLLM_LATENCY_PREFILL]),  # type: ignore[arg-type]
        decode=duration_s(tree.child(semconv.SPAN_DECODE))
        - float(theirs[semconv.VLLM_LATENCY_DECODE]),  # type: ignore[arg-type]
        inference=(
            tree.child(semconv.SPAN_DECODE).end_time_unix_nano
            - tree.child(semconv.SPAN_PREFILL).start_time_unix_nano
        )
        / _NS_PER_S
        - float(theirs[semconv.VLLM_LATENCY_INFERENCE]),  # type: ignore[arg-type]
        e2e=duration_s(root) - float(theirs[semconv.VLLM_LATENCY_E2E]),  # type: ignore[arg-type]
    )


def assert_consistent_tree(tree: RequestTree) -> None:
    """queue -> prefill -> decode -> postprocess tile ``llm.request`` from engine arrival (the
    queue's start, at or after the request's) to its end, in order."""
    root = tree.root
    phases = [
        tree.child(name)
        for name in (
            semconv.SPAN_QUEUE,
            semconv.SPAN_PREFILL,
            semconv.SPAN_DECODE,
            semconv.SPAN_POSTPROCESS,
        )
    ]
    assert root.start_time_unix_nano <= phases[0].start_time_unix_nano
    assert phases[-1].end_time_unix_nano == root.end_time_unix_nano
    for before, after in pairwise(phases):
        assert before.end_time_unix_nano == after.start_time_unix_nano, (before.name, after.name)
    for phase in phases:
        assert phase.trace_id == root.trace_id
        assert phase.start_time_unix_nano <= phase.end_time_unix_nano, phase.name
    for preempted in tree.children.get(semconv.SPAN_PREEMPTED, []):
        assert root.start_time_unix_nano <= preempted.start_time_unix_nano
        assert preempted.end_time_unix_nano <= root.end_time_unix_nano
