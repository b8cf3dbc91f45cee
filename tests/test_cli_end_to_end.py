"""The commands as an operator runs them: `tokentrace collector`, `replay`, `top`, `explain`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.collector_process import start_collector_process

pytestmark = pytest.mark.slow

CONFIG = """
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:0"}
processors:
  assembly: {quiet_period: 5s, root_grace: 50ms}
  slo:
    targets:
      - {name: ttft-p95, metric: ttft, percentile: 95, threshold: 500ms}
exporters:
  store: {path: STORE}
"""


def tokentrace(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokentrace.agent.cli", *args]


def test_collector_replay_explain_top(tmp_path: Path) -> None:
    store = tmp_path / "requests.db"
    config = tmp_path / "collector.yaml"
    config.write_text(CONFIG.replace("STORE", str(store)), encoding="utf-8")
    collector = start_collector_process(config, tmp_path / "collector.log")
    port = collector.grpc_port
    try:
        replay = subprocess.run(
            tokentrace(
                "replay",
                "--endpoint",
                f"http://127.0.0.1:{port}",
                "--requests",
                "40",
                "--scenario",
                "queue_saturation",
                "--seed",
                "2",
                "--quiet",
            ),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert replay.returncode == 0, replay.stderr
    finally:
        # SIGTERM: the quiet period has not passed, so only a clean shutdown stores the traces.
        exit_status = collector.stop(timeout_s=60)
    output = collector.output
    assert exit_status == 0, output
    assert "Traceback" not in output

    explain = subprocess.run(
        tokentrace("explain", "--slowest", "--metric", "ttft", "--json", "--store", str(store)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    doc = json.loads(explain.stdout)
    assert doc["verdict"]["cause"] == "queueing"
    assert doc["slo"] == {"ttft-p95": False}

    text = subprocess.run(
        tokentrace("explain", doc["trace_id"][:12], "--store", str(store)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "queue" in text and doc["verdict"]["sentence"] in text

    top = subprocess.run(
        tokentrace("top", "--once", "--json", "--window", "1h", "--store", str(store)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(top.stdout)
    assert sum(key["requests"] for key in report["keys"]) == 40


def test_collector_config_errors_exit_2_without_traceback(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("processors:\n  assembly: {quiet_period: soon}\n", encoding="utf-8")
    result = subprocess.run(
        tokentrace("collector", "--config", str(config)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "processors.assembly.quiet_period" in result.stderr
    assert "Traceback" not in result.stderr


def test_collector_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "c.yaml"
        config.write_text(
            f"receivers:\n  otlp:\n    protocols:\n      http: {{endpoint: '127.0.0.1:{port}'}}\n"
            f"exporters:\n  store: {{path: '{tmp_path / 'x.db'}'}}\n",
            encoding="utf-8",
        )
        result = subprocess.run(
            tokentrace("collector", "--config", str(config)),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1
    assert str(port) in result.stderr and "Traceback" not in result.stderr


def test_check_config_validates_without_binding(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG.replace("STORE", str(tmp_path / "x.db")), encoding="utf-8")
    result = subprocess.run(
        tokentrace("collector", "--config", str(config), "--check-config"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "configuration OK" in result.stdout and "SLO targets: ttft-p95" in result.stdout
    assert not (tmp_path / "x.db").exists()  # nothing was started
