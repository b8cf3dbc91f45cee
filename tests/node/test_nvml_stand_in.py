"""The NVML stand-in's fidelity to the real NVML, exercised through the real pynvml binding.

Only what pynvml and the node agent's sampler rely on is pinned here: struct layouts, the
loading path, return codes (and so pynvml's exception classes), units, and the call protocols
(init refcount, GPM samples, the process-list size handshake). The stand-in's scripting
conveniences (ramps, per-device values, call counts, the build helper) are exercised by the
sampler and node agent tests that use them.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from typing import Any

import pynvml
import pytest

from tests.node.nvml_stand_in import NvmlStandIn

GIB = 1024**3
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


def test_invalid_arguments_are_rejected(nvml_up: NvmlStandIn) -> None:
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetTemperature(handle(0), 7)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetPcieThroughput(handle(0), 2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetClockInfo(handle(0), 9)


# --- Failures ---------------------------------------------------------------------------------


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


def test_a_call_delay_slows_that_function_only_until_cleared(nvml_up: NvmlStandIn) -> None:
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    nvml_up.set_call_delay_us("nvmlDeviceGetPcieThroughput", 20_000)

    def seconds(call: Callable[[], Any]) -> float:
        started = time.perf_counter()
        call()
        return time.perf_counter() - started

    assert seconds(lambda: pynvml.nvmlDeviceGetPcieThroughput(handle, 0)) >= 0.02
    assert seconds(lambda: pynvml.nvmlDeviceGetPowerUsage(handle)) < 0.02
    nvml_up.set_call_delay_us("nvmlDeviceGetPcieThroughput", 0)
    assert seconds(lambda: pynvml.nvmlDeviceGetPcieThroughput(handle, 0)) < 0.02
    with pytest.raises(ValueError):
        nvml_up.set_call_delay_us("nvmlNoSuchFunction", 1)
