"""GPU aggregates on spans: each phase span gets the samples of its own time window.

``SpanEnricher.enrich(request)`` walks one ``ExportTraceServiceRequest`` in place. Per resource it
finds the process's GPUs (the in-process agent's ``tokentrace.gpu.uuids``; else NVML's process
list by ``process.pid``, which it then writes to the resource), and per ``llm.request``,
``llm.prefill``, ``llm.decode`` and ``llm.engine.step`` span appends the aggregates of the samples
with ``start <= time <= end`` on those GPUs. A window with no sample inside (a 5 ms engine step
between two 100 ms samples) gets the next sample's values, which cover it, and
``tokentrace.gpu.samples = 0``.

Decode roofline: a decode step reads every weight once, so with ``W`` weight bytes and peak
bandwidth ``P`` no token can come faster than ``W / P``; ``llm.decode`` gets that over its
measured time per token. ``W`` comes from the in-process agent's ``llm.cold_start.weight_load``
spans (one per worker, summed over the workers of the latest start on the same GPUs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.agent.node.sampler import GpuDevice, GpuSample, NvmlSampler

ENRICHED_SPANS: Final = frozenset(
    {semconv.SPAN_REQUEST, semconv.SPAN_PREFILL, semconv.SPAN_DECODE, semconv.SPAN_ENGINE_STEP}
)
_DEFAULT_MAX_WEIGHT_ENTRIES: Final = 256


@dataclass(frozen=True, slots=True)
class WindowAggregate:
    """What one span's window looked like on its GPUs (sums over GPUs where that is meaningful:
    bandwidth, memory, power; means over all samples for shares and clocks)."""

    samples: int
    utilization_mean: float | None
    utilization_max: float | None
    memory_controller_utilization_mean: float | None
    memory_bandwidth_bps: float | None
    peak_bandwidth_bps: float | None
    memory_used_bytes: float | None
    power_watts: float | None
    sm_clock_mhz: float | None
    memory_clock_mhz: float | None
    bandwidth_source: str

    def attributes(self) -> list[tuple[str, int | float | str]]:
        pairs: list[tuple[str, int | float | str | None]] = [
            (semconv.GPU_SAMPLES, self.samples),
            (semconv.GPU_UTILIZATION_MEAN, self.utilization_mean),
            (semconv.GPU_UTILIZATION_MAX, self.utilization_max),
            (
                semconv.GPU_MEMORY_CONTROLLER_UTILIZATION_MEAN,
                self.memory_controller_utilization_mean,
            ),
            (semconv.GPU_MEMORY_USED_BYTES, _round_int(self.memory_used_bytes)),
            (semconv.GPU_POWER_WATTS, self.power_watts),
            (semconv.GPU_SM_CLOCK_MHZ, self.sm_clock_mhz),
            (semconv.GPU_MEMORY_CLOCK_MHZ, self.memory_clock_mhz),
        ]
        if self.memory_bandwidth_bps is not None:
            pairs.append((semconv.GPU_MEMORY_BANDWIDTH_GBPS, self.memory_bandwidth_bps / 1e9))
            pairs.append((semconv.GPU_MEMORY_BANDWIDTH_SOURCE, self.bandwidth_source))
            if self.peak_bandwidth_bps:
                pairs.append(
                    (
                        semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO,
                        self.memory_bandwidth_bps / self.peak_bandwidth_bps,
                    )
                )
        if self.peak_bandwidth_bps is not None:
            pairs.append((semconv.GPU_MEMORY_BANDWIDTH_PEAK_GBPS, self.peak_bandwidth_bps / 1e9))
        return [(key, value) for key, value in pairs if value is not None]


def _round_int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def aggregate_window(
    per_gpu: Sequence[tuple[GpuDevice, Sequence[GpuSample]]], *, samples_inside: int
) -> WindowAggregate | None:
    """Aggregate each GPU's samples of one window (``samples_inside``: how many were inside it,
    0 when each GPU's list is the one covering sample)."""
    utilization: list[float] = []
    memory_busy: list[float] = []
    sm_clock: list[float] = []
    memory_clock: list[float] = []
    bandwidth_sum: float | None = None
    peak_sum: float | None = None
    memory_sum: float | None = None
    power_sum: float | None = None
    all_gpm = True
    for device, samples in per_gpu:
        if not samples:
            continue
        utilization += [s.utilization for s in samples if s.utilization is not None]
        memory_busy += [
            s.memory_controller_utilization
            for s in samples
            if s.memory_controller_utilization is not None
        ]
        sm_clock += [s.sm_clock_mhz for s in samples if s.sm_clock_mhz is not None]
        memory_clock += [s.memory_clock_mhz for s in samples if s.memory_clock_mhz is not None]
        bandwidth = _mean(
            [s.memory_bandwidth_bps for s in samples if s.memory_bandwidth_bps is not None]
        )
        bandwidth_sum = _add(bandwidth_sum, bandwidth)
        peak_sum = _add(peak_sum, device.peak_bandwidth_bps)
        memory_sum = _add(
            memory_sum,
            _mean([s.memory_used_bytes for s in samples if s.memory_used_bytes is not None]),
        )
        power_sum = _add(
            power_sum, _mean([s.power_watts for s in samples if s.power_watts is not None])
        )
        all_gpm = all_gpm and device.gpm_supported
    if not (utilization or memory_busy or bandwidth_sum is not None or memory_sum is not None):
        return None
    return WindowAggregate(
        samples=samples_inside,
        utilization_mean=_mean(utilization),
        utilization_max=max(utilization) if utilization else None,
        memory_controller_utilization_mean=_mean(memory_busy),
        memory_bandwidth_bps=bandwidth_sum,
        peak_bandwidth_bps=peak_sum,
        memory_used_bytes=memory_sum,
        power_watts=power_sum,
        sm_clock_mhz=_mean(sm_clock),
        memory_clock_mhz=_mean(memory_clock),
        bandwidth_source=semconv.MEMORY_BANDWIDTH_SOURCE_GPM
        if all_gpm
        else semconv.MEMORY_BANDWIDTH_SOURCE_MEMORY_CONTROLLER,
    )


def _add(total: float | None, value: float | None) -> float | None:
    if value is None:
        return total
    return value if total is None else total + value


def _set_value(target: AnyValue, value: int | float | str) -> None:
    if isinstance(value, str):
        target.string_value = value
    elif isinstance(value, int):
        target.int_value = value
    else:
        target.double_value = value


class SpanEnricher:
    """Adds window aggregates to the phase spans of OTLP requests (one thread uses it)."""

    def __init__(
        self, sampler: NvmlSampler, *, max_weight_entries: int = _DEFAULT_MAX_WEIGHT_ENTRIES
    ) -> None:
        self._sampler = sampler
        self._max_weight_entries = max_weight_entries
        # GPU set -> (cold start trace id, {pid: weight bytes}): the workers of the latest start.
        self._weights: dict[tuple[str, ...], tuple[bytes, dict[int, int]]] = {}
        self.enriched_spans = 0
        self.unmapped_spans = 0
        """Phase spans of processes whose GPUs were unknown (relayed without GPU data)."""
        self.unsampled_spans = 0
        """Phase spans whose window has no sample at all (older than the ring, or not yet)."""
        self.roofline_spans = 0

    def process_gpus(
        self, resource_attributes: Sequence[KeyValue]
    ) -> tuple[tuple[str, ...], int, bool]:
        """(the process's GPUs, its pid or 0, whether its resource names GPUs) in one scan."""
        pid = 0
        named: tuple[str, ...] = ()
        for kv in resource_attributes:
            if kv.key == semconv.GPU_UUIDS:
                named = tuple(item.string_value for item in kv.value.array_value.values)
            elif kv.key == semconv.PROCESS_PID:
                pid = kv.value.int_value
        known = tuple(uuid for uuid in named if self._sampler.device(uuid) is not None)
        if known or not pid:
            return known, pid, bool(named)
        return self._sampler.gpus_of_pid(pid), pid, bool(named)

    def enrich(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            attributes = resource_spans.resource.attributes
            gpus, pid, named = self.process_gpus(attributes)
            if gpus and not named:  # mapped through NVML's process list: say which GPUs
                entry = attributes.add(key=semconv.GPU_UUIDS)
                for uuid in gpus:
                    entry.value.array_value.values.add(string_value=uuid)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    name = span.name
                    if name == semconv.SPAN_COLD_START_WEIGHT_LOAD and gpus:
                        self._learn_weights(gpus, pid, span)
                    elif name in ENRICHED_SPANS:
                        if not gpus:
                            self.unmapped_spans += 1
                            continue
                        self._enrich_span(span, gpus)

    def _enrich_span(self, span: Span, gpus: tuple[str, ...]) -> None:
        start, end = span.start_time_unix_nano, span.end_time_unix_nano
        per_gpu: list[tuple[GpuDevice, Sequence[GpuSample]]] = []
        covering: list[tuple[GpuDevice, Sequence[GpuSample]]] = []
        inside = 0
        for uuid in gpus:
            device = self._sampler.device(uuid)
            ring = self._sampler.ring(uuid)
            if device is None or ring is None:
                continue
            samples, following = ring.window(start, end)
            inside += len(samples)
            per_gpu.append((device, samples))
            if following is not None:
                covering.append((device, (following,)))
        aggregate = (
            aggregate_window(per_gpu, samples_inside=inside)
            if inside
            else aggregate_window(covering, samples_inside=0)
        )
        if aggregate is None:
            self.unsampled_spans += 1
            return
        added = aggregate.attributes()
        if span.name == semconv.SPAN_DECODE:
            ratio = self._roofline(span, gpus, aggregate.peak_bandwidth_bps)
            if ratio is not None:
                added.append((semconv.DECODE_ROOFLINE_RATIO, ratio))
        for key, value in added:
            _set_value(span.attributes.add(key=key).value, value)
        self.enriched_spans += 1

    def _learn_weights(self, gpus: tuple[str, ...], pid: int, span: Span) -> None:
        weight_bytes = next(
            (
                kv.value.int_value
                for kv in span.attributes
                if kv.key == semconv.MODEL_WEIGHT_BYTES and kv.value.HasField("int_value")
            ),
            None,
        )
        if not weight_bytes or weight_bytes <= 0:
            return
        key = tuple(sorted(gpus))
        entry = self._weights.get(key)
        if entry is None or entry[0] != span.trace_id:  # a new server start on these GPUs
            if entry is None and len(self._weights) >= self._max_weight_entries:
                self._weights.pop(next(iter(self._weights)))
            entry = (span.trace_id, {})
            self._weights[key] = entry
        entry[1][pid] = weight_bytes

    def weight_bytes(self, gpus: tuple[str, ...]) -> int | None:
        entry = self._weights.get(tuple(sorted(gpus)))
        return None if entry is None else sum(entry[1].values())

    def _roofline(self, span: Span, gpus: tuple[str, ...], peak_bps: float | None) -> float | None:
        weight_bytes = self.weight_bytes(gpus)
        if not weight_bytes or not peak_bps:
            return None
        tokens = 0
        for kv in span.attributes:
            if kv.key == semconv.DECODE_TOKEN_OFFSETS:
                tokens += len(kv.value.array_value.values)
            elif kv.key == semconv.DECODE_TOKEN_OFFSETS_DROPPED:
                tokens += kv.value.int_value
        duration_ns = span.end_time_unix_nano - span.start_time_unix_nano
        if tokens < 2 or duration_ns <= 0:
            return None
        measured_s = duration_ns / 1e9 / (tokens - 1)
        ratio = weight_bytes / peak_bps / measured_s
        if not math.isfinite(ratio):
            return None
        self.roofline_spans += 1
        return ratio

    def stats(self) -> dict[str, int]:
        return {
            "enriched_spans": self.enriched_spans,
            "unmapped_spans": self.unmapped_spans,
            "unsampled_spans": self.unsampled_spans,
            "roofline_spans": self.roofline_spans,
        }
