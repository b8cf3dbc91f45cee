"""The NVML stand-in, exercised through the real pynvml binding."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from tests.node import nvml_stand_in
from tests.node.nvml_stand_in import (
    ALL_DEVICES,
    FIELDS,
    LIBRARY_NAME,
    NvmlStandIn,
    build_stand_in,
    library_env,
)

GIB = 1024**3
SUBPROCESS_TIMEOUT_S = 30
PYNVML_STRUCTS = (
    "c_nvmlUtilization_t",
    "c_nvmlMemory_t",
    "c_nvmlMemory_v2_t",
    "c_nvmlProcessInfo_v3_t",
    "c_nvmlProcessUtilizationSample_t",
    "c_nvmlGpmSupport_t",
    "c_nvmlGpmMetric_t",
    "c_nvmlGpmMetricsGet_t",
)


@pytest.fixture
def nvml_up(nvml: NvmlStandIn) -> Iterator[NvmlStandIn]:
    """The stand-in after pynvml.nvmlInit()."""
    pynvml.nvmlInit()
    yield nvml


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def gpm_metrics(device: Any, metric_ids: list[int]) -> Any:
    """pynvml's GPM flow: two samples taken one after the other, then the metrics between them."""
    first = pynvml.nvmlGpmSampleAlloc()
    second = pynvml.nvmlGpmSampleAlloc()
    try:
        pynvml.nvmlGpmSampleGet(device, first)
        pynvml.nvmlGpmSampleGet(device, second)
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(metric_ids)
        request.sample1 = first
        request.sample2 = second
        for position, metric_id in enumerate(metric_ids):
            request.metrics[position].metricId = metric_id
        return pynvml.nvmlGpmMetricsGet(request)
    finally:
        pynvml.nvmlGpmSampleFree(first)
        pynvml.nvmlGpmSampleFree(second)


# --- ABI and loading ----------------------------------------------------------------------


@pytest.mark.parametrize("struct_name", PYNVML_STRUCTS)
def test_c_structs_have_the_size_of_pynvml_structs(nvml: NvmlStandIn, struct_name: str) -> None:
    assert nvml.struct_size(struct_name) == ctypes.sizeof(getattr(pynvml, struct_name))


def test_gpm_metrics_array_length_matches_pynvml(nvml: NvmlStandIn) -> None:
    assert nvml.gpm_metric_max() == pynvml.NVML_GPM_METRIC_MAX


def test_pynvml_loads_the_stand_in_by_soname(nvml_up: NvmlStandIn) -> None:
    assert hasattr(pynvml.nvmlLib, "standin_reset")
    assert pynvml.nvmlDeviceGetCount() == 2
    assert nvml_up.calls("nvmlInitWithFlags") == 1


def test_calls_before_init_and_after_shutdown_raise_uninitialized(nvml: NvmlStandIn) -> None:
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    pynvml.nvmlInit()
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 2  # init is reference-counted
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()


def test_identity_of_devices(nvml_up: NvmlStandIn) -> None:
    nvml_up.reset(4)
    pynvml.nvmlInit()
    uuids = [pynvml.nvmlDeviceGetUUID(handle(i)) for i in range(4)]
    assert len(set(uuids)) == 4
    assert all(uuid.startswith("GPU-") for uuid in uuids)
    for index, uuid in enumerate(uuids):
        by_uuid = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        assert pynvml.nvmlDeviceGetIndex(by_uuid) == index
    assert pynvml.nvmlDeviceGetName(handle(3)) == "Stand-in H100"
    assert pynvml.nvmlSystemGetDriverVersion().count(".") == 2
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-not-there")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(4)


def test_device_count_follows_set_device_count(nvml_up: NvmlStandIn) -> None:
    nvml_up.set(1, "power_mw", 123_000)
    nvml_up.set_device_count(3)
    assert pynvml.nvmlDeviceGetCount() == 3
    assert pynvml.nvmlDeviceGetPowerUsage(handle(1)) == 123_000
    nvml_up.set_device_count(1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(1)


# --- Values ---------------------------------------------------------------------------------


def test_defaults_describe_an_idle_h100(nvml_up: NvmlStandIn) -> None:
    device = handle(0)
    memory = pynvml.nvmlDeviceGetMemoryInfo(device)
    assert (memory.total, memory.used, memory.free) == (80 * GIB, 10 * GIB, 70 * GIB)
    utilization = pynvml.nvmlDeviceGetUtilizationRates(device)
    assert (utilization.gpu, utilization.memory) == (50, 30)
    assert pynvml.nvmlDeviceGetPowerUsage(device) == 300_000
    assert pynvml.nvmlDeviceGetClockInfo(device, pynvml.NVML_CLOCK_SM) == 1755
    assert pynvml.nvmlDeviceGetClockInfo(device, pynvml.NVML_CLOCK_MEM) == 2619
    assert pynvml.nvmlDeviceGetMaxClockInfo(device, pynvml.NVML_CLOCK_SM) == 1980
    assert pynvml.nvmlDeviceGetMaxClockInfo(device, pynvml.NVML_CLOCK_MEM) == 2619
    assert pynvml.nvmlDeviceGetMemoryBusWidth(device) == 5120
    assert pynvml.nvmlDeviceGetTemperature(device, pynvml.NVML_TEMPERATURE_GPU) == 55
    assert pynvml.nvmlDeviceGetPcieThroughput(device, pynvml.NVML_PCIE_UTIL_TX_BYTES) == 1000
    assert pynvml.nvmlDeviceGetPcieThroughput(device, pynvml.NVML_PCIE_UTIL_RX_BYTES) == 2000


READERS: dict[str, Callable[[Any], float]] = {
    "gpu_util": lambda h: pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
    "mem_util": lambda h: pynvml.nvmlDeviceGetUtilizationRates(h).memory,
    "mem_used": lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).used,
    "mem_total": lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).total,
    "power_mw": pynvml.nvmlDeviceGetPowerUsage,
    "sm_clock": lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
    "mem_clock": lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
    "max_sm_clock": lambda h: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
    "max_mem_clock": lambda h: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
    "bus_width": pynvml.nvmlDeviceGetMemoryBusWidth,
    "temperature": lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
    "pcie_tx_kbps": lambda h: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES),
    "pcie_rx_kbps": lambda h: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES),
    "dram_bw_util": lambda h: (
        gpm_metrics(h, [pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL]).metrics[0].value
    ),
}


@pytest.mark.parametrize("field", sorted(READERS))
def test_set_value_is_read_on_that_device_only(nvml_up: NvmlStandIn, field: str) -> None:
    before_on_device_0 = READERS[field](handle(0))
    nvml_up.set(1, field, 77)
    assert READERS[field](handle(1)) == 77
    assert READERS[field](handle(0)) == before_on_device_0 != 77


def test_every_field_can_be_scripted(nvml: NvmlStandIn) -> None:
    for field in FIELDS:
        nvml.set(0, field, 1)
    assert set(READERS) <= FIELDS


def test_graphics_clock_is_the_sm_clock(nvml_up: NvmlStandIn) -> None:
    nvml_up.set(0, "sm_clock", 1410)
    assert pynvml.nvmlDeviceGetClockInfo(handle(0), pynvml.NVML_CLOCK_GRAPHICS) == 1410


def test_memory_free_is_total_minus_used(nvml_up: NvmlStandIn) -> None:
    nvml_up.set(0, "mem_total", 40 * GIB)
    nvml_up.set(0, "mem_used", 25 * GIB)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle(0))
    assert memory.free == 15 * GIB
    nvml_up.set(0, "mem_used", 50 * GIB)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(0)).free == 0


def test_memory_v2_splits_out_the_reserved_memory(nvml_up: NvmlStandIn) -> None:
    nvml_up.set(0, "mem_reserved", GIB // 2)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle(0), version=pynvml.nvmlMemory_v2)
    assert memory.reserved == GIB // 2
    assert memory.used == 10 * GIB - GIB // 2
    assert memory.free + memory.used + memory.reserved == memory.total == 80 * GIB
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetMemoryInfo(handle(0), version=1)


def test_ramp_advances_on_every_read(nvml_up: NvmlStandIn) -> None:
    nvml_up.set_ramp(0, "power_mw", 100_000, 2_500)
    readings = [pynvml.nvmlDeviceGetPowerUsage(handle(0)) for _ in range(4)]
    assert readings == [100_000, 102_500, 105_000, 107_500]
    assert pynvml.nvmlDeviceGetPowerUsage(handle(1)) == 300_000
    nvml_up.set(0, "power_mw", 5)
    assert [pynvml.nvmlDeviceGetPowerUsage(handle(0)) for _ in range(2)] == [5, 5]


def test_negative_ramp_values_clamp_to_zero(nvml_up: NvmlStandIn) -> None:
    nvml_up.set_ramp(0, "gpu_util", 1, -1)
    gpu = [pynvml.nvmlDeviceGetUtilizationRates(handle(0)).gpu for _ in range(3)]
    assert gpu == [1, 0, 0]


def test_all_devices_sets_every_device(nvml_up: NvmlStandIn) -> None:
    nvml_up.set(ALL_DEVICES, "temperature", 81)
    assert [pynvml.nvmlDeviceGetTemperature(handle(i), 0) for i in range(2)] == [81, 81]


def test_reset_restores_defaults(nvml_up: NvmlStandIn) -> None:
    nvml_up.set(0, "gpu_util", 99)
    nvml_up.reset()
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetUtilizationRates(handle(0)).gpu == 50


def test_invalid_arguments_are_rejected(nvml_up: NvmlStandIn) -> None:
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetTemperature(handle(0), 7)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetPcieThroughput(handle(0), 2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetClockInfo(handle(0), 9)


# --- Failures ---------------------------------------------------------------------------------


def test_set_error_fails_that_function_on_that_device(nvml_up: NvmlStandIn) -> None:
    not_supported = pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml_up.set_error(0, "nvmlDeviceGetMemoryBusWidth", not_supported)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMemoryBusWidth(handle(0))
    assert pynvml.nvmlDeviceGetMemoryBusWidth(handle(1)) == 5120
    assert pynvml.nvmlDeviceGetPowerUsage(handle(0)) == 300_000
    nvml_up.set_error(0, "nvmlDeviceGetMemoryBusWidth", 0)
    assert pynvml.nvmlDeviceGetMemoryBusWidth(handle(0)) == 5120


def test_error_on_all_devices_covers_functions_without_a_device(nvml_up: NvmlStandIn) -> None:
    nvml_up.set_error(ALL_DEVICES, "nvmlDeviceGetCount_v2", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetCount()
    nvml_up.set_error(ALL_DEVICES, "nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_TIMEOUT)
    for index in range(2):
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlDeviceGetPowerUsage(handle(index))


def test_lost_gpu_fails_every_call_for_that_device(nvml_up: NvmlStandIn) -> None:
    held = handle(1)
    nvml_up.lose_gpu(1)
    calls: list[Callable[[], object]] = [
        lambda: pynvml.nvmlDeviceGetUtilizationRates(held),
        lambda: pynvml.nvmlDeviceGetMemoryInfo(held),
        lambda: pynvml.nvmlDeviceGetPowerUsage(held),
        lambda: pynvml.nvmlDeviceGetUUID(held),
        lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(held),
        lambda: pynvml.nvmlGpmQueryDeviceSupport(held),
        lambda: handle(1),
    ]
    for call in calls:
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert pynvml.nvmlDeviceGetPowerUsage(handle(0)) == 300_000


def test_init_error_makes_init_raise(nvml: NvmlStandIn) -> None:
    nvml.set_init_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    nvml.set_init_error(0)
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 2


def test_error_strings_read_like_nvml(nvml: NvmlStandIn) -> None:
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_NOT_SUPPORTED) == "Not Supported"
    assert pynvml.nvmlErrorString(12345) == "Unknown Error"
    # pynvml asks the library for codes it has no text for.
    assert str(pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)) == "In use by another client"


def test_scripting_rejects_unknown_names_and_devices(nvml: NvmlStandIn) -> None:
    with pytest.raises(ValueError, match="gpu_utilisation"):
        nvml.set(0, "gpu_utilisation", 1)
    with pytest.raises(ValueError, match="nvmlDeviceGetPower"):
        nvml.set_error(0, "nvmlDeviceGetPower", 3)
    with pytest.raises(ValueError, match="nvmlNope"):
        nvml.calls("nvmlNope")
    with pytest.raises(IndexError):
        nvml.set(16, "gpu_util", 1)
    with pytest.raises(IndexError):
        nvml.reset(17)


# --- Call counts ------------------------------------------------------------------------------


def test_calls_counts_every_call_including_failures(nvml_up: NvmlStandIn) -> None:
    nvml_up.set_error(1, "nvmlDeviceGetTemperature", pynvml.NVML_ERROR_NOT_SUPPORTED)
    for index in (0, 1, 1):
        with contextlib.suppress(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetTemperature(handle(index), 0)
    assert nvml_up.calls("nvmlDeviceGetTemperature") == 3
    assert nvml_up.calls("nvmlDeviceGetPowerUsage") == 0
    nvml_up.reset()
    assert nvml_up.calls("nvmlDeviceGetTemperature") == 0


def test_concurrent_callers_are_all_counted(nvml_up: NvmlStandIn) -> None:
    per_thread = 2_000
    devices = [handle(0), handle(1)]

    def sample(device: Any) -> None:
        for _ in range(per_thread):
            pynvml.nvmlDeviceGetPowerUsage(device)

    threads = [threading.Thread(target=sample, args=(device,)) for device in devices]
    for thread in threads:
        thread.start()
    for _ in range(200):
        nvml_up.set_ramp(ALL_DEVICES, "power_mw", 1, 1)
    for thread in threads:
        thread.join()
    assert nvml_up.calls("nvmlDeviceGetPowerUsage") == 2 * per_thread


# --- GPM ------------------------------------------------------------------------------------


def test_gpm_reports_the_scripted_dram_bandwidth(nvml_up: NvmlStandIn) -> None:
    live_before = nvml_up.gpm_samples_live()
    assert pynvml.nvmlGpmQueryDeviceSupport(handle(1)).isSupportedDevice == 1
    nvml_up.set(1, "dram_bw_util", 72.5)
    result = gpm_metrics(
        handle(1), [pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL]
    )
    occupancy, dram = result.metrics[0], result.metrics[1]
    assert occupancy.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert dram.nvmlReturn == pynvml.NVML_SUCCESS
    assert dram.value == 72.5
    assert dram.metricInfo.unit == b"%"
    assert gpm_metrics(handle(0), [pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL]).metrics[0].value == 40.0
    assert nvml_up.gpm_samples_live() == live_before


def test_gpm_dram_bandwidth_ramps(nvml_up: NvmlStandIn) -> None:
    nvml_up.set_ramp(0, "dram_bw_util", 10.0, 0.5)
    values = [
        gpm_metrics(handle(0), [pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL]).metrics[0].value
        for _ in range(3)
    ]
    assert values == [10.0, 10.5, 11.0]


def test_unsupported_gpm_says_so_and_refuses_samples(nvml_up: NvmlStandIn) -> None:
    nvml_up.set_gpm_supported(0, False)
    assert pynvml.nvmlGpmQueryDeviceSupport(handle(0)).isSupportedDevice == 0
    sample = pynvml.nvmlGpmSampleAlloc()
    try:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlGpmSampleGet(handle(0), sample)
        pynvml.nvmlGpmSampleGet(handle(1), sample)
    finally:
        pynvml.nvmlGpmSampleFree(sample)


def test_gpm_metrics_need_two_taken_samples(nvml_up: NvmlStandIn) -> None:
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    try:
        pynvml.nvmlGpmSampleGet(handle(0), first)
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1, request.sample2 = first, second
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlGpmMetricsGet(request)
    finally:
        pynvml.nvmlGpmSampleFree(first)
        pynvml.nvmlGpmSampleFree(second)


# --- Processes ----------------------------------------------------------------------------------


def test_running_processes_are_listed_per_device(nvml_up: NvmlStandIn) -> None:
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0)) == []
    nvml_up.add_process(0, 4242, used_memory_bytes=3 * GIB, sm_util=60, mem_util=20)
    nvml_up.add_process(0, 4343, used_memory_bytes=GIB)
    processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0))
    assert {(p.pid, p.usedGpuMemory) for p in processes} == {(4242, 3 * GIB), (4343, GIB)}
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(1)) == []
    nvml_up.add_process(0, 4242, used_memory_bytes=5 * GIB)
    processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0))
    assert sorted((p.pid, p.usedGpuMemory) for p in processes) == [(4242, 5 * GIB), (4343, GIB)]


def test_process_buffer_too_small_gets_the_needed_count(nvml_up: NvmlStandIn) -> None:
    for pid in (1, 2, 3):
        nvml_up.add_process(0, pid, used_memory_bytes=GIB)
    function = pynvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3
    count = ctypes.c_uint(2)
    buffer = (pynvml.c_nvmlProcessInfo_v3_t * 2)()
    status = function(handle(0), ctypes.byref(count), buffer)
    assert (status, count.value) == (pynvml.NVML_ERROR_INSUFFICIENT_SIZE, 3)


def test_process_utilization_returns_fresh_samples(nvml_up: NvmlStandIn) -> None:
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(handle(0), 0)
    nvml_up.add_process(0, 4242, used_memory_bytes=GIB, sm_util=60, mem_util=20)
    nvml_up.add_process(0, 4343, used_memory_bytes=GIB, sm_util=5, mem_util=1)
    before_us = time.time_ns() // 1000
    samples = pynvml.nvmlDeviceGetProcessUtilization(handle(0), 0)
    assert {(s.pid, s.smUtil, s.memUtil) for s in samples} == {(4242, 60, 20), (4343, 5, 1)}
    assert all(s.timeStamp >= before_us for s in samples)
    latest = max(s.timeStamp for s in samples)
    later = pynvml.nvmlDeviceGetProcessUtilization(handle(0), latest)
    assert all(s.timeStamp > latest for s in later)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(handle(0), latest + 3_600_000_000)


# --- Building and subprocesses ------------------------------------------------------------------


def test_build_is_skipped_when_the_library_is_newer(
    nvml_library_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert build_stand_in(nvml_library_dir) == nvml_library_dir / LIBRARY_NAME


def test_build_failure_raises_with_the_compiler_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = tmp_path / "failing-cc"
    compiler.write_text("#!/bin/sh\necho 'fake_nvml.c:1: error: broken' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    with pytest.raises(RuntimeError, match="error: broken"):
        build_stand_in(tmp_path / "out")
    assert not (tmp_path / "out" / LIBRARY_NAME).exists()
    monkeypatch.setenv("CC", str(tmp_path / "missing-cc"))
    with pytest.raises(RuntimeError, match="missing-cc"):
        build_stand_in(tmp_path / "out")


def test_build_reruns_when_the_source_is_newer(
    nvml_library_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = tmp_path / LIBRARY_NAME
    library.write_bytes((nvml_library_dir / LIBRARY_NAME).read_bytes())
    source = tmp_path / "fake_nvml.c"
    source.write_text("/* newer */\n")
    os.utime(library, (1, 1))
    monkeypatch.setattr(nvml_stand_in, "SOURCE_PATH", source)
    monkeypatch.setenv("CC", str(tmp_path / "missing-cc"))
    with pytest.raises(RuntimeError):
        build_stand_in(tmp_path)


_CHILD = (
    "import pynvml\n"
    "try:\n"
    "    pynvml.nvmlInit()\n"
    "    print(pynvml.nvmlDeviceGetCount())\n"
    "except pynvml.NVMLError as error:\n"
    "    print(type(error).__name__)\n"
)


def run_child(env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=True,
    )
    return result.stdout.strip()


def test_subprocess_finds_the_stand_in_through_ld_library_path(nvml_library_dir: Path) -> None:
    assert run_child(library_env(nvml_library_dir, device_count=3)) == "3"


def test_subprocess_without_the_library_path_finds_no_nvml(nvml_library_dir: Path) -> None:
    if ctypes.util.find_library("nvidia-ml") is not None:
        pytest.skip("a real libnvidia-ml is installed on this machine")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    assert str(nvml_library_dir) not in os.environ.get("LD_LIBRARY_PATH", "")
    assert run_child(env) == "NVMLError_LibraryNotFound"
