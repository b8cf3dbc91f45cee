"""The telemetry contract: every span, attribute and metric name tokentrace emits or reads.

OpenTelemetry GenAI semantic-convention names are used wherever the conventions define one;
everything else lives under ``tokentrace.``. This is the only module that spells these strings:
the agent, the processors and the collector import them from here. ``docs/telemetry.md`` is
generated from this module (``python -m tokentrace.agent.semconv``) and a test keeps it current.

Units: timestamps and durations on spans are integer nanoseconds (as in OTLP) unless the name
says otherwise; metrics are in seconds, as the GenAI conventions require.
"""

from __future__ import annotations

from typing import Final

# --- span names -------------------------------------------------------------------------------
SPAN_REQUEST: Final = "llm.request"
"""The whole server-side life of one generation request: arrival (at the engine client, after
tokenisation; vLLM's ``arrival_time``) to response complete."""
SPAN_QUEUE: Final = "llm.queue"
"""Engine arrival to first scheduled."""
SPAN_PREFILL: Final = "llm.prefill"
"""First scheduled to first output token; with chunked prefill, one child per chunk."""
SPAN_PREFILL_CHUNK: Final = "llm.prefill.chunk"
"""One chunk of a chunked prefill (child of ``llm.prefill``)."""
SPAN_DECODE: Final = "llm.decode"
"""First to last output token; carries the per-token emission offsets."""
SPAN_PREEMPTED: Final = "llm.preempted"
"""One interval during which the request was evicted and waited to resume."""
SPAN_POSTPROCESS: Final = "llm.postprocess"
"""Last output token to response complete."""
SPAN_ENGINE_STEP: Final = "llm.engine.step"
"""One scheduler iteration of the engine."""
SPAN_COLD_START: Final = "llm.cold_start"
"""One per server process: process start to ready to serve."""
SPAN_COLD_START_IMPORT: Final = "llm.cold_start.import"
SPAN_COLD_START_WEIGHT_LOAD: Final = "llm.cold_start.weight_load"
SPAN_COLD_START_KV_CACHE: Final = "llm.cold_start.kv_cache"
SPAN_COLD_START_WARMUP: Final = "llm.cold_start.warmup"
SPAN_CLIENT_REQUEST: Final = "llm.client.request"
"""A load generator's or instrumented client's span around one request."""
REPLAY_SCOPE: Final = "tokentrace.replay"
"""Instrumentation scope of the spans ``tokentrace replay`` sends (simulated traffic)."""

# Other dialects the collector reads.
VLLM_SPAN_REQUEST: Final = "llm_request"
"""vLLM's built-in per-request span (``--otlp-traces-endpoint``, scope ``vllm.tracing.otel``)."""
VLLM_TRACING_SCOPE: Final = "vllm.tracing.otel"
SGLANG_TRACING_SCOPE: Final = "sglang server"
"""Instrumentation scope of SGLang's built-in tracing (``--enable-trace``, SGLang 0.5)."""
SGLANG_SPAN_REQUEST_MARK: Final = " Req "
"""In the name of SGLang's per-request root span, ``"<role> Req <first 8 of the request id>"``
(role empty unless prefill/decode are disaggregated, hence the usual leading space)."""
SGLANG_SPAN_REQUEST_PROCESS: Final = "request_process"
"""SGLang: the scheduler taking the request in (its start: engine arrival)."""
SGLANG_SPAN_PREFILL_WAITING: Final = "prefill_waiting"
"""SGLang: the request waiting in the scheduler's queue for its prefill."""
SGLANG_SPAN_PREFILL_FORWARD: Final = "prefill_forward"
"""SGLang: the prefill (its start: first scheduled; its end: the first token, scheduler-side)."""
SGLANG_SPAN_DECODE_FORWARD: Final = "decode_forward"
"""SGLang: the decode phase; parent of the ``decode_loop`` spans."""
SGLANG_SPAN_DECODE_LOOP: Final = "decode_loop"
"""SGLang: one decode step of the request; its end is one output token (after the first)."""

# --- OpenTelemetry resource / general attributes ------------------------------------------------
SERVICE_NAME: Final = "service.name"
SERVICE_INSTANCE_ID: Final = "service.instance.id"
PROCESS_PID: Final = "process.pid"
HOST_NAME: Final = "host.name"
K8S_NODE_NAME: Final = "k8s.node.name"
K8S_POD_NAME: Final = "k8s.pod.name"
K8S_NAMESPACE_NAME: Final = "k8s.namespace.name"
HTTP_REQUEST_METHOD: Final = "http.request.method"
HTTP_RESPONSE_STATUS_CODE: Final = "http.response.status_code"
URL_PATH: Final = "url.path"
HTTP_ROUTE: Final = "http.route"
ERROR_TYPE: Final = "error.type"

# --- GenAI semantic conventions -----------------------------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_SYSTEM: Final = "gen_ai.system"
"""Deprecated predecessor of ``gen_ai.provider.name``; still read."""
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"

# Operation names (values of gen_ai.operation.name).
OPERATION_CHAT: Final = "chat"
OPERATION_TEXT_COMPLETION: Final = "text_completion"
OPERATION_GENERATE_CONTENT: Final = "generate_content"

# vLLM's built-in tracing (older GenAI names, all latencies in seconds).
VLLM_LATENCY_TTFT: Final = "gen_ai.latency.time_to_first_token"
VLLM_LATENCY_E2E: Final = "gen_ai.latency.e2e"
VLLM_LATENCY_QUEUE: Final = "gen_ai.latency.time_in_queue"
VLLM_LATENCY_PREFILL: Final = "gen_ai.latency.time_in_model_prefill"
VLLM_LATENCY_DECODE: Final = "gen_ai.latency.time_in_model_decode"
VLLM_LATENCY_INFERENCE: Final = "gen_ai.latency.time_in_model_inference"
VLLM_USAGE_PROMPT_TOKENS: Final = "gen_ai.usage.prompt_tokens"
VLLM_USAGE_COMPLETION_TOKENS: Final = "gen_ai.usage.completion_tokens"
VLLM_REQUEST_ID: Final = "gen_ai.request.id"
VLLM_REQUEST_N: Final = "gen_ai.request.n"
# SGLang's root span carries the same older names (latencies in seconds, counts as strings),
# and one of its own:
SGLANG_USAGE_CACHED_TOKENS: Final = "gen_ai.usage.cached_tokens"
"""SGLang: prompt tokens served from its prefix cache (a string holding the count)."""

# --- tokentrace attributes set by the agent -------------------------------------------------------
REQUEST_ID: Final = "tokentrace.request.id"
"""The serving engine's own id for the request."""
COLD_START_READY_TIME: Final = "tokentrace.cold_start.ready_time"
"""Unix ns at which the server became ready; set on requests that arrived before it."""
QUEUE_REQUESTS_AHEAD: Final = "tokentrace.queue.requests_ahead"
"""Requests waiting ahead of this one when it arrived."""
QUEUE_RUNNING_AT_ARRIVAL: Final = "tokentrace.queue.running"
"""Requests running when this one arrived."""
QUEUE_MAX_RUNNING: Final = "tokentrace.queue.max_running"
"""The engine's admission limit (e.g. vLLM ``max_num_seqs``): the batch is full at this count."""
PROMPT_PREFIX_HASH: Final = "tokentrace.prompt.prefix_hash"
"""A hash of the prompt's first tokens (never the text): repeated prefixes are detectable."""
NOT_REPORTED: Final = "tokentrace.not_reported"
"""On ``llm.request``: what the engine's instrumentation cannot measure (string array, e.g.
``engine steps``), so the request's budget lacks it; explain and the API name it."""
NOT_REPORTED_BY: Final = "tokentrace.not_reported_by"
"""On ``llm.request``, beside ``tokentrace.not_reported``: whose instrumentation it is (e.g.
``llama-cpp-python's server``)."""
PREFILL_CHUNK_TOKENS: Final = "tokentrace.prefill.tokens"
"""Prompt tokens computed in a prefill span or chunk."""
DECODE_TOKEN_OFFSETS: Final = "tokentrace.decode.token_offsets_us"
"""Integer array: each output token's emission time in µs after the first output token."""
DECODE_TOKEN_OFFSETS_DROPPED: Final = "tokentrace.decode.token_offsets_dropped"
"""How many token offsets the cap left out (absent or 0 when all were recorded)."""
DECODE_OUTLIER_STEPS_WITH_PREFILL: Final = "tokentrace.decode.outlier_steps_with_prefill"
"""Inter-token outliers whose engine step also scheduled a prefill of another request."""
CLIENT_FIRST_TOKEN_TIME: Final = "tokentrace.client.first_token_time"
"""Unix ns at which the client received the first output token."""
CLIENT_FIRST_BYTE_TIME: Final = "tokentrace.client.first_byte_time"
"""Unix ns at which the client read the first byte of the response (its status line)."""
CLIENT_STREAM: Final = "tokentrace.client.stream"
"""Boolean: the client asked for a streamed response (a non-streamed one shows nothing until
it is complete, so its user-visible first token is its E2E)."""
CLIENT_CONNECTION_REUSED: Final = "tokentrace.client.connection_reused"
"""Boolean: the request went over a kept-alive connection (false: the client opened one)."""
CLIENT_CONNECT_NS: Final = "tokentrace.client.connect_ns"
"""Connection setup of a new connection (name resolution, TCP handshake, TLS), ns; absent when
the request reused a kept-alive connection."""
CLIENT_SEND_WAIT_NS: Final = "tokentrace.client.send_wait_ns"
"""The client's own delay before the request's bytes were written, connection setup excluded
(pool wait, a busy client event loop, a first attempt on a stale connection), ns."""
CLIENT_FIRST_TOKEN_READ_WAIT_NS: Final = "tokentrace.client.first_token_read_wait_ns"
"""How late the client read its first token, ns: the larger of how long the bytes had waited in
its kernel (TCP_INFO ``tcpi_last_data_recv`` at that read) and how long its event loop stalled
since the request was sent (a saturated or starved client reads late)."""
CLIENT_READ_WAIT_NS: Final = "tokentrace.client.read_wait_ns"
"""The same at the read that completed the response, ns."""
CLIENT_RTT_NS: Final = "tokentrace.client.rtt_ns"
"""The kernel's smoothed round-trip time of the client's connection (TCP_INFO ``tcpi_rtt``),
ns: the first hop only (a proxy or load balancer in between is not in it)."""
OPENLLMETRY_IS_STREAMING: Final = "llm.is_streaming"
"""OpenLLMetry's streaming flag on its client spans (read like ``CLIENT_STREAM``)."""
HTTP_RECEIVE_WAIT_NS: Final = "tokentrace.http.receive_wait_ns"
"""On the HTTP server span: how long the request's bytes had waited in the server's kernel
before the app started (TCP_INFO ``tcpi_last_data_recv`` at app start, millisecond
resolution), ns: the accept queue and a busy event loop, which happen before the span starts."""
HTTP_FIRST_BODY_TIME: Final = "tokentrace.http.first_body_time"
"""On the HTTP server span: Unix ns at which the app handed the response's first body bytes to
the server (for a stream, the first token's delivery)."""
PROXY_ENGINE: Final = "tokentrace.proxy.engine"
"""On ``tokentrace proxy``'s HTTP server span: whose timing report the proxy folded into the
request's spans (``llama-server``, ``tgi``, ``ollama``, or ``openai``: only what the stream
shows)."""
PROXY_NOT_REPORTED: Final = "tokentrace.proxy.not_reported"
"""On ``tokentrace proxy``'s HTTP server span: what the engine's report cannot tell (string
array), so the request's budget lacks it; docs/proxy.md has the same table."""
ENGINE_STEP_BATCH_SIZE: Final = "tokentrace.step.batch_size"
ENGINE_STEP_PREFILL_REQUESTS: Final = "tokentrace.step.prefill_requests"
ENGINE_STEP_DECODE_REQUESTS: Final = "tokentrace.step.decode_requests"
ENGINE_STEP_PREFILL_TOKENS: Final = "tokentrace.step.prefill_tokens"
ENGINE_STEP_DECODE_TOKENS: Final = "tokentrace.step.decode_tokens"
ENGINE_STEP_KV_CACHE_USAGE: Final = "tokentrace.step.kv_cache_usage"
ENGINE_STEP_WAITING: Final = "tokentrace.step.waiting"
ENGINE_STEP_RUNNING: Final = "tokentrace.step.running"
ENGINE_STEP_REQUEST_IDS: Final = "tokentrace.step.request_ids"

# GPU aggregates over a span's window (set by the node agent).
GPU_UTILIZATION_MEAN: Final = "tokentrace.gpu.utilization.mean"
"""Mean share of time (0..1) a kernel ran on the span's GPUs over its window (NVML)."""
GPU_UTILIZATION_MAX: Final = "tokentrace.gpu.utilization.max"
"""Highest GPU utilisation sample (0..1) over the window."""
GPU_MEMORY_BANDWIDTH_GBPS: Final = "tokentrace.gpu.memory_bandwidth.gbps"
"""Mean DRAM bandwidth over the window in GB/s (10^9 bytes/s), summed over the span's GPUs."""
GPU_MEMORY_BANDWIDTH_PEAK_RATIO: Final = "tokentrace.gpu.memory_bandwidth.peak_ratio"
"""Mean memory bandwidth over the window as a fraction of the GPU's peak (0..1)."""
GPU_MEMORY_USED_BYTES: Final = "tokentrace.gpu.memory.used_bytes"
"""Mean GPU memory in use over the window (summed over the span's GPUs)."""
GPU_POWER_WATTS: Final = "tokentrace.gpu.power.watts"
"""Mean power draw over the window (summed over the span's GPUs)."""
GPU_MEMORY_CONTROLLER_UTILIZATION_MEAN: Final = "tokentrace.gpu.memory_controller.utilization.mean"
"""Mean share of time (0..1) the memory controller was busy (NVML's memory utilisation)."""
GPU_MEMORY_BANDWIDTH_PEAK_GBPS: Final = "tokentrace.gpu.memory_bandwidth.peak_gbps"
"""The span's GPUs' peak DRAM bandwidth (bus width x max memory clock x 2), summed."""
GPU_MEMORY_BANDWIDTH_SOURCE: Final = "tokentrace.gpu.memory_bandwidth.source"
"""Where bandwidth came from: ``gpm`` (DRAM bandwidth, Hopper+) or ``memory_controller``
(busy-time share x peak: an upper-bound estimate on older GPUs)."""
GPU_SM_CLOCK_MHZ: Final = "tokentrace.gpu.sm_clock.mhz"
"""Mean SM clock over the window."""
GPU_MEMORY_CLOCK_MHZ: Final = "tokentrace.gpu.memory_clock.mhz"
"""Mean memory clock over the window."""
GPU_SAMPLES: Final = "tokentrace.gpu.samples"
"""GPU samples inside the span's window, over all its GPUs. 0: the window fell between two
samples and the aggregates are the next sample's, which covers it."""
GPU_UUIDS: Final = "tokentrace.gpu.uuids"
"""Resource attribute, string array: the GPUs a process uses (set by the in-process agent from
the visible devices, or by the node agent from NVML's process list)."""
MODEL_WEIGHT_BYTES: Final = "tokentrace.model.weight_bytes"
"""Bytes of model weights one engine reads per decode step (on ``llm.cold_start.weight_load``)."""
DECODE_ROOFLINE_RATIO: Final = "tokentrace.decode.roofline_ratio"
"""Ideal time per output token (weight bytes / peak bandwidth) over the measured one (0..1):
1 means decode ran at the memory-bandwidth limit."""
NODE_AGENT_SCOPE: Final = "tokentrace.node_agent"
"""Instrumentation scope of the GPU metrics the node agent exports."""
MEMORY_BANDWIDTH_SOURCE_GPM: Final = "gpm"
MEMORY_BANDWIDTH_SOURCE_MEMORY_CONTROLLER: Final = "memory_controller"

# GPU metrics of the node agent: OpenTelemetry hardware semantic conventions where they define a
# name (``hw.*``, attribute ``hw.id`` = GPU UUID, ``hw.type`` = gpu), ``tokentrace.gpu.*`` else.
HW_ID: Final = "hw.id"
HW_NAME: Final = "hw.name"
HW_TYPE: Final = "hw.type"
HW_VENDOR: Final = "hw.vendor"
HW_GPU_TASK: Final = "hw.gpu.task"
NETWORK_IO_DIRECTION: Final = "network.io.direction"
HW_TYPE_GPU: Final = "gpu"
HW_VENDOR_NVIDIA: Final = "NVIDIA"
HW_GPU_TASK_GENERAL: Final = "general"
NETWORK_IO_DIRECTION_TRANSMIT: Final = "transmit"
NETWORK_IO_DIRECTION_RECEIVE: Final = "receive"
METRIC_HW_GPU_UTILIZATION: Final = "hw.gpu.utilization"
METRIC_HW_GPU_MEMORY_UTILIZATION: Final = "hw.gpu.memory.utilization"
"""Fraction of GPU memory in use (used / limit), per the conventions."""
METRIC_HW_GPU_MEMORY_USAGE: Final = "hw.gpu.memory.usage"
METRIC_HW_GPU_MEMORY_LIMIT: Final = "hw.gpu.memory.limit"
METRIC_HW_GPU_IO: Final = "hw.gpu.io"
METRIC_HW_POWER: Final = "hw.power"
METRIC_GPU_MEMORY_CONTROLLER_UTILIZATION: Final = "tokentrace.gpu.memory_controller.utilization"
METRIC_GPU_MEMORY_BANDWIDTH: Final = "tokentrace.gpu.memory_bandwidth"
METRIC_GPU_MEMORY_BANDWIDTH_PEAK_RATIO: Final = "tokentrace.gpu.memory_bandwidth.peak_ratio"
METRIC_GPU_SM_CLOCK: Final = "tokentrace.gpu.sm_clock"
METRIC_GPU_MEMORY_CLOCK: Final = "tokentrace.gpu.memory_clock"
METRIC_GPU_TEMPERATURE: Final = "tokentrace.gpu.temperature"
METRIC_GPU_PROCESS_MEMORY_USAGE: Final = "tokentrace.gpu.process.memory.usage"
METRIC_GPU_PROCESS_UTILIZATION: Final = "tokentrace.gpu.process.utilization"

# --- tokentrace attributes added by the collector (enrichment) ------------------------------------
BUDGET_PREFIX: Final = "tokentrace.budget."
"""``tokentrace.budget.<segment>_ns``: the request's E2E budget, integer ns per segment."""
TTFT_BUDGET_PREFIX: Final = "tokentrace.ttft_budget."
"""``tokentrace.ttft_budget.<segment>_ns``: the budget of the time to first token."""
TTFT_NS: Final = "tokentrace.ttft_ns"
TPOT_NS: Final = "tokentrace.tpot_ns"
E2E_NS: Final = "tokentrace.e2e_ns"
PROMPT_BUCKET: Final = "tokentrace.prompt.bucket"
DIAGNOSIS_SEGMENT: Final = "tokentrace.diagnosis.segment"
DIAGNOSIS_CAUSE: Final = "tokentrace.diagnosis.cause"
DIAGNOSIS_VERDICT: Final = "tokentrace.diagnosis.verdict"
DIAGNOSIS_ADVICE: Final = "tokentrace.diagnosis.advice"
DIAGNOSIS_METRIC: Final = "tokentrace.diagnosis.metric"
"""The latency metric the verdict answers: that of the first SLO target the request breached,
else ``e2e``."""
SLO_MET: Final = "tokentrace.slo.met"
"""String array: names of the targets this request met."""
SLO_BREACHED: Final = "tokentrace.slo.breached"
"""String array: names of the targets this request breached."""

# --- budget segments (one partition of E2E, in time order) ---------------------------------------
SEGMENT_CLIENT: Final = "client"
"""The client's own time: waiting to send, and reading bytes that had already arrived."""
SEGMENT_CONNECT: Final = "connect"
"""Connection setup of a new connection (TCP handshake, TLS), as the client measured it."""
SEGMENT_NETWORK: Final = "network"
SEGMENT_HTTP: Final = "http"
SEGMENT_COLD_START: Final = "cold_start"
SEGMENT_QUEUE: Final = "queue"
SEGMENT_PREFILL: Final = "prefill"
SEGMENT_PREEMPTED: Final = "preempted"
SEGMENT_DECODE: Final = "decode"
SEGMENT_POSTPROCESS: Final = "postprocess"
SEGMENT_UNATTRIBUTED: Final = "unattributed"
"""Time a client observed that no server span explains (a client-only trace)."""
SEGMENTS: Final = (
    SEGMENT_CLIENT,
    SEGMENT_CONNECT,
    SEGMENT_NETWORK,
    SEGMENT_HTTP,
    SEGMENT_COLD_START,
    SEGMENT_QUEUE,
    SEGMENT_PREFILL,
    SEGMENT_PREEMPTED,
    SEGMENT_DECODE,
    SEGMENT_POSTPROCESS,
    SEGMENT_UNATTRIBUTED,
)
CLIENT_SIDE_SEGMENTS: Final = (SEGMENT_CLIENT, SEGMENT_CONNECT, SEGMENT_NETWORK)
"""The segments only a client span can show; a server-seen budget has none of them."""
SEGMENT_INTERFERENCE: Final = "interference"
"""TPOT/ITL budgets: the excess of inter-token gaps whose engine steps also prefilled other
requests (a co-scheduled prefill stalled the batch)."""
SEGMENT_STALL: Final = "stall"
"""TPOT/ITL budgets: the excess of inter-token gaps that no slow step of the request explains
(the request was not stepped: the engine or its frontend stalled)."""
DECODE_SEGMENTS: Final = (SEGMENT_DECODE, SEGMENT_INTERFERENCE, SEGMENT_STALL)
"""How the TPOT/ITL budgets split the E2E budget's ``decode``: the request's own steps at its
usual pace, and the excess of its outlier gaps by what the engine steps say caused it."""
METRIC_BUDGET_SEGMENTS: Final = tuple(
    part
    for segment in SEGMENTS
    for part in (DECODE_SEGMENTS if segment == SEGMENT_DECODE else (segment,))
)
"""Every segment a metric budget can hold, in time order: ``SEGMENTS`` with decode followed by
the rest of its split."""


def budget_attribute(segment: str) -> str:
    """The enrichment attribute carrying one E2E budget segment in ns."""
    return f"{BUDGET_PREFIX}{segment}_ns"


def ttft_budget_attribute(segment: str) -> str:
    """The enrichment attribute carrying one TTFT budget segment in ns."""
    return f"{TTFT_BUDGET_PREFIX}{segment}_ns"


# --- latency metrics (per request, what the sketches and SLOs are over) ---------------------------
METRIC_TTFT: Final = "ttft"
METRIC_TPOT: Final = "tpot"
METRIC_ITL: Final = "itl"
METRIC_E2E: Final = "e2e"
METRIC_QUEUE: Final = "queue"
METRIC_PREFILL: Final = "prefill"
METRIC_DECODE: Final = "decode"
METRIC_NETWORK: Final = "network"
LATENCY_METRICS: Final = (
    METRIC_TTFT,
    METRIC_TPOT,
    METRIC_ITL,
    METRIC_E2E,
    METRIC_QUEUE,
    METRIC_PREFILL,
    METRIC_DECODE,
    METRIC_NETWORK,
)
METRIC_LABELS: Final = {
    METRIC_TTFT: "TTFT",
    METRIC_TPOT: "TPOT",
    METRIC_ITL: "ITL",
    METRIC_E2E: "E2E",
    METRIC_QUEUE: "queue",
    METRIC_PREFILL: "prefill",
    METRIC_DECODE: "decode",
    METRIC_NETWORK: "network",
}
"""How every view (load, explain, diagnose, compare, the API) names each latency metric."""
VERDICT_METRICS: Final = (METRIC_TTFT, METRIC_TPOT, METRIC_ITL, METRIC_E2E)
"""The metrics a verdict can answer about (an SLO target's metric), in the order views list
them."""
CLOCK_CLIENT: Final = "client"
"""A metric as the client saw it (what the user saw, the time outside the server included)."""
CLOCK_SERVER: Final = "server"
"""A metric as the server saw it (what the SLO targets judge)."""

# OTLP metric names (exponential histograms, unit seconds). GenAI names where they exist.
OTLP_METRIC_NAMES: Final = {
    METRIC_TTFT: "gen_ai.server.time_to_first_token",
    METRIC_TPOT: "gen_ai.server.time_per_output_token",
    METRIC_E2E: "gen_ai.server.request.duration",
    METRIC_ITL: "tokentrace.server.inter_token_latency",
    METRIC_QUEUE: "tokentrace.server.queue.duration",
    METRIC_PREFILL: "tokentrace.server.prefill.duration",
    METRIC_DECODE: "tokentrace.server.decode.duration",
    METRIC_NETWORK: "tokentrace.network.duration",
}
METRIC_UNIT_SECONDS: Final = "s"
METRIC_UNIT_BYTES: Final = "By"
"""Unit of the self-telemetry gauges counted in bytes (the spool's size)."""

# Metric data-point attributes (the percentile key).
METRIC_ATTR_SERVICE: Final = SERVICE_NAME
METRIC_ATTR_MODEL: Final = GEN_AI_REQUEST_MODEL
METRIC_ATTR_OPERATION: Final = GEN_AI_OPERATION_NAME
METRIC_ATTR_PROMPT_BUCKET: Final = PROMPT_BUCKET

# Instrumentation scope of what the collector itself emits.
COLLECTOR_SCOPE: Final = "tokentrace.collector"

# --- the collector's self-telemetry -------------------------------------------------------------
# Every component of a collector reports what it did to one registry, exported as OTLP metrics
# (cumulative monotonic sums for counters, gauges, explicit-bucket histograms) with the
# component's id and kind as attributes. Counts have unit ``1``.
SELF_METRIC_PREFIX: Final = "tokentrace.collector."
"""Prefix of every self-telemetry metric name."""
SELF_ATTR_COMPONENT_ID: Final = "tokentrace.collector.component.id"
"""The component's id as the configuration names it: ``otlp``, ``store``, ``otlp/tempo``,
``diagnosis/strict``; ``traces`` for the pipeline itself."""
SELF_ATTR_COMPONENT_KIND: Final = "tokentrace.collector.component.kind"
"""``receiver``, ``processor``, ``exporter``, ``extension`` or ``pipeline``."""
SELF_ATTR_TRANSPORT: Final = "tokentrace.collector.transport"
"""Receivers: the protocol the data came over (``grpc`` or ``http``)."""
SELF_ATTR_SIGNAL: Final = "tokentrace.collector.signal"
"""OTLP exporters: what the series is about (``traces`` or ``metrics``)."""
SELF_METRIC_RECEIVED_SPANS: Final = "tokentrace.collector.received_spans"
"""Assembly: spans accepted for assembly."""
SELF_METRIC_PENDING_SPANS: Final = "tokentrace.collector.pending_spans"
"""Assembly, gauge: spans waiting for their trace to finish."""
SELF_METRIC_PENDING_TRACES: Final = "tokentrace.collector.pending_traces"
"""Assembly, gauge: traces being assembled."""
SELF_METRIC_TRACES_FINISHED_EARLY: Final = "tokentrace.collector.traces_finished_early"
"""Assembly: traces finished before complete because ``max_traces`` was reached."""
SELF_METRIC_SPANS_DROPPED_TRACE_FULL: Final = "tokentrace.collector.spans_dropped_trace_full"
"""Assembly: spans dropped because their trace held ``max_spans_per_trace``."""
SELF_METRIC_LATE_SPANS: Final = "tokentrace.collector.late_spans"
"""Assembly: spans that came after their trace was finished (assembled as a fragment)."""
SELF_METRIC_REFUSED_BATCHES: Final = "tokentrace.collector.refused_batches"
"""Assembly: batches refused at ``max_pending_spans`` (the senders were told to retry)."""
SELF_METRIC_TRACES: Final = "tokentrace.collector.traces"
"""Pipeline: traces processed (a late fragment counts as one)."""
SELF_METRIC_REQUESTS: Final = "tokentrace.collector.requests"
"""Pipeline: requests derived, each once (deriving a stored one again does not count)."""
SELF_METRIC_LATE_TRACES_REDERIVED: Final = "tokentrace.collector.late_traces_rederived"
"""Pipeline: late fragments derived again with their trace's stored spans."""
SELF_METRIC_LATE_TRACES_UNMATCHED: Final = "tokentrace.collector.late_traces_unmatched"
"""Pipeline: late fragments processed alone (no stored spans of their trace were found)."""
SELF_METRIC_PROCESSOR_ERRORS: Final = "tokentrace.collector.processor_errors"
"""Pipeline: requests a processor (or the normalize, budget, enrich stages) failed on; the
component id names it."""
SELF_METRIC_EXPORTER_ERRORS: Final = "tokentrace.collector.exporter_errors"
"""Pipeline: batches an exporter failed on; the component id names it."""
SELF_METRIC_BATCH_DURATION: Final = "tokentrace.collector.batch_duration"
"""Pipeline, histogram (s): processing one batch of finished traces and handing it to the
exporters."""
SELF_METRIC_SPOOL_BYTES: Final = "tokentrace.collector.spool_bytes"
"""Pipeline, gauge (By): bytes in the write-ahead spool's segment files (durability ``fsync``)."""
SELF_METRIC_SPOOL_SEGMENTS: Final = "tokentrace.collector.spool_segments"
"""Pipeline, gauge: segment files of the write-ahead spool."""
SELF_METRIC_SPOOL_FSYNC_DURATION: Final = "tokentrace.collector.spool_fsync_duration"
"""Pipeline, histogram (s): one group commit's fsync (every export it covers waited for it)."""
SELF_METRIC_SPOOL_REFUSED_REQUESTS: Final = "tokentrace.collector.spool_refused_requests"
"""Pipeline: exports refused because the spool held ``durability.max_bytes`` (the sender was
told to retry)."""
SELF_METRIC_SPOOL_REPLAYED_REQUESTS: Final = "tokentrace.collector.spool_replayed_requests"
"""Pipeline: spooled export requests replayed into assembly at start (after a crash)."""
SELF_METRIC_SPOOL_REPLAYED_TRACES_STORED: Final = (
    "tokentrace.collector.spool_replayed_traces_stored"
)
"""Pipeline: replayed traces whose spans the store already held (not processed again)."""
SELF_METRIC_SPOOL_TORN_RECORDS: Final = "tokentrace.collector.spool_torn_records"
"""Pipeline: spool records ignored at replay (cut short or failing their CRC)."""
SELF_METRIC_MEMORY_RESIDENT: Final = "tokentrace.collector.memory_resident"
"""Memory limiter, gauge (By): the collector's resident set size at the last reading."""
SELF_METRIC_MEMORY_LIMIT: Final = "tokentrace.collector.memory_limit"
"""Memory limiter, gauge (By): the hard limit (the soft limit is ``spike_limit_mib`` below)."""
SELF_METRIC_MEMORY_REFUSED_REQUESTS: Final = "tokentrace.collector.memory_refused_requests"
"""Memory limiter: exports refused near the limit (the sender was told to retry)."""
SELF_METRIC_MEMORY_GARBAGE_COLLECTIONS: Final = "tokentrace.collector.memory_garbage_collections"
"""Memory limiter: garbage collections forced above the hard limit."""
SELF_METRIC_PERCENTILE_KEYS_EVICTED: Final = "tokentrace.collector.percentile_keys_evicted"
"""Percentiles: keys evicted at ``max_keys``."""
SELF_METRIC_PERCENTILE_SLICES_DROPPED: Final = "tokentrace.collector.percentile_slices_dropped"
"""Percentiles: closed slices dropped before an exporter took them."""
SELF_METRIC_PERCENTILE_RECORD_ERRORS: Final = "tokentrace.collector.percentile_record_errors"
"""Percentiles: requests whose latencies could not be recorded."""
SELF_METRIC_SAMPLING_KEPT_ALWAYS: Final = "tokentrace.collector.sampling_kept_always"
"""Tail sampling: traces kept whatever the rules (no request in them, or a late fragment
replacing stored rows)."""
SELF_METRIC_SAMPLING_KEPT_BREACH: Final = "tokentrace.collector.sampling_kept_breach"
"""Tail sampling: traces kept because a request breached an SLO target or failed."""
SELF_METRIC_SAMPLING_KEPT_SLOWEST: Final = "tokentrace.collector.sampling_kept_slowest"
"""Tail sampling: traces kept because a request was among the slowest of its window and key."""
SELF_METRIC_SAMPLING_KEPT_RARE: Final = "tokentrace.collector.sampling_kept_rare"
"""Tail sampling: traces kept because a request's verdict cause was rare in its window and key."""
SELF_METRIC_SAMPLING_KEPT_RANDOM: Final = "tokentrace.collector.sampling_kept_random"
"""Tail sampling: traces kept by the trace-id hash (``random_share``)."""
SELF_METRIC_SAMPLING_DROPPED_RANDOM: Final = "tokentrace.collector.sampling_dropped_random"
"""Tail sampling: traces dropped (not exported, not stored): no keep rule held and the trace-id
hash fell outside ``random_share``."""
SELF_METRIC_SAMPLING_KEYS_EVICTED: Final = "tokentrace.collector.sampling_keys_evicted"
"""Tail sampling: keys whose window statistics were evicted at ``max_keys``."""
SELF_METRIC_ACCEPTED_SPANS: Final = "tokentrace.collector.accepted_spans"
"""Receivers: spans handed to the pipeline and taken by it."""
SELF_METRIC_REJECTED_SPANS: Final = "tokentrace.collector.rejected_spans"
"""Receivers: invalid spans dropped (answered as a partial success); OTLP exporters: spans the
upstream refused in a partial success."""
SELF_METRIC_REFUSED_REQUESTS: Final = "tokentrace.collector.refused_requests"
"""Receivers: exports the pipeline refused (overloaded or shutting down); the sender retries."""
SELF_METRIC_FAILED_REQUESTS: Final = "tokentrace.collector.failed_requests"
"""Receivers: exports that failed unexpectedly (gRPC INTERNAL, HTTP 500)."""
SELF_METRIC_MALFORMED_REQUESTS: Final = "tokentrace.collector.malformed_requests"
"""Receivers: undecodable or over-limit exports (HTTP 4xx)."""
SELF_METRIC_UNAUTHENTICATED_REQUESTS: Final = "tokentrace.collector.unauthenticated_requests"
"""Receivers: exports without the right bearer token."""
SELF_METRIC_REFUSED_CONNECTIONS: Final = "tokentrace.collector.refused_connections"
"""HTTP receiver: connections closed at once at ``max_connections``."""
SELF_METRIC_WRITTEN_REQUESTS: Final = "tokentrace.collector.written_requests"
"""Store exporter: requests written."""
SELF_METRIC_REJECTED_RECORDS: Final = "tokentrace.collector.rejected_records"
"""Store exporter: requests the store left out (malformed records, and quarantined ones)."""
SELF_METRIC_QUARANTINED_RECORDS: Final = "tokentrace.collector.quarantined_records"
"""Store exporter: requests dropped because their trace could not be stored even alone (a write
that raised for it, retried alone once); also counted in ``rejected_records``."""
SELF_METRIC_DUPLICATE_SPANS: Final = "tokentrace.collector.duplicate_spans"
"""Pipeline: spans left out because the trace already held a span with their id (a sender's
retry of an export whose OK it never got, e.g. across a collector crash whose spool replayed it
too)."""
SELF_METRIC_RETRIED_BATCHES: Final = "tokentrace.collector.retried_batches"
"""Pipeline: batch exports retried after an exporter failed on them (the store's database
refused a write, say); held, with their spool records, until they go through."""
SELF_METRIC_FAILED_BATCHES: Final = "tokentrace.collector.failed_batches"
"""Store exporter: batch writes that stored nothing (each attempt: a batch the database refused
is held by the pipeline and written again, ``retried_batches``)."""
SELF_METRIC_CHECKPOINTS: Final = "tokentrace.collector.checkpoints"
"""Store exporter: WAL checkpoints run."""
SELF_METRIC_FAILED_CHECKPOINTS: Final = "tokentrace.collector.failed_checkpoints"
"""Store exporter: WAL checkpoints that failed."""
SELF_METRIC_REPLACED_TRACES: Final = "tokentrace.collector.replaced_traces"
"""Store exporter: trace writes whose spans replaced the stored ones (per-trace size cap)."""
SELF_METRIC_PRUNED_REQUESTS: Final = "tokentrace.collector.pruned_requests"
"""Store exporter: requests pruned by retention or ``max_requests``."""
SELF_METRIC_SENT_SPANS: Final = "tokentrace.collector.sent_spans"
"""OTLP exporters: spans the upstream accepted."""
SELF_METRIC_DROPPED_SPANS: Final = "tokentrace.collector.dropped_spans"
"""OTLP exporters: spans given up (queue full, retries exhausted, shutting down)."""
SELF_METRIC_SENT_DATA_POINTS: Final = "tokentrace.collector.sent_data_points"
"""OTLP exporters: metric data points the upstream accepted."""
SELF_METRIC_DROPPED_DATA_POINTS: Final = "tokentrace.collector.dropped_data_points"
"""OTLP exporters: metric data points given up."""
SELF_METRIC_REJECTED_DATA_POINTS: Final = "tokentrace.collector.rejected_data_points"
"""OTLP exporters: metric data points the upstream refused in a partial success."""
SELF_METRIC_RETRIES: Final = "tokentrace.collector.retries"
"""OTLP exporters: export attempts retried."""
SELF_METRIC_QUEUE_LEN: Final = "tokentrace.collector.queue_len"
"""OTLP exporters, gauge: items waiting to be sent."""
SELF_METRIC_EXPORT_DURATION: Final = "tokentrace.collector.export_duration"
"""Exporters, histogram (s): handing one batch to an exporter (the store: its write
transaction; an OTLP exporter: queueing the spans); the component id names the exporter."""

# --- Prometheus /metrics (the admin endpoint of the collector and the node agent) ----------------
# Served by ``prometheus-client`` from a registry of each process's own, never the global one.
# Names follow Prometheus conventions: base units in the name (``_seconds``, ``_bytes``,
# ``_ratio``, ``_hertz``, ``_watts``), counters end in ``_total``, no dots. The self-telemetry
# above is exposed under ``prometheus_name`` of each ``SELF_METRIC_*`` name (the one translation),
# with ``prometheus_label`` of its attributes as labels.
PROMETHEUS_UNIT_SUFFIXES: Final = {METRIC_UNIT_SECONDS: "seconds", METRIC_UNIT_BYTES: "bytes"}
"""Self-telemetry unit -> the base-unit word its Prometheus name ends with."""
PROM_LABEL_SERVICE: Final = "service"
"""The request's ``service.name`` (label sets capped, the overflow is ``_other``)."""
PROM_LABEL_MODEL: Final = "model"
"""The request's model (``gen_ai.request.model``)."""
PROM_LABEL_OPERATION: Final = "operation"
"""The request's operation (``gen_ai.operation.name``: ``chat``, ``text_completion``...), the
route of an inference server."""
PROM_LABEL_TARGET: Final = "target"
"""An SLO target's name."""
PROM_LABEL_METRIC: Final = "metric"
"""A latency metric (``ttft``, ``tpot``, ``itl``, ``e2e``...)."""
PROM_LABEL_OUTCOME: Final = "outcome"
"""``good`` (inside the target's threshold) or ``bad``."""
PROM_LABEL_SEGMENT: Final = "segment"
"""A budget segment (``queue``, ``prefill``, ``decode``...)."""
PROM_LABEL_CAUSE: Final = "cause"
"""The verdict's cause (``causes.CAUSES``)."""
PROM_LABEL_GPU: Final = "gpu_uuid"
"""Node agent: the GPU's UUID (``hw.id`` in the OTLP metrics)."""
PROM_LABEL_GPU_NAME: Final = "gpu_name"
"""Node agent: the GPU's product name."""
PROM_LABEL_REASON: Final = "reason"
"""Node agent: why spans were dropped or refused."""
PROM_LABEL_ENDPOINT: Final = "endpoint"
"""Node agent: a collector replica's endpoint (``http://10.0.3.7:4317``)."""
PROM_OUTCOME_GOOD: Final = "good"
PROM_OUTCOME_BAD: Final = "bad"
PROM_OVERFLOW_LABEL_VALUE: Final = "_other"
"""The label value of every label set past the cap (``max_label_sets``)."""
PROM_METRIC_TTFT: Final = "tokentrace_request_ttft_seconds"
"""Collector, histogram: time to first token of each request (server clock)."""
PROM_METRIC_TPOT: Final = "tokentrace_request_tpot_seconds"
"""Collector, histogram: time per output token of each request (after the first)."""
PROM_METRIC_ITL: Final = "tokentrace_request_itl_seconds"
"""Collector, histogram: every inter-token gap (one observation per gap, not per request)."""
PROM_METRIC_E2E: Final = "tokentrace_request_e2e_seconds"
"""Collector, histogram: end-to-end latency of each request (its count: requests derived)."""
PROM_METRIC_SLO_REQUESTS: Final = "tokentrace_slo_requests_total"
"""Collector, counter: requests an SLO target judged, by outcome. Compliance over a range is
``good / (good + bad)``; the burn rate is ``(1 - compliance) / (1 - objective)``."""
PROM_METRIC_SLO_OBJECTIVE: Final = "tokentrace_slo_objective_ratio"
"""Collector, gauge: the share of requests a target wants inside its threshold (its percentile
/ 100)."""
PROM_METRIC_SLO_THRESHOLD: Final = "tokentrace_slo_threshold_seconds"
"""Collector, gauge: a target's latency threshold."""
PROM_METRIC_DOMINANT_SEGMENT: Final = "tokentrace_requests_dominant_segment_total"
"""Collector, counter: requests by the dominant cost of their verdict (the segment and cause,
about the metric of the first target they breached, else E2E)."""
PROM_METRIC_SEGMENT_SECONDS: Final = "tokentrace_request_segment_seconds_total"
"""Collector, counter: seconds requests spent in each budget segment (the E2E partition, so the
segments of one request sum to its E2E). Divided by the request rate, the mean budget of a
request by segment over time."""
PROM_METRIC_LABEL_SETS_OVERFLOWED: Final = "tokentrace_label_sets_overflowed_total"
"""Collector, counter: requests counted under ``_other`` because ``max_label_sets`` (service,
model, operation) label sets were already in use."""
PROM_METRIC_NODE_RECEIVED_SPANS: Final = "tokentrace_node_received_spans_total"
"""Node agent, counter: spans its receivers handed on and it took."""
PROM_METRIC_NODE_RELAYED_SPANS: Final = "tokentrace_node_relayed_spans_total"
"""Node agent, counter: spans queued for the collector."""
PROM_METRIC_NODE_SENT_SPANS: Final = "tokentrace_node_sent_spans_total"
"""Node agent, counter: spans the collector accepted."""
PROM_METRIC_NODE_DROPPED_SPANS: Final = "tokentrace_node_dropped_spans_total"
"""Node agent, counter: spans dropped or refused, by ``reason``: ``invalid`` (its receivers
dropped them), ``hold_queue_full`` (refused, the sender retries), ``upstream`` (the sender gave
up: queue full, retries exhausted), ``upstream_rejected`` (the collector refused them)."""
PROM_METRIC_NODE_HELD_SPANS: Final = "tokentrace_node_held_spans"
"""Node agent, gauge: spans in the hold queue, waiting for their GPU samples."""
PROM_METRIC_NODE_HOLD_CAPACITY: Final = "tokentrace_node_hold_capacity_spans"
"""Node agent, gauge: the hold queue's capacity (``max_held_spans``)."""
PROM_METRIC_NODE_QUEUE_LEN: Final = "tokentrace_node_upstream_queue_spans"
"""Node agent, gauge: spans waiting to be sent to the collector."""
PROM_METRIC_NODE_QUEUE_CAPACITY: Final = "tokentrace_node_upstream_queue_capacity_spans"
"""Node agent, gauge: the upstream send queue's capacity."""
PROM_METRIC_NODE_RELEASED_UNSAMPLED: Final = "tokentrace_node_released_unsampled_total"
"""Node agent, counter: requests sent on at ``max_hold`` before the sampler covered them."""
PROM_METRIC_NODE_ROUTED_SPANS: Final = "tokentrace_node_routed_spans_total"
"""Node agent with several collector replicas, counter: spans queued for each replica, by
``endpoint`` (re-routed spans included; a replica that leaves the set loses its series)."""
PROM_METRIC_NODE_REROUTED_SPANS: Final = "tokentrace_node_rerouted_spans_total"
"""Node agent with several collector replicas, counter: spans taken back from the queue of a
replica that left the set and routed again over the others."""
PROM_METRIC_NODE_UPSTREAM_ENDPOINTS: Final = "tokentrace_node_upstream_endpoints"
"""Node agent with several collector replicas, gauge: the replicas spans are routed over."""
PROM_METRIC_NODE_UPSTREAM_CHANGES: Final = "tokentrace_node_upstream_endpoint_changes_total"
"""Node agent with several collector replicas, counter: changes of the replica set (DNS)."""
PROM_METRIC_NODE_SAMPLES: Final = "tokentrace_node_gpu_samples_total"
"""Node agent, counter: GPU sampling passes (one sample per GPU each)."""
PROM_METRIC_GPU_UTILIZATION: Final = "tokentrace_node_gpu_utilization_ratio"
"""Node agent, gauge: the latest sample's share of time a kernel ran (0..1), per GPU."""
PROM_METRIC_GPU_MEMORY_USED: Final = "tokentrace_node_gpu_memory_used_bytes"
"""Node agent, gauge: GPU memory in use at the latest sample, per GPU."""
PROM_METRIC_GPU_MEMORY_TOTAL: Final = "tokentrace_node_gpu_memory_total_bytes"
"""Node agent, gauge: the GPU's memory, per GPU."""
PROM_METRIC_GPU_POWER: Final = "tokentrace_node_gpu_power_watts"
"""Node agent, gauge: power draw at the latest sample, per GPU."""
PROM_METRIC_GPU_SM_CLOCK: Final = "tokentrace_node_gpu_sm_clock_hertz"
"""Node agent, gauge: SM clock at the latest sample, per GPU."""
PROM_METRIC_GPU_MEMORY_BANDWIDTH_UTILIZATION: Final = (
    "tokentrace_node_gpu_memory_bandwidth_utilization_ratio"
)
"""Node agent, gauge: DRAM bandwidth at the latest sample as a share of the GPU's peak (0..1),
per GPU (GPM on Hopper and newer, else the memory controller's busy share)."""
PROMETHEUS_METRICS: Final = (
    (PROM_METRIC_TTFT, (PROM_LABEL_SERVICE, PROM_LABEL_MODEL, PROM_LABEL_OPERATION)),
    (PROM_METRIC_TPOT, (PROM_LABEL_SERVICE, PROM_LABEL_MODEL, PROM_LABEL_OPERATION)),
    (PROM_METRIC_ITL, (PROM_LABEL_SERVICE, PROM_LABEL_MODEL, PROM_LABEL_OPERATION)),
    (PROM_METRIC_E2E, (PROM_LABEL_SERVICE, PROM_LABEL_MODEL, PROM_LABEL_OPERATION)),
    (PROM_METRIC_SLO_REQUESTS, (PROM_LABEL_TARGET, PROM_LABEL_METRIC, PROM_LABEL_OUTCOME)),
    (PROM_METRIC_SLO_OBJECTIVE, (PROM_LABEL_TARGET, PROM_LABEL_METRIC)),
    (PROM_METRIC_SLO_THRESHOLD, (PROM_LABEL_TARGET, PROM_LABEL_METRIC)),
    (
        PROM_METRIC_DOMINANT_SEGMENT,
        (
            PROM_LABEL_SERVICE,
            PROM_LABEL_MODEL,
            PROM_LABEL_OPERATION,
            PROM_LABEL_METRIC,
            PROM_LABEL_SEGMENT,
            PROM_LABEL_CAUSE,
        ),
    ),
    (
        PROM_METRIC_SEGMENT_SECONDS,
        (PROM_LABEL_SERVICE, PROM_LABEL_MODEL, PROM_LABEL_OPERATION, PROM_LABEL_SEGMENT),
    ),
    (PROM_METRIC_LABEL_SETS_OVERFLOWED, ()),
    (PROM_METRIC_NODE_RECEIVED_SPANS, ()),
    (PROM_METRIC_NODE_RELAYED_SPANS, ()),
    (PROM_METRIC_NODE_SENT_SPANS, ()),
    (PROM_METRIC_NODE_DROPPED_SPANS, (PROM_LABEL_REASON,)),
    (PROM_METRIC_NODE_HELD_SPANS, ()),
    (PROM_METRIC_NODE_HOLD_CAPACITY, ()),
    (PROM_METRIC_NODE_QUEUE_LEN, ()),
    (PROM_METRIC_NODE_QUEUE_CAPACITY, ()),
    (PROM_METRIC_NODE_RELEASED_UNSAMPLED, ()),
    (PROM_METRIC_NODE_ROUTED_SPANS, (PROM_LABEL_ENDPOINT,)),
    (PROM_METRIC_NODE_REROUTED_SPANS, ()),
    (PROM_METRIC_NODE_UPSTREAM_ENDPOINTS, ()),
    (PROM_METRIC_NODE_UPSTREAM_CHANGES, ()),
    (PROM_METRIC_NODE_SAMPLES, ()),
    (PROM_METRIC_GPU_UTILIZATION, (PROM_LABEL_GPU, PROM_LABEL_GPU_NAME)),
    (PROM_METRIC_GPU_MEMORY_USED, (PROM_LABEL_GPU, PROM_LABEL_GPU_NAME)),
    (PROM_METRIC_GPU_MEMORY_TOTAL, (PROM_LABEL_GPU, PROM_LABEL_GPU_NAME)),
    (PROM_METRIC_GPU_POWER, (PROM_LABEL_GPU, PROM_LABEL_GPU_NAME)),
    (PROM_METRIC_GPU_SM_CLOCK, (PROM_LABEL_GPU, PROM_LABEL_GPU_NAME)),
    (PROM_METRIC_GPU_MEMORY_BANDWIDTH_UTILIZATION, (PROM_LABEL_GPU, PROM_LABEL_GPU_NAME)),
)
"""Every Prometheus metric beyond the self-telemetry: (name, labels); the type and meaning are
the constant's documentation (``Collector, histogram: ...``)."""


def prometheus_name(name: str, *, unit: str, counter: bool) -> str:
    """A self-telemetry metric's Prometheus name (the one translation): dots become
    underscores, the unit's base-unit word is appended unless the name already ends with it,
    and a counter ends in ``_total`` (``tokentrace.collector.received_spans`` ->
    ``tokentrace_collector_received_spans_total``, ``...batch_duration`` in ``s`` ->
    ``tokentrace_collector_batch_duration_seconds``)."""
    base = name.replace(".", "_")
    suffix = PROMETHEUS_UNIT_SUFFIXES.get(unit)
    if suffix is not None and not base.endswith(f"_{suffix}"):
        base = f"{base}_{suffix}"
    return f"{base}_total" if counter else base


def prometheus_label(attribute: str) -> str:
    """A self-telemetry attribute's Prometheus label: ``tokentrace.collector.component.id`` ->
    ``component_id``."""
    return attribute.removeprefix(SELF_METRIC_PREFIX).replace(".", "_")


def _constant_docs() -> dict[str, str]:
    """Each constant's documentation (the string after it), by constant name."""
    import ast
    import inspect
    import sys

    source = inspect.getsource(sys.modules[__name__])
    docs: dict[str, str] = {}
    body = ast.parse(source).body
    for node, following in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


_SELF_LABELS: Final = (
    "component_id, component_kind (receivers: + transport; OTLP exporters: + signal)"
)
_KEYED_SELF_METRICS: Final = ("SELF_METRIC_PROCESSOR_ERRORS", "SELF_METRIC_EXPORTER_ERRORS")


def prometheus_metrics() -> list[tuple[str, str, str, str]]:
    """Every Prometheus metric the admin endpoints expose: (name, type, labels, meaning), the
    self-telemetry's from its constants (the type and unit their documentation opens with:
    ``Pipeline, histogram (s): ...``; none named: a counter), then ``PROMETHEUS_METRICS``."""
    docs = _constant_docs()
    module = globals()
    rows: list[tuple[str, str, str, str]] = []
    for constant in sorted(docs):
        if not constant.startswith("SELF_METRIC_") or constant == "SELF_METRIC_PREFIX":
            continue
        head, _, meaning = docs[constant].partition(": ")
        kind = next((k for k in ("histogram", "gauge") if k in head), "counter")
        unit = next((u for u in PROMETHEUS_UNIT_SUFFIXES if f"({u})" in head), "1")
        name = prometheus_name(module[constant], unit=unit, counter=kind == "counter")
        labels = _SELF_LABELS
        if constant in _KEYED_SELF_METRICS:
            labels = "component_id, component_kind (of the component that failed)"
        rows.append((name, kind, labels, f"{head}: {meaning}"))
    names = {value: constant for constant, value in module.items() if constant.startswith("PROM_")}
    for metric, label_names in PROMETHEUS_METRICS:
        head, _, meaning = docs[names[metric]].partition(": ")
        owner, _, kind = head.partition(", ")
        rows.append((metric, kind, ", ".join(label_names), f"{owner}: {meaning}"))
    return rows


def contract_markdown() -> str:
    """``docs/telemetry.md``: every public constant of this module with its value and meaning."""
    import sys

    docs = _constant_docs()
    rows = [
        "# The tokentrace telemetry contract",
        "",
        "Generated from `agent/semconv.py` by `make docs`; a test keeps it current.",
        "GenAI semantic-convention names are used where they exist; everything else is under",
        "`tokentrace.`. Span times and durations are integer nanoseconds; metrics are seconds.",
        "",
        "| constant | value | meaning |",
        "|---|---|---|",
    ]
    module = sys.modules[__name__]
    for name in sorted(vars(module)):
        value = getattr(module, name)
        if name.startswith("_") or not name.isupper() or not isinstance(value, str):
            continue
        rows.append(f"| `{name}` | `{value}` | {docs.get(name, '')} |")
    rows += [
        "",
        f"Metrics (OTLP exponential histograms, unit `{METRIC_UNIT_SECONDS}`, one data point per",
        "service, model, operation and prompt bucket):",
        "",
        "| latency | metric name |",
        "|---|---|",
    ]
    rows += [f"| `{metric}` | `{name}` |" for metric, name in OTLP_METRIC_NAMES.items()]
    rows += [
        "",
        "## Prometheus `/metrics`",
        "",
        "The collector's `admin` extension and the node agent's `--admin-endpoint` serve these",
        "(unauthenticated; see docs/configuration.md and docs/node-agent.md). The collector's",
        "self-telemetry is exposed under `prometheus_name` of each `SELF_METRIC_*` name; a",
        "counter's samples end in `_total`, a histogram's in `_bucket`, `_sum` and `_count`.",
        "",
        "| name | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    rows += [
        f"| `{name}` | {kind} | {labels or '-'} | {meaning} |"
        for name, kind, labels, meaning in prometheus_metrics()
    ]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(contract_markdown(), end="")
