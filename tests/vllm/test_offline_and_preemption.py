"""tokentrace on vLLM's offline ``LLM.generate``, and on requests that a tiny KV cache preempts.

Both scenarios run in one child interpreter on one engine (the driver ``offline_generate``
below), one ``LLM.generate`` call after the other: vLLM's CPU backend spawns EngineCore and worker
processes, and a fresh interpreter keeps vLLM out of the test process. The tokentrace plugin loads
through its ``vllm.general_plugins`` entry point: offline, vLLM loads general plugins in the
frontend from ``EngineArgs.__post_init__`` (before ``LLMEngine`` is built), so nothing is
instrumented by hand. Stats logging is turned on (``disable_log_stats=False``): without it vLLM
sends no QUEUED/SCHEDULED/PREEMPTED events and no ``RequestStateStats``. After each call the
driver writes what vLLM itself returned (token ids, its ``RequestStateStats``) to a JSON file and
flushes the agent; the test compares that with the spans that reached a test-owned OTLP/gRPC
receiver.

The engine's KV cache is tiny: ``_KV_BLOCKS`` blocks of ``_BLOCK_SIZE`` tokens
(``num_gpu_blocks_override``; ``VLLM_CPU_KVCACHE_SPACE`` is in GiB, far too coarse), one block per
request at the start. The offline scenario's requests fit in their one block for good (prompt and
``_OFFLINE_MAX_TOKENS`` outputs), so the cache only makes one of them wait; the preemption
scenario's eight requests, generating ``_PREEMPTION_MAX_TOKENS`` tokens each, outgrow it and vLLM
preempts (recomputes) some of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from tests.collector.upstream import UpstreamOtlp
from tests.spanbuild import attributes_of
from tests.vllm.shared_server import require_vllm, traced_server_env
from tests.vllm.traces import RequestTree, assert_consistent_tree, duration_s, request_trees
from tokentrace.agent import semconv
from tokentrace.processors.budget import compute_budget
from tokentrace.processors.model import AssembledTrace, Budget, SpanRef
from tokentrace.processors.timeline import normalize

require_vllm()

pytestmark = pytest.mark.slow

_REPO_ROOT = Path(__file__).resolve().parents[2]
_DRIVER_TIMEOUT_S = 300.0
_SPAN_TIMEOUT_S = 20.0
_AGREEMENT_S = 0.001
"""Durations tokentrace and vLLM take from the same EngineCore timestamps agree this well."""
_SERVED_MODEL_NAME = "tiny-llama-offline"
_SERVICE_NAME = "vllm-offline-under-test"
_NUM_PROMPTS = 8
_OFFLINE_MAX_TOKENS = 16
_BLOCK_SIZE = 32
"""Tokens per KV-cache block (the CPU backend's default is 128 and it wants multiples of 32)."""
_KV_BLOCKS = 8
"""One block per request at the start; vLLM keeps one block back (the null block)."""
_MAX_MODEL_LEN = 128
"""vLLM refuses a max_model_len that the (usable) KV cache cannot hold once: 7 x 32 >= 128."""
_PREEMPTION_MAX_TOKENS = 96
PROMPTS = tuple(
    f"def function_{index}(value):\n    return value +" for index in range(_NUM_PROMPTS)
)


# --- the driver (runs in the child interpreter) ---------------------------------------------------
def offline_generate(model_dir: str, result_path: str, *, max_tokens: list[int]) -> None:
    """One engine; ``LLM.generate`` for every prompt at once, once per entry of `max_tokens`;
    writes vLLM's own view of each request and the agent's stats after each call."""
    from vllm import LLM, SamplingParams

    from tokentrace.agent.runtime import get_runtime

    llm = LLM(
        model=model_dir,
        served_model_name=_SERVED_MODEL_NAME,
        dtype="bfloat16",
        max_model_len=_MAX_MODEL_LEN,
        enforce_eager=True,
        disable_log_stats=False,  # vLLM's scheduler events: queue and preemption intervals
        block_size=_BLOCK_SIZE,
        num_gpu_blocks_override=_KV_BLOCKS,
    )
    # Nothing here instruments vLLM: only the plugin entry point could have patched it.
    from vllm.v1.engine.output_processor import OutputProcessor

    from tokentrace.agent.frameworks.patching import is_patch

    patched = is_patch(vars(OutputProcessor)["process_outputs"])
    runtime = get_runtime()
    runs = []
    for tokens in max_tokens:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
        requests = []
        for output in outputs:
            stats = output.metrics
            requests.append(
                {
                    "request_id": output.request_id,
                    "prompt_tokens": len(output.prompt_token_ids or ()),
                    "output_tokens": len(output.outputs[0].token_ids),
                    "finish_reason": output.outputs[0].finish_reason,
                    "num_preemptions": getattr(stats, "num_preemptions", None),
                    "queued_ts": getattr(stats, "queued_ts", None),
                    "scheduled_ts": getattr(stats, "scheduled_ts", None),
                    "first_token_ts": getattr(stats, "first_token_ts", None),
                    "last_token_ts": getattr(stats, "last_token_ts", None),
                }
            )
        flushed = runtime is not None and runtime.flush()
        agent = {} if runtime is None else runtime.stats()
        runs.append({"requests": requests, "flushed": flushed, "agent": agent})
    Path(result_path).write_text(json.dumps({"runs": runs, "patched": patched}), encoding="utf-8")


# --- the test side --------------------------------------------------------------------------------
@dataclass(frozen=True)
class OfflineRun:
    """What vLLM returned (per request id) and what the receiver got for the same requests."""

    vllm_requests: dict[str, dict[str, Any]]
    patched_by_plugin: bool
    agent_stats: dict[str, Any]
    trees: dict[str, RequestTree]
    log: str


def run_offline(tmp_path: Path, model_dir: Path, *, max_tokens: list[int]) -> list[OfflineRun]:
    result_path = tmp_path / "result.json"
    log_path = tmp_path / "driver.log"
    call = f"{str(model_dir)!r}, {str(result_path)!r}, max_tokens={max_tokens!r}"
    # `-c` (no main module file): vLLM's spawned processes do not re-run this test module.
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(_REPO_ROOT)!r})
        if __name__ == "__main__":
            from tests.vllm.test_offline_and_preemption import offline_generate
            offline_generate({call})
        """
    )
    with UpstreamOtlp() as upstream:
        env = {
            **os.environ,
            **traced_server_env(upstream, service_name=_SERVICE_NAME),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        with log_path.open("wb") as log:
            completed = subprocess.run(
                [sys.executable, "-c", script],
                cwd=tmp_path,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=_DRIVER_TIMEOUT_S,
                check=False,
            )
        log_text = log_path.read_text(encoding="utf-8", errors="replace")
        assert completed.returncode == 0, log_text[-6000:]
        result = json.loads(result_path.read_text(encoding="utf-8"))
        per_run = []
        for run in result["runs"]:
            assert run["flushed"], run["agent"]
            per_run.append({request["request_id"]: request for request in run["requests"]})
            assert len(per_run[-1]) == _NUM_PROMPTS
        everything = {request_id for requests in per_run for request_id in requests}
        assert len(everything) == _NUM_PROMPTS * len(max_tokens)  # ids unique across the calls
        assert upstream.wait_for(
            lambda: set(request_trees(upstream)) >= everything, _SPAN_TIMEOUT_S
        ), (sorted(request_trees(upstream)), sorted(everything), log_text[-3000:])
        trees = request_trees(upstream)
    assert set(trees) == everything  # one llm.request per request, no extras
    return [
        OfflineRun(
            requests,
            result["patched"],
            run["agent"],
            {request_id: trees[request_id] for request_id in requests},
            log_text,
        )
        for run, requests in zip(result["runs"], per_run, strict=True)
    ]


def budget_of(tree: RequestTree) -> Budget:
    """The collector's budget of one request, from its exported spans; it partitions E2E."""
    spans = [tree.root, *(span for group in tree.children.values() for span in group)]
    refs = [SpanRef(span, Resource(), InstrumentationScope(), _SERVICE_NAME) for span in spans]
    (timeline,) = normalize(AssembledTrace(trace_id=tree.root.trace_id, spans=refs))
    budget = compute_budget(timeline)
    assert budget.e2e_ns == tree.root.end_time_unix_nano - tree.root.start_time_unix_nano
    assert sum(budget.segments.values()) == budget.e2e_ns
    assert all(value >= 0 for value in budget.segments.values()), budget.segments
    assert not budget.skew_clamped
    return budget


def check_request(tree: RequestTree, theirs: dict[str, Any], *, max_tokens: int) -> None:
    """One request: complete tree, vLLM's token counts and finish reason, no error."""
    assert_consistent_tree(tree)
    attributes = tree.attributes
    assert theirs["output_tokens"] == max_tokens  # ignore_eos: the model ran to the limit
    assert attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == theirs["output_tokens"]
    assert attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == theirs["prompt_tokens"]
    assert attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == [theirs["finish_reason"]]
    assert attributes[semconv.GEN_AI_REQUEST_MODEL] == _SERVED_MODEL_NAME
    assert attributes[semconv.GEN_AI_OPERATION_NAME] == semconv.OPERATION_TEXT_COMPLETION
    assert attributes[semconv.GEN_AI_REQUEST_MAX_TOKENS] == max_tokens
    offsets = attributes_of(tree.child(semconv.SPAN_DECODE))[semconv.DECODE_TOKEN_OFFSETS]
    assert isinstance(offsets, list) and len(offsets) == theirs["output_tokens"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert tree.root.status.code != tree.root.status.STATUS_CODE_ERROR
    assert tree.root.parent_span_id == b""  # offline: no caller's trace context


# Own engine: offline LLM.generate (not the OpenAI server) with a KV cache of a few blocks.
@pytest.fixture(scope="module")
def offline_runs(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[OfflineRun]:
    return run_offline(
        tmp_path_factory.mktemp("vllm-offline"),
        tiny_model_dir,
        max_tokens=[_OFFLINE_MAX_TOKENS, _PREEMPTION_MAX_TOKENS],
    )


@pytest.fixture(scope="module")
def offline_run(offline_runs: list[OfflineRun]) -> OfflineRun:
    return offline_runs[0]


@pytest.fixture(scope="module")
def preemption_run(offline_runs: list[OfflineRun]) -> OfflineRun:
    return offline_runs[1]


def test_offline_generate_traces_every_request(offline_run: OfflineRun) -> None:
    assert offline_run.patched_by_plugin  # through the entry point, in the frontend
    assert offline_run.agent_stats.get("untraced_requests") == 0, offline_run.agent_stats
    assert len(offline_run.trees) == _NUM_PROMPTS  # one llm.request per prompt, no extras
    for request_id, theirs in offline_run.vllm_requests.items():
        tree = offline_run.trees[request_id]
        check_request(tree, theirs, max_tokens=_OFFLINE_MAX_TOKENS)
        # The premise of no preemption here: the request fits in its one KV-cache block.
        assert theirs["prompt_tokens"] + _OFFLINE_MAX_TOKENS <= _BLOCK_SIZE
        assert theirs["num_preemptions"] == 0
        assert semconv.SPAN_PREEMPTED not in tree.children
        # The same EngineCore timestamps as vLLM's RequestStateStats.
        for span_name, start, end in (
            (semconv.SPAN_QUEUE, "queued_ts", "scheduled_ts"),
            (semconv.SPAN_PREFILL, "scheduled_ts", "first_token_ts"),
            (semconv.SPAN_DECODE, "first_token_ts", "last_token_ts"),
        ):
            delta = duration_s(tree.child(span_name)) - (theirs[end] - theirs[start])
            assert abs(delta) < _AGREEMENT_S, (span_name, delta)
        budget = budget_of(tree)
        assert budget.segments[semconv.SEGMENT_PREEMPTED] == 0
        assert budget.segments[semconv.SEGMENT_DECODE] > 0


def test_tiny_kv_cache_preemptions_become_preempted_spans(preemption_run: OfflineRun) -> None:
    preemptions = {
        request_id: theirs["num_preemptions"]
        for request_id, theirs in preemption_run.vllm_requests.items()
    }
    assert sum(preemptions.values()) > 0, "vLLM did not preempt: the KV cache is not tiny enough"
    assert len(preemption_run.trees) == _NUM_PROMPTS
    preempted_ms: list[float] = []
    for request_id, theirs in preemption_run.vllm_requests.items():
        tree = preemption_run.trees[request_id]
        check_request(tree, theirs, max_tokens=_PREEMPTION_MAX_TOKENS)
        # vLLM's queue ends at the first SCHEDULED, whatever the preemptions after it.
        queue_delta = duration_s(tree.child(semconv.SPAN_QUEUE)) - (
            theirs["scheduled_ts"] - theirs["queued_ts"]
        )
        assert abs(queue_delta) < _AGREEMENT_S, queue_delta
        preempted = tree.children.get(semconv.SPAN_PREEMPTED, [])
        # One interval per preemption vLLM counted, each inside its request, in order.
        assert len(preempted) == theirs["num_preemptions"], (request_id, theirs)
        # Each interval lies between the first scheduling and the last token (a preempted
        # request resumes before it generates again), so the budget moves all of it out of
        # prefill/decode into its preempted segment.
        previous_end = tree.child(semconv.SPAN_PREFILL).start_time_unix_nano
        last_token = tree.child(semconv.SPAN_DECODE).end_time_unix_nano
        for span in sorted(preempted, key=lambda span: span.start_time_unix_nano):
            assert span.trace_id == tree.root.trace_id
            assert previous_end <= span.start_time_unix_nano < span.end_time_unix_nano
            assert span.end_time_unix_nano <= last_token
            previous_end = span.end_time_unix_nano
        budget = budget_of(tree)
        preempted_ms.append(budget.segments[semconv.SEGMENT_PREEMPTED] / 1e6)
        if preempted:
            assert budget.segments[semconv.SEGMENT_PREEMPTED] == sum(
                span.end_time_unix_nano - span.start_time_unix_nano for span in preempted
            )
        else:
            assert budget.segments[semconv.SEGMENT_PREEMPTED] == 0

    # For the record (``pytest -s``): how hard the tiny cache pushed.
    print(
        f"\npreemptions per request (vLLM): {sorted(preemptions.values())}; "
        f"preempted segment per request, ms: {[round(ms, 2) for ms in sorted(preempted_ms)]}"
    )
