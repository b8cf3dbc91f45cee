"""A real Prometheus server for the tests (Debian's package; ``make test`` installs it through
``tests/deploy/install_debian_tools.sh``): started on 127.0.0.1 with port 0 (the port read back from
its log), a temporary storage directory, and a scrape configuration naming the test's targets.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

PROMETHEUS: Final = "/usr/bin/prometheus"
_LISTENING = re.compile(r'msg="Listening on" address=([\d.]+:\d+)')
_START_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True)
class Prometheus:
    base_url: str
    log_path: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (or matrix); raises with Prometheus's error."""
        url = f"{self.base_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:  # 400 for a bad query, with the reason
            body = json.load(error)
        if body.get("status") != "success":
            raise AssertionError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, expr: str, *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The query's result once it is not empty (scrapes and rates need a few intervals)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.5)

    def targets(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.base_url}/api/v1/targets", timeout=10) as response:
            active: list[dict[str, Any]] = json.load(response)["data"]["activeTargets"]
        return active


def _scrape_config(jobs: Mapping[str, Sequence[str]], interval: str) -> str:
    scrape_configs = [
        {"job_name": job, "static_configs": [{"targets": list(targets)}]}
        for job, targets in jobs.items()
    ]
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": scrape_configs,
    }
    return json.dumps(config)  # JSON is YAML


@contextmanager
def running_prometheus(
    workdir: Path, jobs: Mapping[str, Sequence[str]], *, scrape_interval: str = "1s"
) -> Iterator[Prometheus]:
    """Prometheus scraping ``jobs`` (job name -> ``host:port`` targets, path ``/metrics``)."""
    if shutil.which(PROMETHEUS) is None:
        pytest.fail(
            f"{PROMETHEUS} is missing: `make test` installs it "
            "(sh tests/deploy/install_debian_tools.sh)"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(_scrape_config(jobs, scrape_interval), encoding="utf-8")
    log_path = workdir / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                "--web.listen-address=127.0.0.1:0",
                "--log.level=info",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        address = None
        while address is None:
            text = log_path.read_text(encoding="utf-8", errors="replace")
            if "Server is ready to receive web requests" in text:
                found = _LISTENING.search(text)
                address = found.group(1) if found else None
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"Prometheus did not start:\n{text[-3000:]}")
            if address is None:
                time.sleep(0.1)
        yield Prometheus(f"http://{address}", log_path)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
