"""``make demo``: the collector end to end on an embedded default, in about half a minute.

Until the vLLM agent lands, the traffic comes from ``tokentrace replay``: a simulated
continuous-batching server whose request traces are sent by the official OpenTelemetry SDK OTLP
exporter to a real ``tokentrace collector`` process. Then it prints what an engineer would look
at: the percentile table with SLO status, and the explanation of the slowest request.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO_CONFIG = """\
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:0"}
      http: {endpoint: "127.0.0.1:0"}
processors:
  assembly: {quiet_period: 1s, root_grace: 200ms}
  slo:
    targets:
      - {name: chat-ttft-p95, metric: ttft, percentile: 95, threshold: 500ms,
         selector: {operation: chat}}
      - {name: tpot-p99, metric: tpot, percentile: 99, threshold: 60ms}
      - {name: e2e-p95, metric: e2e, percentile: 95, threshold: 8s}
exporters:
  store: {path: STORE_PATH}
"""

_PORT_LINE = re.compile(r"OTLP/gRPC receiver listening on ([\d.]+):(\d+)")
_DEFAULT_REQUESTS = 600
_STARTUP_TIMEOUT_S = 30.0
_DRAIN_TIMEOUT_S = 60.0


def _tokentrace(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokentrace.agent.cli", *args]


def _start_collector(config_path: Path) -> tuple[subprocess.Popen[str], int]:
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
        match = _PORT_LINE.search(line)
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


def _wait_for_requests(store_path: Path, expected: int) -> int:
    from tokentrace.collector.store.sqlite import RequestStore

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
    parser.add_argument("--requests", type=int, default=_DEFAULT_REQUESTS)
    parser.add_argument("--scenario", default="mixed")
    parser.add_argument("--store", default="./tokentrace-demo.db")
    args = parser.parse_args(argv)

    store_path = Path(args.store).resolve()
    for stale in (store_path, Path(f"{store_path}-wal"), Path(f"{store_path}-shm")):
        stale.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="tokentrace-demo-") as tmp:
        config_path = Path(tmp) / "collector.yaml"
        config_path.write_text(DEMO_CONFIG.replace("STORE_PATH", str(store_path)), "utf-8")
        print("==> starting tokentrace collector (embedded SQLite store)")
        collector, port = _start_collector(config_path)
        try:
            print(
                f"\n==> replaying {args.requests} simulated requests ({args.scenario!r}) "
                "through the OpenTelemetry SDK's OTLP/gRPC exporter"
            )
            replay = subprocess.run(
                _tokentrace(
                    "replay",
                    "--endpoint",
                    f"http://127.0.0.1:{port}",
                    "--scenario",
                    args.scenario,
                    "--requests",
                    str(args.requests),
                    "--seed",
                    "7",
                ),
                check=False,
            )
            if replay.returncode != 0:
                print("demo: replay failed", file=sys.stderr)
                return 1
            count = _wait_for_requests(store_path, args.requests)
            print(f"\n==> the collector derived {count} request records\n")
        finally:
            collector.send_signal(signal.SIGTERM)
            try:
                collector.wait(timeout=30)
            except subprocess.TimeoutExpired:
                collector.kill()
    env = dict(os.environ, COLUMNS=os.environ.get("COLUMNS", "110"))
    print("==> tokentrace top --once   (percentiles per model and prompt bucket, SLO status)\n")
    subprocess.run(
        _tokentrace("top", "--once", "--store", str(store_path), "--window", "1h"),
        env=env,
        check=False,
    )
    # The breached target is chat TTFT p95, so the story starts at the slowest first token.
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
        f"  tokentrace explain TRACE_ID --store {args.store}\n"
        f"  tokentrace explain --slowest --store {args.store}      # slowest end to end\n"
        f"  tokentrace explain --slowest --metric ttft --store {args.store} --json\n"
        f"  tokentrace top --store {args.store} --window 1h\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
