"""One agent per process: the recorder, the emitter and the OTLP sender, created on first use.

Framework instrumentations call ``get_runtime()`` when they instrument (never per request) and
then use ``runtime.recorder`` on the serving path. The runtime is fork-safe (the emitter and the
sender restart their threads in a child) and flushes, briefly, at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from tokentrace.agent.config import AgentConfig, load_agent_config
from tokentrace.agent.emit import SpanEmitter
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.otlp_export import OtlpSender
from tokentrace.agent.recorder import ClockDomain, Recorder

_log = logging.getLogger(__name__)

SCOPE_NAME = "tokentrace.agent"
_EXIT_FLUSH_TIMEOUT_S = 2.0


def _package_version() -> str:
    try:
        return version("tokentrace")
    except PackageNotFoundError:
        return ""


class AgentRuntime:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.guard = HookGuard()
        self.clock = ClockDomain()
        """The process's one monotonic -> Unix mapping: spans and instrumentations share it."""
        self.sender = OtlpSender(config.exporter, signal="traces")
        self.emitter = SpanEmitter(
            self.sender.submit,
            resource_attributes=config.resource(),
            scope_name=SCOPE_NAME,
            scope_version=_package_version(),
            max_queue=config.max_queue,
            max_token_offsets=config.max_token_offsets,
            clock_domain=self.clock,
            has_room=self.sender.has_room,
        )
        self.recorder = Recorder(
            self.emitter.submit,
            max_in_flight=config.max_in_flight,
            max_age_s=config.max_request_age_s,
        )

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "in_flight_requests": self.recorder.in_flight,
            "untraced_requests": self.recorder.untraced_requests,
            "expired_requests": self.recorder.expired_requests,
        }
        stats.update({f"emitter.{k}": v for k, v in self.emitter.stats().items()})
        stats.update({f"sender.{k}": v for k, v in self.sender.stats().items()})
        stats.update(self.guard.stats())
        return stats

    def flush(self, timeout_s: float = _EXIT_FLUSH_TIMEOUT_S) -> bool:
        emitted = self.emitter.flush(timeout_s)
        return self.sender.force_flush(timeout_s) and emitted

    def shutdown(self, timeout_s: float = _EXIT_FLUSH_TIMEOUT_S) -> None:
        self.emitter.shutdown(timeout_s)
        self.sender.shutdown(timeout_s)


_runtime: AgentRuntime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> AgentRuntime | None:
    """The process's agent, created from the environment on first call; None when disabled."""
    global _runtime
    if _runtime is not None:
        return _runtime
    with _runtime_lock:
        if _runtime is None:
            config = load_agent_config()
            if not config.enabled:
                return None
            _runtime = AgentRuntime(config)
            atexit.register(_runtime.flush)
    return _runtime
