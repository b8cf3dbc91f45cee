"""Test support: make one tokentrace hook body raise, in every process of a test server.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``; the zero-harm tests put this
folder there and name a hook method in ``TOKENTRACE_TEST_FAIL_HOOK``: ``VllmInstrumentor``'s
(frontend, e.g. ``_after_outputs``) or ``EngineStepTracer``'s (EngineCore, e.g.
``EngineStepTracer.on_step_done``). Only this test module reads that variable: production code
has no failure switch.
"""

from __future__ import annotations

import os

_FAILING_HOOK = os.environ.get("TOKENTRACE_TEST_FAIL_HOOK", "")

if _FAILING_HOOK:
    from tokentrace.agent.frameworks import vllm as _frontend
    from tokentrace.agent.frameworks import vllm_engine as _engine

    _owner_name, _, _method = _FAILING_HOOK.rpartition(".")
    _owner: type = getattr(_engine, _owner_name) if _owner_name else _frontend.VllmInstrumentor
    if not hasattr(_owner, _method):
        raise SystemExit(f"TOKENTRACE_TEST_FAIL_HOOK={_FAILING_HOOK!r}: no such hook method")

    def _fail(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(f"tokentrace test: forced failure of {_FAILING_HOOK}")

    setattr(_owner, _method, _fail)
