"""bench/collector_throughput.py's stop condition: a run ends when the collector is through,
with tail sampling too (where the requests stored and the spans exported are fewer than sent),
and the config it runs the collector with."""

from __future__ import annotations

from typing import Any

from bench.collector_throughput import _collector_config, _done
from tokentrace.agent import semconv
from tokentrace.collector.self_telemetry import metric_key

_KEPT_RANDOM = metric_key(semconv.SELF_METRIC_SAMPLING_KEPT_RANDOM)
_KEPT_BREACH = metric_key(semconv.SELF_METRIC_SAMPLING_KEPT_BREACH)


def _stats(**values: Any) -> dict[str, Any]:
    return {key.replace("__", "."): value for key, value in values.items()}


def test_without_sampling_every_span_must_be_exported() -> None:
    through = _stats(requests=10, UpstreamSink__traces__sent_spans=70)
    assert _done(through, spans=70, requests=10, sampled=False)
    assert not _done({**through, "requests": 9}, spans=70, requests=10, sampled=False)
    assert not _done(
        {**through, "UpstreamSink.traces.sent_spans": 69}, spans=70, requests=10, sampled=False
    )


def test_with_sampling_the_kept_requests_stored_and_the_queue_drained() -> None:
    through = {
        **_stats(
            requests=10,
            pending_traces=0,
            StoreSink__written_requests=3,
            UpstreamSink__traces__queue_len=0,
            UpstreamSink__traces__sent_spans=21,
        ),
        _KEPT_RANDOM: 2,
        _KEPT_BREACH: 1,
    }
    assert _done(through, spans=70, requests=10, sampled=True)
    assert not _done(through, spans=70, requests=10, sampled=False)  # 21 of 70 spans
    for key, value in (
        ("requests", 9),
        ("pending_traces", 1),
        ("StoreSink.written_requests", 2),  # the last kept batch not in the store yet
        ("UpstreamSink.traces.queue_len", 5),
    ):
        assert not _done({**through, key: value}, spans=70, requests=10, sampled=True), key


def test_the_sampled_run_configures_tail_sampling() -> None:
    assert _collector_config("x.db", 1).tail_sampling is None
    config = _collector_config("x.db", 1, tail_sampling=0.25)
    assert config.tail_sampling is not None
    assert config.tail_sampling.random_share == 0.25
