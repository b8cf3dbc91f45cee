"""The causes a diagnosis can name: stable identifiers, the advice for each, and their labels.

A closed vocabulary that the store's documents, the API, the UI, the window findings and the
per-request verdicts all key on. It is separate from the rules that pick a cause
(``diagnosis.py``) so that adding a cause touches one table here plus one rule there, and so
that readers of stored verdicts (the store, the terminal views) need not import the rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from tokentrace.agent import semconv

CAUSE_QUEUEING: Final = "queueing"
CAUSE_COLD_START: Final = "cold_start"
CAUSE_LONG_PROMPT: Final = "long_prompt"
CAUSE_PREFIX_CACHE_MISS: Final = "prefix_cache_miss"
CAUSE_PREFILL: Final = "prefill"
CAUSE_BANDWIDTH_BOUND_DECODE: Final = "bandwidth_bound_decode"
CAUSE_BATCHING_INTERFERENCE: Final = "batching_interference"
CAUSE_LONG_DECODE: Final = "long_decode"
CAUSE_SLOW_DECODE: Final = "slow_decode"
CAUSE_DECODE_STALL: Final = "decode_stall"
CAUSE_KV_CACHE_PRESSURE: Final = "kv_cache_pressure"
CAUSE_NETWORK: Final = "network"
CAUSE_CONNECTION_SETUP: Final = "connection_setup"
CAUSE_CLIENT_SATURATED: Final = "client_saturated"
CAUSE_HTTP: Final = "http"
CAUSE_POSTPROCESS: Final = "postprocess"
CAUSE_UNATTRIBUTED: Final = "unattributed"
CAUSE_ERROR: Final = "error"
CAUSES: Final = (
    CAUSE_QUEUEING,
    CAUSE_COLD_START,
    CAUSE_LONG_PROMPT,
    CAUSE_PREFIX_CACHE_MISS,
    CAUSE_PREFILL,
    CAUSE_BANDWIDTH_BOUND_DECODE,
    CAUSE_BATCHING_INTERFERENCE,
    CAUSE_LONG_DECODE,
    CAUSE_SLOW_DECODE,
    CAUSE_DECODE_STALL,
    CAUSE_KV_CACHE_PRESSURE,
    CAUSE_NETWORK,
    CAUSE_CONNECTION_SETUP,
    CAUSE_CLIENT_SATURATED,
    CAUSE_HTTP,
    CAUSE_POSTPROCESS,
    CAUSE_UNATTRIBUTED,
    CAUSE_ERROR,
)
"""Every cause a verdict can name (``Verdict.cause``), stable identifiers."""

_FRONTEND_CPU_ADVICE: Final = (
    "When the server's frontend is CPU-bound (many concurrent streams), add API server "
    "processes (vLLM --api-server-count, SGLang --tokenizer-worker-num) or cores."
)
ADVICE: Final[Mapping[str, str]] = {
    CAUSE_QUEUEING: (
        "Add replicas, or raise the batch limit (vLLM max_num_seqs, SGLang "
        "--max-running-requests) if GPU memory allows; "
        "add admission control so queues stay short under bursts."
    ),
    CAUSE_COLD_START: (
        "Keep a warm replica (minimum replicas above zero), pre-load or locally cache the "
        "weights, and scale up earlier, before demand arrives."
    ),
    CAUSE_LONG_PROMPT: (
        "Enable chunked prefill so long prompts do not block others, trim prompts (history, "
        "retrieved context), and enable prefix caching for their shared parts."
    ),
    CAUSE_PREFIX_CACHE_MISS: (
        "Enable prefix caching (vLLM --enable-prefix-caching; SGLang's radix cache is on unless "
        "--disable-radix-cache) and route requests with the same "
        "prefix to the same replica (prefix-aware routing)."
    ),
    CAUSE_PREFILL: (
        "Prefill is compute-bound or contended: enable chunked prefill, limit the tokens "
        "prefilled per step (vLLM max_num_batched_tokens, SGLang --chunked-prefill-size), or "
        "use faster compute."
    ),
    CAUSE_BANDWIDTH_BOUND_DECODE: (
        "Decode is memory-bandwidth-bound: quantise the weights or the KV cache, run larger "
        "batches to amortise weight reads, or use hardware with faster memory."
    ),
    CAUSE_BATCHING_INTERFERENCE: (
        "Prefills stall decode steps: use smaller prefill chunks (max_num_batched_tokens), "
        "disaggregate prefill and decode, or schedule streaming requests with priority."
    ),
    CAUSE_LONG_DECODE: (
        "Many output tokens: cap max_tokens or ask for shorter answers, use speculative "
        "decoding, or faster per-token hardware."
    ),
    CAUSE_SLOW_DECODE: (
        "Each token is slow to compute: use a smaller or quantised model, speculative decoding, "
        "or faster hardware; a smaller batch (max_num_seqs) shortens each step when latency "
        "matters more than throughput."
    ),
    CAUSE_DECODE_STALL: (
        "Tokens stopped coming with no engine step of the request behind them: look for a "
        "starved engine or API server process (CPU share, GIL contention, synchronous work in "
        "the serving loop) and for host-side pauses (swapping, garbage collection)."
    ),
    CAUSE_KV_CACHE_PRESSURE: (
        "Running requests are evicted for lack of KV-cache memory: raise "
        "gpu_memory_utilization, lower max_num_seqs, or shorten max_model_len."
    ),
    CAUSE_NETWORK: (
        "Place clients closer to the servers (or remove a slow proxy or load balancer hop), "
        "reuse connections (keep-alive, HTTP/2), and send smaller payloads."
    ),
    CAUSE_CONNECTION_SETUP: (
        "Reuse connections: keep-alive and a connection pool in the client (one client object "
        "per process, not per request), TLS session resumption, HTTP/2."
    ),
    CAUSE_CLIENT_SATURATED: (
        "The client itself was late to send or to read (its event loop or CPU was busy): run "
        "fewer concurrent requests per client process or give it more cores; in an "
        "application, keep blocking work off the loop that reads the stream."
    ),
    CAUSE_HTTP: (
        "Keep tokenisation and chat templating on a fast path (fast tokenizer, cached "
        "templates) and off the event loop, and send smaller payloads. " + _FRONTEND_CPU_ADVICE
    ),
    CAUSE_POSTPROCESS: (
        "Stream the response, detokenise incrementally, and keep response assembly and "
        "serialisation light. " + _FRONTEND_CPU_ADVICE
    ),
    CAUSE_UNATTRIBUTED: (
        "Instrument the inference server (tokentrace run -- CMD, or vLLM "
        "--otlp-traces-endpoint, SGLang --enable-trace) and propagate W3C traceparent from the "
        "client so server spans join the trace."
    ),
    CAUSE_ERROR: (
        "Look up the error on the request span and in the server logs; a failed request's "
        "latency says little about normal serving."
    ),
}
"""cause -> one line of advice."""

CAUSE_LABELS: Final[Mapping[str, str]] = {
    CAUSE_QUEUEING: "queueing",
    CAUSE_COLD_START: "cold start",
    CAUSE_LONG_PROMPT: "long prompt",
    CAUSE_PREFIX_CACHE_MISS: "prefix-cache miss",
    CAUSE_PREFILL: "prefill",
    CAUSE_BANDWIDTH_BOUND_DECODE: "bandwidth-bound decode",
    CAUSE_BATCHING_INTERFERENCE: "batching interference",
    CAUSE_LONG_DECODE: "long decode",
    CAUSE_SLOW_DECODE: "slow per-token decode",
    CAUSE_DECODE_STALL: "decode stalls",
    CAUSE_KV_CACHE_PRESSURE: "KV-cache pressure",
    CAUSE_NETWORK: "network",
    CAUSE_CONNECTION_SETUP: "connection setup",
    CAUSE_CLIENT_SATURATED: "saturated client",
    CAUSE_HTTP: "HTTP handling",
    CAUSE_POSTPROCESS: "post-processing",
    CAUSE_UNATTRIBUTED: "unattributed (server spans or their phase timings missing)",
    CAUSE_ERROR: "errors",
}
"""How sentences name each cause."""


NETWORK_NOT_MEASURED: Final = (
    "network not measured: no client span (send W3C traceparent from the client, or load with "
    "tokentrace load --otlp-endpoint)"
)
"""What a server-seen TTFT/E2E verdict says about the network it could not see."""

SERVER_WITHOUT_PHASES_ADVICE: Final = (
    "The server span arrived without phase timings: run the server under tokentrace "
    "(tokentrace run -- CMD) for queue, prefill and decode spans, or use a vLLM version whose "
    f"{semconv.VLLM_SPAN_REQUEST} span records {semconv.VLLM_LATENCY_TTFT} and the phase latencies."
)
"""Advice for unattributed time on a server span (not the client-only case ``ADVICE`` covers)."""
