"""The memory limiter: refusal near the limit, bursts between readings, garbage collection above
the hard limit, container limits, configuration errors."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from tokentrace.collector.component import ConfigError
from tokentrace.collector.config import parse_config
from tokentrace.collector.consumer import Overloaded
from tokentrace.collector.memory_limiter import (
    DECODED_BYTES_PER_SPAN,
    DEFAULT_LIMIT_BYTES,
    DEFAULT_LIMIT_FRACTION,
    MemoryLimiter,
    MemoryLimiterConfig,
    container_memory_limit,
    resident_bytes,
)

MIB = 2**20


class FakeMemory:
    """A resident size the test sets; garbage collection frees ``freed`` bytes."""

    def __init__(self, rss: int, *, freed: int = 0) -> None:
        self.rss = rss
        self.freed = freed
        self.collections = 0

    def read(self) -> int:
        return self.rss

    def collect(self) -> int:
        self.collections += 1
        self.rss -= self.freed
        return 0


def limiter(memory: FakeMemory, *, limit: int = 100 * MIB, spike: int = 20 * MIB) -> MemoryLimiter:
    return MemoryLimiter(
        limit_bytes=limit,
        spike_limit_bytes=spike,
        read_rss=memory.read,
        collect_garbage=memory.collect,
    )


def test_admits_below_the_soft_limit_and_refuses_above_it_until_memory_falls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tokentrace.collector.memory_limiter")
    memory = FakeMemory(50 * MIB)
    limits = limiter(memory)
    limits.admit(10)
    memory.rss = 81 * MIB  # above 100 - 20
    limits.check()
    for _ in range(3):
        with pytest.raises(Overloaded) as refused:
            limits.admit(10)
    assert refused.value.retry_after_s > 0
    assert "81 MiB in use" in str(refused.value)
    assert limits.refused_requests == 3
    memory.rss = 60 * MIB
    limits.check()
    limits.admit(10)
    assert limits.refused_requests == 3
    # One line when refusing starts and one when it ends, not one per request.
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]


def test_a_burst_between_two_readings_is_counted() -> None:
    memory = FakeMemory(50 * MIB)
    limits = limiter(memory)
    room = 80 * MIB - 50 * MIB
    spans = 256
    admitted = 0
    with pytest.raises(Overloaded):
        for _ in range(1000):
            limits.admit(spans)
            admitted += 1
    # Each admitted request counts its decoded size until the next reading sees it for real.
    assert admitted == room // (spans * DECODED_BYTES_PER_SPAN)
    limits.check()  # the reading: the resident size did not grow, the estimate starts over
    limits.admit(spans)


def test_above_the_hard_limit_it_collects_garbage_and_reads_again() -> None:
    memory = FakeMemory(120 * MIB, freed=50 * MIB)
    limits = limiter(memory)
    limits.check()
    assert memory.collections == 1 and limits.garbage_collections == 1
    assert limits.rss_bytes == 70 * MIB
    limits.admit(10)  # below the soft limit after collecting
    limits.check()
    assert memory.collections == 1  # not above the hard limit any more


def test_the_thread_reads_until_shut_down() -> None:
    readings: list[int] = []
    enough = threading.Event()

    def read() -> int:
        readings.append(1)
        if len(readings) > 5:
            enough.set()
        return 10 * MIB

    limits = MemoryLimiter(
        limit_bytes=100 * MIB, spike_limit_bytes=10 * MIB, check_interval_s=0.01, read_rss=read
    )
    limits.start()
    try:
        assert enough.wait(timeout=30)
    finally:
        limits.shutdown()
    stopped_at = len(readings)
    time.sleep(0.05)
    assert len(readings) == stopped_at


def test_container_limits_v2_v1_and_none(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert container_memory_limit(v2, v1) is None  # neither file
    v2.write_text("max\n")
    assert container_memory_limit(v2, v1) is None
    v2.write_text("2147483648\n")
    assert container_memory_limit(v2, v1) == 2 * 1024**3
    v2.unlink()
    v1.write_text("9223372036854771712\n")  # v1's "unlimited"
    assert container_memory_limit(v2, v1) is None
    v1.write_text("536870912\n")
    assert container_memory_limit(v2, v1) == 512 * MIB


def test_default_limit_follows_the_container_or_falls_back() -> None:
    config = MemoryLimiterConfig()
    assert config.limit_bytes(container_limit=2 * 1024**3) == int(
        2 * 1024**3 * DEFAULT_LIMIT_FRACTION
    )
    assert MemoryLimiterConfig(limit_mib=123).limit_bytes(4 * 1024**3) == 123 * MIB
    assert config.spike_limit_bytes(100 * MIB) == 20 * MIB
    if container_memory_limit() is None:
        assert config.limit_bytes() == DEFAULT_LIMIT_BYTES
    assert MemoryLimiter.from_config(MemoryLimiterConfig(enabled=False)) is None


@pytest.mark.parametrize(
    ("config", "key"),
    [
        (MemoryLimiterConfig(limit_mib=0), "limit_mib"),
        (MemoryLimiterConfig(limit_mib=10, spike_limit_mib=10), "spike_limit_mib"),
        (MemoryLimiterConfig(spike_limit_mib=-1), "spike_limit_mib"),
        (MemoryLimiterConfig(check_interval_s=0), "check_interval"),
    ],
)
def test_bad_configuration_names_the_key(config: MemoryLimiterConfig, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        config.validate()


def test_the_service_section_is_read_and_checked() -> None:
    config = parse_config(
        {"service": {"memory_limiter": {"limit_mib": 512, "check_interval": "50ms"}}},
        environ={},
    )
    assert config.memory_limiter.limit_mib == 512
    assert config.memory_limiter.check_interval_s == pytest.approx(0.05)
    for raw, message in [
        ({"limit_mib": 0}, r"^service\.memory_limiter\.limit_mib: must be > 0"),
        ({"enabled": "yes"}, r"^service\.memory_limiter\.enabled: expected true or false"),
        ({"limit": 5}, r"^service\.memory_limiter\.limit: unknown key"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config({"service": {"memory_limiter": raw}}, environ={})


def test_resident_bytes_reads_this_process() -> None:
    rss = resident_bytes()
    assert 10 * MIB < rss < 64 * 1024 * MIB
