"""A load run against a real engine under ``tokentrace run``, and what the collector stored of
it: shared by the vLLM loop (test_load_vllm.py) and SGLang's (tests/sglang/test_sglang_agent.py).

A ``LoadLoop`` is anything with the server's ``base_url``, the collector's ``otlp_endpoint`` and
its ``store_path``, the ``slo_path`` of its targets and a ``workdir`` for the runs' records.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import pytest

from tokentrace.agent import semconv
from tokentrace.collector.store import RequestStore
from tokentrace.collector.window import records_of_traces
from tokentrace.loadgen.record import RunRecord, load
from tokentrace.processors.budget import has_server_view
from tokentrace.processors.model import RequestRecord

_STORE_WAIT_S = 30.0


class _Server(Protocol):
    @property
    def base_url(self) -> str: ...


class LoadLoop(Protocol):
    @property
    def server(self) -> _Server: ...
    @property
    def otlp_endpoint(self) -> str: ...
    @property
    def store_path(self) -> Path: ...
    @property
    def slo_path(self) -> Path: ...
    @property
    def workdir(self) -> Path: ...


def run_load(
    loop: LoadLoop,
    name: str,
    *args: str,
    url: str | None = None,
    capsys: pytest.CaptureFixture[str],
    client_spans: bool = True,
) -> RunRecord:
    """``tokentrace load`` in its own process, as users run it: in this one it would share the
    GIL with the in-process collector and fall behind reading 16,000 SSE events, which the
    budget then shows (rightly) as client-side network time."""
    out = loop.workdir / f"{name}.json"
    command = [
        sys.executable, "-m", "tokentrace.agent.cli", "load", url or loop.server.base_url,
        *(("--otlp-endpoint", loop.otlp_endpoint) if client_spans else ()),
        "--slo", str(loop.slo_path), "--out", str(out), "--quiet", *args,
    ]  # fmt: skip
    # Spans go where --otlp-endpoint says, never to an endpoint the environment names.
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    completed = subprocess.run(
        command, capture_output=True, text=True, check=False, env=environment
    )
    with capsys.disabled():
        print(completed.stdout)  # the report, for the test log
    assert completed.returncode == 0, completed.stdout + completed.stderr
    record = load(out)
    assert record.summary["failed"] == 0, record.summary["errors"]
    return record


def stored_records(loop: LoadLoop, record: RunRecord) -> dict[str, RequestRecord]:
    """trace id -> the collector's record, once every request of the run is in the store."""
    wanted = [bytes.fromhex(result.trace_id) for result in record.results]
    deadline = time.monotonic() + _STORE_WAIT_S
    while True:
        store = RequestStore.open_readonly(loop.store_path)
        try:
            window = records_of_traces(store, wanted)
        finally:
            store.close()
        # Both sides: a client span stored before its server's spans is a client-only record
        # until they join it (the collector re-derives the request when they come).
        with_both = [
            r
            for r in window.records
            if r.timeline.client_start is not None and has_server_view(r.timeline)
        ]
        if len(with_both) == len(wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(with_both) == len(wanted), "some requests never reached the store with both sides"
    return {r.timeline.trace_id.hex(): r for r in with_both}


def stored_documents(loop: LoadLoop, record: RunRecord) -> list[dict[str, Any]]:
    """The stored request documents of a run (what explain, the API and the UI show): its
    verdicts were chosen by the collector's targets."""
    stored_records(loop, record)  # every request is in the store, client span included
    store = RequestStore.open_readonly(loop.store_path)
    try:
        documents = [store.get(result.trace_id) for result in record.results]
    finally:
        store.close()
    assert all(doc is not None for doc in documents)
    return [doc for doc in documents if doc is not None]


def network_ns(record: RequestRecord) -> int:
    return record.budget.segments.get(semconv.SEGMENT_NETWORK, 0)


def outside_ns(record: RequestRecord) -> int:
    """The time the client saw outside the server span: client, connect, network and the
    request's wait in the server's kernel (in ``http``)."""
    assert record.budget.server_e2e_ns == record.metrics.e2e
    return record.budget.e2e_ns - record.metrics.e2e
