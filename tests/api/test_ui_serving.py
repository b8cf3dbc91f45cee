"""How the UI is served: the collector's ``ui`` extension and ``tokentrace ui``."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.replayed import collector_config, post_scenario, replayed_store
from tokentrace.collector.api.app import CONTENT_SECURITY_POLICY
from tokentrace.collector.cli import UI_TOKEN_ENV
from tokentrace.collector.config import ConfigError, UiConfig, parse_config
from tokentrace.collector.service import Collector, describe

_URL_LINE = re.compile(r"serving .* at (http://127\.0\.0\.1:\d+)/")
_START_TIMEOUT_S = 60.0


def ui_config(**ui: Any) -> UiConfig | None:
    return parse_config(collector_config(Path("/tmp/x.db"), ui=ui), environ={}).ui


def test_ui_extension_config_defaults_and_errors(tmp_path: Path) -> None:
    assert parse_config(collector_config(tmp_path / "s.db"), environ={}).ui is None
    assert ui_config() == UiConfig()
    assert ui_config(endpoint="0.0.0.0:9000", auth_token="t") == UiConfig(
        endpoint="0.0.0.0:9000", auth_token="t"
    )
    # service.extensions picks what runs; a bare type runs on defaults.
    raw = collector_config(tmp_path / "s.db", ui={"endpoint": "127.0.0.1:1"})
    raw["service"] = {"extensions": []}
    assert parse_config(raw, environ={}).ui is None
    raw = collector_config(tmp_path / "s.db")
    raw["service"] = {"extensions": ["ui"]}
    assert parse_config(raw, environ={}).ui == UiConfig()

    problems = {
        "extensions.ui.colour: unknown key": {"colour": "red"},
        "extensions.ui.endpoint: expected HOST:PORT": {"endpoint": "nowhere"},
        "extensions.ui.trace_link: must contain {trace_id}": {"trace_link": "https://t/x"},
        "extensions.ui.trace_link: must be an http": {"trace_link": "javascript:{trace_id}"},
        "extensions.ui.tls: cert_file and key_file must be given together": {
            "tls": {"cert_file": "c.pem"}
        },
    }
    for expected, ui in problems.items():
        with pytest.raises(ConfigError, match=re.escape(expected)):
            ui_config(**ui)
    raw = collector_config(tmp_path / "s.db", ui={})
    raw["exporters"] = {}
    raw["service"] = {"pipelines": {"traces": {"exporters": []}}}
    with pytest.raises(ConfigError, match="add a store exporter"):
        parse_config(raw, environ={})


@pytest.fixture
def collector_with_ui(tmp_path: Path) -> Iterator[Collector]:
    raw = collector_config(
        tmp_path / "store.db",
        ui={
            "endpoint": "127.0.0.1:0",
            "auth_token": "s3cret",
            "trace_link": "https://tempo.example/trace/{trace_id}",
        },
    )
    collector = Collector(parse_config(raw, environ={}))
    collector.start()
    try:
        yield collector
    finally:
        collector.shutdown()


def test_collector_serves_its_store_with_auth(collector_with_ui: Collector) -> None:
    collector = collector_with_ui
    url = collector.ui_url
    assert url is not None and url.startswith("http://127.0.0.1:")
    assert any(line.startswith(f"web UI and API at {url}/") for line in describe(collector))
    post_scenario(collector, scenario="steady", requests=30, seed=3)
    collector.flush()
    with httpx.Client(base_url=url, timeout=10.0) as client:
        refused = client.get("/api/v1/meta")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        assert refused.json() == {"error": "missing or wrong bearer token"}
        assert (
            client.get("/api/v1/meta", headers={"Authorization": "Bearer wrong"}).status_code == 401
        )
        meta = client.get("/api/v1/meta", headers={"Authorization": "Bearer s3cret"})
        assert meta.status_code == 200
        assert meta.json()["requests"] == 30
        assert meta.json()["auth"] is True
        assert meta.json()["trace_link"] == "https://tempo.example/trace/{trace_id}"
        # The page itself carries no data: served without the token, under a strict CSP.
        page = client.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert page.headers["x-content-type-options"] == "nosniff"
    # Shutdown stops the UI with the rest (upstream first).
    collector.shutdown()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/healthz", timeout=2.0)


def start_ui(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tokentrace.agent.cli", "ui", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_tokentrace_ui_serves_a_store_until_terminated(tmp_path: Path) -> None:
    store = replayed_store(tmp_path / "store.db", requests=20, seed=2)
    process = start_ui(
        ["--store", str(store), "--listen", "127.0.0.1:0"], env={UI_TOKEN_ENV: "tok"}
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = _URL_LINE.search(line)
        assert match, line + (process.stderr.read() if process.stderr else "")
        assert "bearer token" in line
        url = match.group(1)
        headers = {"Authorization": "Bearer tok"}
        assert httpx.get(f"{url}/api/v1/meta", headers=headers, timeout=10).json()["requests"] == 20
        assert httpx.get(f"{url}/api/v1/meta", timeout=10).status_code == 401
        assert httpx.get(f"{url}/ui/app.js", timeout=10).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=_START_TIMEOUT_S)
    assert process.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_tokentrace_ui_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    missing = start_ui(["--store", str(tmp_path / "none.db")])
    _, err = missing.communicate(timeout=_START_TIMEOUT_S)
    assert missing.returncode == 2
    assert err.strip().startswith("tokentrace ui: no store at")
    assert "Traceback" not in err

    store = replayed_store(tmp_path / "store.db", requests=5, seed=1)
    bad_link = start_ui(["--store", str(store), "--trace-link", "ftp://x/{trace_id}"])
    _, err = bad_link.communicate(timeout=_START_TIMEOUT_S)
    assert bad_link.returncode == 2
    assert "--trace-link must be an http" in err

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        busy = start_ui(["--store", str(store), "--listen", f"127.0.0.1:{port}"])
        _, err = busy.communicate(timeout=_START_TIMEOUT_S)
    assert busy.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in err
    assert "Traceback" not in err
