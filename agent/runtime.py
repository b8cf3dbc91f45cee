"""One agent per process: the recorder, the emitter and the OTLP sender, created on first use.

Framework instrumentations call ``get_runtime()`` when they instrument (never per request) and
then use ``runtime.recorder`` on the serving path. The runtime is fork-safe (the emitter and the
sender restart their threads in a child) and flushes, briefly, at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from tokentrace.agent.config import AgentConfig, load_agent_config
from tokentrace.agent.emit import SpanEmitter
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.local_relay import LocalRelayClient, hello
from tokentrace.agent.otlp_export import OtlpSender
from tokentrace.agent.recorder import MonotonicToUnix, Recorder

if TYPE_CHECKING:
    from tokentrace.agent.frameworks.vllm_engine import EngineStepTracer

_log = logging.getLogger(__name__)

SCOPE_NAME = "tokentrace.agent"
_EXIT_FLUSH_TIMEOUT_S = 2.0
_EMITTER_STOP_S = 1.0
"""For the emitter's thread to finish once the sender is shut down (its sends return at once)."""


def _package_version() -> str:
    try:
        return version("tokentrace")
    except PackageNotFoundError:
        return ""


class AgentRuntime:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.guard = HookGuard()
        self.clock = MonotonicToUnix()
        """The process's one monotonic -> Unix mapping: spans and instrumentations share it."""
        self.sender = OtlpSender(config.exporter, signal="traces")
        resource = config.resource()
        relay = None
        if config.node_socket:
            relay = LocalRelayClient(
                config.node_socket,
                hello_message=hello(
                    resource=resource,
                    scope_name=SCOPE_NAME,
                    scope_version=_package_version(),
                    max_token_offsets=config.max_token_offsets,
                ),
            )
        self.emitter = SpanEmitter(
            self.sender.send_now,  # on the emitter's thread: one background thread, not two
            resource_attributes=resource,
            scope_name=SCOPE_NAME,
            scope_version=_package_version(),
            max_queue=config.max_queue,
            interval_s=config.batch_delay_s,
            max_token_offsets=config.max_token_offsets,
            to_unix=self.clock,
            has_room=self.sender.has_room,
            relay=relay,
        )
        self.recorder = Recorder(
            self.emitter.submit,
            max_in_flight=config.max_in_flight,
            max_age_s=config.max_request_age_s,
        )
        self._engine_step_tracer: EngineStepTracer | None = None
        self._stats_sources: list[Callable[[], Mapping[str, Any]]] = []

    def add_stats_source(self, source: Callable[[], Mapping[str, Any]]) -> None:
        """An instrumentation's counters, merged into ``stats()`` (once per source)."""
        if source not in self._stats_sources:
            self._stats_sources.append(source)

    def engine_step_tracer(self) -> EngineStepTracer:
        """This process's engine-step tracer (created on first call: only engine processes)."""
        if self._engine_step_tracer is None:
            from tokentrace.agent.frameworks.vllm_engine import EngineStepTracer

            self._engine_step_tracer = EngineStepTracer(
                self.emitter.submit,
                guard=self.guard,
                to_unix=self.clock,
                ring_steps=self.config.engine_steps,
                sample_rate=self.config.step_sample_rate,
                outlier_ratio=self.config.itl_outlier_ratio,
            )
            self.add_stats_source(self._engine_step_tracer.stats)
        return self._engine_step_tracer

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "in_flight_requests": self.recorder.in_flight,
            "untraced_requests": self.recorder.untraced_requests,
            "expired_requests": self.recorder.expired_requests,
        }
        stats.update({f"emitter.{k}": v for k, v in self.emitter.stats().items()})
        stats.update({f"sender.{k}": v for k, v in self.sender.stats().items()})
        stats.update(self.guard.stats())
        for source in self._stats_sources:
            stats.update(source())
        return stats

    def flush(self, timeout_s: float = _EXIT_FLUSH_TIMEOUT_S) -> bool:
        """Send what is queued; within ``timeout_s`` in all (the emitter's thread sends, so a
        hung endpoint holds its flush and the sender's alike: they share the time)."""
        deadline = time.monotonic() + timeout_s
        emitted = self.emitter.flush(timeout_s)
        return self.sender.force_flush(max(0.0, deadline - time.monotonic())) and emitted

    def shutdown(self, timeout_s: float = _EXIT_FLUSH_TIMEOUT_S) -> None:
        """Send what is queued within ``timeout_s``, then stop: the sender first, which cancels
        a send the emitter's thread may still be stuck in, then that thread."""
        deadline = time.monotonic() + timeout_s
        self.emitter.flush(timeout_s)
        self.sender.shutdown(max(0.0, deadline - time.monotonic()))
        self.emitter.shutdown(_EMITTER_STOP_S)


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
