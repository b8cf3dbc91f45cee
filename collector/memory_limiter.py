"""A memory ceiling for the collector, like the OpenTelemetry Collector's ``memory_limiter``.

A thread of its own reads the process's resident set size every ``check_interval`` (one
``/proc/self/statm`` read; never starved by the pipeline, which it does not share a lock with).
The pipeline asks ``admit(span_count)`` for every received export request, on the receiver's
thread: the answer is one comparison against the last reading plus what was admitted since it (so
a burst between two readings is counted too, at ``DECODED_BYTES_PER_SPAN`` a span). Above the
soft limit (``limit_mib - spike_limit_mib``) requests are refused with ``Overloaded``, which the
receivers answer with RESOURCE_EXHAUSTED / 429 and a retry hint, until memory falls back below
it. Above the hard limit (``limit_mib``) the limiter also runs the garbage
collector, at most once per reading.

The limit defaults to ``DEFAULT_LIMIT_FRACTION`` of the container's memory limit (cgroup v2
``memory.max``, or v1 ``memory.limit_in_bytes``) and to ``DEFAULT_LIMIT_BYTES`` where there is
none; the spike limit to ``DEFAULT_SPIKE_FRACTION`` of the limit.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tokentrace.agent import semconv
from tokentrace.collector.component import ConfigError, ConfigSection, check
from tokentrace.collector.consumer import Overloaded
from tokentrace.collector.self_telemetry import ComponentTelemetry

_log = logging.getLogger(__name__)

DEFAULT_LIMIT_BYTES: Final = 1024**3
"""The limit where no container limit is found: 1 GiB (set ``limit_mib`` on a larger host)."""
DEFAULT_LIMIT_FRACTION: Final = 0.8
"""Of the container's memory limit: room for the interpreter's own overhead beyond the heap."""
DEFAULT_SPIKE_FRACTION: Final = 0.2
"""Of the limit: refusing starts this far below it, the most one reading interval may add."""
DEFAULT_CHECK_INTERVAL_S: Final = 0.1
DECODED_BYTES_PER_SPAN: Final = 4096
"""About what one received span holds in memory once decoded (its protobuf message and the
span reference made from it): the estimate for what was admitted since the last reading."""
_RETRY_AFTER_S: Final = 1.0
_MIB: Final = 1024 * 1024
_CGROUP_V2: Final = Path("/sys/fs/cgroup/memory.max")
_CGROUP_V1: Final = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
_NO_CGROUP_LIMIT: Final = 1 << 60
"""cgroup v1 reports "no limit" as a huge number (page-rounded 2^63); v2 says ``max``."""
_PAGE_BYTES: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def container_memory_limit(v2: Path = _CGROUP_V2, v1: Path = _CGROUP_V1) -> int | None:
    """The cgroup's memory limit in bytes, or None when unlimited or unknown."""
    for path in (v2, v1):
        try:
            text = path.read_text(encoding="ascii").strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            limit = int(text)
        except ValueError:
            continue
        return limit if 0 < limit < _NO_CGROUP_LIMIT else None
    return None


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``'s second field, in pages)."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * _PAGE_BYTES


@dataclass(frozen=True, kw_only=True)
class MemoryLimiterConfig:
    """The ``memory_limiter`` settings (the field names are the YAML keys, as in the
    OpenTelemetry Collector's): ``limit_mib`` / ``spike_limit_mib`` (None: the defaults of the
    module docstring), ``check_interval``; ``enabled: false`` turns the limiter off."""

    enabled: bool = True
    limit_mib: float | None = None
    spike_limit_mib: float | None = None
    check_interval_s: float = DEFAULT_CHECK_INTERVAL_S

    def validate(self) -> None:
        """Raise ConfigError naming the first bad key."""
        check(self.limit_mib is None or self.limit_mib > 0, "limit_mib", "must be > 0")
        if self.spike_limit_mib is not None:
            check(self.spike_limit_mib >= 0, "spike_limit_mib", "must be >= 0")
            limit = self.limit_bytes()
            check(
                self.spike_limit_mib * _MIB < limit,
                "spike_limit_mib",
                f"must be below the limit ({limit / _MIB:g} MiB), got {self.spike_limit_mib:g}",
            )
        check(0 < self.check_interval_s <= 60, "check_interval", "must be in (0, 60] s")

    @classmethod
    def from_section(cls, section: ConfigSection) -> MemoryLimiterConfig:
        section.allow_keys("enabled", "limit_mib", "spike_limit_mib", "check_interval")
        enabled = section.raw.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{section.path('enabled')}: expected true or false")
        optional = {
            key: None if section.raw.get(key) is None else section.number(key, 0.0)
            for key in ("limit_mib", "spike_limit_mib")
        }
        return cls(
            enabled=enabled,
            limit_mib=optional["limit_mib"],
            spike_limit_mib=optional["spike_limit_mib"],
            check_interval_s=section.duration_s("check_interval", DEFAULT_CHECK_INTERVAL_S),
        )

    def limit_bytes(self, container_limit: int | None = None) -> int:
        """The limit: configured, else a share of the container's, else the fallback."""
        if self.limit_mib is not None:
            return int(self.limit_mib * _MIB)
        found = container_limit if container_limit is not None else container_memory_limit()
        return int(found * DEFAULT_LIMIT_FRACTION) if found is not None else DEFAULT_LIMIT_BYTES

    def spike_limit_bytes(self, limit_bytes: int) -> int:
        if self.spike_limit_mib is not None:
            return int(self.spike_limit_mib * _MIB)
        return int(limit_bytes * DEFAULT_SPIKE_FRACTION)


class MemoryLimiter:
    """Refuses export requests while the process is near its memory limit (module docstring)."""

    def __init__(
        self,
        *,
        limit_bytes: int,
        spike_limit_bytes: int,
        check_interval_s: float = DEFAULT_CHECK_INTERVAL_S,
        read_rss: Callable[[], int] = resident_bytes,
        collect_garbage: Callable[[], object] = gc.collect,
        telemetry: ComponentTelemetry | None = None,
    ) -> None:
        if not 0 <= spike_limit_bytes < limit_bytes:
            raise ValueError("spike_limit_bytes must be in [0, limit_bytes)")
        self.limit_bytes = limit_bytes
        self.soft_limit_bytes = limit_bytes - spike_limit_bytes
        self._interval_s = check_interval_s
        self._read_rss = read_rss
        self._collect_garbage = collect_garbage
        # Plain ints updated by one thread each (reads are atomic under the GIL); the admitted
        # bytes are added on receiver threads under a lock that nothing slow ever holds.
        self.rss_bytes = read_rss()
        self._admitted_since_reading = 0
        self._lock = threading.Lock()
        self.refused_requests = 0
        self.garbage_collections = 0
        self._refusing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if telemetry is not None:
            telemetry.observe_each(
                counters={
                    semconv.SELF_METRIC_MEMORY_REFUSED_REQUESTS: (
                        "exports refused near the memory limit",
                        lambda: self.refused_requests,
                    ),
                    semconv.SELF_METRIC_MEMORY_GARBAGE_COLLECTIONS: (
                        "garbage collections forced above the limit",
                        lambda: self.garbage_collections,
                    ),
                },
            )
            telemetry.observe_each(
                counters={},
                gauges={
                    semconv.SELF_METRIC_MEMORY_RESIDENT: (
                        "resident set size at the last reading",
                        lambda: self.rss_bytes,
                    ),
                    semconv.SELF_METRIC_MEMORY_LIMIT: (
                        "the memory limit",
                        lambda: self.limit_bytes,
                    ),
                },
                unit=semconv.METRIC_UNIT_BYTES,
            )

    @classmethod
    def from_config(
        cls, config: MemoryLimiterConfig, *, telemetry: ComponentTelemetry | None = None
    ) -> MemoryLimiter | None:
        """The limiter ``config`` describes (None when it is disabled)."""
        if not config.enabled:
            return None
        limit = config.limit_bytes()
        return cls(
            limit_bytes=limit,
            spike_limit_bytes=config.spike_limit_bytes(limit),
            check_interval_s=config.check_interval_s,
            telemetry=telemetry,
        )

    # --- on receiver threads ---------------------------------------------------------------------
    def admit(self, span_count: int) -> None:
        """Count a received request of ``span_count`` spans, or raise ``Overloaded`` near the
        limit."""
        added = span_count * DECODED_BYTES_PER_SPAN
        with self._lock:
            if self.rss_bytes + self._admitted_since_reading + added > self.soft_limit_bytes:
                self.refused_requests += 1
                refused = True
            else:
                self._admitted_since_reading += added
                refused = False
        if refused:
            raise Overloaded(
                f"memory near its limit ({self.rss_bytes / 2**20:.0f} MiB in use, refusing above "
                f"{self.soft_limit_bytes / 2**20:.0f} MiB)",
                retry_after_s=_RETRY_AFTER_S,
            )

    # --- its own thread --------------------------------------------------------------------------
    def check(self) -> None:
        """One reading: refresh the resident size; above the hard limit, collect garbage."""
        rss = self._read_rss()
        if rss > self.limit_bytes:
            self._collect_garbage()
            self.garbage_collections += 1
            rss = self._read_rss()
        with self._lock:
            self.rss_bytes = rss
            self._admitted_since_reading = 0
        refusing = rss > self.soft_limit_bytes
        if refusing != self._refusing:
            self._refusing = refusing
            if refusing:
                _log.warning(
                    "memory limiter: %.0f MiB in use, above the soft limit of %.0f MiB: "
                    "refusing new data until it falls",
                    rss / 2**20,
                    self.soft_limit_bytes / 2**20,
                )
            else:
                _log.info("memory limiter: %.0f MiB in use, accepting data again", rss / 2**20)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="tokentrace-memory-limiter", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except Exception:  # keep limiting with the last reading; the log says why
                _log.exception("memory limiter: reading the resident size failed")

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
