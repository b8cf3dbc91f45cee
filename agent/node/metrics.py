"""GPU metrics as OTLP: one ``ExportMetricsServiceRequest`` per export interval.

Names follow the OpenTelemetry hardware semantic conventions where they define one
(``hw.gpu.utilization``, ``hw.gpu.memory.usage`` / ``.limit`` / ``.utilization``, ``hw.gpu.io``,
``hw.power``; data points keyed by ``hw.id`` = the GPU's UUID); the rest are ``tokentrace.gpu.*``.
Gauges are the mean of the samples taken since the previous export (a 10 s export of 100 ms
samples reports the 10 s average, not one 100 ms glimpse); ``hw.gpu.io`` is a cumulative counter
integrated from NVML's PCIe throughput.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AGGREGATION_TEMPORALITY_CUMULATIVE,
    Metric,
    NumberDataPoint,
)

from tokentrace.agent import semconv
from tokentrace.agent.node.sampler import GpuSample, NvmlSampler


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _field_mean(
    samples: Sequence[GpuSample], read: Callable[[GpuSample], float | None]
) -> float | None:
    return _mean([value for value in map(read, samples) if value is not None])


class GpuMetrics:
    """Builds the node's GPU metric requests from the sampler's rings (one caller thread)."""

    def __init__(
        self, sampler: NvmlSampler, *, resource_attributes: Mapping[str, str], scope_version: str
    ) -> None:
        self._sampler = sampler
        self._resource = dict(resource_attributes)
        self._scope_version = scope_version
        self._start_ns: int | None = None
        self._last_ns: dict[str, int] = {}
        self._io_bytes: dict[tuple[str, str], float] = {}

    def collect(self, now_ns: int) -> tuple[ExportMetricsServiceRequest, int] | None:
        """The request for the samples since the last call, and its data point count; None
        when there is nothing new."""
        if self._start_ns is None:
            self._start_ns = now_ns
        metrics: dict[str, Metric] = {}
        points = 0

        def add(
            name: str,
            unit: str,
            value: float | None,
            attributes: Mapping[str, object],
            *,
            monotonic: bool | None = None,
        ) -> None:
            """A gauge point, or with ``monotonic`` a cumulative sum's point."""
            nonlocal points
            if value is None:
                return
            metric = metrics.get(name)
            if metric is None:
                metric = metrics[name] = Metric(name=name, unit=unit)
                if monotonic is None:
                    metric.gauge.SetInParent()
                else:
                    metric.sum.aggregation_temporality = AGGREGATION_TEMPORALITY_CUMULATIVE
                    metric.sum.is_monotonic = monotonic
            if monotonic is None:
                _point(metric.gauge.data_points.add(), now_ns, None, value, attributes)
            else:
                _point(metric.sum.data_points.add(), now_ns, self._start_ns, value, attributes)
            points += 1

        for device in self._sampler.devices:
            ring = self._sampler.ring(device.uuid)
            if ring is None:
                continue
            since = self._last_ns.get(device.uuid, 0)
            samples, _ = ring.window(since + 1, now_ns)
            if not samples:
                continue
            previous_ns = since or samples[0].time_ns
            self._last_ns[device.uuid] = samples[-1].time_ns
            gpu = {
                semconv.HW_ID: device.uuid,
                semconv.HW_NAME: device.name,
                semconv.HW_TYPE: semconv.HW_TYPE_GPU,
                semconv.HW_VENDOR: semconv.HW_VENDOR_NVIDIA,
            }
            latest = samples[-1]
            add(
                semconv.METRIC_HW_GPU_UTILIZATION,
                "1",
                _field_mean(samples, lambda s: s.utilization),
                {**gpu, semconv.HW_GPU_TASK: semconv.HW_GPU_TASK_GENERAL},
            )
            memory_controller = _field_mean(samples, lambda s: s.memory_controller_utilization)
            add(semconv.METRIC_GPU_MEMORY_CONTROLLER_UTILIZATION, "1", memory_controller, gpu)
            bandwidth = _field_mean(samples, lambda s: s.memory_bandwidth_bps)
            add(semconv.METRIC_GPU_MEMORY_BANDWIDTH, "By/s", bandwidth, gpu)
            if bandwidth is not None and device.peak_bandwidth_bps:
                add(
                    semconv.METRIC_GPU_MEMORY_BANDWIDTH_PEAK_RATIO,
                    "1",
                    bandwidth / device.peak_bandwidth_bps,
                    gpu,
                )
            add(
                semconv.METRIC_HW_GPU_MEMORY_USAGE,
                "By",
                latest.memory_used_bytes,
                gpu,
                monotonic=False,
            )
            add(
                semconv.METRIC_HW_GPU_MEMORY_LIMIT,
                "By",
                device.memory_total_bytes,
                gpu,
                monotonic=False,
            )
            if latest.memory_used_bytes is not None and device.memory_total_bytes:
                add(
                    semconv.METRIC_HW_GPU_MEMORY_UTILIZATION,
                    "1",
                    latest.memory_used_bytes / device.memory_total_bytes,
                    gpu,
                )
            add(semconv.METRIC_HW_POWER, "W", _field_mean(samples, lambda s: s.power_watts), gpu)
            add(
                semconv.METRIC_GPU_SM_CLOCK,
                "MHz",
                _field_mean(samples, lambda s: s.sm_clock_mhz),
                gpu,
            )
            add(
                semconv.METRIC_GPU_MEMORY_CLOCK,
                "MHz",
                _field_mean(samples, lambda s: s.memory_clock_mhz),
                gpu,
            )
            add(
                semconv.METRIC_GPU_TEMPERATURE,
                "Cel",
                _field_mean(samples, lambda s: s.temperature_c),
                gpu,
            )
            for direction, read in (
                (semconv.NETWORK_IO_DIRECTION_TRANSMIT, lambda s: s.pcie_tx_bytes_per_s),
                (semconv.NETWORK_IO_DIRECTION_RECEIVE, lambda s: s.pcie_rx_bytes_per_s),
            ):
                key = (device.uuid, direction)
                # Each sample's rate holds since the sample before it.
                moved = 0.0
                seen = False
                before = previous_ns
                for sample in samples:
                    rate = read(sample)
                    if rate is not None:
                        moved += rate * max(0, sample.time_ns - before) / 1e9
                        seen = True
                    before = sample.time_ns
                if seen or key in self._io_bytes:
                    self._io_bytes[key] = self._io_bytes.get(key, 0.0) + moved
                    add(
                        semconv.METRIC_HW_GPU_IO,
                        "By",
                        round(self._io_bytes[key]),
                        {**gpu, semconv.NETWORK_IO_DIRECTION: direction},
                        monotonic=True,
                    )
        for usage in self._sampler.process_usage():
            process = {semconv.HW_ID: usage.gpu_uuid, semconv.PROCESS_PID: usage.pid}
            add(
                semconv.METRIC_GPU_PROCESS_MEMORY_USAGE,
                "By",
                usage.memory_used_bytes,
                process,
                monotonic=False,
            )
            add(semconv.METRIC_GPU_PROCESS_UTILIZATION, "1", usage.sm_utilization, process)
        if not points:
            return None
        request = ExportMetricsServiceRequest()
        resource_metrics = request.resource_metrics.add()
        for name, text in self._resource.items():
            resource_metrics.resource.attributes.add(key=name).value.string_value = text
        scope_metrics = resource_metrics.scope_metrics.add()
        scope_metrics.scope.name = semconv.NODE_AGENT_SCOPE
        scope_metrics.scope.version = self._scope_version
        scope_metrics.metrics.extend(metrics.values())
        return request, points


def _point(
    point: NumberDataPoint,
    now_ns: int,
    start_ns: int | None,
    value: float,
    attributes: Mapping[str, object],
) -> None:
    point.time_unix_nano = now_ns
    if start_ns is not None:
        point.start_time_unix_nano = start_ns
    if isinstance(value, int):
        point.as_int = value
    else:
        point.as_double = value
    for key, attribute in attributes.items():
        entry: KeyValue = point.attributes.add(key=key)
        if isinstance(attribute, int):
            entry.value.int_value = attribute
        else:
            entry.value.string_value = str(attribute)
