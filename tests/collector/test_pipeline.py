from __future__ import annotations

from tests.spanbuild import KIND_CLIENT, T0, export_request, request_spans, sid, span
from tokentrace.agent import semconv
from tokentrace.collector.config import parse_config
from tokentrace.collector.pipeline import Pipeline


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_late_client_span_does_not_become_a_second_request() -> None:
    clock = FakeClock()
    pipeline = Pipeline(parse_config({}, environ={}), monotonic=clock)
    server = request_spans(first_span_id=2)
    server[0].parent_span_id = sid(1)  # the HTTP server span's parent is the client span
    client = span(
        semconv.SPAN_CLIENT_REQUEST,
        T0 - 1_000_000,
        server[0].end_time_unix_nano + 1_000_000,
        span_id=sid(1),
        kind=KIND_CLIENT,
        attrs={semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_CHAT},
    )
    pipeline.consume_traces(export_request(server))
    clock.now += 60  # the quiet period passes before the client exports its span
    first = pipeline.assembler.pop_finished()
    assert [len(pipeline.process_trace(t).records) for t in first] == [1]

    pipeline.consume_traces(export_request([client]))
    clock.now += 60
    (late,) = pipeline.assembler.pop_finished()
    assert late.late
    processed = pipeline.process_trace(late)
    assert processed.records == []  # no client-only duplicate of the request
    assert processed.otlp  # but the span still goes to the exporters
    assert pipeline.assembler.stats.late_spans == 1
