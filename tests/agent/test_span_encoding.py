"""The agent's wire encoder (``span_encoding``) against the protobuf API, and span ids
(``span_ids``)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.agent.finished_requests import (
    PARENT,
    RESOURCE,
    SCOPE,
    T0,
    aborted_while_queued,
    encode,
    full_finished_request,
    minimal_finished_request,
    request_span,
    spans_of,
    trace_id,
)
from tests.spanbuild import attributes_of, key_value
from tokentrace.agent import semconv, span_ids
from tokentrace.agent.span_encoding import (
    ResourceScope,
    SpanBatchEncoder,
    encode_finished_requests,
    encode_span,
    export_request,
)
from tokentrace.agent.span_ids import random_span_id, random_span_id_bytes
from tokentrace.agent.spans import KIND_CLIENT, PlannedSpan, count_spans, plan_spans

# --- the wire encoding ----------------------------------------------------------------------------


def reference_span(planned: PlannedSpan, trace: bytes, span_id: bytes, parent: bytes) -> Span:
    """The same span built through the protobuf API, field by field."""
    span = Span(
        trace_id=trace,
        span_id=span_id,
        parent_span_id=parent,
        name=planned.name,
        kind=planned.kind,
        start_time_unix_nano=planned.start_ns,
        end_time_unix_nano=planned.end_ns,
    )
    span.attributes.extend(key_value(k, v) for k, v in planned.attributes.items())
    if planned.status_error is not None:
        span.status.code = Status.STATUS_CODE_ERROR
        span.status.message = planned.status_error
    return span


def test_encoded_spans_equal_spans_built_through_the_protobuf_api() -> None:
    finished = full_finished_request()
    message, _ = encode([dataclasses.replace(finished, status_error="engine died")])
    encoded = spans_of(message)
    planned = list(plan_spans(dataclasses.replace(finished, status_error="engine died")))
    assert len(encoded) == len(planned)
    for span, plan in zip(encoded, planned, strict=True):
        parent = encoded[plan.parent_local_id].span_id if plan.parent_local_id >= 0 else PARENT
        assert span == reference_span(plan, finished.trace_id, span.span_id, parent)


@pytest.mark.parametrize(
    "value",
    [
        0,
        127,
        128,
        16_384,
        -1,
        -(2**63),
        2**63 - 1,
        2.5,
        -0.0,
        True,
        False,
        "",
        "ünïcode ✓",
        ("stop", "length"),
        (),
        [0, 1, 127, 128, 2**35 - 1, 2**35, 2**62],
        [5, -3],
        [],
    ],
)
def test_every_attribute_value_type_round_trips(value: Any) -> None:
    planned = PlannedSpan(
        0, -1, "x", KIND_CLIENT, T0, T0 + 1, {"k": value, "n": 7}, status_error=""
    )
    span_id = (2**64 - 1).to_bytes(8, "big")
    payload = export_request(
        [(ResourceScope(resource_attributes={"r": value}, scope_name="s", scope_version="1"), [
            encode_span(planned, trace_id=trace_id(9), span_id=span_id)
        ])]
    )  # fmt: skip
    message = ExportTraceServiceRequest.FromString(payload)
    (span,) = spans_of(message)
    assert span == reference_span(planned, trace_id(9), span_id, b"")
    expected = list(value) if isinstance(value, tuple) else value
    assert attributes_of(span) == {"k": expected, "n": 7}
    assert attributes_of(message.resource_spans[0].resource) == {"r": expected}  # type: ignore[arg-type]
    assert message.resource_spans[0].scope_spans[0].scope.version == "1"
    assert span.status.code == Status.STATUS_CODE_ERROR and span.status.message == ""


def test_empty_input_is_an_empty_request() -> None:
    assert encode_finished_requests([], resource_attributes=RESOURCE, scope_name=SCOPE) == (b"", 0)
    assert export_request([(ResourceScope(resource_attributes={}, scope_name="s"), [])]) == b""


def test_bad_finished_requests_are_skipped_and_counted_never_raised() -> None:
    encoder = SpanBatchEncoder(resource_attributes=RESOURCE, scope_name=SCOPE)
    bad = [
        full_finished_request(1, trace_id=b"short"),
        full_finished_request(2, parent_span_id=b"\x01\x02"),
        full_finished_request(3, requests_ahead=2**64),
        full_finished_request(4, token_offsets_us=[0, 2**70]),
        full_finished_request(5, arrival_ns=-1),
        full_finished_request(6, model=None),
    ]
    good = minimal_finished_request(7)
    payload, count = encoder.encode([*bad[:3], good, *bad[3:]])
    assert encoder.skipped == len(bad)
    spans = spans_of(ExportTraceServiceRequest.FromString(payload))
    assert count == len(spans) == count_spans(good)
    assert {span.trace_id for span in spans} == {good.trace_id}


def test_encoded_bytes_include_unicode_and_error_messages_intact() -> None:
    finished = aborted_while_queued()
    finished = dataclasses.replace(finished, model="模型-ü", status_error="abgebrochen: 客户端")
    (message, _) = encode([finished])
    root = request_span(spans_of(message))
    assert attributes_of(root)[semconv.GEN_AI_REQUEST_MODEL] == "模型-ü"
    assert root.status.message == "abgebrochen: 客户端"


# --- span ids -------------------------------------------------------------------------------------


def test_caller_supplied_span_ids_are_used_in_plan_order() -> None:
    finished = minimal_finished_request()
    (message, _) = encode([finished], span_ids=itertools.count(100).__next__)
    spans = spans_of(message)
    planned = list(plan_spans(finished))
    assert [int.from_bytes(s.span_id, "big") for s in spans] == list(range(100, 100 + len(planned)))
    assert [s.name for s in spans] == [p.name for p in planned]


def test_a_zero_span_id_from_the_source_skips_the_finished_request() -> None:
    encoder = SpanBatchEncoder(
        resource_attributes=RESOURCE, scope_name=SCOPE, span_ids=itertools.repeat(0).__next__
    )
    assert encoder.encode([minimal_finished_request()]) == (b"", 0)
    assert encoder.skipped == 1


def test_random_span_ids_are_distinct_and_never_zero() -> None:
    ids = [random_span_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(0 < span_id < 2**64 for span_id in ids)
    assert max(ids) > 2**63  # the whole 64-bit range is used


def test_span_ids_chosen_in_advance_are_eight_random_bytes_never_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [random_span_id_bytes() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(span_id) == 8 and span_id != bytes(8) for span_id in ids)
    assert max(ids)[0] >= 0x80  # the whole 64-bit range is used
    monkeypatch.setattr(span_ids, "_random_bits", lambda bits: 0)
    assert random_span_id_bytes() == (1).to_bytes(8, "big")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_processes_draw_different_span_ids() -> None:
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.write(write_end, random_span_id().to_bytes(8, "big"))
        os._exit(0)
    os.close(write_end)
    parent_id = random_span_id()
    child_id = int.from_bytes(os.read(read_end, 8), "big")
    os.close(read_end)
    os.waitpid(child, 0)
    assert child_id != 0 and child_id != parent_id


# --- packaging ------------------------------------------------------------------------------------


def test_the_encoder_needs_neither_protobuf_nor_the_collector() -> None:
    code = (
        "import sys\n"
        "from tokentrace.agent import span_encoding\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'google', "
        "'grpc', 'tokentrace.collector', 'tokentrace.processors'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_equal_but_differently_typed_arrays_are_not_confused_by_the_cache() -> None:
    # (0.0, False) == (0, 0) in Python: a cache keyed by value alone gave the second the first's
    # bytes (found by comparing the C encoder with this one).
    from tokentrace.agent.span_encoding import _WRITER

    for value in ((0.0, False), (0, 0), ("a", "b"), ("a", "b")):
        parts: list[bytes] = []
        _WRITER.attributes_python([("k", value)], parts.append)
        span = Span()
        span.MergeFromString(b"".join(parts))
        assert attributes_of(span) == {"k": list(value)}
        assert [type(item) for item in attributes_of(span)["k"]] == [type(v) for v in value]  # type: ignore[union-attr]
