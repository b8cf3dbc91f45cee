"""Fixtures shared by the agent's and the collector's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.collector.upstream import UpstreamOtlp


@pytest.fixture
def upstream() -> Iterator[UpstreamOtlp]:
    """A test-owned OTLP receiver (gRPC and HTTP) on loopback, recording what it receives."""
    with UpstreamOtlp() as server:
        yield server
