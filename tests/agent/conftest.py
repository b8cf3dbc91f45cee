"""Fixtures of the agent tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.agent.vllm_stand_ins import (
    CLOCK,
    Recorder,
    RequestTimer,
    Setup,
    engine_monotonic_ns,
    patched_attributes,
    stand_in_modules,
)
from tokentrace.agent.frameworks.vllm import VllmInstrumentor
from tokentrace.agent.frameworks.vllm_engine import EngineStepTracer
from tokentrace.agent.hooks import HookGuard


@pytest.fixture
def vllm_stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    for name, module in stand_in_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    finished: list[RequestTimer] = []
    guard = HookGuard()
    engine_jobs: list[Any] = []
    tracer = EngineStepTracer(
        engine_jobs.append,
        guard=guard,
        to_unix=CLOCK,
        sample_rate=0.0,
        monotonic_ns=engine_monotonic_ns,
    )
    setup = Setup(
        VllmInstrumentor(), finished, Recorder(finished.append), guard, engine_jobs, tracer
    )
    originals = patched_attributes()
    yield setup
    if setup.instrumentor.is_instrumented_by_opentelemetry:
        setup.instrumentor.uninstrument()
    assert patched_attributes() == originals
