"""Fixtures of the collector tests."""

from __future__ import annotations

import pytest

from tests.collector.consumers import RecordingConsumer


@pytest.fixture
def consumer() -> RecordingConsumer:
    """What the receiver under test hands its requests to."""
    return RecordingConsumer()
