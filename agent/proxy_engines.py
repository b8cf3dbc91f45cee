"""What an engine behind ``tokentrace proxy`` reports about a request, and where it puts it.

The proxy (``proxy.py``) times what it sees: the request's arrival, every chunk of generated
content, the response's end. Engines it cannot patch report their own per-request timings in
the response, each in its own shape (their documented formats; see docs/proxy.md):

``llama-server`` (llama.cpp)
    a ``timings`` object in the final SSE event or the JSON body: ``prompt_n``, ``prompt_ms``
    (prompt evaluation: prefill), ``predicted_n``, ``predicted_ms`` (decode), ``cache_n`` (prompt
    tokens reused from the cache).
``tgi`` (text-generation-inference)
    response headers, in ms: ``x-validation-time``, ``x-queue-time``, ``x-inference-time``
    (prefill + decode), ``x-time-per-token``; counts ``x-prompt-tokens``, ``x-generated-tokens``.
``ollama``
    the final NDJSON object (``"done": true``) or the JSON body, in ns: ``total_duration``
    (the handler's whole time), ``load_duration`` (getting a loaded runner: a model load, or a
    wait for one), ``prompt_eval_duration`` / ``prompt_eval_count``, ``eval_duration`` /
    ``eval_count``.
``openai``
    any OpenAI-compatible server: only what the stream shows, plus ``usage`` if it sends one.

``fold`` turns a report and the proxy's own instants into the request's engine boundaries (engine
arrival, end of cold start, first scheduled), anchored on the proxy's clock: durations are
subtracted from instants the proxy saw, so no engine clock is ever compared with the proxy's.
Nothing here raises on a malformed report: what cannot be read is absent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "ENGINES",
    "ENGINE_AUTO",
    "ENGINE_LLAMA_SERVER",
    "ENGINE_OLLAMA",
    "ENGINE_OPENAI",
    "ENGINE_TGI",
    "NOT_REPORTED",
    "Boundaries",
    "EngineReport",
    "Observed",
    "final_objects",
    "fold",
    "read_report",
]

ENGINE_AUTO: Final = "auto"
ENGINE_LLAMA_SERVER: Final = "llama-server"
ENGINE_TGI: Final = "tgi"
ENGINE_OLLAMA: Final = "ollama"
ENGINE_OPENAI: Final = "openai"
ENGINES: Final = (ENGINE_AUTO, ENGINE_LLAMA_SERVER, ENGINE_TGI, ENGINE_OLLAMA, ENGINE_OPENAI)

_COMMON_NOT_REPORTED: Final = ("engine steps", "preemption", "per-token times inside the engine")
NOT_REPORTED: Final[Mapping[str, tuple[str, ...]]] = {
    ENGINE_LLAMA_SERVER: (
        "cold start",
        "queue wait apart from tokenisation and the proxy-to-engine hop",
        *_COMMON_NOT_REPORTED,
    ),
    ENGINE_TGI: ("cold start", *_COMMON_NOT_REPORTED),
    ENGINE_OLLAMA: (
        "the wait for a runner apart from a model load (both are cold_start)",
        *_COMMON_NOT_REPORTED,
    ),
    ENGINE_OPENAI: ("queue wait (all of it is in prefill)", "cold start", *_COMMON_NOT_REPORTED),
}
"""Per engine: what its report cannot tell. The proxy puts the list on its HTTP server span
(``semconv.PROXY_NOT_REPORTED``); docs/proxy.md has the same table."""
NOT_REPORTED_UNSTREAMED: Final = "prefill and decode apart (a response that is not streamed)"
"""Added to the list for a response that is not streamed: the proxy sees one chunk."""

_MS: Final = 1_000_000
_TGI_HEADERS: Final = (
    b"x-queue-time",
    b"x-inference-time",
    b"x-time-per-token",
    b"x-validation-time",
    b"x-prompt-tokens",
    b"x-generated-tokens",
)
_LLAMA_STOP_TYPES: Final = {"eos": "stop", "word": "stop", "limit": "length"}
"""llama-server's own ``stop_type`` as an OpenAI finish reason."""
_MAX_FINAL_OBJECTS: Final = 4
"""Stream events read from the end when looking for the report (it is in the last one or two)."""


@dataclass(slots=True)
class EngineReport:
    """One request as its engine reported it; None: not reported. Durations in ns."""

    engine: str
    queue_ns: int | None = None
    load_ns: int | None = None
    prefill_ns: int | None = None
    decode_ns: int | None = None
    inference_ns: int | None = None
    """Prefill + decode (TGI's ``x-inference-time``)."""
    total_ns: int | None = None
    """The engine handler's whole time (Ollama's ``total_duration``)."""
    validation_ns: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    model: str | None = None
    response_id: str | None = None


@dataclass(slots=True)
class Observed:
    """The proxy's own instants of one request (monotonic ns)."""

    arrival_ns: int
    first_token_ns: int | None
    last_token_ns: int | None
    report_ns: int
    """When the report was seen: the final event's or the body's arrival at the proxy."""
    streamed: bool


@dataclass(slots=True)
class Boundaries:
    """What ``fold`` gives the request's timer (monotonic ns); None: not known."""

    queued_ns: int | None = None
    ready_ns: int | None = None
    first_scheduled_ns: int | None = None


# --- reading -------------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _count(value: Any) -> int | None:
    number = _number(value)
    return None if number is None else int(number)


def _ns(value: Any, unit_ns: int) -> int | None:
    number = _number(value)
    return None if number is None else int(number * unit_ns)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def final_objects(payload: bytes, *, event_stream: bool) -> list[dict[str, Any]]:
    """The last JSON objects of a response payload, last first: the events of an SSE stream
    (``data:`` lines), the lines of NDJSON, or the one JSON body."""
    objects: list[dict[str, Any]] = []
    if event_stream or b"\n" in payload.strip():
        for line in reversed(payload.split(b"\n")):
            line = line.strip()
            if line.startswith(b"data:"):
                line = line[5:].strip()
            if not line.startswith(b"{"):
                continue
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                objects.append(value)
                if len(objects) >= _MAX_FINAL_OBJECTS:
                    break
        return objects
    try:
        value = json.loads(payload)
    except ValueError:
        return objects
    if isinstance(value, dict):
        objects.append(value)
    return objects


def read_report(
    engine: str, headers: Mapping[bytes, bytes], objects: Iterable[Mapping[str, Any]]
) -> EngineReport:
    """The engine's report from the response ``headers`` (lower-case names) and its final
    ``objects`` (last first). ``engine`` ``auto`` picks by what is there: ``timings`` →
    llama-server, TGI's headers → tgi, ``total_duration`` / ``eval_count`` → ollama, else
    openai (usage and finish reason only)."""
    objects = list(objects)
    timings = next((o["timings"] for o in objects if isinstance(o.get("timings"), dict)), None)
    ollama = next((o for o in objects if "eval_count" in o or "total_duration" in o), None)
    tgi = any(name in headers for name in _TGI_HEADERS[:3])
    if engine == ENGINE_AUTO:
        if timings is not None:
            engine = ENGINE_LLAMA_SERVER
        elif tgi:
            engine = ENGINE_TGI
        elif ollama is not None:
            engine = ENGINE_OLLAMA
        else:
            engine = ENGINE_OPENAI
    report = EngineReport(engine)
    _read_openai(report, objects)
    if engine == ENGINE_LLAMA_SERVER and timings is not None:
        report.prefill_ns = _ns(timings.get("prompt_ms"), _MS)
        report.decode_ns = _ns(timings.get("predicted_ms"), _MS)
        prompt_n = _count(timings.get("prompt_n"))
        cache_n = _count(timings.get("cache_n"))
        if prompt_n is not None:
            report.input_tokens = prompt_n + (cache_n or 0)
        if cache_n is not None:
            report.cached_tokens = cache_n
        predicted = _count(timings.get("predicted_n"))
        if predicted is not None:
            report.output_tokens = predicted
    elif engine == ENGINE_TGI:
        _read_tgi(report, headers, objects)
    elif engine == ENGINE_OLLAMA and ollama is not None:
        report.load_ns = _ns(ollama.get("load_duration"), 1)
        report.prefill_ns = _ns(ollama.get("prompt_eval_duration"), 1)
        report.decode_ns = _ns(ollama.get("eval_duration"), 1)
        report.total_ns = _ns(ollama.get("total_duration"), 1)
        report.input_tokens = _count(ollama.get("prompt_eval_count")) or report.input_tokens
        report.output_tokens = _count(ollama.get("eval_count")) or report.output_tokens
        report.finish_reason = _text(ollama.get("done_reason")) or report.finish_reason
    if (
        (engine == ENGINE_LLAMA_SERVER and timings is None)
        or (engine == ENGINE_TGI and not tgi)
        or (engine == ENGINE_OLLAMA and ollama is None)
    ):
        report.engine = ENGINE_OPENAI  # the engine named did not report: only the stream's facts
    return report


def _read_openai(report: EngineReport, objects: list[Mapping[str, Any]]) -> None:
    """Model, id, usage and finish reason, wherever the final objects have them."""
    for obj in objects:
        report.model = report.model or _text(obj.get("model"))
        report.response_id = report.response_id or _text(obj.get("id"))
        usage = obj.get("usage")
        if isinstance(usage, dict) and report.output_tokens is None:
            report.input_tokens = _count(usage.get("prompt_tokens"))
            report.output_tokens = _count(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                report.cached_tokens = _count(details.get("cached_tokens"))
        choices = obj.get("choices")
        if report.finish_reason is None and isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and _text(choice.get("finish_reason")):
                    report.finish_reason = choice["finish_reason"]
                    break
        if report.finish_reason is None:  # llama-server's own /completion
            reason = _text(obj.get("stop_type"))
            report.finish_reason = _LLAMA_STOP_TYPES.get(reason or "")


def _header_ms(headers: Mapping[bytes, bytes], name: bytes) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return _ns(float(raw.decode("latin-1").strip()), _MS)
    except ValueError:
        return None


def _header_count(headers: Mapping[bytes, bytes], name: bytes) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return _count(int(raw.decode("latin-1").strip()))
    except ValueError:
        return None


def _read_tgi(
    report: EngineReport, headers: Mapping[bytes, bytes], objects: list[Mapping[str, Any]]
) -> None:
    report.queue_ns = _header_ms(headers, b"x-queue-time")
    report.inference_ns = _header_ms(headers, b"x-inference-time")
    report.validation_ns = _header_ms(headers, b"x-validation-time")
    per_token = _header_ms(headers, b"x-time-per-token")
    report.input_tokens = _header_count(headers, b"x-prompt-tokens") or report.input_tokens
    generated = _header_count(headers, b"x-generated-tokens")
    if generated is not None:
        report.output_tokens = generated
    for obj in objects:  # TGI's own /generate(_stream): {"details": {...}}
        details = obj.get("details")
        if isinstance(details, dict):
            report.output_tokens = report.output_tokens or _count(details.get("generated_tokens"))
            report.finish_reason = report.finish_reason or _text(details.get("finish_reason"))
            break
    if report.inference_ns is None and per_token is not None and report.output_tokens:
        report.inference_ns = per_token * report.output_tokens


# --- folding -------------------------------------------------------------------------------------


def fold(report: EngineReport, seen: Observed) -> Boundaries:
    """The engine boundaries of one request: each engine duration ends at an instant the proxy
    saw (a streamed response: prefill ends at the first content chunk; otherwise at the body's
    arrival, minus the decode the engine reports). Boundaries are clamped into
    ``[arrival, first token]``; ``plan_spans`` and the budget keep them in order."""
    arrival = seen.arrival_ns
    first = seen.first_token_ns if seen.first_token_ns is not None else seen.report_ns
    bounds = Boundaries()

    def clamp(value: int) -> int:
        return min(max(value, arrival), first)

    engine = report.engine
    if engine == ENGINE_LLAMA_SERVER:
        if report.prefill_ns is not None:
            end = first if seen.streamed else seen.report_ns - (report.decode_ns or 0)
            bounds.first_scheduled_ns = clamp(end - report.prefill_ns)
    elif engine == ENGINE_TGI:
        if report.inference_ns is not None:
            done = seen.last_token_ns if seen.streamed and seen.last_token_ns else seen.report_ns
            scheduled = done - report.inference_ns
            bounds.first_scheduled_ns = clamp(scheduled)
            if report.queue_ns is not None:
                bounds.queued_ns = clamp(scheduled - report.queue_ns)
    elif engine == ENGINE_OLLAMA:
        if report.prefill_ns is not None:
            end = first if seen.streamed else seen.report_ns - (report.decode_ns or 0)
            bounds.first_scheduled_ns = clamp(end - report.prefill_ns)
        if report.total_ns is not None:
            handler_start = clamp(seen.report_ns - report.total_ns)
            bounds.queued_ns = handler_start
            if report.load_ns:
                bounds.ready_ns = clamp(handler_start + report.load_ns)
    else:  # openai: the whole wait for the first token is the engine's: prefill
        bounds.first_scheduled_ns = arrival
    if bounds.first_scheduled_ns is None:  # the engine's report was missing: as openai
        bounds.first_scheduled_ns = arrival
    return bounds
