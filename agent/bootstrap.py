"""Automatic instrumentation for ``tokentrace run``: instrument each framework when it is imported.

``autoinstrument()`` registers a post-import hook per tokentrace instrumentor (the
``opentelemetry_instrumentor`` entry points of the tokentrace distribution): nothing is imported
up front, so a process that never imports vLLM pays nothing, and one that does is instrumented
before its first request. vLLM's own plugin mechanism (``vllm.general_plugins``) reaches the same
instrumentor in vLLM's spawned processes; instrumenting twice is a no-op. An instrumentor whose
class says ``auto_instrument = False`` (in-process ``generate()``: it wraps the application's own
calls) is left to the application's one-line call or to ``opentelemetry-instrument``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import MutableMapping
from importlib.metadata import EntryPoint, entry_points
from typing import Final

_log = logging.getLogger(__name__)

EXPORTER_VARIABLE_PREFIX: Final = "OTEL_EXPORTER_OTLP_"
PINNED_EXPORTER_ENV: Final = "TOKENTRACE_PINNED_OTLP_ENV"
"""The ``OTEL_EXPORTER_OTLP_*`` variables as the first instrumented process saw them (a JSON
object), inherited by its children, whose agent reads these instead of their own (``config``)."""

INSTRUMENTOR_GROUP = "opentelemetry_instrumentor"
_DISTRIBUTION = "tokentrace"

registered: list[str] = []
"""Target modules with a pending or completed tokentrace hook in this process."""


def _ours(entry: EntryPoint) -> bool:
    dist = getattr(entry, "dist", None)
    return dist is not None and dist.name == _DISTRIBUTION


def pin_exporter_environment(environ: MutableMapping[str, str]) -> None:
    """Keep this process's ``OTEL_EXPORTER_OTLP_*`` variables for its children: an engine may
    set them for its own tracing once it runs (vLLM writes ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    for ``--otlp-traces-endpoint``), and its child processes would otherwise send tokentrace's
    spans there too, bypassing the node agent. A process that inherited a pin keeps it."""
    if PINNED_EXPORTER_ENV in environ:
        return
    seen = {k: v for k, v in environ.items() if k.startswith(EXPORTER_VARIABLE_PREFIX)}
    environ[PINNED_EXPORTER_ENV] = json.dumps(seen, sort_keys=True)


def autoinstrument() -> None:
    import wrapt

    pin_exporter_environment(os.environ)

    for entry in entry_points(group=INSTRUMENTOR_GROUP):
        if not _ours(entry):
            continue
        try:
            instrumentor_class = entry.load()
            target = instrumentor_class.target_module
            # Opt-in instrumentors (in-process generate()) wait for the application's own call.
            if not getattr(instrumentor_class, "auto_instrument", True):
                continue
        except Exception:  # a broken entry must not break the host's start-up
            _log.warning("tokentrace: cannot load instrumentor %s", entry.name, exc_info=True)
            continue
        if target in registered:
            continue

        def instrument(_module: object, cls: type = instrumentor_class) -> None:
            try:
                cls().instrument()
            except Exception:
                _log.warning("tokentrace: instrumenting %s failed", cls.__name__, exc_info=True)

        wrapt.register_post_import_hook(instrument, target)
        registered.append(target)
