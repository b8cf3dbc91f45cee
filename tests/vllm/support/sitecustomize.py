"""Test support: make one tokentrace hook body raise, in every process of a test server.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``; the zero-harm tests put this
folder there and name a ``VllmInstrumentor`` hook method in ``TOKENTRACE_TEST_FAIL_HOOK``. Only
this test module reads that variable: production code has no failure switch.
"""

from __future__ import annotations

import os

_FAILING_METHOD = os.environ.get("TOKENTRACE_TEST_FAIL_HOOK", "")

if _FAILING_METHOD:
    from tokentrace.agent.frameworks import vllm as _instrumentation

    if not hasattr(_instrumentation.VllmInstrumentor, _FAILING_METHOD):
        raise SystemExit(f"TOKENTRACE_TEST_FAIL_HOOK={_FAILING_METHOD!r}: no such hook method")

    def _fail(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(f"tokentrace test: forced failure of {_FAILING_METHOD}")

    setattr(_instrumentation.VllmInstrumentor, _FAILING_METHOD, _fail)
