"""Agent configuration: the standard ``OTEL_*`` environment variables plus ``TOKENTRACE_*``.

- ``OTEL_SDK_DISABLED`` (false): true turns the agent off, as for any OTel SDK.
- ``TOKENTRACE_ENABLED`` (true): false turns only tokentrace off.
- ``OTEL_SERVICE_NAME`` (vllm) and ``OTEL_RESOURCE_ATTRIBUTES`` (``k=v,k2=v2``): the resource.
- ``OTEL_EXPORTER_OTLP_*`` (node-local ``http://localhost:4317``, gRPC): where spans go.
- ``TOKENTRACE_MAX_TOKEN_OFFSETS`` (1024): token offsets kept on ``llm.decode``; the rest counted.
- ``TOKENTRACE_MAX_IN_FLIGHT`` (65536): requests timed at once; beyond, untraced and counted.
- ``TOKENTRACE_MAX_QUEUE`` (8192): finished requests awaiting span building; beyond, dropped
  and counted.
- ``OTEL_BSP_SCHEDULE_DELAY`` (200 ms; the SDK's is 5000): how long finished requests gather
  into one export batch. Longer: fewer export calls (each costs the server's process ~0.3 ms of
  interpreter time here), spans reach the collector later.
- ``TOKENTRACE_MAX_REQUEST_AGE`` (600 s): a request with no end reported for this long is
  finished as expired and counted (requests the framework dropped without telling us).
- ``TOKENTRACE_ENGINE_STEPS`` (4096): engine steps kept in the engine's ring buffer; a request's
  inter-token outliers older than that find no steps to export.
- ``TOKENTRACE_STEP_SAMPLE_RATE`` (0.01): fraction of all engine steps exported on their own
  (each its own trace), besides those overlapping requests' inter-token outliers.
- ``TOKENTRACE_ITL_OUTLIER_RATIO`` (3.0): an inter-token gap above this many times the request's
  median gap is an outlier; the engine steps inside it are exported under the request.
- ``TOKENTRACE_HTTP_RECEIVE_WAIT`` (true): the HTTP server span reads how long each request's
  bytes waited in the server's kernel before the app took them (one ``TCP_INFO`` system call
  per request, about a sixth of the tracing's share of vLLM's API server in docs/performance.md);
  false leaves ``tokentrace.http.receive_wait_ns`` out, and the budget counts that wait as
  network.
- ``TOKENTRACE_NODE_SOCKET``: the node agent's local socket (``tokentrace node-agent
  --local-socket``). Set: finished requests go there as plain data and the node agent builds
  their spans, which takes that work out of this process (``local_relay``); OTLP is used
  whenever it cannot be reached.
- ``TOKENTRACE_GPU_UUIDS``: the process's GPUs, comma-separated, for the node agent; by default
  from ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES`` (UUIDs) or NVML (indices).
- ``K8S_POD_NAME`` / ``K8S_NAMESPACE_NAME`` / ``K8S_NODE_NAME`` (or ``POD_NAME`` /
  ``POD_NAMESPACE`` / ``NODE_NAME``): the pod's identity from the Kubernetes downward API.

The ``OTEL_EXPORTER_OTLP_*`` variables are read as the first instrumented process saw them at
start-up (``bootstrap.pin_exporter_environment``): an engine may set them for its own tracing
once it runs (vLLM writes ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` for ``--otlp-traces-endpoint``),
and its child processes (EngineCore, workers) would otherwise send tokentrace's spans there too,
bypassing the node agent.

The agent runs inside someone else's server, so a bad value never stops it: it is logged once
and its default used.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import unquote, urlsplit

from tokentrace.agent import semconv
from tokentrace.agent.bootstrap import EXPORTER_VARIABLE_PREFIX, PINNED_EXPORTER_ENV
from tokentrace.agent.finished_request import DEFAULT_ITL_OUTLIER_RATIO
from tokentrace.agent.identity import kubernetes_resource, visible_gpu_uuids
from tokentrace.agent.otlp_config import PROTOCOL_GRPC, PROTOCOL_HTTP_PROTOBUF, OtlpExporterConfig
from tokentrace.agent.spans import DEFAULT_MAX_TOKEN_OFFSETS, AttrValue

_log = logging.getLogger(__name__)

_DEFAULT_SERVICE_NAME = "vllm"
_DEFAULT_ENDPOINT = "http://localhost:4317"
"""The node agent's OTLP/gRPC receiver on the same node."""
_DEFAULT_MAX_IN_FLIGHT = 65_536
_DEFAULT_MAX_QUEUE = 8192
_DEFAULT_BATCH_DELAY_MS = 200.0
"""Not the SDK's 5 s: the collector's live views (``top``, the fleet view) want spans soon."""
_MAX_BATCH_DELAY_MS = 60_000.0
"""Beyond a minute the queue (``TOKENTRACE_MAX_QUEUE``) would overflow at modest rates."""
_MS_PER_S = 1000.0
_DEFAULT_MAX_REQUEST_AGE_S = 600
_DEFAULT_ENGINE_STEPS = 4096
_DEFAULT_STEP_SAMPLE_RATE = 0.01
_DEFAULT_ITL_OUTLIER_RATIO = DEFAULT_ITL_OUTLIER_RATIO
NODE_SOCKET_ENV: Final = "TOKENTRACE_NODE_SOCKET"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    enabled: bool = True
    service_name: str = _DEFAULT_SERVICE_NAME
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    exporter: OtlpExporterConfig = field(
        default_factory=lambda: OtlpExporterConfig(
            endpoint=_DEFAULT_ENDPOINT, protocol=PROTOCOL_GRPC
        )
    )
    max_token_offsets: int = DEFAULT_MAX_TOKEN_OFFSETS
    max_in_flight: int = _DEFAULT_MAX_IN_FLIGHT
    max_queue: int = _DEFAULT_MAX_QUEUE
    batch_delay_s: float = _DEFAULT_BATCH_DELAY_MS / _MS_PER_S
    """How long finished requests gather into one export batch (``OTEL_BSP_SCHEDULE_DELAY``)."""
    max_request_age_s: float = _DEFAULT_MAX_REQUEST_AGE_S
    engine_steps: int = _DEFAULT_ENGINE_STEPS
    step_sample_rate: float = _DEFAULT_STEP_SAMPLE_RATE
    itl_outlier_ratio: float = _DEFAULT_ITL_OUTLIER_RATIO
    http_receive_wait: bool = True
    """Whether the HTTP server span reads each request's kernel wait
    (``TOKENTRACE_HTTP_RECEIVE_WAIT``)."""
    gpu_uuids: tuple[str, ...] = ()
    """The GPUs this process may use (``identity.visible_gpu_uuids``)."""
    node_socket: str | None = None
    """The node agent's local socket (``TOKENTRACE_NODE_SOCKET``); None: export OTLP only."""

    def resource(self) -> dict[str, AttrValue]:
        """Resource attributes of every span: identity of this process, its service, its pod
        and its GPUs (what the node agent maps spans to GPUs by)."""
        resource: dict[str, AttrValue] = dict(self.resource_attributes)
        resource[semconv.SERVICE_NAME] = self.service_name
        resource.setdefault(semconv.PROCESS_PID, os.getpid())
        if self.gpu_uuids and semconv.GPU_UUIDS not in resource:
            resource[semconv.GPU_UUIDS] = self.gpu_uuids
        return resource


def _exporter_environment(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` with its ``OTEL_EXPORTER_OTLP_*`` variables as pinned, when they were."""
    raw = env.get(PINNED_EXPORTER_ENV)
    if not raw:
        return env
    try:
        pinned = json.loads(raw)
        if not isinstance(pinned, dict) or not all(
            isinstance(k, str) and k.startswith(EXPORTER_VARIABLE_PREFIX) and isinstance(v, str)
            for k, v in pinned.items()
        ):
            raise ValueError("not an object of OTEL_EXPORTER_OTLP_* strings")
    except ValueError as error:
        _log.warning("tokentrace: %s is ignored (%s)", PINNED_EXPORTER_ENV, error)
        return env
    merged = {k: v for k, v in env.items() if not k.startswith(EXPORTER_VARIABLE_PREFIX)}
    merged.update(pinned)
    return merged


def load_agent_config(environ: Mapping[str, str] | None = None) -> AgentConfig:
    env = os.environ if environ is None else environ
    enabled = _flag(env, "TOKENTRACE_ENABLED", True) and not _flag(env, "OTEL_SDK_DISABLED", False)
    # The pod's downward-API identity, unless OTEL_RESOURCE_ATTRIBUTES says otherwise.
    resource = {
        **kubernetes_resource(env),
        **_resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", "")),
    }
    service = (
        env.get("OTEL_SERVICE_NAME")
        or resource.pop(semconv.SERVICE_NAME, "")
        or (_DEFAULT_SERVICE_NAME)
    )
    exporter = OtlpExporterConfig(endpoint=_DEFAULT_ENDPOINT, protocol=PROTOCOL_GRPC)
    try:
        from_env = OtlpExporterConfig.from_env(_exporter_environment(env), signal="traces")
        if from_env is not None:
            from_env.validate()
            exporter = from_env
    except ValueError as error:
        _log.warning("tokentrace: %s; exporting to %s instead", error, _DEFAULT_ENDPOINT)
    _warn_on_port_protocol_mismatch(exporter)
    return AgentConfig(
        enabled=enabled,
        service_name=service,
        resource_attributes=resource,
        exporter=exporter,
        max_token_offsets=_positive_int(
            env, "TOKENTRACE_MAX_TOKEN_OFFSETS", DEFAULT_MAX_TOKEN_OFFSETS, minimum=0
        ),
        max_in_flight=_positive_int(env, "TOKENTRACE_MAX_IN_FLIGHT", _DEFAULT_MAX_IN_FLIGHT),
        max_queue=_positive_int(env, "TOKENTRACE_MAX_QUEUE", _DEFAULT_MAX_QUEUE),
        batch_delay_s=_number(
            env,
            "OTEL_BSP_SCHEDULE_DELAY",
            _DEFAULT_BATCH_DELAY_MS,
            low=1.0,
            high=_MAX_BATCH_DELAY_MS,
        )
        / _MS_PER_S,
        max_request_age_s=_positive_int(
            env, "TOKENTRACE_MAX_REQUEST_AGE", _DEFAULT_MAX_REQUEST_AGE_S
        ),
        engine_steps=_positive_int(env, "TOKENTRACE_ENGINE_STEPS", _DEFAULT_ENGINE_STEPS),
        step_sample_rate=_number(
            env, "TOKENTRACE_STEP_SAMPLE_RATE", _DEFAULT_STEP_SAMPLE_RATE, low=0.0, high=1.0
        ),
        itl_outlier_ratio=_number(
            env, "TOKENTRACE_ITL_OUTLIER_RATIO", _DEFAULT_ITL_OUTLIER_RATIO, low=1.0
        ),
        http_receive_wait=_flag(env, "TOKENTRACE_HTTP_RECEIVE_WAIT", True),
        gpu_uuids=tuple(visible_gpu_uuids(env)) if enabled else (),
        node_socket=env.get(NODE_SOCKET_ENV, "").strip() or None,
    )


_CONVENTIONAL_PORTS: Final = {PROTOCOL_GRPC: 4317, PROTOCOL_HTTP_PROTOBUF: 4318}


def _warn_on_port_protocol_mismatch(exporter: OtlpExporterConfig) -> None:
    """The OTLP default protocol is http/protobuf: an endpoint on 4317 (the gRPC port) without
    ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` is a common slip that loses every span silently."""
    endpoint = exporter.endpoint_for("traces") or ""
    try:
        port = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}").port
    except ValueError:
        return
    for protocol, conventional in _CONVENTIONAL_PORTS.items():
        if port == conventional and exporter.protocol != protocol:
            _log.warning(
                "tokentrace: exporting with %s to %s, the conventional OTLP %s port; set "
                "OTEL_EXPORTER_OTLP_PROTOCOL=%s if the endpoint speaks %s",
                exporter.protocol,
                endpoint,
                protocol,
                protocol,
                protocol,
            )


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    _log.warning("tokentrace: %s=%r is not true/false; using %s", name, value, default)
    return default


def _positive_int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 1) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        _log.warning(
            "tokentrace: %s=%r must be an integer >= %d; using %d", name, raw, minimum, default
        )
        return default
    return value


def _number(
    env: Mapping[str, str], name: str, default: float, *, low: float, high: float = math.inf
) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high:  # NaN fails too
        bounds = f"between {low:g} and {high:g}" if math.isfinite(high) else f">= {low:g}"
        _log.warning("tokentrace: %s=%r must be a number %s; using %g", name, raw, bounds, default)
        return default
    return value


def _resource_attributes(raw: str) -> dict[str, str]:
    """``OTEL_RESOURCE_ATTRIBUTES``: comma-separated ``key=value``, values percent-encoded."""
    attributes: dict[str, str] = {}
    for item in raw.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            if item.strip():
                _log.warning("tokentrace: ignoring OTEL_RESOURCE_ATTRIBUTES entry %r", item)
            continue
        attributes[key.strip()] = unquote(value.strip())
    return attributes
