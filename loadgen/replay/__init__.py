"""Realistic LLM-serving request traces from a simulated continuous-batching engine.

Until the real framework instrumentation runs in front of it, the demo, the integration tests
and the collector benchmark drive the collector with these traces. The modules, in the order
data flows through them:

- ``scenarios``: the named workloads and engine settings (``Scenario``, ``SCENARIOS``);
- ``simulation``: the discrete-event engine model; ``simulate`` returns what happened to each
  request;
- ``request``: ``SimulatedRequest``, one request's recorded life, and how its span ids are laid
  out: what the simulation hands to emission;
- ``emit``: the requests as spans, through the OpenTelemetry SDK (``emit_sdk``) or as wire-encoded
  OTLP requests (``to_otlp_requests``), in tokentrace's dialect or vLLM's;
- ``cli``: ``tokentrace replay``, the SDK path with an OTLP exporter.

Everything here imports only the standard library and the agent's stdlib-only modules (semconv,
finished_request, spans, span_encoding) at import time; the OpenTelemetry packages are imported
by the functions that need them, so ``tokentrace replay --help`` stays fast.
"""
