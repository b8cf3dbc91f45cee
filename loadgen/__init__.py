"""Client-side tools: what sends traffic to an inference server or traces to a collector.

- ``tokentrace load`` (``cli``, ``workload`` with ``lengths`` and ``prompts``, ``runner``,
  ``http``, ``record``, ``report``, ``results``, ``export``): a load generator for
  OpenAI-compatible endpoints that traces each request as a client span, so the collector can
  compute the network segment.
- ``tokentrace replay`` (the ``replay`` package): simulated continuous-batching traces sent to a
  collector through the OpenTelemetry SDK, for demos, tests and benchmarks.
- ``tiny_model`` and ``local_vllm``: a random-weight Llama built without downloads and a real
  vLLM server started on loopback (the demo, the tests and the benches use them).

Nothing here runs inside an inference server; see docs/architecture.md for where code goes.
"""
