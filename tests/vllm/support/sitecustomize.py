"""Test support: make tokentrace hook bodies raise, in every process of a test server.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``; the zero-harm tests put this
folder there and name hook methods in ``TOKENTRACE_TEST_FAIL_HOOK`` (comma-separated):
``VllmInstrumentor``'s (frontend, e.g. ``_after_outputs``), or a class's of the engine or ASGI
modules (e.g. ``EngineStepTracer.on_step_done`` in EngineCore, ``HttpServerTracer.begin`` in
the API server). Only this test module reads that variable: production code has no failure
switch.
"""

from __future__ import annotations

import os

_FAILING_HOOKS = [
    name for name in os.environ.get("TOKENTRACE_TEST_FAIL_HOOK", "").split(",") if name
]

if _FAILING_HOOKS:
    from tokentrace.agent.frameworks import asgi as _asgi
    from tokentrace.agent.frameworks import vllm as _frontend
    from tokentrace.agent.frameworks import vllm_engine as _engine

    def _failing(name: str) -> object:
        def fail(*_args: object, **_kwargs: object) -> None:
            raise RuntimeError(f"tokentrace test: forced failure of {name}")

        return fail

    for _hook in _FAILING_HOOKS:
        _owner_name, _, _method = _hook.rpartition(".")
        _owner: type = _frontend.VllmInstrumentor
        if _owner_name:
            _owner = getattr(_engine, _owner_name, None) or getattr(_asgi, _owner_name)
        if not hasattr(_owner, _method):
            raise SystemExit(f"TOKENTRACE_TEST_FAIL_HOOK: no such hook method {_hook!r}")
        setattr(_owner, _method, _failing(_hook))
