"""One real SGLang server shared by the whole session, tracing into a real tokentrace collector.

SGLang lives in a virtual environment of its own (its torch pin differs from vLLM's): ``make
sglang-venv`` builds it outside the clone and ``make pytest`` hands its interpreter to the tests
in ``TOKENTRACE_SGLANG_PYTHON`` (`sglang_python`); a test that needs it and finds it unset fails
with one line saying so. The server runs that interpreter as a child process with
``tests/sglang/support`` on its ``PYTHONPATH`` (a pure-torch stand-in for the one ``vllm``
function SGLang imports without a GPU; see its docstring), on the tiny random Llama of
``tests/conftest.py``'s `tiny_model_dir`, with the CPU flags that make it start in about a minute
here (``SERVER_FLAGS``).

`sglang_server` starts it once per session (CI time) with SGLang's own tracing
(``--enable-trace``) exporting to a ``tokentrace collector`` process that only this server sends
to; the collector stores what it makes of the spans in a test-owned SQLite store, which tests read
with the ``tokentrace`` commands as an operator would. Tests never assume the store is fresh: they
find their own requests by the trace ids they sent in ``traceparent`` (SGLang continues the
caller's trace).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.collector_process import running_collector_process
from tokentrace.loadgen.local_vllm import (
    free_loopback_port,
    log_tail,
    spawn_until_healthy,
    stop_server,
)

SGLANG_PYTHON_ENV = "TOKENTRACE_SGLANG_PYTHON"
SGLANG_PYTHON_HINT = (
    f"{SGLANG_PYTHON_ENV} is not set: run `make sglang-venv` and export "
    f"{SGLANG_PYTHON_ENV}=<that venv>/bin/python (`make pytest` does both)"
)
SERVED_MODEL_NAME = "tiny-llama"
SUPPORT_DIR = Path(__file__).parent / "support"
REPOSITORY = Path(__file__).resolve().parents[2]
_PACKAGE_ENTRIES = ("pyproject.toml", "README.md", "agent", "collector", "processors", "loadgen")
"""What the tokentrace distribution is built from (as deploy/images/install.sh copies it)."""
_AGENT_ONLY_REQUIREMENTS = ("wrapt", "opentelemetry-instrumentation")
"""``tokentrace[agent]``'s requirements that SGLang's environment lacks (versions: constraints)."""
_SITE_BUILD_TIMEOUT_S = 300
"""On the server's ``PYTHONPATH``: the ``vllm`` stand-in."""
SERVER_FLAGS: tuple[str, ...] = (
    *("--device", "cpu"),
    *("--attention-backend", "torch_native"),
    "--disable-overlap-schedule",
    "--sleep-on-idle",
    # Without a bound the KV pool takes ~15 GB of RAM and start-up is 20 s slower.
    *("--max-total-tokens", "32768"),
)
_DEFAULT_READY_TIMEOUT_S = 240.0
_DEFAULT_SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    # Spans leave the server within 100 ms of their end (SGLang's default waits 500 ms).
    "SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS": "100",
}
COLLECTOR_CONFIG = """
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:0"}
processors:
  assembly: {quiet_period: 1s, root_grace: 50ms}
exporters:
  store: {path: STORE}
"""
"""A short quiet period: a request is stored about a second after its last span arrives."""


class SglangServerError(RuntimeError):
    """The server exited or did not become healthy; the message carries its log's tail."""


def sglang_python() -> str:
    """The SGLang venv's interpreter; fails the calling test with one line when it is not set."""
    python = os.environ.get(SGLANG_PYTHON_ENV)
    if not python:
        pytest.fail(SGLANG_PYTHON_HINT, pytrace=False)
    if not Path(python).exists():
        pytest.fail(
            f"{SGLANG_PYTHON_ENV}={python} does not exist: run `make sglang-venv`", pytrace=False
        )
    return python


@dataclass(frozen=True)
class SglangServer:
    base_url: str
    model_name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    started_in_s: float

    def log_tail(self) -> str:
        return log_tail(self.log_path)


def server_command(
    python: str,
    model_dir: Path,
    *,
    port: int,
    otlp_endpoint: str | None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """``sglang.launch_server`` with ``SERVER_FLAGS``; ``--enable-trace`` to ``otlp_endpoint``
    (``host:port``, OTLP/gRPC) when given."""
    tracing = ("--enable-trace", "--otlp-traces-endpoint", otlp_endpoint) if otlp_endpoint else ()
    return [
        python,
        *("-m", "sglang.launch_server"),
        *("--model-path", str(model_dir)),
        *("--served-model-name", SERVED_MODEL_NAME),
        *SERVER_FLAGS,
        *("--host", "127.0.0.1", "--port", str(port)),
        *tracing,
        *extra_args,
    ]


def tokentrace_site(python: str, directory: Path) -> Path:
    """tokentrace installed for SGLang's interpreter into ``directory`` (``pip install
    --target``, as a user would install ``tokentrace[agent]`` into SGLang's environment, less
    what SGLang's environment already has: the OpenTelemetry SDK, protobuf and grpcio), built
    from a copy of the sources so that the build leaves nothing in the clone. A few seconds."""
    source = directory / "source"
    for entry in _PACKAGE_ENTRIES:
        origin = REPOSITORY / entry
        if origin.is_dir():
            shutil.copytree(origin, source / entry, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, source / entry)
    site = directory / "site"
    completed = subprocess.run(
        [
            python, *("-m", "pip", "install", "--quiet", "--disable-pip-version-check"),
            *("--no-deps", "--target", str(site)),
            *("--constraint", str(REPOSITORY / "constraints.txt")),
            str(source), *_AGENT_ONLY_REQUIREMENTS,
        ],
        capture_output=True, text=True, check=False, timeout=_SITE_BUILD_TIMEOUT_S,
    )  # fmt: skip
    if completed.returncode != 0:
        raise SglangServerError(f"installing tokentrace for SGLang failed:\n{completed.stderr}")
    return site


@contextmanager
def running_sglang_server(
    python: str,
    model_dir: Path,
    *,
    log_path: Path,
    otlp_endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = _DEFAULT_READY_TIMEOUT_S,
    extra_args: Sequence[str] = (),
    command_prefix: Sequence[str] = (),
) -> Iterator[SglangServer]:
    """Start SGLang on a free loopback port, wait for ``/health``, yield it, stop it afterwards
    (its whole process group: scheduler and detokenizer included). ``command_prefix`` runs the
    server under another command (``tokentrace run --``)."""
    port = free_loopback_port()
    child_env = {**_DEFAULT_SERVER_ENV, **os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(SUPPORT_DIR), *filter(None, [child_env.get("PYTHONPATH")])]
    )
    base_url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    process = spawn_until_healthy(
        [
            *command_prefix,
            *server_command(
                python, model_dir, port=port, otlp_endpoint=otlp_endpoint, extra_args=extra_args
            ),
        ],
        env=child_env,
        log_path=log_path,
        health_url=f"{base_url}/health",
        ready_timeout_s=ready_timeout_s,
        name="SGLang",
        error=SglangServerError,
    )
    try:
        yield SglangServer(
            base_url=base_url,
            model_name=SERVED_MODEL_NAME,
            process=process,
            log_path=log_path,
            started_in_s=time.monotonic() - started,
        )
    finally:
        stop_server(process)


def tokentrace_command(*args: str) -> list[str]:
    """The ``tokentrace`` command of this interpreter (the project's environment)."""
    return [sys.executable, "-m", "tokentrace.agent.cli", *args]


@dataclass(frozen=True)
class CollectorProcess:
    port: int
    """Its OTLP/gRPC receiver on 127.0.0.1."""
    store: Path
    log_path: Path

    def log_tail(self) -> str:
        return log_tail(self.log_path)


@contextmanager
def running_collector(directory: Path) -> Iterator[CollectorProcess]:
    """A ``tokentrace collector`` storing into ``directory / "requests.db"``; its output goes to
    ``directory / "collector.log"``. Stopped with SIGTERM (it stores what it holds)."""
    store = directory / "requests.db"
    config = directory / "collector.yaml"
    config.write_text(COLLECTOR_CONFIG.replace("STORE", str(store)), encoding="utf-8")
    log_path = directory / "collector.log"
    with running_collector_process(config, log_path) as collector:
        yield CollectorProcess(collector.grpc_port, store, log_path)


@dataclass(frozen=True)
class TracedSglang:
    server: SglangServer
    collector: CollectorProcess
    """Receives SGLang's spans from this server alone, since its start."""

    def log_tail(self) -> str:
        return f"{self.server.log_tail()}\n--- collector ---\n{self.collector.log_tail()}"


@pytest.fixture(scope="session")
def sglang_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TracedSglang]:
    """The shared SGLang server, its own tracing on, exporting to a test-owned collector."""
    python = sglang_python()
    with (
        running_collector(tmp_path_factory.mktemp("sglang-collector")) as collector,
        running_sglang_server(
            python,
            tiny_model_dir,
            log_path=tmp_path_factory.mktemp("sglang") / "server.log",
            otlp_endpoint=f"127.0.0.1:{collector.port}",
        ) as server,
    ):
        yield TracedSglang(server, collector)
