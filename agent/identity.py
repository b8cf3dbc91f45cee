"""Who emitted a span: Kubernetes identity from the downward API and the GPUs a process uses.

Both the in-process agent and the node agent read these, from their own environments: the
inference pod's spec sets its pod/namespace/node names as environment variables through the
downward API (``fieldRef: metadata.name`` ...), and so does the node agent's DaemonSet. Outside
Kubernetes nothing is set and the spans carry ``host.name`` only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import Final

from tokentrace.agent import semconv

_log = logging.getLogger(__name__)

# Each attribute from the first variable set: OpenTelemetry's conventional names first, then the
# names most manifests use.
_DOWNWARD_API: Final = {
    semconv.K8S_NODE_NAME: ("K8S_NODE_NAME", "NODE_NAME"),
    semconv.K8S_POD_NAME: ("K8S_POD_NAME", "POD_NAME"),
    semconv.K8S_NAMESPACE_NAME: ("K8S_NAMESPACE_NAME", "POD_NAMESPACE"),
}
_UUID_PREFIXES: Final = ("GPU-", "MIG-")
_NO_DEVICES: Final = ("", "-1", "none", "void", "NoDevFiles")
GPU_UUIDS_VARIABLE: Final = "TOKENTRACE_GPU_UUIDS"
"""Comma-separated GPU UUIDs of this process, when the visible-device variables do not say."""


def kubernetes_resource(environ: Mapping[str, str]) -> dict[str, str]:
    """``k8s.node.name`` / ``k8s.pod.name`` / ``k8s.namespace.name`` that the environment sets."""
    resource: dict[str, str] = {}
    for attribute, variables in _DOWNWARD_API.items():
        for variable in variables:
            value = environ.get(variable, "").strip()
            if value:
                resource[attribute] = value
                break
    return resource


def host_resource(environ: Mapping[str, str]) -> dict[str, str]:
    """Kubernetes identity plus ``host.name`` (the node's name in Kubernetes, else hostname)."""
    resource = kubernetes_resource(environ)
    resource[semconv.HOST_NAME] = resource.get(semconv.K8S_NODE_NAME) or socket.gethostname()
    return resource


_NVIDIA_CONTROL_DEVICE: Final = "/dev/nvidiactl"
"""Present wherever the NVIDIA driver is usable (host or GPU container); NVML needs it."""


def _nvml_uuids(indices: list[int] | None) -> list[str]:
    """UUIDs of the given NVML device indices (all when None); [] without NVML."""
    if not os.path.exists(_NVIDIA_CONTROL_DEVICE):
        return []  # no driver here: skip importing pynvml (~30 ms at every process start)
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver, no library, no binding: a CPU process
        return []
    try:
        count = pynvml.nvmlDeviceGetCount()
        uuids = []
        for index in range(count) if indices is None else indices:
            if 0 <= index < count:
                uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
                uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        return uuids
    except Exception:
        _log.debug("tokentrace: could not read GPU UUIDs from NVML", exc_info=True)
        return []
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def visible_gpu_uuids(
    environ: Mapping[str, str],
    *,
    nvml_uuids: Callable[[list[int] | None], list[str]] = _nvml_uuids,
) -> list[str]:
    """The GPUs this process may use, by UUID (what the node agent maps spans to GPUs with).

    ``TOKENTRACE_GPU_UUIDS`` when set; else ``CUDA_VISIBLE_DEVICES`` (then
    ``NVIDIA_VISIBLE_DEVICES``) when it lists UUIDs, as the Kubernetes device plugin does; else
    NVML, once, resolves the listed indices (or every GPU the process can see). Indices are
    NVML's (PCI bus) order: processes that reorder devices should list UUIDs.
    """
    explicit = environ.get(GPU_UUIDS_VARIABLE)
    if explicit is not None:
        return [item.strip() for item in explicit.split(",") if item.strip()]
    for variable in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        raw = environ.get(variable)
        if raw is None:
            continue
        items = [item.strip() for item in raw.split(",")]
        if raw.strip() in _NO_DEVICES:
            return []
        if all(item.startswith(_UUID_PREFIXES) for item in items):
            return items
        if raw.strip() == "all":
            return nvml_uuids(None)
        if all(item.isdigit() for item in items):
            # NVIDIA_VISIBLE_DEVICES indices are the host's; inside the container NVML sees
            # exactly those devices, so all of them are the answer.
            return nvml_uuids(
                [int(item) for item in items] if variable == "CUDA_VISIBLE_DEVICES" else None
            )
        return []  # mixed or unknown forms: leave the mapping to NVML's process list
    return nvml_uuids(None)
