"""The real vLLM's spans through a real ``tokentrace node-agent`` process.

vLLM (CPU build) runs with the agent, exporting to a node agent started as a command whose
``pynvml`` loads the stand-in NVML library from ``LD_LIBRARY_PATH`` (the path the binding loads
from). The vLLM processes name the stand-in's first GPU as theirs (``TOKENTRACE_GPU_UUIDS``, as
the NVIDIA device plugin's UUIDs would). What reaches the OTLP receiver behind the node agent must
carry the GPU aggregates on every phase span, and the decode roofline from the worker's weights.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.collector.upstream import UpstreamOtlp
from tests.node.node_agent_process import start_node_agent
from tests.node.nvml_stand_in import build_stand_in, library_env
from tests.spanbuild import attributes_of
from tests.vllm.conftest import require_vllm, traced_server_env
from tests.vllm.openai_api import request_body
from tests.vllm.traces import exported_spans
from tokentrace.agent import semconv
from tokentrace.loadgen.local_vllm import running_vllm_server

require_vllm()

pytestmark = pytest.mark.slow

_STAND_IN_GPU = "GPU-00000000-0000-0000-0000-000000000000"
_STAND_IN_PEAK_BPS = 5120 / 8 * 2619e6 * 2  # the stand-in's default bus width and memory clock
_STAND_IN_DRAM_SHARE = 0.40  # its default GPM DRAM bandwidth utilisation


# Own server: its spans go through a node agent (stand-in NVML GPUs) before the receiver.
@pytest.fixture(scope="module")
def node_agent_chain(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[UpstreamOtlp, Any, str]]:
    library_dir = tmp_path_factory.mktemp("nvml")
    build_stand_in(library_dir)
    with UpstreamOtlp() as upstream:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["LD_LIBRARY_PATH"] = library_env(library_dir)["LD_LIBRARY_PATH"]
        agent, port, startup = start_node_agent(
            "--upstream", upstream.grpc_endpoint, "--stats-interval", "0", env=env
        )
        assert "sampling 2 GPU(s)" in startup, startup
        log_path = tmp_path_factory.mktemp("vllm-node-agent") / "server.log"
        server_env = {
            **traced_server_env(upstream),
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "TOKENTRACE_GPU_UUIDS": _STAND_IN_GPU,
        }
        try:
            with running_vllm_server(tiny_model_dir, log_path=log_path, env=server_env) as server:
                yield upstream, server, startup
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.communicate(timeout=20)


def test_vllm_phase_spans_arrive_with_the_gpu_samples_of_their_windows(
    node_agent_chain: tuple[UpstreamOtlp, Any, str],
) -> None:
    upstream, server, _ = node_agent_chain
    marker = uuid.uuid4().hex
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json=request_body(server, chat=False, stream=True, max_tokens=48),
        headers={"X-Request-Id": marker},
        timeout=120,
    )
    assert response.status_code == 200, response.text

    def spans_of_request() -> dict[str, Any]:
        spans = [span for _, span in exported_spans(upstream)]
        roots = [
            s
            for s in spans
            if s.name == semconv.SPAN_REQUEST
            and marker in str(attributes_of(s).get(semconv.REQUEST_ID, ""))
        ]
        if not roots:
            return {}
        trace = roots[0].trace_id
        return {s.name: s for s in spans if s.trace_id == trace}

    assert upstream.wait_for(
        lambda: (
            {semconv.SPAN_REQUEST, semconv.SPAN_PREFILL, semconv.SPAN_DECODE}
            <= set(spans_of_request())
        ),
        60,
    ), server.log_tail()
    spans = spans_of_request()
    for name in (semconv.SPAN_REQUEST, semconv.SPAN_PREFILL, semconv.SPAN_DECODE):
        attributes = attributes_of(spans[name])
        duration_s = (spans[name].end_time_unix_nano - spans[name].start_time_unix_nano) / 1e9
        # 100 ms sampling: a window of d seconds holds about 10 d samples (0: the covering one).
        assert abs(attributes[semconv.GPU_SAMPLES] - 10 * duration_s) <= 2, name
        assert attributes[semconv.GPU_UTILIZATION_MEAN] == pytest.approx(0.5), name
        assert attributes[semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO] == pytest.approx(
            _STAND_IN_DRAM_SHARE
        )
        assert attributes[semconv.GPU_MEMORY_BANDWIDTH_GBPS] == pytest.approx(
            _STAND_IN_DRAM_SHARE * _STAND_IN_PEAK_BPS / 1e9
        )
    # The worker's weight_load span taught the node agent the weights: decode's roofline.
    weight_loads = [
        attributes_of(span)
        for _, span in exported_spans(upstream)
        if span.name == semconv.SPAN_COLD_START_WEIGHT_LOAD
    ]
    (weight_bytes,) = [w[semconv.MODEL_WEIGHT_BYTES] for w in weight_loads]
    decode = spans[semconv.SPAN_DECODE]
    attributes = attributes_of(decode)
    offsets = attributes[semconv.DECODE_TOKEN_OFFSETS]
    assert isinstance(offsets, list) and isinstance(weight_bytes, int)
    tokens = len(offsets)
    per_token_s = (decode.end_time_unix_nano - decode.start_time_unix_nano) / 1e9 / (tokens - 1)
    assert attributes[semconv.DECODE_ROOFLINE_RATIO] == pytest.approx(
        weight_bytes / _STAND_IN_PEAK_BPS / per_token_s
    )
