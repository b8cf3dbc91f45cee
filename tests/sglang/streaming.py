"""A plain streaming client for SGLang's OpenAI-compatible ``/v1/completions``, measuring what the
client sees: time to the first token and to the end of the stream (``time.perf_counter``).

Every request carries a ``traceparent`` with a trace id the caller chose (its parent span is not
exported): SGLang continues that trace, so a test finds its own requests in the collector's store
by trace id.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass

import httpx

_DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog and then"
_DATA_PREFIX = "data: "
_DONE = "[DONE]"


@dataclass(frozen=True)
class StreamResult:
    trace_id: str
    """32 hex digits: the trace SGLang's spans of this request belong to."""
    ttft_s: float
    """Request sent to the first chunk (one chunk per token; a token that completes no
    character, frequent with a random model, comes with empty text)."""
    e2e_s: float
    """Request sent to the end of the stream."""
    chunks: int
    """Chunks with a choice: one per output token in SGLang's stream."""

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def stream_completion(
    http: httpx.Client,
    *,
    model: str,
    max_tokens: int,
    trace_id: str | None = None,
    prompt: str = _DEFAULT_PROMPT,
) -> StreamResult:
    """One streaming completion of exactly ``max_tokens`` tokens (EOS ignored)."""
    trace_id = trace_id or secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    first: float | None = None
    chunks = 0
    sent = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(_DATA_PREFIX):
                continue
            data = line.removeprefix(_DATA_PREFIX)
            if data == _DONE:
                continue
            if json.loads(data).get("choices"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise AssertionError(f"trace {trace_id}: the stream carried no token")
    return StreamResult(trace_id=trace_id, ttft_s=first - sent, e2e_s=end - sent, chunks=chunks)
