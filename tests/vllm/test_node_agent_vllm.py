"""The real vLLM's spans through a real ``tokentrace node-agent`` process (tokentrace's built
there from what the agent hands over on the node agent's local socket).

The shared server (`traced_server`, tests/vllm/shared_server.py) runs with the agent, exporting to a
node agent started as a command whose ``pynvml`` loads the stand-in NVML library from
``LD_LIBRARY_PATH`` (the path the binding loads from). The vLLM processes name the stand-in's
first GPU as theirs (``TOKENTRACE_GPU_UUIDS``, as the NVIDIA device plugin's UUIDs would). What
reaches the OTLP receiver behind the node agent must carry the GPU aggregates on every phase
span, and the decode roofline from the worker's weights.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.spanbuild import attributes_of
from tests.vllm.openai_api import request_body
from tests.vllm.shared_server import TracedServer, require_vllm, wait_until_idle
from tests.vllm.traces import exported_spans
from tokentrace.agent import semconv

require_vllm()

pytestmark = pytest.mark.slow

_STAND_IN_PEAK_BPS = 5120 / 8 * 2619e6 * 2  # the stand-in's default bus width and memory clock
_STAND_IN_DRAM_SHARE = 0.40  # its default GPM DRAM bandwidth utilisation


def test_vllm_phase_spans_arrive_with_the_gpu_samples_of_their_windows(
    traced_server: TracedServer,
) -> None:
    upstream, server = traced_server.upstream, traced_server.server
    startup = traced_server.node_agent.startup
    assert "sampling 2 GPU(s)" in startup, startup
    assert f"LocalSocket {traced_server.node_agent.local_socket}" in startup, startup
    wait_until_idle(server)  # the request alone on the server, as on a server of its own
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
    ), traced_server.log_tail()
    spans = spans_of_request()
    for name in (semconv.SPAN_REQUEST, semconv.SPAN_PREFILL, semconv.SPAN_DECODE):
        attributes = attributes_of(spans[name])
        duration_s = (spans[name].end_time_unix_nano - spans[name].start_time_unix_nano) / 1e9
        # 100 ms sampling: a window of d seconds holds at most about 10 d samples; fewer when
        # the node agent's sampler was starved on this shared machine (0: the aggregates are the
        # covering sample's). How many is timing, not behaviour: only the upper bound holds.
        assert 0 <= attributes[semconv.GPU_SAMPLES] <= 10 * duration_s + 2, name
        assert attributes[semconv.GPU_UTILIZATION_MEAN] == pytest.approx(0.5), name
        assert attributes[semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO] == pytest.approx(
            _STAND_IN_DRAM_SHARE
        )
        assert attributes[semconv.GPU_MEMORY_BANDWIDTH_GBPS] == pytest.approx(
            _STAND_IN_DRAM_SHARE * _STAND_IN_PEAK_BPS / 1e9
        )
    # Those spans were built by the node agent from what the agent handed it on the local
    # socket (its counters, printed every 2 s).
    assert upstream.wait_for(
        lambda: "LocalSocketReceiver.taken_requests=" in traced_server.node_agent.log_tail(), 10
    ), traced_server.node_agent.log_tail()
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
