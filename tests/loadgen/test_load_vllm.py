"""The whole loop on the real vLLM: ``tokentrace load`` -> vLLM under ``tokentrace run`` -> the
collector's store -> ``tokentrace diagnose`` / ``compare``.

One server for the module, made to show each diagnosis on purpose: a batch of 2
(``--max-num-seqs 2``, so concurrent requests queue), prefix caching off (a shared system prompt
is recomputed every time), a 2048-token context (long prompts fit), and a test middleware
(``tests/loadgen/support/frontend_delay.py``) that blocks the API server's event loop for requests
that ask. The network delay comes from a delaying TCP proxy on loopback between the load and the
server.

The scenarios are the issue's ground truth: one knob turned at a time, and the verdict about the
target's metric must name that knob (with the budget within 10% of an injected delay): queueing
for a TTFT target at concurrency 24 on a batch of 2, prefill for long prompts, http for a blocked
event loop, network for a delay on the wire (and never network for a saturated server with none),
decode for long outputs against a TPOT target.

The last two tests take the collector away in the middle of a streaming load: the module's
in-process collector stopped cleanly, then a ``tokentrace collector`` process SIGKILLed (the
module's collector steps aside for it and is back on the same port afterwards, so the order of
the tests does not matter).
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.collector_process import CollectorProcess, start_collector_process
from tests.loadgen.delay_proxy import DelayProxy
from tests.loadgen.load_loop import (
    network_ns,
    outside_ns,
    run_load,
    stored_documents,
    stored_records,
)
from tests.loadgen.support import frontend_delay
from tests.storing_collector import IN_TEST_PROCESS_MEMORY_LIMITER
from tests.vllm.shared_server import require_vllm
from tokentrace.agent import semconv
from tokentrace.agent.cli import main as tokentrace_main
from tokentrace.collector.config import parse_config
from tokentrace.collector.service import Collector
from tokentrace.collector.store import RequestStore
from tokentrace.collector.window import records_of_traces
from tokentrace.loadgen.local_vllm import VllmServer, running_vllm_server
from tokentrace.loadgen.record import RunRecord, load
from tokentrace.loadgen.results import percentile
from tokentrace.processors.budget import has_server_view

require_vllm()
pytestmark = pytest.mark.slow

_MAX_MODEL_LEN = 2048
_SUPPORT_DIR = Path(frontend_delay.__file__).parent
_BATCH = 2
_STORE_WAIT_S = 30.0
_SLO_FILE = """\
targets:
  - {name: ttft-p95, metric: ttft, percentile: 95, threshold: 500ms}
  - {name: e2e-p95, metric: e2e, percentile: 95, threshold: 60s}
"""
"""The collector's targets (and so every stored request's default verdict): a TTFT target the
queueing scenario breaches, an E2E target nothing here breaches."""


@dataclass(frozen=True)
class Loop:
    server: VllmServer
    collectors: list[Collector]
    """The collector the server exports to now is the last (a test may restart it)."""
    raw_config: dict[str, Any]
    store_path: Path
    slo_path: Path
    workdir: Path
    model_dir: Path

    @property
    def collector(self) -> Collector:
        return self.collectors[-1]

    @property
    def otlp_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.collector.grpc_port}"

    def restart_collector(self, *, down_s: float) -> None:
        """Stop the collector, leave its port closed for ``down_s``, start a new one on the
        same port and store (as a restarted collector process would be)."""
        port = self.collector.grpc_port
        self.collector.shutdown()
        time.sleep(down_s)
        raw = json.loads(json.dumps(self.raw_config))
        raw["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] = f"127.0.0.1:{port}"
        collector = Collector(parse_config(raw, environ={}))
        collector.start()
        self.collectors.append(collector)


# Own server: a batch of 2, no prefix caching, a blocking middleware, under `tokentrace run`.
@pytest.fixture(scope="module")
def loop(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loop]:
    workdir = tmp_path_factory.mktemp("load-loop")
    model_dir = tiny_model_dir  # 2048 positions: the long prompts fit
    slo_path = workdir / "slo.yaml"
    slo_path.write_text(_SLO_FILE, encoding="utf-8")
    store_path = workdir / "store.db"
    raw = {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}},
        "processors": {
            "assembly": {"quiet_period": "1s", "root_grace": "500ms"},
            "slo": {"file": str(slo_path)},
        },
        "exporters": {"store": {"path": str(store_path)}},
        "service": {"memory_limiter": IN_TEST_PROCESS_MEMORY_LIMITER},
    }
    collectors = [Collector(parse_config(raw, environ={}))]
    collectors[0].start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collectors[0].grpc_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "vllm-loop",
        "PYTHONSAFEPATH": "1",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(_SUPPORT_DIR), os.environ.get("PYTHONPATH")])
        ),
    }
    try:
        with running_vllm_server(
            model_dir,
            log_path=workdir / "server.log",
            max_model_len=_MAX_MODEL_LEN,
            extra_args=[
                *("--max-num-seqs", str(_BATCH), "--no-enable-prefix-caching"),
                *("--middleware", "frontend_delay.FrontendDelay"),  # from _SUPPORT_DIR
            ],
            env=env,
            command_prefix=[sys.executable, "-m", "tokentrace.agent.cli", "run", "--"],
        ) as server:
            yield Loop(server, collectors, raw, store_path, slo_path, workdir, model_dir)
    finally:
        collectors[-1].shutdown()


def diagnose(
    loop: Loop,
    record_path: Path,
    capsys: pytest.CaptureFixture[str],
    *,
    targets: str | None = None,
) -> dict[str, Any]:
    """``tokentrace diagnose --run`` (JSON, and the text printed to the test log), against the
    store's targets or, with ``targets``, an SLO file of these YAML target lines. Right after a
    load, as users run it: it waits for the run's requests to be in the store, each with its
    server's spans too (once in CI, one of 48 saturated streams had only its client span there).
    """
    capsys.readouterr()  # drop what the test printed so far
    command = ["diagnose", "--run", str(record_path), "--store", str(loop.store_path)]
    if targets is not None:
        slo = record_path.with_suffix(".slo.yaml")
        slo.write_text(f"targets:\n{targets}", encoding="utf-8")
        command += ["--slo", str(slo)]
    code = tokentrace_main([*command, "--json"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    analysis: dict[str, Any] = json.loads(printed)
    tokentrace_main(command)
    table = capsys.readouterr().out
    with capsys.disabled():
        print(table)
    return analysis


def finding(analysis: dict[str, Any], target: str) -> dict[str, Any]:
    found: dict[str, Any] = next(f for f in analysis["findings"] if f["target"] == target)
    return found


def metric_finding(analysis: dict[str, Any], metric: str, group: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        f for f in analysis["metric_findings"] if f["metric"] == metric and f["group"] == group
    )
    return found


def show(capsys: pytest.CaptureFixture[str], text: str) -> None:
    """Print to the test log (``pytest -s``) even where ``capsys`` captures the CLI's output."""
    with capsys.disabled():
        print(text)


def show_verdicts(
    capsys: pytest.CaptureFixture[str],
    title: str,
    documents: list[dict[str, Any]],
    metric: str | None = None,
) -> None:
    lines = [title]
    for doc in documents:
        verdict = doc["verdict"] if metric is None else doc["verdicts"][metric]
        lines.append(f"  {doc['trace_id'][:12]}  {verdict['metric']:>4}  {verdict['sentence']}")
    show(capsys, "\n".join(lines))


@pytest.mark.parametrize("concurrency", [1, 16])
def test_client_percentiles_agree_with_the_collector_and_the_time_outside_the_server(
    loop: Loop, concurrency: int, capsys: pytest.CaptureFixture[str]
) -> None:
    record = run_load(
        loop,
        f"agree-c{concurrency}",
        "--concurrency", str(concurrency),
        "--requests", str(8 * concurrency if concurrency > 1 else 24),
        "--prompt-tokens", "uniform:16:96",
        "--output-tokens", "uniform:8:48",
        "--api", "chat" if concurrency == 1 else "completions",
        "--seed", str(concurrency),
        "--warmup", "2",
        capsys=capsys,
    )  # fmt: skip
    stored = stored_records(loop, record)
    client_ttft, server_ttft, client_e2e, server_e2e_plus_outside = [], [], [], []
    for result in record.results:
        collected = stored[result.trace_id]
        outside = outside_ns(collected)
        # The budget partitions the client-observed E2E: server E2E + the time outside it.
        assert abs((result.end_ns - result.start_ns) - collected.budget.e2e_ns) <= 2_000
        assert outside >= network_ns(collected) >= 0
        ttft = collected.metrics.ttft
        assert ttft is not None and result.ttft_ns is not None
        # One clock, two observers: the client never sees the first token before the engine
        # made it. (How much later depends on the API server: on 2 cores its event loop
        # competes with the engine and hands tokens out in bursts, so no upper bound here.)
        assert result.ttft_ns - ttft >= -1_000_000
        assert collected.timeline.output_tokens == result.output_tokens
        client_ttft.append(result.ttft_ns)
        server_ttft.append(ttft)
        client_e2e.append(result.e2e_ns)
        server_e2e_plus_outside.append(collected.metrics.e2e + outside)
    for values in (client_ttft, server_ttft, client_e2e, server_e2e_plus_outside):
        values.sort()
    # What separates the two E2E definitions: the response's tail after the last token chunk
    # (the usage chunk and [DONE]), which the client measured for every request.
    tail_ms = max(r.end_ns - (r.last_token_ns or r.end_ns) for r in record.results) / 1e6
    show(capsys, f"c={concurrency}: client TTFT  engine TTFT  client E2E  server E2E + outside")
    for q in (50, 95, 99):
        row = [
            percentile(v, q) / 1e6
            for v in (client_ttft, server_ttft, client_e2e, server_e2e_plus_outside)
        ]
        show(capsys, f"  p{q}  " + "  ".join(f"{value:10.2f}" for value in row))
        # E2E: the client's percentiles (to the last token, as vllm bench serve) agree with the
        # collector's server-side E2E plus the time outside it (to the response's end) up to
        # that tail: a few µs on an idle machine, tens of ms when vLLM's API server is starved.
        assert row[3] - tail_ms - 1.0 <= row[2] <= row[3] + 1.0
        assert row[1] <= row[0] + 1.0


# --- the scenarios: the verdict about the target's metric names the knob turned --------
def test_a_ttft_target_missed_by_queueing_names_the_queue_not_decode(
    loop: Loop, capsys: pytest.CaptureFixture[str]
) -> None:
    """24 concurrent short prompts with long outputs on a batch of 2: most of each request's
    E2E is the queue and decode, its TTFT is the queue. The TTFT finding and the slowest-TTFT
    requests' default verdicts say queueing (before, they said long_decode).

    160-token outputs: the last pair waits 11 generations, so the queue stays past the 500 ms
    target on a fast machine too (CI once decoded 96 tokens so fast that p95 TTFT met it). On a
    slow run the 2-core box's load generator itself falls behind 24 streams (seen in CI: 2 s late
    before sending): then a slow request's verdict rightly says ``client``; never an engine
    segment."""
    record = run_load(
        loop, "queueing",
        "--concurrency", "24", "--requests", "24", "--prompt-tokens", "16",
        "--output-tokens", "160", "--api", "chat", "--seed", "21",
        capsys=capsys,
    )  # fmt: skip
    analysis = diagnose(loop, loop.workdir / "queueing.json", capsys)
    ttft = finding(analysis, "ttft-p95")
    assert ttft["met"] is False
    assert analysis["findings"][0]["target"] == "ttft-p95"  # breached first
    assert ttft["segment"] == semconv.SEGMENT_QUEUE
    assert ttft["cause"] == "queueing"
    counterfactual = ttft["counterfactual"]
    assert counterfactual["segment"] == semconv.SEGMENT_QUEUE
    assert counterfactual["without_ms"] < counterfactual["value_ms"] / 2

    documents = stored_documents(loop, record)
    slowest = sorted(documents, key=lambda doc: -doc["metrics_ms"]["ttft"])[:5]
    show_verdicts(capsys, "slowest TTFT, default verdicts:", slowest)
    show_verdicts(capsys, "the same requests, about E2E:", slowest, metric="e2e")
    for doc in slowest:
        assert doc["slo"]["ttft-p95"] is False
        assert doc["verdict"]["metric"] == semconv.METRIC_TTFT
        assert "ttft-p95" in doc["verdict"]["why"]
        assert doc["verdict"]["segment"] in (semconv.SEGMENT_QUEUE, semconv.SEGMENT_CLIENT)
        if doc["verdict"]["segment"] == semconv.SEGMENT_QUEUE:
            assert doc["verdict"]["cause"] == "queueing"


def test_a_ttft_target_missed_by_long_prompts_names_prefill(
    loop: Loop, capsys: pytest.CaptureFixture[str]
) -> None:
    record = run_load(
        loop, "long-prompts",
        "--concurrency", "1", "--requests", "12", "--prompt-tokens", "1400",
        "--output-tokens", "2", "--api", "completions", "--seed", "5", "--warmup", "1",
        "--tokenizer", str(loop.model_dir),
        capsys=capsys,
    )  # fmt: skip
    assert min(r.prompt_tokens or 0 for r in record.results) >= 1024
    analysis = diagnose(
        loop,
        loop.workdir / "long-prompts.json",
        capsys,
        targets="  - {name: fast-ttft, metric: ttft, percentile: 50, threshold: 5ms}\n",
    )
    ttft = finding(analysis, "fast-ttft")
    assert ttft["met"] is False
    assert ttft["segment"] == semconv.SEGMENT_PREFILL
    assert ttft["cause"] == "long_prompt"
    # Each measured request's own verdict too (the unmeasured first one paid the API server's
    # first long tokenisation in `http`: 20 ms against its 26 ms prefill here, more on a busy CI).
    for doc in stored_documents(loop, record):
        assert doc["verdicts"]["ttft"]["cause"] == "long_prompt"


def test_a_blocked_event_loop_misses_a_ttft_target_by_http_time_not_network(
    loop: Loop, capsys: pytest.CaptureFixture[str]
) -> None:
    """A blocked event loop inside the API server grows ``http`` by the blocked time (the HTTP
    span separates it from the network), and the TTFT finding names it."""
    blocked_s = 0.08
    shape = (
        "--concurrency", "1", "--requests", "12", "--prompt-tokens", "32",
        "--output-tokens", "8", "--seed", "13", "--warmup", "1",
    )  # fmt: skip
    plain = run_load(loop, "frontend-plain", *shape, capsys=capsys)
    busy = run_load(
        loop, "frontend-busy", *shape,
        "--header", f"{frontend_delay.HEADER}: {round(blocked_s * 1000)}",
        capsys=capsys,
    )  # fmt: skip

    def medians(record: RunRecord) -> tuple[float, float]:
        stored = stored_records(loop, record).values()
        http = statistics.median(r.budget.ttft_segments[semconv.SEGMENT_HTTP] for r in stored)
        return http / 1e9, statistics.median(network_ns(r) for r in stored) / 1e9

    (http_before, network_before), (http_after, network_after) = medians(plain), medians(busy)
    show(
        capsys,
        f"TTFT http p50 {http_before * 1e3:.2f} -> {http_after * 1e3:.2f} ms, network p50 "
        f"{network_before * 1e3:.2f} -> {network_after * 1e3:.2f} ms",
    )
    assert http_after - http_before == pytest.approx(blocked_s, rel=0.10)
    assert abs(network_after - network_before) < 0.1 * blocked_s

    analysis = diagnose(
        loop,
        loop.workdir / "frontend-busy.json",
        capsys,
        targets="  - {name: snappy-ttft, metric: ttft, percentile: 50, threshold: 50ms}\n",
    )
    ttft = finding(analysis, "snappy-ttft")
    assert ttft["met"] is False
    assert ttft["segment"] == semconv.SEGMENT_HTTP
    assert ttft["cause"] == "http"
    for doc in stored_documents(loop, busy):
        assert doc["verdicts"]["ttft"]["segment"] == semconv.SEGMENT_HTTP


def test_an_injected_delay_is_network_within_ten_percent_and_is_diagnosed(
    loop: Loop, capsys: pytest.CaptureFixture[str]
) -> None:
    # The network must dominate E2E with a margin a busy CI keeps: 200 ms of round trip against
    # 3 decode gaps (~30 ms idle here; 7 gaps on a loaded CI once outgrew 120 ms of delay).
    one_way_s = 0.1
    shape = (
        "--concurrency", "1", "--requests", "16", "--prompt-tokens", "32",
        "--output-tokens", "4", "--seed", "11", "--warmup", "1",
    )  # fmt: skip
    direct = run_load(loop, "direct", *shape, capsys=capsys)
    with DelayProxy(("127.0.0.1", _port(loop.server.base_url)), one_way_delay_s=one_way_s) as proxy:
        delayed = run_load(loop, "delayed", *shape, url=proxy.url, capsys=capsys)
    before = [network_ns(r) for r in stored_records(loop, direct).values()]
    after = [network_ns(r) for r in stored_records(loop, delayed).values()]
    growth_s = (statistics.median(after) - statistics.median(before)) / 1e9
    show(
        capsys,
        f"network p50 {statistics.median(before) / 1e6:.2f} ms, +{growth_s * 1e3:.2f} ms delayed",
    )
    assert growth_s == pytest.approx(2 * one_way_s, rel=0.10)

    analysis = diagnose(loop, loop.workdir / "delayed.json", capsys)
    for group in ("typical", "tail"):
        e2e = metric_finding(analysis, semconv.METRIC_E2E, group)
        assert e2e["clock"] == "client"
        assert (e2e["segment"], e2e["cause"]) == (semconv.SEGMENT_NETWORK, "network")
    documents = stored_documents(loop, delayed)
    show_verdicts(capsys, "delayed, default verdicts:", documents[:4])
    for doc in documents:
        assert doc["verdict"]["metric"] == semconv.METRIC_E2E  # no target breached
        assert doc["verdict"]["clock"] == "client"
        assert doc["verdict"]["segment"] == semconv.SEGMENT_NETWORK

    capsys.readouterr()  # what the test printed so far is not the comparison
    code = tokentrace_main(
        [
            "compare", str(loop.workdir / "direct.json"), str(loop.workdir / "delayed.json"),
            "--store", str(loop.store_path), "--json",
        ]
    )  # fmt: skip
    comparison = json.loads(capsys.readouterr().out)
    assert code == 0
    assert comparison["load_differences"] == []
    network_row = next(r for r in comparison["segments"] if r["segment"] == "network")
    assert network_row["direction"] == "grew"
    assert network_row["delta_mean_ms"] == pytest.approx(2 * one_way_s * 1e3, rel=0.10)


def test_a_saturated_server_with_no_delay_on_the_wire_is_never_called_network(
    loop: Loop, capsys: pytest.CaptureFixture[str]
) -> None:
    """32 streams on a batch of 2 over loopback: vLLM's API server falls behind the
    engine on 2 cores and requests wait in its kernel before the app reads them; the client
    sees that time and the server does not. It is measured on each side (the server's kernel
    wait, the client's own read waits), so it is http or client time, never network."""
    record = run_load(
        loop, "saturated-streams",
        "--concurrency", "32", "--requests", "48", "--prompt-tokens", "32",
        "--output-tokens", "128", "--api", "completions", "--seed", "3",
        capsys=capsys,
    )  # fmt: skip
    analysis = diagnose(loop, loop.workdir / "saturated-streams.json", capsys)
    named = [(f.get("target") or f["metric"], f["segment"], f["cause"]) for f in (
        *analysis["findings"], *analysis["metric_findings"])]  # fmt: skip
    assert all(segment != semconv.SEGMENT_NETWORK for _, segment, _ in named), named
    assert all(cause != "network" for _, _, cause in named), named
    documents = stored_documents(loop, record)
    for doc in documents:
        for verdict in doc["verdicts"].values():
            assert verdict["segment"] != semconv.SEGMENT_NETWORK, verdict["sentence"]
    outside = [
        doc["budget"]["network"] + doc["budget"]["client"] + doc["budget"]["connect"]
        for doc in documents
    ]
    show(capsys, f"time outside the server p50 {statistics.median(outside):.2f} ms")


def test_a_tpot_target_missed_by_long_outputs_names_decode(
    loop: Loop, capsys: pytest.CaptureFixture[str]
) -> None:
    record = run_load(
        loop, "long-outputs",
        "--concurrency", "1", "--requests", "4", "--prompt-tokens", "16",
        "--output-tokens", "384", "--api", "completions", "--seed", "17",
        capsys=capsys,
    )  # fmt: skip
    analysis = diagnose(
        loop,
        loop.workdir / "long-outputs.json",
        capsys,
        targets="  - {name: quick-tokens, metric: tpot, percentile: 50, threshold: 0.2ms}\n",
    )
    tpot = finding(analysis, "quick-tokens")
    assert tpot["met"] is False
    assert tpot["segment"] == semconv.SEGMENT_DECODE
    assert tpot["cause"] == "slow_decode"
    for doc in stored_documents(loop, record):
        assert doc["verdicts"]["tpot"]["segment"] == semconv.SEGMENT_DECODE


# --- more diagnoses on the real engine ------------------------------------------------------------
def test_diagnose_names_queueing_when_far_more_requests_arrive_than_the_batch_admits(
    loop: Loop, capsys: pytest.CaptureFixture[str]
) -> None:
    # Engine-side view: no client spans, whole responses.
    run_load(
        loop, "saturated",
        "--concurrency", str(12 * _BATCH), "--requests", str(12 * _BATCH), "--prompt-tokens",
        "32", "--output-tokens", "96", "--api", "completions", "--no-stream", "--seed", "3",
        capsys=capsys, client_spans=False,
    )  # fmt: skip
    analysis = diagnose(loop, loop.workdir / "saturated.json", capsys)
    ttft = finding(analysis, "ttft-p95")
    assert (ttft["segment"], ttft["cause"]) == (semconv.SEGMENT_QUEUE, "queueing")
    typical = metric_finding(analysis, semconv.METRIC_E2E, "typical")
    assert typical["clock"] == "server"  # no client spans
    # Of the time before the first token, the queue is the most; whether it outweighs decode in
    # the whole E2E depends on how bunched the starved client's sends arrive (once in CI they
    # spread over 0.5 s: queue 22%, decode 73% of E2E, while the TTFT verdict stayed queueing).
    shares = {name: segment["share"] for name, segment in analysis["segments"].items()}
    before_first_token = {k: v for k, v in shares.items() if k != semconv.SEGMENT_DECODE}
    assert max(before_first_token, key=before_first_token.__getitem__) == semconv.SEGMENT_QUEUE


def test_diagnose_names_a_shared_prefix_recomputed_with_prefix_caching_off(
    loop: Loop, capsys: pytest.CaptureFixture[str]
) -> None:
    run_load(
        loop, "shared-prefix",
        "--concurrency", "1", "--requests", "12", "--shared-prefix-fraction", "1",
        "--shared-prefix-tokens", "1200", "--prompt-tokens", "16", "--output-tokens", "2",
        "--seed", "9", "--tokenizer", str(loop.model_dir),
        capsys=capsys,
    )  # fmt: skip
    analysis = diagnose(loop, loop.workdir / "shared-prefix.json", capsys)
    typical = metric_finding(analysis, semconv.METRIC_TTFT, "typical")
    assert typical["cause"] == "prefix_cache_miss"
    assert analysis["segments"]["prefill"]["share"] > 0.4


def _port(base_url: str) -> int:
    return int(base_url.rsplit(":", 1)[1])


_RESTART_LOAD = 200
_RESTART_RATE = 20
"""Requests/s of the restart test's load (open loop, so it lasts about 10 s on any machine that
keeps up): as fast as the server went (25-36 requests/s here), 160 requests had all started by
the time the collector came back (2 s + 3 s down), and the test found no request after it."""


def test_a_collector_restart_under_load_fails_no_inference_request(
    loop: Loop, capsys: pytest.CaptureFixture[str]
) -> None:
    """The collector goes away for 3 s in the middle of a streaming load and comes back on the
    same port: every inference request is served, and the requests that ran after it came back
    are traced (the agent kept serving, retried, and resumed)."""
    record_path = loop.workdir / "restart.json"
    command = [
        sys.executable, "-m", "tokentrace.agent.cli", "load", loop.server.base_url,
        "--concurrency", "8", "--requests", str(_RESTART_LOAD), "--rate", str(_RESTART_RATE),
        "--prompt-tokens", "32", "--output-tokens", "32", "--api", "completions",
        "--seed", "31", "--quiet",
        "--out", str(record_path), "--otlp-endpoint", loop.otlp_endpoint,
    ]  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    traffic = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        time.sleep(2.0)
        assert traffic.poll() is None, "the load ended before the collector went away"
        loop.restart_collector(down_s=3.0)
        restarted_ns = time.time_ns()
        output, _ = traffic.communicate(timeout=_STORE_WAIT_S * 4)
    finally:
        if traffic.poll() is None:
            traffic.kill()
            traffic.wait()
    assert traffic.returncode == 0, output
    record = load(record_path)
    assert record.summary["failed"] == 0, record.summary["errors"]
    assert len(record.results) == _RESTART_LOAD
    after = [r for r in record.results if r.start_ns > restarted_ns]
    assert after, "no request started after the collector came back"
    wanted = [bytes.fromhex(r.trace_id) for r in after]
    deadline = time.monotonic() + _STORE_WAIT_S
    while True:
        store = RequestStore.open_readonly(loop.store_path)
        try:
            window = records_of_traces(store, wanted)
        finally:
            store.close()
        stored = sum(1 for r in window.records if has_server_view(r.timeline))
        if stored >= len(wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    show(capsys, f"restart under load: {len(record.results)} served, 0 failed; "
         f"{stored} of {len(wanted)} requests after the restart stored")  # fmt: skip
    assert stored == len(wanted)


# --- a collector process SIGKILLed under the real load (issue 15) -------------------------------
_INFO_LOGS = {"TOKENTRACE_LOG_LEVEL": "INFO"}
"""The collector process logs its spool replay at INFO: the test prints those lines."""
_KILL_LOAD = 200
_KILL_RATE = 20
"""Requests/s, open loop (at most ``_KILL_CONCURRENCY`` in flight): the load lasts about 10 s on
any machine that keeps up, so the kill (about 2.5 s in) and the restart (2-5 s after it) fall
inside it. As fast as it answers (a closed loop), vLLM takes both cores here and the new
collector process needs 7-9 s to start instead of 2-3 s."""
_KILL_CONCURRENCY = 8
_STORED_BEFORE_KILL = 24
"""Requests of the run stored before the kill: it comes in a steady stream, with finished
requests both stored and still in assembly (or in flight from the agent)."""
_DOWN_S = 1.5
"""How long the port stays closed before the new collector process starts. Its start-up (0.5 s on
an idle machine, 1-4 s beside the busy server on 2 cores) adds to it: the senders find the port
closed 2-5 s."""


def wait_for_stored_since(loop: Loop, since_ns: int, at_least: int) -> None:
    """Until the store holds ``at_least`` requests that started after ``since_ns`` (a test
    before may still be storing its own)."""
    deadline = time.monotonic() + _STORE_WAIT_S
    while True:
        connection = sqlite3.connect(f"file:{loop.store_path}?mode=ro", uri=True)
        try:
            (count,) = connection.execute(
                "SELECT COUNT(*) FROM requests WHERE start_ns > ?", (since_ns,)
            ).fetchone()
        finally:
            connection.close()
        if count >= at_least:
            return
        assert time.monotonic() < deadline, f"{count} requests stored, waiting for {at_least}"
        time.sleep(0.1)


def with_both_sides(store_path: Path, trace_ids: list[str], *, wait_s: float) -> set[str]:
    """The trace ids (of ``trace_ids``) that the store holds with their client span and their
    server spans, waiting up to ``wait_s`` until it holds all."""
    wanted = [bytes.fromhex(trace_id) for trace_id in trace_ids]
    deadline = time.monotonic() + wait_s
    while True:
        store = RequestStore.open_readonly(store_path)
        try:
            window = records_of_traces(store, wanted)
        finally:
            store.close()
        found = {
            r.timeline.trace_id.hex()
            for r in window.records
            if r.timeline.client_start is not None and has_server_view(r.timeline)
        }
        if len(found) == len(wanted) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def snapshot_store(loop: Loop, name: str) -> Path:
    """A copy of the store as it is now (SQLite's backup: the WAL's committed pages included)."""
    snapshot = loop.workdir / name
    source = sqlite3.connect(f"file:{loop.store_path}?mode=ro", uri=True)
    target = sqlite3.connect(snapshot)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()
    return snapshot


def duplicated(loop: Loop, trace_ids: list[str]) -> tuple[list[str], list[str]]:
    """Of ``trace_ids``: those with more than one request row, and those whose stored spans
    hold a span id twice (docs/reliability.md: a replay appends no span twice)."""
    connection = sqlite3.connect(f"file:{loop.store_path}?mode=ro", uri=True)
    rows_twice, spans_twice = [], []
    try:
        for trace_id in trace_ids:
            key = bytes.fromhex(trace_id)
            (rows,) = connection.execute(
                "SELECT COUNT(*) FROM requests WHERE trace_id = ?", (key,)
            ).fetchone()
            if rows > 1:
                rows_twice.append(trace_id)
            (otlp,) = connection.execute(
                "SELECT otlp FROM traces WHERE trace_id = ?", (key,)
            ).fetchone()
            request = ExportTraceServiceRequest.FromString(otlp)
            span_ids = [
                span.span_id
                for resource_spans in request.resource_spans
                for scope_spans in resource_spans.scope_spans
                for span in scope_spans.spans
            ]
            if len(span_ids) != len(set(span_ids)):
                spans_twice.append(trace_id)
    finally:
        connection.close()
    return rows_twice, spans_twice


def test_a_collector_process_sigkilled_under_load_loses_no_request_and_fails_none(
    loop: Loop, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 15, for real: the server's agent and the load export to a ``tokentrace collector``
    process (store and fsync spool); it is SIGKILLed in the middle of a streaming load, its port
    stays closed 2-5 s, and it is started again on the same port and store. Every inference
    request is served, and every request of the run is stored with both its sides, once: those
    that had finished before the kill (acknowledged, so spooled, or retried by their sender),
    those in flight across it and those after. Before the spool, 22 of 66 requests finished
    before a kill never reached the store. The module's in-process collector stands aside for
    the process and is back on the same port afterwards."""
    port = loop.collector.grpc_port
    assert port is not None
    raw = json.loads(json.dumps(loop.raw_config))
    raw["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] = f"127.0.0.1:{port}"
    raw["service"] = {"durability": {"mode": "fsync"}}
    config = loop.workdir / "collector-process.yaml"
    config.write_text(json.dumps(raw), encoding="utf-8")  # JSON is YAML
    log_path = loop.workdir / "collector-process.log"
    record_path = loop.workdir / "sigkill.json"
    command = [
        sys.executable, "-m", "tokentrace.agent.cli", "load", loop.server.base_url,
        "--concurrency", str(_KILL_CONCURRENCY), "--requests", str(_KILL_LOAD),
        "--rate", str(_KILL_RATE),
        "--prompt-tokens", "32", "--output-tokens", "32", "--api", "completions",
        "--seed", "37", "--quiet", "--out", str(record_path),
        "--otlp-endpoint", f"http://127.0.0.1:{port}",
    ]  # fmt: skip
    load_environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}

    loop.collector.shutdown()
    collector: CollectorProcess | None = None
    traffic: subprocess.Popen[str] | None = None
    exit_status: int | None = None
    try:
        collector = start_collector_process(config, log_path, env=_INFO_LOGS)
        load_started_ns = time.time_ns()
        traffic = subprocess.Popen(
            command,
            env=load_environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wait_for_stored_since(loop, load_started_ns, _STORED_BEFORE_KILL)
        assert traffic.poll() is None, "the load ended before the kill"
        killed_ns = time.time_ns()
        collector.kill()
        # What the killed collector had stored: the rest of the run comes back from its spool
        # (acknowledged) or from its senders' retries (not acknowledged).
        at_kill = snapshot_store(loop, "store-at-kill.db")
        time.sleep(max(0.0, _DOWN_S - (time.time_ns() - killed_ns) / 1e9))
        collector = start_collector_process(config, log_path, env=_INFO_LOGS)
        restarted_ns = time.time_ns()
        output, _ = traffic.communicate(timeout=_STORE_WAIT_S * 4)
        assert traffic.returncode == 0, output
        record = load(record_path)
        assert record.summary["failed"] == 0, record.summary["errors"]
        assert len(record.results) == _KILL_LOAD

        stored = with_both_sides(loop.store_path, record.trace_ids, wait_s=_STORE_WAIT_S)
        stored_at_kill = with_both_sides(at_kill, record.trace_ids, wait_s=0)
        rows_twice, spans_twice = duplicated(loop, sorted(stored))
    finally:
        if traffic is not None and traffic.poll() is None:
            traffic.kill()
            traffic.wait()
        try:
            if collector is not None:
                exit_status = collector.stop()
        finally:
            # Later tests export to the same port, as the server's agent does.
            restored = Collector(parse_config(raw, environ={}))
            restored.start()
            loop.collectors.append(restored)

    finished_before = [r.trace_id for r in record.results if r.end_ns < killed_ns]
    across = [r.trace_id for r in record.results if r.start_ns < killed_ns <= r.end_ns]
    after = [r.trace_id for r in record.results if r.start_ns >= killed_ns]
    after_restart = sum(1 for r in record.results if r.start_ns >= restarted_ns)
    spool_lines = [
        line
        for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        if "spool:" in line
    ]
    show(
        capsys,
        f"SIGKILL under vLLM load: {len(record.results)} served, "
        f"{record.summary['failed']} failed; "
        f"{len(stored.intersection(finished_before))} of {len(finished_before)} finished before "
        f"the kill stored ({len(stored_at_kill.intersection(finished_before))} of them at the "
        f"kill), {len(stored.intersection(across))} of {len(across)} in flight across "
        f"it, {len(stored.intersection(after))} of {len(after)} after "
        f"(port closed {(restarted_ns - killed_ns) / 1e9:.1f} s, {after_restart} requests "
        f"started after the restart); "
        f"{len(spans_twice)} traces stored with a span twice; client spans exported "
        f"{record.export}\n" + "\n".join(f"  collector | {line}" for line in spool_lines),
    )
    assert finished_before and after, "the kill did not fall in the middle of the load"
    for name, wanted in (
        ("finished before the kill", finished_before),
        ("in flight across the kill", across),
        ("started after the kill", after),
    ):
        missing = sorted(set(wanted) - stored)
        assert not missing, f"{len(missing)} requests {name} not stored with both sides: {missing}"
    assert not rows_twice, f"requests with two rows: {rows_twice}"
    assert exit_status == 0, "the restarted collector did not stop cleanly"
    # An export spooled but killed before its OK left comes back twice (replayed, and retried
    # by its sender): the copy that finds its spans stored adds none of them again.
    assert not spans_twice, f"traces stored with a span twice: {spans_twice}"
