"""Real SGLang with its own tracing (``--enable-trace``) exporting to a real tokentrace collector:
what the collector stores for SGLang's requests, checked against what the client measured.

The server and collector are the session's (`sglang_server`, tests/sglang/shared_server.py).
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.sglang.shared_server import TracedSglang, tokentrace_command
from tests.sglang.streaming import StreamResult, stream_completion
from tests.stored_requests import stored_documents as wait_for_documents
from tokentrace.agent import semconv
from tokentrace.collector.store.document import RequestDocument, budget_segments
from tokentrace.processors.timeline import DIALECT_SGLANG, NOT_REPORTED

pytestmark = pytest.mark.slow

_CONCURRENT = 4
_MAX_TOKENS = 16
_WARM_UP_REQUESTS = 2
_STORED_TIMEOUT_S = 60.0
_CLI_TIMEOUT_S = 60


def stored_documents(traced: TracedSglang, trace_ids: list[str]) -> dict[str, RequestDocument]:
    return wait_for_documents(
        traced.collector.store, trace_ids, timeout_s=_STORED_TIMEOUT_S, context=traced.log_tail
    )


def test_concurrent_streams_are_stored_with_sglangs_budget(sglang_server: TracedSglang) -> None:
    server = sglang_server.server
    with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
        for _ in range(_WARM_UP_REQUESTS):  # the first requests pay one-off costs in the server
            stream_completion(http, model=server.model_name, max_tokens=4)
    with (
        httpx.Client(
            base_url=server.base_url,
            timeout=120.0,
            limits=httpx.Limits(max_connections=_CONCURRENT),
        ) as http,
        ThreadPoolExecutor(_CONCURRENT) as pool,
    ):
        results: list[StreamResult] = list(
            pool.map(
                lambda _: stream_completion(http, model=server.model_name, max_tokens=_MAX_TOKENS),
                range(_CONCURRENT),
            )
        )
    docs = stored_documents(sglang_server, [result.trace_id for result in results])

    for result in results:
        doc = docs[result.trace_id]
        where = f"trace {result.trace_id}"
        assert doc["dialect"] == DIALECT_SGLANG, where
        assert not doc.get("other_span_ids"), f"{where}: one request per SGLang request"
        assert doc["model"] == server.model_name, where
        assert doc["tokens"]["output"] == _MAX_TOKENS, where
        assert result.chunks >= 1, where

        budget = doc["budget"]
        assert sum(budget_segments(budget).values()) == pytest.approx(budget["e2e_ms"], abs=1e-6)
        assert budget[semconv.SEGMENT_UNATTRIBUTED] == 0, where
        assert not doc["skew_clamped"], where
        # The server's E2E is inside the client's (which adds HTTP and the network).
        assert doc["metrics_ms"]["e2e"] <= result.e2e_s * 1e3, where

        # SGLang's own TTFT, hence the stored one, starts when its tokenizer manager takes the
        # request (after the HTTP layer read and parsed it) and ends when the first token reaches
        # the tokenizer manager (before the HTTP stream writes it): the client's TTFT holds it,
        # plus what no SGLang span covers (see test_explain_names_what_sglangs_spans_do_not_report).
        ttft_ms = doc["metrics_ms"]["ttft"]
        client_ttft_ms = result.ttft_s * 1e3
        assert ttft_ms is not None and 0 < ttft_ms <= client_ttft_ms, (
            f"{where}: TTFT {ttft_ms} ms stored, {client_ttft_ms:.3f} ms at the client"
        )
        print(
            f"{where}: TTFT stored {ttft_ms:.3f} ms, client {client_ttft_ms:.3f} ms; "
            f"E2E stored {doc['metrics_ms']['e2e']:.3f} ms, client {result.e2e_s * 1e3:.3f} ms"
        )
        # The token times (decode_loop spans) reach the live pipeline (ITL, TPOT) and the
        # store's re-read of the stored trace (collector/store/row.py ``decode_from_otlp``).
        assert len(doc["token_offsets_us"]) == _MAX_TOKENS, where
        assert doc["token_offsets_dropped"] == 0, where
        assert doc["metrics_ms"]["itl"]["count"] == _MAX_TOKENS - 1, where
        assert doc["verdict"] is not None and doc["verdict"]["cause"], where


def test_explain_names_what_sglangs_spans_do_not_report(sglang_server: TracedSglang) -> None:
    server = sglang_server.server
    with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
        result = stream_completion(http, model=server.model_name, max_tokens=4)
    stored_documents(sglang_server, [result.trace_id])
    store = str(sglang_server.collector.store)

    text = subprocess.run(
        tokentrace_command("explain", result.trace_id, "--store", store),
        capture_output=True,
        text=True,
        timeout=_CLI_TIMEOUT_S,
        check=True,
    ).stdout
    (missing,) = [line for line in text.splitlines() if line.startswith("missing")]
    for piece in NOT_REPORTED[DIALECT_SGLANG]:
        assert piece in missing
    assert "sglang" in missing

    doc = json.loads(
        subprocess.run(
            tokentrace_command("explain", result.trace_id, "--json", "--store", store),
            capture_output=True,
            text=True,
            timeout=_CLI_TIMEOUT_S,
            check=True,
        ).stdout
    )
    assert doc["dialect"] == DIALECT_SGLANG
    assert doc["verdict"]["sentence"] in text
