"""The in-process ``generate()`` / ``pipeline()`` instrumentation with real transformers: the
tiny random Llama (``tiny_model_dir``) on the CPU, greedy, a few tokens per call, and an
in-memory recorder; one end-to-end test through the real exporter to an in-process collector."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    pipeline,
)
from transformers.generation.utils import GenerationMixin

from tokentrace.agent import semconv
from tokentrace.agent.frameworks import transformers_generate as instrumentation
from tokentrace.agent.frameworks.transformers_generate import (
    HOOK_GENERATE,
    NOT_REPORTED,
    NOT_REPORTED_BEAM_SEARCH,
    NOT_REPORTED_BY,
    SUPPORTED_VERSIONS,
    TokenClock,
    TransformersGenerateInstrumentor,
    instrument_generate,
)
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import PROMPT_TOKEN_IDS, Recorder, RequestTimer

ORIGINAL_GENERATE = vars(GenerationMixin)["generate"]
NEW_TOKENS = 6


@dataclass
class Setup:
    instrumentor: TransformersGenerateInstrumentor
    finished: list[RequestTimer]
    recorder: Recorder
    guard: HookGuard


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> PreTrainedModel:
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    loaded.eval()
    return loaded


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    loaded.padding_side = "left"
    if loaded.pad_token is None:
        loaded.pad_token = loaded.eos_token
    return loaded


@pytest.fixture
def traced() -> Iterator[Setup]:
    finished: list[RequestTimer] = []
    recorder, guard = Recorder(finished.append), HookGuard()
    instrumentor = TransformersGenerateInstrumentor()
    instrumentor.instrument(recorder=recorder, guard=guard)
    assert instrumentor.is_instrumented_by_opentelemetry
    yield Setup(instrumentor, finished, recorder, guard)
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    assert vars(GenerationMixin)["generate"] is ORIGINAL_GENERATE


def greedy(**options: Any) -> dict[str, Any]:
    return {"do_sample": False, "max_new_tokens": NEW_TOKENS, **options}


class RecordingStreamer:
    """A caller's streamer: what generate() handed it."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ends += 1


class FailAtStep(LogitsProcessor):
    """Raises when generate() asks for the scores of step ``step`` (0: the first token)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.calls == self.step:
            raise RuntimeError("a logits processor failed")
        self.calls += 1
        return scores


def assert_timed(timer: RequestTimer, *, tokens: int) -> None:
    """Arrival (= queue = first scheduled) <= each token, in order, <= end."""
    assert timer.queued_ns == timer.first_scheduled_ns == timer.arrival_ns
    assert len(timer.token_ns) == tokens == timer.attributes["output_tokens"]
    assert timer.end_ns is not None
    times = [timer.arrival_ns, *timer.token_ns, timer.end_ns]
    assert times == sorted(times)
    assert timer.token_ns[0] > timer.arrival_ns  # the prefill took time


# --- one call --------------------------------------------------------------------------------


def test_each_new_token_is_timed_after_the_prefill(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tiny_model_dir: Path
) -> None:
    inputs = tokenizer("the quick brown fox", return_tensors="pt")
    output = model.generate(**inputs, **greedy())
    assert output.shape[-1] == inputs["input_ids"].shape[-1] + NEW_TOKENS
    (timer,) = traced.finished
    assert_timed(timer, tokens=NEW_TOKENS)
    attributes = timer.attributes
    assert attributes["input_tokens"] == inputs["input_ids"].shape[-1]
    assert attributes["model"] == str(tiny_model_dir)
    assert attributes["operation"] == semconv.OPERATION_TEXT_COMPLETION
    assert attributes["finish_reason"] == "length"
    assert attributes["max_tokens"] == NEW_TOKENS
    assert attributes["not_reported"] == NOT_REPORTED
    assert attributes["not_reported_by"] == NOT_REPORTED_BY
    assert attributes[PROMPT_TOKEN_IDS].tolist() == inputs["input_ids"][0].tolist()
    assert timer.status_error is None
    assert traced.recorder.in_flight == 0 and not traced.guard.failures


def test_the_applications_current_span_is_the_parent(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    tracer = TracerProvider().get_tracer("app")
    inputs = tokenizer("hello", return_tensors="pt")
    with tracer.start_as_current_span("handle", kind=SpanKind.SERVER) as app_span:
        model.generate(**inputs, **greedy())
    context = app_span.get_span_context()
    (timer,) = traced.finished
    assert timer.trace_id == context.trace_id.to_bytes(16, "big")
    assert timer.parent_span_id == context.span_id.to_bytes(8, "big")


def test_a_generate_thread_that_runs_in_the_callers_context_keeps_the_parent(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    import contextvars
    import threading

    tracer = TracerProvider().get_tracer("app")
    inputs = tokenizer("threaded", return_tensors="pt")
    with tracer.start_as_current_span("handle") as app_span:
        thread = threading.Thread(
            target=contextvars.copy_context().run,
            args=(model.generate,),
            kwargs={**inputs, **greedy()},
        )
        thread.start()
        thread.join(timeout=120)
    (timer,) = traced.finished
    assert timer.parent_span_id == app_span.get_span_context().span_id.to_bytes(8, "big")


def test_without_a_current_span_each_call_is_a_new_trace(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    inputs = tokenizer("hello", return_tensors="pt")
    model.generate(**inputs, **greedy())
    model.generate(**inputs, **greedy())
    first, second = traced.finished
    assert first.parent_span_id == second.parent_span_id == b""
    assert len(first.trace_id) == 16 and any(first.trace_id)
    assert first.trace_id != second.trace_id
    assert first.request_id != second.request_id


def test_the_callers_streamer_still_gets_every_call(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    inputs = tokenizer("stream me", return_tensors="pt")
    untraced_streamer = RecordingStreamer()
    traced.instrumentor.uninstrument()
    expected = model.generate(**inputs, **greedy(), streamer=untraced_streamer)
    traced.instrumentor.instrument(recorder=traced.recorder, guard=traced.guard)

    streamer = RecordingStreamer()
    output = model.generate(**inputs, **greedy(), streamer=streamer)
    assert torch.equal(output, expected)
    assert streamer.ends == untraced_streamer.ends == 1
    assert [put.tolist() for put in streamer.puts] == [
        put.tolist() for put in untraced_streamer.puts
    ]
    assert len(streamer.puts) == 1 + NEW_TOKENS  # the prompt, then one put per token
    (timer,) = traced.finished
    assert_timed(timer, tokens=NEW_TOKENS)


def test_a_positional_streamer_is_wrapped_in_place(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    input_ids = tokenizer("positional", return_tensors="pt")["input_ids"]
    streamer = RecordingStreamer()
    # inputs, generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn,
    # synced_gpus, assistant_model, streamer
    model.generate(input_ids, None, None, None, None, None, None, streamer, **greedy())
    assert len(streamer.puts) == 1 + NEW_TOKENS and streamer.ends == 1
    (timer,) = traced.finished
    assert_timed(timer, tokens=NEW_TOKENS)


def test_a_text_generation_pipeline_is_traced(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tiny_model_dir: Path
) -> None:
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    (result,) = generator("once upon a time", **greedy())
    assert result["generated_text"].startswith("once upon a time")
    (timer,) = traced.finished
    assert_timed(timer, tokens=NEW_TOKENS)
    assert timer.attributes["model"] == str(tiny_model_dir)
    assert timer.attributes["input_tokens"] == len(tokenizer("once upon a time")["input_ids"])


# --- batches -------------------------------------------------------------------------------


def test_a_batch_of_two_is_one_request_per_row_each_ending_at_its_eos(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    batch = tokenizer(["hi", "a much longer second prompt"], return_tensors="pt", padding=True)
    prompt_columns = batch["input_ids"].shape[-1]
    free = model.generate(**batch, **greedy(), eos_token_id=None)
    new_tokens = free[:, prompt_columns:].tolist()

    def ended_at(row: list[int], eos: int) -> int:
        return row.index(eos) + 1 if eos in row else NEW_TOKENS

    # An EOS token that ends the rows at different steps, one of them early.
    candidates = [
        (token, [ended_at(row, token) for row in new_tokens])
        for token in dict.fromkeys(new_tokens[0] + new_tokens[1])
    ]
    stop_token, lengths = next(
        (token, lengths)
        for token, lengths in candidates
        if lengths[0] != lengths[1] and min(lengths) > 1
    )
    traced.finished.clear()

    model.generate(**batch, **greedy(), eos_token_id=stop_token)
    first, second = traced.finished
    for timer, length in zip((first, second), lengths, strict=True):
        assert_timed(timer, tokens=length)
        reason = "stop" if stop_token in new_tokens[traced.finished.index(timer)] else "length"
        assert timer.attributes["finish_reason"] == reason
    # The rows share the call: arrival, prefill, token times, trace and end.
    assert first.arrival_ns == second.arrival_ns
    shorter = min(lengths)
    assert first.token_ns[:shorter] == second.token_ns[:shorter]
    assert first.trace_id == second.trace_id
    assert first.request_id != second.request_id
    assert [first.attributes["input_tokens"], second.attributes["input_tokens"]] == (
        batch["attention_mask"].sum(-1).tolist()
    )
    # Left padding is not part of the prompt the prefix hash sees.
    assert first.attributes[PROMPT_TOKEN_IDS].tolist() == tokenizer("hi")["input_ids"]


def test_num_return_sequences_is_a_request_per_sequence(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    inputs = tokenizer("sample twice", return_tensors="pt")
    torch.manual_seed(0)
    output = model.generate(
        **inputs, do_sample=True, max_new_tokens=NEW_TOKENS, num_return_sequences=2
    )
    assert output.shape[0] == 2
    assert len(traced.finished) == 2
    for timer in traced.finished:
        assert timer.attributes["input_tokens"] == inputs["input_ids"].shape[-1]
        assert len(timer.token_ns) == timer.attributes["output_tokens"]


def test_beam_search_is_traced_without_token_times(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    inputs = tokenizer("beams", return_tensors="pt")
    # transformers refuses a streamer with beam search: the instrumentation must not pass one.
    output = model.generate(**inputs, **greedy(num_beams=2))
    (timer,) = traced.finished
    assert timer.token_ns == [] and timer.status_error is None
    assert timer.attributes["output_tokens"] == output.shape[-1] - inputs["input_ids"].shape[-1]
    assert NOT_REPORTED_BEAM_SEARCH in timer.attributes["not_reported"]


def test_an_assistant_models_own_generate_is_not_a_request(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    inputs = tokenizer("assisted decoding", return_tensors="pt")
    output = model.generate(**inputs, **greedy(), assistant_model=model)
    (timer,) = traced.finished  # the drafts' generate() calls are inside this one
    new_tokens = output.shape[-1] - inputs["input_ids"].shape[-1]
    assert_timed(timer, tokens=new_tokens)


def test_prompt_lookup_tokens_of_one_step_share_its_time(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    inputs = tokenizer("the cat the cat the cat the cat", return_tensors="pt")
    output = model.generate(**inputs, **greedy(max_new_tokens=12), prompt_lookup_num_tokens=3)
    (timer,) = traced.finished
    new_tokens = output.shape[-1] - inputs["input_ids"].shape[-1]
    assert_timed(timer, tokens=new_tokens)
    assert not traced.guard.failures


# --- failures ------------------------------------------------------------------------------


def test_an_exception_in_generate_ends_the_request_with_an_error_and_propagates(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    inputs = tokenizer("this fails", return_tensors="pt")
    failing = FailAtStep(3)
    with pytest.raises(RuntimeError, match="a logits processor failed") as raised:
        model.generate(**inputs, **greedy(), logits_processor=LogitsProcessorList([failing]))
    assert raised.type is RuntimeError
    (timer,) = traced.finished
    assert timer.status_error == "generate() raised RuntimeError"
    assert len(timer.token_ns) == 3  # the tokens before the failing step
    assert timer.end_ns is not None and timer.end_ns >= timer.token_ns[-1]
    assert "output_tokens" not in timer.attributes
    assert not traced.guard.failures


def test_a_failing_hook_never_breaks_generate(
    traced: Setup,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inputs = tokenizer("robust", return_tensors="pt")
    expected = model.generate(**inputs, **greedy())
    traced.finished.clear()

    def broken(_model: Any) -> str:
        raise ValueError("a bug in the hook")

    monkeypatch.setattr(instrumentation, "_model_name", broken)
    assert torch.equal(model.generate(**inputs, **greedy()), expected)
    assert traced.guard.failures == {HOOK_GENERATE: 1}
    assert traced.finished == []
    assert torch.equal(model.generate(**inputs, **greedy()), expected)  # disabled: untraced
    assert traced.finished == []


def test_a_token_clock_failure_is_reported_once_and_stops_tracing(
    traced: Setup,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class FailingClock(TokenClock):
        __slots__ = ()

        def put(self, value: Any) -> None:
            super().put(value)
            if len(self.step_ns) == 2:
                self.failure = RuntimeError("a bug in the token clock")

    monkeypatch.setattr(instrumentation, "TokenClock", FailingClock)
    inputs = tokenizer("robust tokens", return_tensors="pt")
    streamer = RecordingStreamer()
    output = model.generate(**inputs, **greedy(), streamer=streamer)
    assert output.shape[-1] == inputs["input_ids"].shape[-1] + NEW_TOKENS
    assert len(streamer.puts) == 1 + NEW_TOKENS
    assert traced.guard.failures == {instrumentation.HOOK_TOKENS: 1}
    (timer,) = traced.finished
    assert timer.token_ns == []  # times from a failed clock are dropped
    model.generate(**inputs, **greedy())
    assert len(traced.finished) == 1  # no longer traced


def test_a_token_clock_failure_keeps_the_callers_streamer_fed() -> None:
    class KeepingStreamer:
        def __init__(self) -> None:
            self.puts: list[Any] = []
            self.ends = 0

        def put(self, value: Any) -> None:
            self.puts.append(value)

        def end(self) -> None:
            self.ends += 1

    streamer = KeepingStreamer()
    clock = TokenClock(iter(range(10)).__next__, streamer, several_per_put=True)
    prompt = torch.tensor([[5, 6]])
    clock.put(prompt)
    clock.put("not a tensor")
    clock.put(torch.tensor([7]))
    assert isinstance(clock.failure, AttributeError)
    assert streamer.puts[0] is prompt and streamer.puts[1] == "not a tensor"
    assert len(streamer.puts) == 3
    clock.end()
    assert streamer.ends == 1
    assert clock.ends == 1  # attributes it lacks are the caller's streamer's


# --- activation ----------------------------------------------------------------------------


def test_instrument_uninstrument_instrument(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    inputs = tokenizer("again", return_tensors="pt")
    assert vars(GenerationMixin)["generate"] is not ORIGINAL_GENERATE
    traced.instrumentor.uninstrument()
    assert vars(GenerationMixin)["generate"] is ORIGINAL_GENERATE
    model.generate(**inputs, **greedy())
    assert traced.finished == []
    traced.instrumentor.instrument(recorder=traced.recorder, guard=traced.guard)
    model.generate(**inputs, **greedy())
    assert len(traced.finished) == 1


def test_the_one_line_api_is_idempotent(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    finished: list[RequestTimer] = []
    recorder, guard = Recorder(finished.append), HookGuard()
    instrumentor = instrument_generate(recorder=recorder, guard=guard)
    try:
        assert instrument_generate(recorder=recorder, guard=guard) is instrumentor
        assert len(instrumentor._applied) == 1
        model.generate(**tokenizer("once", return_tensors="pt"), **greedy())
        assert len(finished) == 1
    finally:
        instrumentor.uninstrument()
    assert vars(GenerationMixin)["generate"] is ORIGINAL_GENERATE


def test_it_is_opt_in_for_tokentrace_run() -> None:
    assert TransformersGenerateInstrumentor.auto_instrument is False
    assert TransformersGenerateInstrumentor.target_module == "transformers"


def test_an_unsupported_version_is_refused_with_one_warning(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(
        instrumentation.TransformersGenerateInstrumentor,
        "installed",
        lambda _self: ("transformers", "9.0"),
    )
    monkeypatch.setattr(TransformersGenerateInstrumentor, "_unsupported_warned", False)
    finished: list[RequestTimer] = []
    instrumentor = TransformersGenerateInstrumentor()
    with caplog.at_level(logging.WARNING):
        instrumentor.instrument(recorder=Recorder(finished.append), guard=HookGuard())
        instrumentor.instrument(recorder=Recorder(finished.append), guard=HookGuard())
    assert not instrumentor.is_instrumented_by_opentelemetry
    assert vars(GenerationMixin)["generate"] is ORIGINAL_GENERATE
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "transformers 9.0" in warnings[0] and SUPPORTED_VERSIONS in warnings[0]
    model.generate(**tokenizer("untraced", return_tensors="pt"), **greedy())
    assert finished == []


def test_calls_on_transformers_serves_inference_thread_are_left_to_its_instrumentation(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    # transformers serve's unstreamed calls pass no streamer: the thread they run on says it.
    from transformers.cli.serving.utils import InferenceThread

    inputs = tokenizer("served", return_tensors="pt")
    InferenceThread().submit(model.generate, **inputs, **greedy()).result(timeout=60)
    assert traced.finished == []
    model.generate(**inputs, **greedy())  # the same call on the application's thread
    assert len(traced.finished) == 1


def test_transformers_serves_own_calls_are_left_to_its_instrumentation(
    traced: Setup, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    serve_streamer_class = type(
        "DirectStreamer", (RecordingStreamer,), {"__module__": "transformers.cli.serving.utils"}
    )
    streamer = serve_streamer_class()
    model.generate(**tokenizer("served", return_tensors="pt"), **greedy(), streamer=streamer)
    assert traced.finished == []
    assert len(streamer.puts) == 1 + NEW_TOKENS  # handed over untouched


# --- end to end ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_generate_call_in_an_app_gets_a_budget_metrics_and_a_verdict(
    tmp_path: Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The application's own span (its SDK exports it) -> generate() under it -> the agent's
    emitter and OTLP sender -> an in-process collector -> the stored request, explained."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from tokentrace.agent.cli import main as tokentrace_main
    from tokentrace.agent.emit import SpanEmitter
    from tokentrace.agent.otlp_config import OtlpExporterConfig
    from tokentrace.agent.otlp_export import OtlpSender
    from tokentrace.collector.config import parse_config
    from tokentrace.collector.service import Collector
    from tokentrace.collector.store import RequestStore
    from tokentrace.collector.store.document import budget_segments

    store_path = tmp_path / "requests.db"
    collector = Collector(
        parse_config(
            {
                "receivers": {"otlp": {"protocols": {"http": {"endpoint": "127.0.0.1:0"}}}},
                "exporters": {"store": {"path": str(store_path)}},
            },
            environ={},
        )
    )
    collector.start()
    endpoint = f"http://127.0.0.1:{collector.http_port}"
    service = {semconv.SERVICE_NAME: "generate-app"}
    sender = OtlpSender(
        OtlpExporterConfig(endpoint=endpoint, protocol="http/protobuf"), signal="traces"
    )
    emitter = SpanEmitter(sender.submit, resource_attributes=service, scope_name="t")
    app_provider = TracerProvider(resource=Resource.create(service))
    app_provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces"))
    )
    instrumentor = instrument_generate(recorder=Recorder(emitter.submit), guard=HookGuard())
    inputs = tokenizer("explain this request", return_tensors="pt")
    try:
        with app_provider.get_tracer("app").start_as_current_span(
            "POST /answer", kind=SpanKind.SERVER
        ) as app_span:
            model.generate(**inputs, **greedy(max_new_tokens=12))
        assert emitter.flush(10.0)
        assert sender.force_flush(10.0)
        app_provider.force_flush()
        collector.flush()
    finally:
        instrumentor.uninstrument()
        app_provider.shutdown()
        emitter.shutdown(1.0)
        sender.shutdown(1.0)
        collector.shutdown()
    trace_id = format(app_span.get_span_context().trace_id, "032x")
    store = RequestStore.open_readonly(store_path)
    try:
        doc = store.get(trace_id)
    finally:
        store.close()
    assert doc is not None
    assert doc["service"] == "generate-app" and doc["tokens"]["output"] == 12
    budget = doc["budget"]
    # The app's SERVER span is the request's server view: the segments partition its E2E.
    assert sum(budget_segments(budget).values()) == pytest.approx(budget["e2e_ms"], abs=0.01)
    assert doc["metrics_ms"]["e2e"] == pytest.approx(budget["e2e_ms"], abs=0.01)
    assert budget[semconv.SEGMENT_QUEUE] == 0
    assert budget[semconv.SEGMENT_PREFILL] > 0 and budget[semconv.SEGMENT_DECODE] > 0
    metrics = doc["metrics_ms"]
    assert metrics["ttft"] is not None and metrics["tpot"] is not None
    assert metrics["ttft"] < metrics["e2e"]
    assert doc["verdict"] is not None and doc["verdict"]["segment"] in semconv.SEGMENTS
    assert doc["not_reported"] == {"source": NOT_REPORTED_BY, "items": list(NOT_REPORTED)}
    capsys.readouterr()
    assert tokentrace_main(["explain", trace_id, "--store", str(store_path)]) == 0
    text = capsys.readouterr().out
    # (explain leaves out the zero queue; http is the app's own time around the call)
    for segment in ("http", "prefill", "decode", "postprocess"):
        assert f"\n{segment} " in text, text
    assert "output 12" in text and NOT_REPORTED_BY in text, text


_APP_UNDER_OPENTELEMETRY_INSTRUMENT = """
import sys

import torch
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, endpoint = sys.argv[1], sys.argv[2]
provider = TracerProvider(resource=Resource.create({"service.name": "generate-app"}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
inputs = AutoTokenizer.from_pretrained(model_dir)("launched", return_tensors="pt")
with provider.get_tracer("app").start_as_current_span("answer", kind=SpanKind.SERVER) as span:
    model.generate(**inputs, do_sample=False, max_new_tokens=5)
provider.shutdown()
print(format(span.get_span_context().trace_id, "032x"))
"""


@pytest.mark.slow
def test_opentelemetry_instrument_activates_it_through_the_entry_point(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import os
    import shutil
    import subprocess
    from importlib.metadata import entry_points

    from tests.stored_requests import stored_documents
    from tokentrace.collector.config import parse_config
    from tokentrace.collector.service import Collector

    names = {entry.name for entry in entry_points(group="opentelemetry_instrumentor")}
    if "transformers_generate" not in names:
        pytest.skip("the transformers_generate entry point is not installed (make install)")
    launcher = shutil.which("opentelemetry-instrument", path=str(Path(sys.executable).parent))
    assert launcher is not None
    store_path = tmp_path / "requests.db"
    collector = Collector(
        parse_config(
            {
                "receivers": {"otlp": {"protocols": {"http": {"endpoint": "127.0.0.1:0"}}}},
                "exporters": {"store": {"path": str(store_path)}},
            },
            environ={},
        )
    )
    collector.start()
    endpoint = f"http://127.0.0.1:{collector.http_port}"
    script = tmp_path / "app.py"
    script.write_text(_APP_UNDER_OPENTELEMETRY_INSTRUMENT, encoding="utf-8")
    environ = {
        **os.environ,
        "OTEL_SERVICE_NAME": "generate-app",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "none",  # the app exports its own span; tokentrace its own
    }
    try:
        result = subprocess.run(
            [launcher, sys.executable, str(script), str(tiny_model_dir), f"{endpoint}/v1/traces"],
            capture_output=True,
            text=True,
            env=environ,
            timeout=240,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        trace_id = result.stdout.split()[-1]
        doc = stored_documents(store_path, [trace_id], context=lambda: result.stderr[-4000:])[
            trace_id
        ]
    finally:
        collector.shutdown()
    assert doc["tokens"]["output"] == 5 and doc["service"] == "generate-app"
    assert doc["metrics_ms"]["ttft"] is not None and doc["verdict"] is not None
    assert doc["not_reported"] is not None and doc["not_reported"]["source"] == NOT_REPORTED_BY
