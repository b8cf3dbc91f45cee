"""GPU sampler over NVML (the official ``pynvml`` binding): one sample per GPU per interval.

Every ``interval_s`` (default 100 ms) the sampler thread reads, per GPU: utilisation and memory
controller utilisation, DRAM bandwidth (GPM ``DRAM_BW_UTIL`` on GPUs that support GPM, Hopper and
newer; else the memory controller's busy share as an upper-bound estimate), memory used, power,
SM and memory clocks and temperature (the fast fields, microseconds per call). Each sample lands
in a bounded ring per GPU with its Unix ns timestamp, so the enricher can aggregate exactly the
samples inside a span's window. Peak bandwidth is derived once per GPU: bus width (bits) / 8 x
max memory clock x 2 (double data rate), which gives the datasheet figure (H100 SXM: 5120 bits,
2619 MHz -> 3.35 TB/s).

Slow reads never run inside that tick: on an H100 (driver 580) one ``nvmlDeviceGetPcieThroughput``
call blocks for ~21 ms (the driver measures over a window) and ``nvmlDeviceGetProcessUtilization``
takes ~2.5 ms, so reading them in the tick made one GPU's tick 42 ms and 8 GPUs' ~340 ms. A second,
low-priority thread reads the slow fields (``_SLOW_FIELDS``: PCIe TX/RX, every ``pcie_interval_s``)
and refreshes the process list (every ``process_refresh_s``); the fast tick copies each slow field's
latest value into its sample, or None once that value is older than ``_SLOW_MAX_AGE_INTERVALS``
of its interval (the slow reader stopped producing: never a stale value).

NVML errors are handled per field: a field a GPU does not support (or that needs privileges) is
reported once and never read again on that GPU; a lost GPU is reported once and no longer sampled;
anything else is counted and the field skipped for that tick. On a machine without NVML,
``start()`` says so once and returns False; the node agent then relays spans unchanged.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final, NamedTuple

_log = logging.getLogger(__name__)

_DEFAULT_INTERVAL_S: Final = 0.1
_DEFAULT_RING_SAMPLES: Final = 6000
"""Ten minutes at the default interval: spans older than that find no samples."""
_DEFAULT_PROCESS_REFRESH_S: Final = 1.0
_DEFAULT_MAX_PROCESSES: Final = 1024
_DEFAULT_PCIE_INTERVAL_S: Final = 1.0
_SLOW_MAX_AGE_INTERVALS: Final = 3
"""A slow field's value older than this many of its intervals is reported as None."""
_SLOW_THREAD_NICE: Final = 10
"""Added to the slow thread's nice value (Linux: per thread), best effort."""
_SLOW_MIN_WAIT_S: Final = 0.005
_BYTES_PER_KB: Final = 1000  # NVML's PCIe throughput unit is KB/s
_MHZ: Final = 1_000_000
_DDR: Final = 2  # two transfers per memory clock

# NVML return codes that mean "this GPU will never answer this": stop asking.
_NOT_SUPPORTED_CODES: Final = frozenset(
    {3, 4, 13}
)  # NOT_SUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND
_GPU_IS_LOST: Final = 15


class _SlowField(NamedTuple):
    """A field read off the fast tick, by the slow thread, every ``interval_s`` of its cadence."""

    name: str
    """The field's name in errors and the disabled set (as the fast fields')."""
    cadence: str
    """Which interval option paces it (``NvmlSampler(<cadence>_interval_s=...)``)."""
    read: Callable[[Any, Any], Any]
    """(pynvml, handle) -> the raw value."""


# NVML_PCIE_UTIL_TX_BYTES = 0, NVML_PCIE_UTIL_RX_BYTES = 1; ~21 ms per call on an H100.
_SLOW_FIELDS: Final = (
    _SlowField("pcie_tx", "pcie", lambda nvml, handle: nvml.nvmlDeviceGetPcieThroughput(handle, 0)),
    _SlowField("pcie_rx", "pcie", lambda nvml, handle: nvml.nvmlDeviceGetPcieThroughput(handle, 1)),
)


class GpuSample(NamedTuple):
    """One GPU's readings at ``time_ns`` (Unix ns); None where the GPU did not report."""

    time_ns: int
    utilization: float | None
    """Share of the last sample period (0..1) in which a kernel ran."""
    memory_controller_utilization: float | None
    memory_bandwidth_bps: float | None
    memory_used_bytes: int | None
    power_watts: float | None
    sm_clock_mhz: int | None
    memory_clock_mhz: int | None
    temperature_c: int | None
    pcie_tx_bytes_per_s: float | None
    pcie_rx_bytes_per_s: float | None


@dataclass(frozen=True, slots=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int | None
    peak_bandwidth_bps: float | None
    """None when NVML reports no bus width or max memory clock."""
    gpm_supported: bool


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    pid: int
    gpu_uuid: str
    memory_used_bytes: int | None
    sm_utilization: float | None
    memory_utilization: float | None


class SampleRing:
    """The last ``capacity`` samples of one GPU, in time order, safe for one writer + readers."""

    __slots__ = ("_capacity", "_lock", "_samples", "_times")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._times: list[int] = []
        self._samples: list[GpuSample] = []

    def append(self, sample: GpuSample) -> None:
        with self._lock:
            self._times.append(sample.time_ns)
            self._samples.append(sample)
            # Trim in chunks: amortised O(1), and readers bisect plain lists.
            if len(self._times) > 2 * self._capacity:
                del self._times[: -self._capacity]
                del self._samples[: -self._capacity]

    def window(self, start_ns: int, end_ns: int) -> tuple[list[GpuSample], GpuSample | None]:
        """The samples with ``start_ns <= time <= end_ns``, and the first one after ``end_ns``."""
        with self._lock:
            first = bisect.bisect_left(self._times, start_ns)
            last = bisect.bisect_right(self._times, end_ns)
            following = self._samples[last] if last < len(self._samples) else None
            return self._samples[first:last], following

    def latest_time_ns(self) -> int | None:
        with self._lock:
            return self._times[-1] if self._times else None

    def latest(self) -> GpuSample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def snapshot(self) -> list[GpuSample]:
        with self._lock:
            return self._samples[-self._capacity :]


class _DeviceState:
    """What the sampler keeps per GPU besides its ring: handle, GPM samples, disabled fields."""

    __slots__ = ("device", "disabled", "gpm_samples", "handle", "lost", "ring", "slow")

    def __init__(self, device: GpuDevice, handle: Any, ring: SampleRing) -> None:
        self.device = device
        self.handle = handle
        self.ring = ring
        self.disabled: set[str] = set()
        self.lost = False
        self.gpm_samples: list[Any] = []
        self.slow: dict[str, tuple[int, Any]] = {}
        """Slow field -> (clock ns when read, raw value); written by the slow thread."""


class _FieldUnavailable(Exception):
    """The field is disabled or lost on this GPU (already reported)."""


def load_nvml() -> ModuleType:
    """The ``pynvml`` module, initialised; raises (ImportError, NVMLError) where there is none."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


class NvmlSampler:
    """Samples every GPU of the node at a fixed rate on its own thread."""

    def __init__(
        self,
        *,
        interval_s: float = _DEFAULT_INTERVAL_S,
        ring_samples: int = _DEFAULT_RING_SAMPLES,
        process_refresh_s: float = _DEFAULT_PROCESS_REFRESH_S,
        max_processes: int = _DEFAULT_MAX_PROCESSES,
        pcie_interval_s: float = _DEFAULT_PCIE_INTERVAL_S,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        if pcie_interval_s <= 0:
            raise ValueError("pcie_interval_s must be positive")
        if ring_samples < 1:
            raise ValueError("ring_samples must be at least 1")
        self._interval_s = interval_s
        self._ring_samples = ring_samples
        self._process_refresh_ns = int(process_refresh_s * 1e9)
        self._cadence_ns = {"pcie": int(pcie_interval_s * 1e9)}
        self._next_slow_ns = dict.fromkeys(self._cadence_ns, 0)
        self._slow_max_age_ns = {
            field.name: _SLOW_MAX_AGE_INTERVALS * self._cadence_ns[field.cadence]
            for field in _SLOW_FIELDS
        }
        self._max_processes = max_processes
        self._clock = clock
        self._nvml: Any = None
        self._states: list[_DeviceState] = []
        self._by_uuid: dict[str, _DeviceState] = {}
        self._processes: dict[int, tuple[str, ...]] = {}
        self._process_usage: list[ProcessUsage] = []
        self._process_util_seen_us: dict[str, int] = {}
        self._next_process_refresh_ns = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._slow_thread: threading.Thread | None = None
        self._error_lock = threading.Lock()
        """The fast and the slow thread both report errors (and may both see a GPU lost)."""
        self.unavailable_reason: str | None = None
        self.ticks = 0
        self.read_errors = 0
        """Transient NVML errors (the field was skipped for that tick)."""
        self.disabled_fields = 0
        self.lost_gpus = 0
        self.dropped_processes = 0
        self.tick_cpu_ns = 0
        """Fast thread CPU time spent sampling, for the overhead report."""
        self.tick_wall_ns = 0
        """Wall time of the fast ticks (what stamps a sample late if it grows)."""
        self.max_tick_wall_ns = 0
        self.slow_passes = 0
        self.slow_cpu_ns = 0
        """Slow thread CPU time (slow fields and the process list)."""
        self.slow_wall_ns = 0

    # --- lifecycle -------------------------------------------------------------------------------
    def open(self) -> bool:
        """Initialise NVML and find the GPUs; False (said once in the log) when there is no NVML."""
        try:
            self._nvml = load_nvml()
        except Exception as error:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.unavailable_reason = f"{type(error).__name__}: {error}"
            _log.warning(
                "tokentrace node agent: NVML is not available (%s); relaying spans without GPU "
                "samples",
                self.unavailable_reason,
            )
            return False
        nvml = self._nvml
        count = nvml.nvmlDeviceGetCount()
        for index in range(count):
            try:
                state = self._open_device(index)
            except nvml.NVMLError as error:
                _log.warning("tokentrace node agent: GPU %d skipped: %s", index, error)
                continue
            self._states.append(state)
            self._by_uuid[state.device.uuid] = state
        for state in self._states:
            device = state.device
            _log.info(
                "tokentrace node agent: GPU %d %s %s, peak memory bandwidth %s, bandwidth from %s",
                device.index,
                device.uuid,
                device.name,
                "unknown"
                if device.peak_bandwidth_bps is None
                else f"{device.peak_bandwidth_bps / 1e9:.0f} GB/s",
                "GPM DRAM_BW_UTIL" if device.gpm_supported else "memory controller utilisation",
            )
        return True

    def _open_device(self, index: int) -> _DeviceState:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        name = _text(self._optional(lambda: nvml.nvmlDeviceGetName(handle)) or "")
        memory = self._optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        bus_width = self._optional(lambda: nvml.nvmlDeviceGetMemoryBusWidth(handle))
        max_memory_clock = self._optional(
            lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM)
        )
        peak = (
            bus_width / 8 * max_memory_clock * _MHZ * _DDR
            if bus_width and max_memory_clock
            else None
        )
        gpm_samples = self._open_gpm(handle)
        device = GpuDevice(
            index=index,
            uuid=uuid,
            name=name,
            memory_total_bytes=None if memory is None else int(memory.total),
            peak_bandwidth_bps=peak,
            gpm_supported=bool(gpm_samples),
        )
        state = _DeviceState(device, handle, SampleRing(self._ring_samples))
        state.gpm_samples = gpm_samples
        return state

    def _open_gpm(self, handle: Any) -> list[Any]:
        """Two GPM sample buffers with the first one taken, or [] where GPM is unsupported."""
        nvml = self._nvml
        try:
            if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                return []
            samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
            nvml.nvmlGpmSampleGet(handle, samples[0])
        except (nvml.NVMLError, AttributeError):  # old driver or binding: no GPM
            return []
        return samples

    def _optional(self, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except self._nvml.NVMLError:
            return None

    def start(self) -> bool:
        """``open()`` and start the sampling thread; False (nothing started) without NVML."""
        if self._nvml is None and not self.open():
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tokentrace-nvml", daemon=True)
        self._slow_thread = threading.Thread(
            target=self._run_slow, name="tokentrace-nvml-slow", daemon=True
        )
        self._thread.start()
        self._slow_thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._slow_thread):
            if thread is not None:
                thread.join(5.0)
        self._thread = self._slow_thread = None
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            for state in self._states:
                for gpm_sample in state.gpm_samples:
                    with contextlib.suppress(nvml.NVMLError):
                        nvml.nvmlGpmSampleFree(gpm_sample)
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()

    def _run(self) -> None:
        deadline = time.monotonic()
        while not self._stop.is_set():
            started = time.thread_time_ns()
            started_wall = time.perf_counter_ns()
            try:
                self.tick()
            except Exception:  # never let the thread die: the next tick tries again
                self._count_error()
                _log.exception("tokentrace node agent: GPU sampling failed")
            self.tick_cpu_ns += time.thread_time_ns() - started
            wall = time.perf_counter_ns() - started_wall
            self.tick_wall_ns += wall
            self.max_tick_wall_ns = max(self.max_tick_wall_ns, wall)
            # Fixed rate, not fixed delay: a slow tick does not shift every later sample. Ticks
            # missed in a stall are skipped, not caught up (two samples of one period are noise).
            deadline += self._interval_s
            now = time.monotonic()
            if deadline < now:
                deadline = now + self._interval_s
            self._stop.wait(deadline - now)

    def _run_slow(self) -> None:
        """The slow thread: slow fields and the process list, each on its own cadence."""
        with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _SLOW_THREAD_NICE)
        while not self._stop.is_set():
            started = time.thread_time_ns()
            started_wall = time.perf_counter_ns()
            try:
                self.read_slow()
            except Exception:  # never let the thread die
                self._count_error()
                _log.exception("tokentrace node agent: slow GPU sampling failed")
            self.slow_cpu_ns += time.thread_time_ns() - started
            self.slow_wall_ns += time.perf_counter_ns() - started_wall
            self.slow_passes += 1
            due = min(self._next_process_refresh_ns, *self._next_slow_ns.values())
            longest_s = max(self._process_refresh_ns, *self._cadence_ns.values()) / 1e9
            wait_s = (due - self._clock()) / 1e9
            self._stop.wait(min(longest_s, max(_SLOW_MIN_WAIT_S, wait_s)))

    # --- sampling --------------------------------------------------------------------------------
    def sample_once(self) -> None:
        """``read_slow()`` then ``tick()``: every field, in this thread (tests, one-off reads).
        The sampler's threads call the two separately, so slow reads never delay a tick. One clock
        read serves both."""
        now = self._clock()
        self.read_slow(now)
        self.tick(now)

    def tick(self, now_ns: int | None = None) -> None:
        """Take one sample of every GPU: the fast fields read now, the slow fields' latest values
        (None past their age bound). One clock read stamps every GPU's sample of the tick (the
        fast reads take microseconds). ``now_ns``: the stamp, else the clock now."""
        now = self._clock() if now_ns is None else now_ns
        for state in self._states:
            if not state.lost:
                sample = self._sample_device(state, now)
                if sample is not None:
                    state.ring.append(sample)
        self.ticks += 1

    def read_slow(self, now_ns: int | None = None) -> None:
        """Read the slow fields and refresh the process list where their cadence is due; the
        values read are stamped ``now_ns`` (else the clock now), the start of the pass, so their
        age errs on the old side."""
        now = self._clock() if now_ns is None else now_ns
        # Also due when the wall clock stepped back by more than an interval (NTP).
        for cadence, next_ns in self._next_slow_ns.items():
            if now >= next_ns or next_ns - now > self._cadence_ns[cadence]:
                self._next_slow_ns[cadence] = now + self._cadence_ns[cadence]
                self._read_slow_fields(cadence, now)
        next_refresh = self._next_process_refresh_ns
        if now >= next_refresh or next_refresh - now > self._process_refresh_ns:
            self._next_process_refresh_ns = now + self._process_refresh_ns
            self._refresh_processes()

    def _read_slow_fields(self, cadence: str, now_ns: int) -> None:
        nvml = self._nvml
        for state in self._states:
            if state.lost:
                continue
            read = self._reader(state)
            handle = state.handle
            try:
                for field in _SLOW_FIELDS:
                    if field.cadence != cadence or field.name in state.disabled:
                        continue
                    value = read(field.name, functools.partial(field.read, nvml, handle))
                    if value is not None:
                        state.slow[field.name] = (now_ns, value)
            except _FieldUnavailable:  # lost during this pass
                continue

    def _slow_value(self, state: _DeviceState, field: str, now_ns: int) -> Any:
        """The slow field's latest value, or None when there is none younger than its bound."""
        entry = state.slow.get(field)
        if entry is None or field in state.disabled:
            return None
        read_ns, value = entry
        return None if now_ns - read_ns > self._slow_max_age_ns[field] else value

    def _sample_device(self, state: _DeviceState, now_ns: int) -> GpuSample | None:
        nvml = self._nvml
        handle = state.handle
        read = self._reader(state)
        try:
            rates = read("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
            memory = read("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
            power_mw = read("power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
            sm_clock = read("sm_clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, 1))
            memory_clock = read("memory_clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, 2))
            temperature = read("temperature", lambda: nvml.nvmlDeviceGetTemperature(handle, 0))
            dram_busy = (
                read("gpm_dram_bandwidth", lambda: self._gpm_dram_utilization(state))
                if state.gpm_samples
                else None
            )
        except _FieldUnavailable:  # the GPU was lost during this tick
            return None
        pcie_tx = self._slow_value(state, "pcie_tx", now_ns)
        pcie_rx = self._slow_value(state, "pcie_rx", now_ns)
        memory_busy = None if rates is None else rates.memory / 100
        peak = state.device.peak_bandwidth_bps
        busy_share = dram_busy / 100 if dram_busy is not None else memory_busy
        return GpuSample(
            time_ns=now_ns,
            utilization=None if rates is None else rates.gpu / 100,
            memory_controller_utilization=memory_busy,
            memory_bandwidth_bps=None if busy_share is None or peak is None else busy_share * peak,
            memory_used_bytes=None if memory is None else int(memory.used),
            power_watts=None if power_mw is None else power_mw / 1000,
            sm_clock_mhz=sm_clock,
            memory_clock_mhz=memory_clock,
            temperature_c=temperature,
            pcie_tx_bytes_per_s=None if pcie_tx is None else pcie_tx * _BYTES_PER_KB,
            pcie_rx_bytes_per_s=None if pcie_rx is None else pcie_rx * _BYTES_PER_KB,
        )

    def _gpm_dram_utilization(self, state: _DeviceState) -> float:
        nvml = self._nvml
        previous, current = state.gpm_samples
        nvml.nvmlGpmSampleGet(state.handle, current)
        state.gpm_samples = [current, previous]
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1 = previous
        request.sample2 = current
        request.metrics[0].metricId = nvml.NVML_GPM_METRIC_DRAM_BW_UTIL
        nvml.nvmlGpmMetricsGet(request)
        result = request.metrics[0]
        if result.nvmlReturn != nvml.NVML_SUCCESS:
            raise nvml.NVMLError(result.nvmlReturn)
        return float(result.value)

    def _reader(self, state: _DeviceState) -> Callable[[str, Callable[[], Any]], Any]:
        nvml = self._nvml

        def read(field: str, call: Callable[[], Any]) -> Any:
            if field in state.disabled:
                return None
            try:
                return call()
            except nvml.NVMLError as error:
                self._on_error(state, field, error)
                if state.lost:
                    raise _FieldUnavailable from None
                return None

        return read

    def _count_error(self) -> None:
        with self._error_lock:
            self.read_errors += 1

    def _on_error(self, state: _DeviceState, field: str, error: Any) -> None:
        with self._error_lock:
            self._on_error_locked(state, field, error)

    def _on_error_locked(self, state: _DeviceState, field: str, error: Any) -> None:
        code = getattr(error, "value", None)
        device = state.device
        if code == _GPU_IS_LOST:
            if state.lost:  # the other thread saw it first
                return
            state.lost = True
            self.lost_gpus += 1
            _log.error(
                "tokentrace node agent: GPU %d %s is lost (NVML: %s); no longer sampled",
                device.index,
                device.uuid,
                error,
            )
        elif code in _NOT_SUPPORTED_CODES:
            if field in state.disabled:
                return
            state.disabled.add(field)
            self.disabled_fields += 1
            _log.info(
                "tokentrace node agent: GPU %d %s does not report %s (NVML: %s); not read again",
                device.index,
                device.uuid,
                field,
                error,
            )
        else:
            self.read_errors += 1

    def _refresh_processes(self) -> None:
        """NVML's process list: which pids use which GPU (the span -> GPU fallback) and usage."""
        gpus_by_pid: dict[int, list[str]] = {}
        usage: list[ProcessUsage] = []
        for state in self._states:
            if state.lost:
                continue
            try:
                processes, utilization = self._read_processes(state)
            except _FieldUnavailable:
                continue
            uuid = state.device.uuid
            by_pid = utilization or {}
            for process in processes or ():
                if len(gpus_by_pid) >= self._max_processes and process.pid not in gpus_by_pid:
                    self.dropped_processes += 1
                    continue
                gpus_by_pid.setdefault(process.pid, []).append(uuid)
                sm, mem = by_pid.get(process.pid, (None, None))
                used = process.usedGpuMemory
                usage.append(
                    ProcessUsage(
                        pid=process.pid,
                        gpu_uuid=uuid,
                        # NVML reports "not available" as an all-ones value.
                        memory_used_bytes=None if used is None or used >= 2**63 else int(used),
                        sm_utilization=sm,
                        memory_utilization=mem,
                    )
                )
        self._processes = {pid: tuple(uuids) for pid, uuids in gpus_by_pid.items()}
        self._process_usage = usage

    def _read_processes(self, state: _DeviceState) -> tuple[Any, Any]:
        nvml = self._nvml
        read = self._reader(state)
        processes = read(
            "processes", lambda: nvml.nvmlDeviceGetComputeRunningProcesses(state.handle)
        )
        return processes, read("process_utilization", lambda: self._process_util(state))

    def _process_util(self, state: _DeviceState) -> dict[int, tuple[float, float]]:
        """Per-pid SM and memory utilisation (0..1) since the last call on this GPU."""
        nvml = self._nvml
        uuid = state.device.uuid
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(
                state.handle, self._process_util_seen_us.get(uuid, 0)
            )
        except nvml.NVMLError as error:
            if getattr(error, "value", None) == nvml.NVML_ERROR_NOT_FOUND:
                return {}  # no process ran a kernel since the last call
            raise
        latest: dict[int, tuple[float, float]] = {}
        seen = self._process_util_seen_us.get(uuid, 0)
        for sample in samples:
            latest[sample.pid] = (sample.smUtil / 100, sample.memUtil / 100)
            seen = max(seen, sample.timeStamp)
        self._process_util_seen_us[uuid] = seen
        return latest

    # --- reading (enricher, metrics, tests) ------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._nvml is not None

    @property
    def devices(self) -> list[GpuDevice]:
        return [state.device for state in self._states]

    def device(self, uuid: str) -> GpuDevice | None:
        state = self._by_uuid.get(uuid)
        return None if state is None else state.device

    def ring(self, uuid: str) -> SampleRing | None:
        state = self._by_uuid.get(uuid)
        return None if state is None else state.ring

    def gpus_of_pid(self, pid: int) -> tuple[str, ...]:
        return self._processes.get(pid, ())

    def process_usage(self) -> Sequence[ProcessUsage]:
        return self._process_usage

    @property
    def sampled_gpus(self) -> int:
        """GPUs still being sampled (not lost)."""
        return sum(not state.lost for state in self._states)

    def sampled_until_ns(self, uuids: Iterable[str] | None = None) -> int | None:
        """The time up to which every (given) GPU that is still sampled has a sample."""
        latest: int | None = None
        for state in self._states if uuids is None else map(self._by_uuid.get, uuids):
            if state is None or state.lost:
                continue
            time_ns = state.ring.latest_time_ns()
            if time_ns is None:
                return None
            latest = time_ns if latest is None else min(latest, time_ns)
        return latest

    def stats(self) -> dict[str, int]:
        return {
            "gpus": len(self._states),
            "ticks": self.ticks,
            "read_errors": self.read_errors,
            "disabled_fields": self.disabled_fields,
            "lost_gpus": self.lost_gpus,
            "dropped_processes": self.dropped_processes,
            "tick_cpu_ns": self.tick_cpu_ns,
            "tick_wall_ns": self.tick_wall_ns,
            "max_tick_wall_ns": self.max_tick_wall_ns,
            "slow_passes": self.slow_passes,
            "slow_cpu_ns": self.slow_cpu_ns,
            "slow_wall_ns": self.slow_wall_ns,
        }


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
