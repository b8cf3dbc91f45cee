"""bench/agent_cpu_share.py's attribution of profiler samples to the tracing or the host."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.agent_cpu_share import (
    OWNER_HOST,
    OWNER_LIBRARY,
    OWNER_TRACING,
    TRACER_BUILTIN,
    TRACER_TOKENTRACE,
    TRACER_TOKENTRACE_SOCKET,
    attribute,
    owner_of,
    parse_frame,
)

_STDLIB = "/root/.pyenv/versions/3.11.7/lib/python3.11"
_SITE = "/venv/lib/python3.11/site-packages"
_REPO = Path(__file__).resolve().parents[2]


def _frame(function: str, path: str, line: int = 1) -> str:
    return f"{function} ({path}:{line})"


def _stack(*frames: str) -> str:
    return ";".join(frames)


_THREAD = (
    _frame("Thread._bootstrap", f"{_STDLIB}/threading.py"),
    _frame("Thread.run", f"{_STDLIB}/threading.py"),
)
_EMITTER = _frame("SpanEmitter._drain", f"{_REPO}/agent/emit.py", 160)
_INSTALLED_EMITTER = _frame("SpanEmitter._drain", f"{_SITE}/tokentrace/agent/emit.py", 160)
_GRPC = _frame("_UnaryUnaryMultiCallable._blocking", f"{_SITE}/grpc/_channel.py")
_VLLM = _frame("EngineCore.step", f"{_SITE}/vllm/v1/engine/core.py")
_OTEL_SDK = _frame("BatchProcessor.worker", f"{_SITE}/opentelemetry/sdk/_shared_internal/x.py")


def test_a_frame_reads_as_py_spy_writes_it() -> None:
    frame = parse_frame(_frame("Outer.method", "/a/b/c.py", 12))
    assert (frame.function, frame.path, frame.label) == (
        "Outer.method",
        "/a/b/c.py",
        "Outer.method (c.py)",
    )


def test_library_frames_belong_to_whoever_called_them() -> None:
    frames = [parse_frame(text) for text in (*_THREAD, _EMITTER, _GRPC)]
    owner, frame = owner_of(frames, TRACER_TOKENTRACE)
    assert owner == OWNER_TRACING
    assert frame is not None and frame.function == "SpanEmitter._drain"
    host = [parse_frame(text) for text in (*_THREAD, _VLLM, _GRPC)]
    assert owner_of(host, TRACER_TOKENTRACE)[0] == OWNER_HOST


def test_the_innermost_owner_wins_over_a_wrapper_around_it() -> None:
    # tokentrace's wrapper calling into vLLM: the time inside vLLM is vLLM's.
    wrapper = _frame("_wrap_outputs", f"{_REPO}/agent/frameworks/vllm.py")
    frames = [parse_frame(text) for text in (*_THREAD, wrapper, _VLLM)]
    assert owner_of(frames, TRACER_TOKENTRACE)[0] == OWNER_HOST


@pytest.mark.parametrize("tracer", [TRACER_TOKENTRACE, TRACER_TOKENTRACE_SOCKET])
def test_an_installed_tokentrace_counts_but_a_venv_named_tokentrace_does_not(tracer: str) -> None:
    """Both of tokentrace's configurations (OTLP, the node agent's socket) own its frames."""
    installed = [parse_frame(text) for text in (*_THREAD, _INSTALLED_EMITTER)]
    assert owner_of(installed, tracer)[0] == OWNER_TRACING
    assert owner_of(installed, TRACER_BUILTIN)[0] == OWNER_HOST
    host_in_our_venv = parse_frame(
        _frame("EngineCore.step", "/root/.cache/tokentrace/venvs/x/site-packages/vllm/core.py")
    )
    assert owner_of([host_in_our_venv], tracer)[0] == OWNER_HOST


def test_opentelemetry_is_the_tracing_for_vllms_own_and_a_library_for_tokentrace() -> None:
    frames = [parse_frame(text) for text in (*_THREAD, _OTEL_SDK)]
    assert owner_of(frames, TRACER_BUILTIN)[0] == OWNER_TRACING
    # A thread of SDK frames only, under tokentrace: started by a tracer all the same.
    assert owner_of(frames, TRACER_TOKENTRACE)[0] == OWNER_TRACING
    do_tracing = _frame("OutputProcessor.do_tracing", f"{_SITE}/vllm/v1/engine/output_processor.py")
    builtin = [parse_frame(text) for text in (*_THREAD, _VLLM, do_tracing)]
    assert owner_of(builtin, TRACER_BUILTIN)[0] == OWNER_TRACING
    assert owner_of(builtin, TRACER_TOKENTRACE)[0] == OWNER_HOST


def test_stdlib_only_threads_are_the_librarys() -> None:
    frames = [parse_frame(text) for text in _THREAD]
    assert owner_of(frames, TRACER_TOKENTRACE)[0] == OWNER_LIBRARY


def test_a_profile_sums_by_owner_with_the_tracings_top_functions() -> None:
    raw = [
        f"{_stack(*_THREAD, _EMITTER, _GRPC)} 30",
        f"{_stack(*_THREAD, _VLLM)} 960",
        f"{_stack(*_THREAD)} 10",
        "malformed line",
        "",
    ]
    share = attribute(raw, TRACER_TOKENTRACE)
    assert (share.busy, share.tracing, share.library) == (1000, 30, 10)
    assert share.share == 0.03
    assert share.functions.most_common(1) == [("SpanEmitter._drain (emit.py)", 30)]


def test_entry_points_count_a_hook_with_everything_the_tracing_does_below_it() -> None:
    hook = _frame("HttpServerTracer.begin", f"{_REPO}/agent/frameworks/asgi.py", 140)
    wait = _frame("_receive_wait_ns", f"{_REPO}/agent/frameworks/asgi.py", 220)
    uvloop = _frame("UVStream.get_extra_info", f"{_SITE}/uvloop/loop.pyx")
    raw = [
        f"{_stack(*_THREAD, _VLLM, hook, wait, uvloop)} 7",  # the host's library: the wait's
        f"{_stack(*_THREAD, _VLLM, hook)} 3",
        f"{_stack(*_THREAD, _VLLM, hook, _VLLM)} 5",  # the host again: not the tracing's
        f"{_stack(*_THREAD, _EMITTER, _GRPC)} 2",
    ]
    share = attribute(raw, TRACER_TOKENTRACE)
    assert share.tracing == 12
    assert share.functions == {
        "_receive_wait_ns (asgi.py)": 7,
        "HttpServerTracer.begin (asgi.py)": 3,
        "SpanEmitter._drain (emit.py)": 2,
    }
    assert share.entries == {
        "HttpServerTracer.begin (asgi.py)": 10,
        "SpanEmitter._drain (emit.py)": 2,
    }


# --- --native: C frames as py-spy --native writes them ---------------------------------------
_OUR_C = _frame("step_facts", "agent/_steps.c", 212)
_LIBC = "0x7f603e64524a (libc.so.6)"
_TORCH_C = _frame("at::native::addmm_out", "aten/src/ATen/native/LinearAlgebra.cpp", 40)


@pytest.mark.parametrize("tracer", [TRACER_TOKENTRACE, TRACER_TOKENTRACE_SOCKET])
def test_tokentraces_c_is_the_tracings_even_called_straight_from_the_host(tracer: str) -> None:
    # A C patch put in vLLM's class: no Python frame of ours between vLLM's and our C.
    frames = [parse_frame(text) for text in (*_THREAD, _VLLM, _OUR_C, _LIBC)]
    owner, frame = owner_of(frames, tracer)
    assert owner == OWNER_TRACING
    assert frame is not None and frame.label == "step_facts (_steps.c)"
    # Built elsewhere, the build's path is absolute.
    absolute = _frame("step_facts", f"{_REPO}/agent/_steps.c", 212)
    assert owner_of([parse_frame(text) for text in (_VLLM, absolute)], tracer)[0] == OWNER_TRACING
    assert owner_of(frames, TRACER_BUILTIN)[0] == OWNER_HOST


def test_other_compiled_code_belongs_to_the_python_frame_that_called_it() -> None:
    ours = [parse_frame(text) for text in (*_THREAD, _VLLM, _EMITTER, _LIBC)]
    assert owner_of(ours, TRACER_TOKENTRACE)[0] == OWNER_TRACING
    host = [parse_frame(text) for text in (*_THREAD, _EMITTER, _VLLM, _TORCH_C, _LIBC)]
    owner, frame = owner_of(host, TRACER_TOKENTRACE)
    assert owner == OWNER_HOST
    assert frame is not None and frame.function == "EngineCore.step"
    native_only = [parse_frame(text) for text in (_LIBC, _TORCH_C)]
    assert owner_of(native_only, TRACER_TOKENTRACE)[0] == OWNER_LIBRARY
