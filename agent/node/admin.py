"""The node agent's admin listener (``--admin-endpoint``): ``/healthz``, ``/readyz`` and a
Prometheus ``/metrics``, on ``agent/admin_http.py``'s listener (the collector's too).

Imported only when the endpoint is set: ``prometheus-client`` is part of ``tokentrace[node]``
but nothing else of the node agent loads it. ``/metrics`` renders a registry of the agent's own
(never the process-global one) holding one custom collector, ``NodeAgentCollector``, which reads
at each scrape what the agent already counts (``NodeAgent.stats()``: its receivers, hold queue,
upstream sender and sampler) and each GPU's latest sample, so nothing is counted twice. Names are
``semconv``'s ``PROM_METRIC_NODE_*`` and ``PROM_METRIC_GPU_*``, in base units (bytes, watts,
hertz, ratios 0..1), GPUs labelled by UUID and name.

``/readyz``: the receivers listen, and spans can go on: the upstream is reachable or buffering
(its send queue has room for a batch) and the hold queue is below its cap.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector as PrometheusCollector

from tokentrace.agent import semconv
from tokentrace.agent.admin_http import AdminHttpServer, ReadinessCheck
from tokentrace.collector.receivers import split_endpoint

if TYPE_CHECKING:
    from tokentrace.agent.node.service import NodeAgent

_HZ_PER_MHZ: Final = 1_000_000
_COUNTER_SUFFIX: Final = "_total"
# Node agent stats keys (``NodeAgent.stats``): the receivers' counters are prefixed with the
# receiver's class name, the sender's with ``sender.``.
_ROUTED: Final = "route.routed_spans."
"""Per collector replica, with several (``TraceRouter.routing_stats``), then its endpoint."""
_ACCEPTED: Final = ".accepted_spans"
_REJECTED: Final = ".rejected_spans"
_GPU_LABELS: Final = (semconv.PROM_LABEL_GPU, semconv.PROM_LABEL_GPU_NAME)
REASON_INVALID: Final = "invalid"
REASON_HOLD_QUEUE_FULL: Final = "hold_queue_full"
REASON_UPSTREAM: Final = "upstream"
REASON_UPSTREAM_REJECTED: Final = "upstream_rejected"


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name.removesuffix(_COUNTER_SUFFIX), documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _summed(stats: Mapping[str, int], suffix: str) -> int:
    return sum(value for key, value in stats.items() if key.endswith(suffix))


class NodeAgentCollector(PrometheusCollector):
    """What the node agent counts and samples, as Prometheus metric families (module docstring)."""

    def __init__(self, agent: NodeAgent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        stats = agent.stats()
        config = agent.config
        yield _counter(
            semconv.PROM_METRIC_NODE_RECEIVED_SPANS,
            "spans the receivers handed on and the agent took",
            _summed({k: v for k, v in stats.items() if "Receiver." in k}, _ACCEPTED),
        )
        yield _counter(
            semconv.PROM_METRIC_NODE_RELAYED_SPANS,
            "spans queued for the collector",
            stats["relayed_spans"],
        )
        yield _counter(
            semconv.PROM_METRIC_NODE_SENT_SPANS,
            "spans the collector accepted",
            stats.get("sender.sent_spans", 0),
        )
        dropped = CounterMetricFamily(
            semconv.PROM_METRIC_NODE_DROPPED_SPANS.removesuffix(_COUNTER_SUFFIX),
            "spans dropped or refused, by reason",
            labels=(semconv.PROM_LABEL_REASON,),
        )
        receivers = {k: v for k, v in stats.items() if "Receiver." in k}
        for reason, value in (
            (REASON_INVALID, _summed(receivers, _REJECTED)),
            (REASON_HOLD_QUEUE_FULL, stats["refused_spans"]),
            (REASON_UPSTREAM, stats.get("sender.dropped_spans", 0)),
            (REASON_UPSTREAM_REJECTED, stats.get("sender.rejected_spans", 0)),
        ):
            dropped.add_metric((reason,), value)
        yield dropped
        yield _gauge(
            semconv.PROM_METRIC_NODE_HELD_SPANS,
            "spans waiting for their GPU samples",
            stats["held_spans"],
        )
        yield _gauge(
            semconv.PROM_METRIC_NODE_HOLD_CAPACITY,
            "the hold queue's capacity",
            config.max_held_spans,
        )
        yield _gauge(
            semconv.PROM_METRIC_NODE_QUEUE_LEN,
            "spans waiting to be sent to the collector",
            stats.get("sender.queue_len", 0),
        )
        yield _gauge(
            semconv.PROM_METRIC_NODE_QUEUE_CAPACITY,
            "the upstream send queue's capacity (one queue per collector replica)",
            config.exporter.queue_size * max(1, stats.get("route.endpoints", 1)),
        )
        yield _counter(
            semconv.PROM_METRIC_NODE_RELEASED_UNSAMPLED,
            "requests sent on before the sampler covered them",
            stats["released_unsampled"],
        )
        if "route.endpoints" in stats:
            yield from self._routing_families(stats)
        yield _counter(
            semconv.PROM_METRIC_NODE_SAMPLES,
            "GPU sampling passes",
            stats.get("sampler.ticks", 0),
        )
        yield from self._gpu_families()

    def _routing_families(self, stats: Mapping[str, int]) -> Iterator[Metric]:
        """Several collector replicas: where spans went, and how the replica set moved."""
        routed = CounterMetricFamily(
            semconv.PROM_METRIC_NODE_ROUTED_SPANS.removesuffix(_COUNTER_SUFFIX),
            "spans queued for each collector replica (re-routed ones included)",
            labels=(semconv.PROM_LABEL_ENDPOINT,),
        )
        for key, value in stats.items():
            if key.startswith(_ROUTED):
                routed.add_metric((key.removeprefix(_ROUTED),), value)
        yield routed
        yield _counter(
            semconv.PROM_METRIC_NODE_REROUTED_SPANS,
            "spans taken back from a leaving replica's queue and routed again",
            stats["route.rerouted_spans"],
        )
        yield _gauge(
            semconv.PROM_METRIC_NODE_UPSTREAM_ENDPOINTS,
            "collector replicas spans are routed over",
            stats["route.endpoints"],
        )
        yield _counter(
            semconv.PROM_METRIC_NODE_UPSTREAM_CHANGES,
            "changes of the collector replica set",
            stats["route.endpoint_set_changes"],
        )

    def _gpu_families(self) -> Iterator[Metric]:
        def family(name: str, documentation: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, documentation, labels=_GPU_LABELS)

        utilization = family(semconv.PROM_METRIC_GPU_UTILIZATION, "share of time a kernel ran")
        memory_used = family(semconv.PROM_METRIC_GPU_MEMORY_USED, "GPU memory in use")
        memory_total = family(semconv.PROM_METRIC_GPU_MEMORY_TOTAL, "GPU memory")
        power = family(semconv.PROM_METRIC_GPU_POWER, "power draw")
        sm_clock = family(semconv.PROM_METRIC_GPU_SM_CLOCK, "SM clock")
        bandwidth = family(
            semconv.PROM_METRIC_GPU_MEMORY_BANDWIDTH_UTILIZATION,
            "DRAM bandwidth as a share of the peak",
        )
        sampler = self._agent.sampler
        if sampler.available:
            for device in sampler.devices:
                labels = (device.uuid, device.name)
                if device.memory_total_bytes is not None:
                    memory_total.add_metric(labels, device.memory_total_bytes)
                ring = sampler.ring(device.uuid)
                sample = None if ring is None else ring.latest()
                if sample is None:
                    continue
                for target, value in (
                    (utilization, sample.utilization),
                    (memory_used, sample.memory_used_bytes),
                    (power, sample.power_watts),
                    (
                        sm_clock,
                        None if sample.sm_clock_mhz is None else sample.sm_clock_mhz * _HZ_PER_MHZ,
                    ),
                ):
                    if value is not None:
                        target.add_metric(labels, value)
                if sample.memory_bandwidth_bps is not None and device.peak_bandwidth_bps:
                    bandwidth.add_metric(
                        labels, sample.memory_bandwidth_bps / device.peak_bandwidth_bps
                    )
        yield from (utilization, memory_used, memory_total, power, sm_clock, bandwidth)

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry must not collect when this is registered."""
        return []


def readiness(agent: NodeAgent) -> Sequence[ReadinessCheck]:
    """The node agent's ``/readyz`` checks (module docstring)."""
    if agent.shutting_down:
        return [ReadinessCheck("node_agent", False, "shutting down")]
    receivers = agent.receivers
    if not receivers:
        return [ReadinessCheck("receivers", False, "not listening yet (starting)")]
    stats = agent.stats()
    config = agent.config
    listening = ", ".join(f"{type(r).__name__} {r.listening}" for r in receivers)
    # With several collector replicas each has its own queue: the fullest one decides.
    queued = stats.get("route.max_queue_len", stats.get("sender.queue_len", 0))
    queue_size = config.exporter.queue_size
    upstream = f"{queued} of {queue_size} spans queued for {agent.trace_sender.endpoint}"
    held = stats["held_spans"]
    hold = f"{held} of {config.max_held_spans} spans held"
    return [
        ReadinessCheck("receivers", True, listening),
        ReadinessCheck(
            "upstream",
            queue_size - queued >= config.exporter.max_batch_spans,
            upstream
            if queue_size - queued >= config.exporter.max_batch_spans
            else f"send queue full ({upstream}): collector unreachable?",
        ),
        ReadinessCheck(
            "hold_queue",
            held < config.max_held_spans,
            hold if held < config.max_held_spans else f"hold queue full ({hold})",
        ),
    ]


class NodeAdmin:
    """The listener, its registry and the node agent's collector; ``start`` raises OSError
    when the endpoint cannot be bound."""

    def __init__(self, agent: NodeAgent, endpoint: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeAgentCollector(agent))
        host, port = split_endpoint(endpoint)
        self.server = AdminHttpServer(
            host=host,
            port=port,
            readiness=lambda: readiness(agent),
            metrics=lambda: (generate_latest(self.registry), CONTENT_TYPE_LATEST),
        )

    def start(self) -> None:
        self.server.start()

    def shutdown(self, timeout_s: float) -> None:
        self.server.shutdown(timeout_s)
