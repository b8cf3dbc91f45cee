"""An in-process collector for the tests that run a real engine (or ``tokentrace proxy``) against
it: it stores every assembled request in a test-owned SQLite store, checks the test's SLO
targets, and, with ``forward_to``, forwards every span to a test-owned OTLP receiver (where the
spans that are no request's, the cold start, are read)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tokentrace.collector.config import parse_config
from tokentrace.collector.service import Collector

IN_TEST_PROCESS_MEMORY_LIMITER: Final = {"limit_mib": 16384, "spike_limit_mib": 2048}
"""The memory ceiling of a collector inside the pytest process. The limiter reads the process's
resident size, which late in a full run holds ~850 MiB of other tests' memory: once that crossed
the default soft limit (819 MiB of 1 GiB), the collector refused every export of the proxy and
SGLang loops and no request reached the store. The ceiling itself is tested in a collector
process of its own (tests/collector/test_memory_ceiling.py)."""


@dataclass(frozen=True)
class StoringCollector:
    collector: Collector
    store_path: Path
    slo_path: Path

    @property
    def otlp_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.collector.grpc_port}"

    def agent_environment(self, *, service_name: str, site: Path | None = None) -> dict[str, str]:
        """The variables that point an agent (``tokentrace run``) at this collector; ``site``:
        a tokentrace installed for another environment's interpreter, put on ``PYTHONPATH``."""
        environment = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_SERVICE_NAME": service_name,
        }
        if site is not None:
            inherited = os.environ.get("PYTHONPATH")
            environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), inherited]))
        return environment


@contextmanager
def storing_collector(
    workdir: Path, slo_file: str, *, forward_to: str | None = None
) -> Iterator[StoringCollector]:
    """The collector on a free loopback port, storing into ``workdir``/store.db with the
    targets of ``slo_file`` (YAML text); ``forward_to``: an OTLP/gRPC endpoint that gets every
    span too."""
    slo_path = workdir / "slo.yaml"
    slo_path.write_text(slo_file, encoding="utf-8")
    store_path = workdir / "store.db"
    exporters: dict[str, Mapping[str, Any]] = {"store": {"path": str(store_path)}}
    if forward_to is not None:
        exporters["otlp"] = {"endpoint": forward_to, "protocol": "grpc"}
    raw = {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}},
        "processors": {
            "assembly": {"quiet_period": "1s", "root_grace": "500ms"},
            "slo": {"file": str(slo_path)},
        },
        "exporters": exporters,
        "service": {"memory_limiter": IN_TEST_PROCESS_MEMORY_LIMITER},
    }
    collector = Collector(parse_config(raw, environ={}))
    collector.start()
    try:
        yield StoringCollector(collector, store_path, slo_path)
    finally:
        collector.shutdown()
