"""Fixtures shared across the test tree: a test-owned OTLP receiver and the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.collector.upstream import UpstreamOtlp


@pytest.fixture
def upstream() -> Iterator[UpstreamOtlp]:
    """A test-owned OTLP receiver (gRPC and HTTP) on loopback, recording what it receives."""
    with UpstreamOtlp() as server:
        yield server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with its tokenizer (2048 positions), built once per session for
    every real-vLLM test."""
    from tokentrace.loadgen.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
