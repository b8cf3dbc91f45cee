"""Test support: make tokentrace hook bodies raise, in every process of a test server.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``; the zero-harm tests put this
folder there, name hook methods in ``TOKENTRACE_TEST_FAIL_HOOK`` (comma-separated):
``VllmInstrumentor``'s (frontend, e.g. ``_finish``), or a class's of the engine or ASGI
modules (e.g. ``_TrackedRequest.__init__`` in EngineCore, ``HttpServerTracer.begin`` in the
API server), and a switch file in ``TOKENTRACE_TEST_FAIL_SWITCH``. A named hook raises while
its name is a line of the switch file, so one server can fail one set of hooks, then another.
Only this test module reads these variables: production code has no failure switch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_FAILING_HOOKS = [
    name for name in os.environ.get("TOKENTRACE_TEST_FAIL_HOOK", "").split(",") if name
]
_SWITCH_PATH = os.environ.get("TOKENTRACE_TEST_FAIL_SWITCH", "")
_switch_state: tuple[int, frozenset[str]] = (-1, frozenset())


def _switched_on() -> frozenset[str]:
    """The hook names the switch file lists now (re-read only when it changes)."""
    global _switch_state
    try:
        mtime_ns = os.stat(_SWITCH_PATH).st_mtime_ns
    except OSError:
        return frozenset()
    if mtime_ns != _switch_state[0]:
        with open(_SWITCH_PATH, encoding="utf-8") as switch:
            names = frozenset(line.strip() for line in switch if line.strip())
        _switch_state = (mtime_ns, names)
    return _switch_state[1]


def _failing(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def fail_when_switched_on(*args: Any, **kwargs: Any) -> Any:
        if name in _switched_on():
            raise RuntimeError(f"tokentrace test: forced failure of {name}")
        return original(*args, **kwargs)

    return fail_when_switched_on


if _FAILING_HOOKS:
    from tokentrace.agent.frameworks import asgi as _asgi
    from tokentrace.agent.frameworks import vllm as _frontend
    from tokentrace.agent.frameworks import vllm_engine as _engine

    for _hook in _FAILING_HOOKS:
        _owner_name, _, _method = _hook.rpartition(".")
        _owner: type = _frontend.VllmInstrumentor
        if _owner_name:
            _owner = getattr(_engine, _owner_name, None) or getattr(_asgi, _owner_name)
        if not hasattr(_owner, _method):
            raise SystemExit(f"TOKENTRACE_TEST_FAIL_HOOK: no such hook method {_hook!r}")
        setattr(_owner, _method, _failing(_hook, getattr(_owner, _method)))
