"""Zero harm: instrumentation code runs beside the host's code, never instead of it.

Every hook body runs through ``HookGuard.run``: an exception is caught, counted, logged once,
and the hook is disabled for the rest of the process, so a bug in tracing (or a host version we
misread) costs a trace, never a request. The host's own call always happens outside the guard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tokentrace.agent import compiled

_log = logging.getLogger(__name__)


class HookGuard:
    def __init__(self) -> None:
        self.failures: dict[str, int] = {}
        """hook name -> exceptions caught (each disables the hook)."""
        self.disabled: set[str] = set()

    def run(self, name: str, hook: Callable[..., Any], *args: Any) -> Any:
        """``hook(*args)``, or None when the hook is disabled or raised. ``_hooks.run`` (C,
        no frame of its own between the host's wrapper and the hook) where built; this is its
        twin, also ``run_python``."""
        if name in self.disabled:
            return None
        try:
            return hook(*args)
        except Exception:
            self.failed(name)
            return None

    run_python = run

    def failed(self, name: str) -> None:
        """The hook ``name`` raised the exception being handled: count and log it, and disable
        the hook. For the hooks run on every engine step, whose ``try`` is inline rather than
        in ``run`` (one Python call fewer per step)."""
        self.failures[name] = self.failures.get(name, 0) + 1
        self.disabled.add(name)
        _log.warning(
            "tokentrace: hook %r failed and is now disabled; the host keeps running "
            "(its requests are no longer traced by this hook)",
            name,
            exc_info=True,
        )

    def stats(self) -> dict[str, int]:
        return {f"hook_failures.{name}": count for name, count in self.failures.items()}


_HOOKS = compiled.load("tokentrace.agent._hooks")
if _HOOKS is not None:
    HookGuard.run = _HOOKS.run  # type: ignore[method-assign]
