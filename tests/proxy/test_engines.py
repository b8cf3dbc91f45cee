"""Reading each engine's report (recorded payloads of the documented shapes: llama-server's
``timings``, TGI's ``x-*`` headers, Ollama's final object's durations) and folding it into the
request's boundaries; the proxy's framing scan and request-field scan."""

from __future__ import annotations

import json

import pytest

from tokentrace.agent.proxy import _Chunked, _read_request_fields
from tokentrace.agent.proxy_engines import (
    ENGINE_LLAMA_SERVER,
    ENGINE_OLLAMA,
    ENGINE_OPENAI,
    ENGINE_TGI,
    Observed,
    final_objects,
    fold,
    read_report,
)

_MS = 1_000_000

# llama-server (b4000+), the last SSE event of an OpenAI-compatible chat stream.
_LLAMA_STREAM = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" world"}}],'
    b'"created":1,"id":"chatcmpl-x","model":"m","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1,'
    b'"id":"chatcmpl-x","model":"m","object":"chat.completion.chunk","usage":'
    b'{"completion_tokens":9,"prompt_tokens":20,"total_tokens":29},"timings":{"cache_n":8,'
    b'"prompt_n":12,"prompt_ms":31.5,"prompt_per_token_ms":2.6,"prompt_per_second":380.9,'
    b'"predicted_n":9,"predicted_ms":80.0,"predicted_per_token_ms":8.9,'
    b'"predicted_per_second":112.5}}\n\ndata: [DONE]\n\n'
)
# Ollama /api/generate, the final NDJSON object.
_OLLAMA_FINAL = (
    b'{"model":"llama3.2","created_at":"2026-11-27T18:00:00Z","response":"","done":true,'
    b'"done_reason":"stop","context":[1,2,3],"total_duration":5043500667,'
    b'"load_duration":5025959,"prompt_eval_count":26,"prompt_eval_duration":325953000,'
    b'"eval_count":290,"eval_duration":4709213000}\n'
)
_TGI_HEADERS = {
    b"x-compute-type": b"gpu+optimized",
    b"x-validation-time": b"1",
    b"x-queue-time": b"25",
    b"x-inference-time": b"140",
    b"x-time-per-token": b"14",
    b"x-prompt-tokens": b"17",
    b"x-generated-tokens": b"10",
}


def test_llama_server_timings() -> None:
    objects = final_objects(_LLAMA_STREAM, event_stream=True)
    report = read_report("auto", {}, objects)
    assert report.engine == ENGINE_LLAMA_SERVER
    assert report.prefill_ns == 31_500_000 and report.decode_ns == 80 * _MS
    assert (report.input_tokens, report.cached_tokens, report.output_tokens) == (20, 8, 9)
    assert report.finish_reason == "stop" and report.response_id == "chatcmpl-x"
    seen = Observed(1_000 * _MS, 1_100 * _MS, 1_180 * _MS, 1_181 * _MS, streamed=True)
    bounds = fold(report, seen)
    assert bounds.first_scheduled_ns == 1_100 * _MS - 31_500_000
    assert bounds.queued_ns is None and bounds.ready_ns is None


def test_ollama_durations() -> None:
    report = read_report("auto", {}, final_objects(_OLLAMA_FINAL, event_stream=False))
    assert report.engine == ENGINE_OLLAMA
    assert report.load_ns == 5025959 and report.prefill_ns == 325953000
    assert (report.input_tokens, report.output_tokens) == (26, 290)
    assert report.finish_reason == "stop"
    end = 10_000 * _MS
    seen = Observed(end - 5_100 * _MS, None, None, end, streamed=False)
    bounds = fold(report, seen)
    assert bounds.queued_ns == end - 5043500667
    assert bounds.ready_ns == end - 5043500667 + 5025959
    # Unstreamed: prefill ends where the reported decode began.
    assert bounds.first_scheduled_ns == end - 4709213000 - 325953000


def test_tgi_headers() -> None:
    objects = final_objects(b'{"generated_text":"hello"}', event_stream=False)
    report = read_report("auto", _TGI_HEADERS, objects)
    assert report.engine == ENGINE_TGI
    assert (report.queue_ns, report.inference_ns) == (25 * _MS, 140 * _MS)
    assert (report.input_tokens, report.output_tokens) == (17, 10)
    seen = Observed(0, 200 * _MS, 200 * _MS, 200 * _MS, streamed=False)
    bounds = fold(report, seen)
    assert bounds.first_scheduled_ns == 60 * _MS
    assert bounds.queued_ns == 35 * _MS


def test_boundaries_never_leave_the_request() -> None:
    """An engine reporting more time than the proxy saw is clamped into the request."""
    report = read_report("auto", _TGI_HEADERS, [])
    bounds = fold(report, Observed(100 * _MS, 150 * _MS, 150 * _MS, 150 * _MS, streamed=True))
    assert bounds.first_scheduled_ns == bounds.queued_ns == 100 * _MS


@pytest.mark.parametrize("engine", [ENGINE_LLAMA_SERVER, ENGINE_TGI, ENGINE_OLLAMA])
def test_an_engine_named_but_silent_is_read_as_openai(engine: str) -> None:
    usage = {"usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    report = read_report(engine, {}, [usage])
    assert report.engine == ENGINE_OPENAI
    assert (report.input_tokens, report.output_tokens) == (3, 4)
    bounds = fold(report, Observed(7, 9, 10, 11, streamed=True))
    assert bounds.first_scheduled_ns == 7  # the whole wait for the first token is prefill


def test_malformed_reports_are_absent_not_errors() -> None:
    assert final_objects(b"data: {not json\n\ndata: [DONE]\n\n", event_stream=True) == []
    bad = {"timings": {"prompt_ms": "fast", "predicted_n": -1, "prompt_n": float("nan")}}
    report = read_report("auto", {b"x-queue-time": b"soon"}, [bad])
    assert report.engine == ENGINE_LLAMA_SERVER
    assert report.prefill_ns is None and report.output_tokens is None
    assert read_report("tgi", {b"x-queue-time": b"soon"}, []).queue_ns is None


def test_the_chunked_scan_finds_the_end_whatever_the_read_boundaries() -> None:
    events = [json.dumps({"i": i}).encode() for i in range(5)]
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\nx-t: 1\r\n\r\n"
    for step in (1, 2, 3, 7, len(body)):
        payload: list[bytes] = []
        scanner = _Chunked(payload.append)
        ends = [scanner.feed(body[i : i + step]) for i in range(0, len(body), step)]
        assert ends[:-1] == [-1] * (len(ends) - 1)
        assert ends[-1] == len(body) - (len(body) - 1) // step * step
        assert b"".join(payload) == b"".join(events)


def test_request_fields_are_scanned_not_parsed() -> None:
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": 'say "model": "evil"'}],
            "model": "llama-3",
            "max_tokens": 64,
            "temperature": 0.2,
            "top_p": 0.9,
        }
    ).encode()
    values: dict[str, object] = {}
    _read_request_fields(body, values)
    assert values == {"model": "llama-3", "max_tokens": 64, "temperature": 0.2, "top_p": 0.9}
