"""The NVML sampler through the real pynvml against the stand-in library."""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable

import pytest

from tests.node.nvml_stand_in import NvmlStandIn
from tokentrace.agent.node.sampler import NvmlSampler

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_UNKNOWN = 999


def _opened(**options: object) -> NvmlSampler:
    sampler = NvmlSampler(**options)  # type: ignore[arg-type]
    assert sampler.open()
    return sampler


def test_every_field_is_read_and_converted(nvml: NvmlStandIn) -> None:
    nvml.set(0, "gpu_util", 73)
    nvml.set(0, "mem_util", 41)
    nvml.set(0, "mem_used", 12_345_678_912)
    nvml.set(0, "power_mw", 412_500)
    nvml.set(0, "sm_clock", 1410)
    nvml.set(0, "mem_clock", 1593)
    nvml.set(0, "max_mem_clock", 1593)
    nvml.set(0, "bus_width", 5120)
    nvml.set(0, "temperature", 61)
    nvml.set(0, "pcie_tx_kbps", 1500)
    nvml.set(0, "pcie_rx_kbps", 2500)
    nvml.set(0, "dram_bw_util", 62.5)
    sampler = _opened()
    try:
        device = sampler.devices[0]
        # A100 80GB: 5120-bit bus at 1593 MHz double data rate = 2039 GB/s, its datasheet figure.
        assert device.peak_bandwidth_bps == pytest.approx(5120 / 8 * 1593e6 * 2)
        assert round(device.peak_bandwidth_bps / 1e9) == 2039
        assert device.gpm_supported
        sampler.sample_once()
        sample = sampler.ring(device.uuid).latest()  # type: ignore[union-attr]
        assert sample is not None
        assert sample.utilization == pytest.approx(0.73)
        assert sample.memory_controller_utilization == pytest.approx(0.41)
        assert sample.memory_used_bytes == 12_345_678_912
        assert sample.power_watts == pytest.approx(412.5)
        assert (sample.sm_clock_mhz, sample.memory_clock_mhz, sample.temperature_c) == (
            1410,
            1593,
            61,
        )
        assert sample.pcie_tx_bytes_per_s == 1_500_000
        assert sample.pcie_rx_bytes_per_s == 2_500_000
        # GPM's DRAM bandwidth share, not the memory controller's busy share.
        assert sample.memory_bandwidth_bps == pytest.approx(0.625 * device.peak_bandwidth_bps)
    finally:
        sampler.stop()


def test_without_gpm_bandwidth_falls_back_to_the_memory_controller(nvml: NvmlStandIn) -> None:
    nvml.set_gpm_supported(1, False)
    nvml.set(1, "mem_util", 30)
    sampler = _opened()
    try:
        gpm, fallback = sampler.devices
        assert gpm.gpm_supported and not fallback.gpm_supported
        sampler.sample_once()
        sample = sampler.ring(fallback.uuid).latest()  # type: ignore[union-attr,unused-ignore]
        assert sample is not None and fallback.peak_bandwidth_bps is not None
        assert sample.memory_bandwidth_bps == pytest.approx(0.30 * fallback.peak_bandwidth_bps)
    finally:
        sampler.stop()


def test_an_unsupported_field_is_reported_once_and_not_read_again(
    nvml: NvmlStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    nvml.set_error(0, "nvmlDeviceGetPowerUsage", NVML_ERROR_NOT_SUPPORTED)
    sampler = _opened()
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(5):
                sampler.sample_once()
        # GPU 0 was asked once; GPU 1 (which supports it) every tick.
        assert nvml.calls("nvmlDeviceGetPowerUsage") == 1 + 5
        reports = [r for r in caplog.records if "does not report power" in r.getMessage()]
        assert len(reports) == 1
        unsupported, supported = (sampler.ring(d.uuid) for d in sampler.devices)
        assert unsupported is not None and supported is not None
        assert all(s.power_watts is None for s in unsupported.snapshot())
        assert all(s.power_watts == 300.0 for s in supported.snapshot())
        # The other fields of the GPU are still sampled.
        assert all(s.utilization == 0.5 for s in unsupported.snapshot())
        assert sampler.stats()["disabled_fields"] == 1
    finally:
        sampler.stop()


def test_a_transient_error_skips_the_field_for_one_tick_only(nvml: NvmlStandIn) -> None:
    sampler = _opened()
    try:
        nvml.set_error(0, "nvmlDeviceGetClockInfo", NVML_ERROR_UNKNOWN)
        sampler.sample_once()
        nvml.set_error(0, "nvmlDeviceGetClockInfo", 0)
        sampler.sample_once()
        ring = sampler.ring(sampler.devices[0].uuid)
        assert ring is not None
        first, second = ring.snapshot()
        assert first.sm_clock_mhz is None and second.sm_clock_mhz == 1755
        assert sampler.stats()["read_errors"] == 2  # SM and memory clock, once each
    finally:
        sampler.stop()


def test_a_lost_gpu_is_reported_once_and_no_longer_sampled(
    nvml: NvmlStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    sampler = _opened()
    try:
        sampler.sample_once()
        nvml.lose_gpu(1)
        with caplog.at_level(logging.ERROR):
            for _ in range(3):
                sampler.sample_once()
        healthy, lost = (sampler.ring(d.uuid) for d in sampler.devices)
        assert healthy is not None and lost is not None
        assert len(healthy.snapshot()) == 4
        assert len(lost.snapshot()) == 1
        assert sum("is lost" in r.getMessage() for r in caplog.records) == 1
        assert sampler.stats()["lost_gpus"] == 1
        # The lost GPU no longer holds back what counts as sampled.
        assert sampler.sampled_until_ns() == healthy.latest_time_ns()
    finally:
        sampler.stop()


def test_without_nvml_the_sampler_says_so_once(
    nvml: NvmlStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    nvml.set_init_error(NVML_ERROR_DRIVER_NOT_LOADED)
    sampler = NvmlSampler()
    with caplog.at_level(logging.WARNING):
        assert not sampler.start()
    assert not sampler.available
    assert sampler.unavailable_reason is not None
    assert [r.getMessage() for r in caplog.records if "NVML is not available" in r.getMessage()]


def test_process_list_maps_pids_to_gpus_with_their_usage(nvml: NvmlStandIn) -> None:
    nvml.add_process(0, pid=4242, used_memory_bytes=3 << 30, sm_util=55, mem_util=25)
    nvml.add_process(1, pid=4242, used_memory_bytes=2 << 30, sm_util=45, mem_util=15)
    nvml.add_process(1, pid=777, used_memory_bytes=1 << 30, sm_util=5, mem_util=1)
    sampler = _opened()
    try:
        sampler.sample_once()
        uuids = [d.uuid for d in sampler.devices]
        assert sampler.gpus_of_pid(4242) == tuple(uuids)
        assert sampler.gpus_of_pid(777) == (uuids[1],)
        assert sampler.gpus_of_pid(1) == ()
        usage = {(u.pid, u.gpu_uuid): u for u in sampler.process_usage()}
        assert usage[(4242, uuids[0])].memory_used_bytes == 3 << 30
        assert usage[(4242, uuids[0])].sm_utilization == pytest.approx(0.55)
        assert usage[(777, uuids[1])].memory_utilization == pytest.approx(0.01)
    finally:
        sampler.stop()


def test_the_ring_keeps_the_newest_samples_and_windows_are_inclusive(nvml: NvmlStandIn) -> None:
    clock = iter(range(1_000, 100_000, 100))
    sampler = NvmlSampler(ring_samples=4, clock=lambda: next(clock))
    assert sampler.open()
    try:
        for _ in range(12):
            sampler.sample_once()
        ring = sampler.ring(sampler.devices[0].uuid)
        assert ring is not None
        times = [s.time_ns for s in ring.snapshot()]
        assert len(times) == 4 and times == sorted(times)
        inside, following = ring.window(times[1], times[2])
        assert [s.time_ns for s in inside] == times[1:3]
        assert following is not None and following.time_ns == times[3]
        inside, following = ring.window(times[1] + 1, times[2] - 1)
        assert inside == [] and following is not None and following.time_ns == times[2]
    finally:
        sampler.stop()


def test_the_sampling_thread_runs_at_its_interval(nvml: NvmlStandIn) -> None:
    sampler = NvmlSampler(interval_s=0.02)
    assert sampler.start()
    try:
        ring = sampler.ring(sampler.devices[0].uuid)
        assert ring is not None
        deadline = time.monotonic() + 5
        while len(ring.snapshot()) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        times = [s.time_ns for s in ring.snapshot()]
        assert len(times) >= 5
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert min(gaps) > 5_000_000  # paced, not a busy loop
    finally:
        sampler.stop()


# --- slow fields (PCIe throughput ~21 ms per call on an H100): off the fast tick -------------


def _stepping_clock() -> tuple[list[int], Callable[[], int]]:
    """A clock the test moves by hand (now[0])."""
    now = [1_000_000_000]

    def clock() -> int:
        return now[0]

    return now, clock


def test_slow_pcie_reads_do_not_stall_the_fast_tick(nvml: NvmlStandIn) -> None:
    gpus, pcie_delay_us, interval_s = 8, 20_000, 0.1
    nvml.reset(gpus)
    nvml.set_call_delay_us("nvmlDeviceGetPcieThroughput", pcie_delay_us)
    sampler = NvmlSampler(interval_s=interval_s, pcie_interval_s=0.5)
    assert sampler.open()
    started_ns = time.time_ns()
    assert sampler.start()
    try:
        time.sleep(1.5)
        wall_s = (time.time_ns() - started_ns) / 1e9
        stats = sampler.stats()
        rings = [sampler.ring(d.uuid) for d in sampler.devices]
    finally:
        sampler.stop()
    # In the tick, 8 GPUs x 2 PCIe reads x 20 ms would take 320 ms: 3-4 ticks in 1.5 s.
    expected = wall_s / interval_s
    assert 0.8 * expected <= stats["ticks"] <= 1.2 * expected + 1, (stats, expected)
    # The PCIe reads did happen, on the slow thread (one read of both counters takes 40 ms).
    assert nvml.calls("nvmlDeviceGetPcieThroughput") >= 2 * gpus
    assert stats["slow_passes"] >= 1
    assert stats["slow_wall_ns"] >= 2 * gpus * pcie_delay_us * 1000  # the delay knob works
    # No tick waited for a PCIe call: the tick's wall time (what a sample's stamp can be late
    # by) stays below even one PCIe call per GPU.
    assert stats["max_tick_wall_ns"] < gpus * pcie_delay_us * 1000, stats
    for ring in rings:
        assert ring is not None
        times = [s.time_ns for s in ring.snapshot()]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert gaps and statistics.median(gaps) < 1.2 * interval_s * 1e9, gaps
        # The PCIe value arrived in the fast samples (after the first slow pass).
        assert ring.latest().pcie_tx_bytes_per_s == 1_000_000  # type: ignore[union-attr]
        assert ring.latest().pcie_rx_bytes_per_s == 2_000_000  # type: ignore[union-attr]


def test_a_slow_value_goes_none_when_it_is_older_than_three_intervals(
    nvml: NvmlStandIn,
) -> None:
    now, clock = _stepping_clock()
    sampler = NvmlSampler(pcie_interval_s=1.0, process_refresh_s=1.0, clock=clock)
    assert sampler.open()
    try:
        uuid = sampler.devices[0].uuid
        sampler.read_slow()  # the slow reader produces once, at t0 ...
        nvml.set(0, "pcie_tx_kbps", 7)
        tx = []
        for _ in range(40):  # ... then stops: only fast ticks, 100 ms apart, for 4 s
            sampler.tick()
            tx.append(sampler.ring(uuid).latest().pcie_tx_bytes_per_s)  # type: ignore[union-attr]
            now[0] += 100_000_000
        # Up to 3 x 1 s old it is reported (the value read at t0), after that None, not stale.
        assert tx[:31] == [1_000_000] * 31
        assert tx[31:] == [None] * 9
        # The slow reader produces again: the new value is back in the next tick.
        sampler.read_slow()
        sampler.tick()
        assert sampler.ring(uuid).latest().pcie_tx_bytes_per_s == 7_000  # type: ignore[union-attr]
        # read_slow() follows its cadence: not due again within the interval.
        calls = nvml.calls("nvmlDeviceGetPcieThroughput")
        now[0] += 500_000_000
        sampler.read_slow()
        assert nvml.calls("nvmlDeviceGetPcieThroughput") == calls
    finally:
        sampler.stop()


def test_the_fast_tick_makes_no_slow_call(nvml: NvmlStandIn) -> None:
    nvml.add_process(0, pid=4242, used_memory_bytes=1 << 30, sm_util=10)
    sampler = _opened()
    try:
        for _ in range(5):
            sampler.tick()
        for function in (
            "nvmlDeviceGetPcieThroughput",
            "nvmlDeviceGetProcessUtilization",
            "nvmlDeviceGetComputeRunningProcesses_v3",
        ):
            assert nvml.calls(function) == 0, function
        assert nvml.calls("nvmlDeviceGetUtilizationRates") == 2 * 5
        # With no slow value yet, the fast samples say None, not 0.
        sample = sampler.ring(sampler.devices[0].uuid).latest()  # type: ignore[union-attr]
        assert sample is not None and sample.pcie_tx_bytes_per_s is None
        sampler.read_slow()
        assert sampler.gpus_of_pid(4242) == (sampler.devices[0].uuid,)
    finally:
        sampler.stop()


def test_an_unsupported_slow_field_is_reported_once_and_not_read_again(
    nvml: NvmlStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    now, clock = _stepping_clock()
    nvml.set_error(0, "nvmlDeviceGetPcieThroughput", NVML_ERROR_NOT_SUPPORTED)
    sampler = NvmlSampler(pcie_interval_s=1.0, clock=clock)
    assert sampler.open()
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                sampler.sample_once()
                now[0] += 1_000_000_000
        # GPU 0: TX and RX asked once each; GPU 1: both, every pass.
        assert nvml.calls("nvmlDeviceGetPcieThroughput") == 2 + 2 * 3
        reports = [
            r.getMessage() for r in caplog.records if "does not report pcie" in r.getMessage()
        ]
        assert len(reports) == 2  # pcie_tx, pcie_rx
        unsupported, supported = (sampler.ring(d.uuid) for d in sampler.devices)
        assert unsupported is not None and supported is not None
        assert all(s.pcie_tx_bytes_per_s is None for s in unsupported.snapshot())
        assert all(s.pcie_rx_bytes_per_s == 2_000_000 for s in supported.snapshot())
        assert all(s.utilization == 0.5 for s in unsupported.snapshot())
        assert sampler.stats()["disabled_fields"] == 2
    finally:
        sampler.stop()


def test_a_gpu_lost_in_a_slow_read_is_reported_once_and_no_longer_sampled(
    nvml: NvmlStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    now, clock = _stepping_clock()
    sampler = NvmlSampler(pcie_interval_s=1.0, clock=clock)
    assert sampler.open()
    try:
        sampler.sample_once()
        nvml.lose_gpu(1)
        now[0] += 1_000_000_000
        with caplog.at_level(logging.ERROR):
            sampler.read_slow()  # the slow reader finds it lost first
            for _ in range(3):
                sampler.sample_once()
                now[0] += 1_000_000_000
        healthy, lost = (sampler.ring(d.uuid) for d in sampler.devices)
        assert healthy is not None and lost is not None
        assert len(healthy.snapshot()) == 4 and len(lost.snapshot()) == 1
        assert sum("is lost" in r.getMessage() for r in caplog.records) == 1
        assert sampler.stats()["lost_gpus"] == 1
        assert sampler.sampled_until_ns() == healthy.latest_time_ns()
    finally:
        sampler.stop()


def test_a_gpu_lost_under_both_threads_is_counted_once(nvml: NvmlStandIn) -> None:
    nvml.set_call_delay_us("nvmlDeviceGetPcieThroughput", 5_000)
    sampler = NvmlSampler(interval_s=0.01, pcie_interval_s=0.01)
    assert sampler.start()
    try:
        time.sleep(0.1)
        nvml.lose_gpu(1)
        deadline = time.monotonic() + 5
        while sampler.sampled_gpus != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert sampler.sampled_gpus == 1
        assert sampler.stats()["lost_gpus"] == 1
    finally:
        sampler.stop()


def test_slow_reads_resume_when_the_wall_clock_steps_back(nvml: NvmlStandIn) -> None:
    now, clock = _stepping_clock()
    sampler = NvmlSampler(pcie_interval_s=1.0, process_refresh_s=1.0, clock=clock)
    assert sampler.open()
    try:
        sampler.read_slow()
        calls = nvml.calls("nvmlDeviceGetPcieThroughput")
        processes = nvml.calls("nvmlDeviceGetComputeRunningProcesses_v3")
        now[0] -= 3_600_000_000_000  # NTP steps the clock back an hour
        sampler.read_slow()
        assert nvml.calls("nvmlDeviceGetPcieThroughput") == calls + 4  # 2 GPUs x TX, RX
        assert nvml.calls("nvmlDeviceGetComputeRunningProcesses_v3") > processes
        sampler.tick()
        sample = sampler.ring(sampler.devices[0].uuid).latest()  # type: ignore[union-attr]
        assert sample is not None and sample.pcie_tx_bytes_per_s == 1_000_000
    finally:
        sampler.stop()
