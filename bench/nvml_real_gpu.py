"""One-shot check of the node agent against a real NVIDIA driver (not a test: CI never runs it).

What it does, in under 90 s, printing everything and writing a JSON report to ``--out``:

1. Facts: ``nvidia-smi -L``, the pynvml / protobuf / grpcio in use, driver, NVML and CUDA driver
   versions, every GPU's name, UUID and memory, and what ``NvmlSampler`` derives (peak bandwidth,
   GPM support, fields it found unsupported).
2. A GPU workload in a child process (torch on cuda:0), phases of ``--phase-s`` each: idle, bf16
   8192^3 matmul loop, 1 GiB device-to-device copies, 8 GiB allocated and held idle. The child
   prints each phase's Unix ns window; ``NvmlSampler`` (100 ms, the default) samples in this
   process; each window is aggregated with the enricher's ``aggregate_window`` into a table. The
   child's pid must show in the sampler's process list (``gpus_of_pid``, ``process_usage``).
3. End to end: the real ``NodeAgent`` (the service behind ``tokentrace node-agent``, in this
   process, driven by the same sampler) with its gRPC receiver on loopback and an OTLP/gRPC
   upstream here; spans with the phase windows go in as the in-process agent sends them (one
   resource naming ``tokentrace.gpu.uuids``, one with only ``process.pid``), and the GPU
   attributes the node agent put on each relayed span are printed and compared with (2).
4. Cost: the sampler's threads over ~3 s at 100 ms (and ~1.5 s at 20 ms) with the GPU idle: per
   fast tick its wall time (how late a sample's stamp can be) and CPU, ticks kept vs expected, and
   the slow thread's CPU (PCIe throughput and the process list, off the tick); then one fast tick
   and one slow pass timed alone, and the wall time of each NVML call the sampler makes.

Checks print ``PASS``/``FAIL`` lines with their numbers; the exit code is 0 whatever they say
(the report lists them), non-zero only when the script itself crashed (1) or its watchdog
fired (3).

On the GPU machine (the repository root is the working directory; ``.whl/``, which git ignores
through ``.git/info/exclude`` and the device tool must therefore carry (``carry: [".whl"]``),
holds the packages the image lacks or has in an untested version, cp312 wheels, which
``bash bench/gpu_machine/wheels.sh`` downloads; tokentrace itself is imported from the working
tree, not installed; ``bench/gpu_machine/checks.sh`` runs this and the collector's figures):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 bench/nvml_real_gpu.py --out $OUT/nvml_real_gpu.json

Without a GPU (``--stand-in``; chosen by itself where there is neither ``/dev/nvidiactl`` nor
``nvidia-smi``) it runs the same code against the tests' stand-in NVML library (built with
``cc``), which the script drives to follow the child's phases, and a CPU busy loop instead of the
CUDA workload. ``--pcie-delay-us 21000`` (stand-in only) makes each of its PCIe throughput calls
sleep that long, as an H100's driver does (~21 ms), to show that the fast tick does not wait.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
PACKAGES = ("tokentrace", "nvidia-ml-py", "protobuf", "grpcio", "opentelemetry-proto", "torch")
_PACKAGE_DIRS = {
    "agent": "agent",
    "collector": "collector",
    "processors": "processors",
    "loadgen": "loadgen",
}


def _tokentrace_from_tree() -> str:
    """Make ``tokentrace.*`` import from this working tree (setuptools maps ``tokentrace.agent``
    to ``agent/`` and so on): a folder of links laid out as the installed namespace, first on
    sys.path. Returns that folder."""
    folder = Path(tempfile.mkdtemp(prefix="tokentrace-tree-"))
    (folder / "tokentrace").mkdir()
    for name, source in _PACKAGE_DIRS.items():
        (folder / "tokentrace" / name).symlink_to(REPO / source, target_is_directory=True)
    sys.path.insert(0, str(folder))
    sys.path.insert(1, str(REPO))  # tests.node.nvml_stand_in for --stand-in
    return str(folder)


TREE = _tokentrace_from_tree()

# ruff: noqa: E402, E501  (imports after the sys.path set-up; the device command is one line)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tokentrace.agent import semconv
from tokentrace.agent.node.enrich import aggregate_window
from tokentrace.agent.node.sampler import GpuDevice, GpuSample, NvmlSampler

# --- report and printing ---------------------------------------------------------------------

REPORT: dict[str, Any] = {
    "mode": None,
    "started_unix": time.time(),
    "facts": {},
    "workload": {},
    "phases": [],
    "e2e": {},
    "cost": {},
    "call_timing": [],
    "checks": [],
    "errors": [],
}
_OUT: Path | None = None
_CHILD: list[subprocess.Popen[str]] = []
_STARTED = time.monotonic()


def say(text: str = "") -> None:
    print(text, flush=True)


def check(name: str, ok: bool, detail: str, *, info: bool = False) -> bool:
    """A PASS/FAIL line (INFO-ok / INFO-no for facts that are not requirements)."""
    label = ("INFO-ok" if ok else "INFO-no") if info else ("PASS" if ok else "FAIL")
    REPORT["checks"].append({"name": name, "result": label, "ok": ok, "detail": detail})
    say(f"{label:7} {name}: {detail}")
    return ok


def record_error(section: str) -> None:
    text = traceback.format_exc()
    REPORT["errors"].append({"section": section, "traceback": text})
    say(f"ERROR in {section}:\n{text}")


def write_report() -> None:
    REPORT["elapsed_s"] = round(time.monotonic() - _STARTED, 2)
    REPORT["summary"] = {
        "pass": sum(c["result"] == "PASS" for c in REPORT["checks"]),
        "fail": sum(c["result"] == "FAIL" for c in REPORT["checks"]),
        "errors": len(REPORT["errors"]),
    }
    if _OUT is None:
        return
    _OUT.parent.mkdir(parents=True, exist_ok=True)
    partial = _OUT.with_suffix(_OUT.suffix + ".partial")
    partial.write_text(json.dumps(REPORT, indent=1, default=str))
    os.replace(partial, _OUT)


def start_watchdog(seconds: float) -> None:
    def fire() -> None:
        say(f"WATCHDOG: {seconds:.0f} s passed; writing what exists and exiting")
        REPORT["watchdog_fired_after_s"] = seconds
        for child in _CHILD:
            if child.poll() is None:
                child.kill()
        try:
            write_report()
        finally:
            os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


# --- 1. facts ----------------------------------------------------------------------------------


def package_versions() -> dict[str, list[str]]:
    """Every installed version of each package on sys.path, first one wins ("version @ path")."""
    found: dict[str, list[str]] = {name: [] for name in PACKAGES}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in found:
            found[name].append(f"{dist.version} @ {dist.locate_file('')}")
    return found


def facts(sampler: NvmlSampler) -> None:
    out: dict[str, Any] = REPORT["facts"]
    out["python"] = sys.version.split()[0]
    out["executable"] = sys.executable
    out["platform"] = platform.platform()
    out["tokentrace_from"] = TREE
    out["packages"] = package_versions()
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=15)
            out["nvidia_smi_L"] = (done.stdout + done.stderr).strip()
        except Exception as error:
            out["nvidia_smi_L"] = f"failed: {error}"
    else:
        out["nvidia_smi_L"] = "nvidia-smi not on PATH"
    import pynvml

    out["pynvml_file"] = getattr(pynvml, "__file__", None)
    for key, call in (
        ("driver_version", "nvmlSystemGetDriverVersion"),
        ("nvml_version", "nvmlSystemGetNVMLVersion"),
        ("cuda_driver_version", "nvmlSystemGetCudaDriverVersion"),
    ):
        try:
            value = getattr(pynvml, call)()
            out[key] = value.decode() if isinstance(value, bytes) else value
        except Exception as error:
            out[key] = f"error: {error}"
    out["device_count"] = len(sampler.devices)
    out["devices"] = [dataclasses.asdict(device) for device in sampler.devices]
    say("== facts")
    say(f"python {out['python']} ({sys.executable}); {out['platform']}")
    say(f"tokentrace imported from {TREE} -> {REPO}")
    for name, versions in out["packages"].items():
        say(f"  {name}: {versions or 'not installed'}")
    say(f"nvidia-smi -L: {out['nvidia_smi_L']}")
    say(
        f"driver {out['driver_version']}, NVML {out['nvml_version']}, CUDA driver "
        f"{out['cuda_driver_version']}, pynvml from {out['pynvml_file']}"
    )
    for device in sampler.devices:
        say(
            f"  GPU {device.index} {device.name} {device.uuid}: memory "
            f"{fmt(device.memory_total_bytes, GIB)} GiB, peak bandwidth (derived) "
            f"{fmt(device.peak_bandwidth_bps, 1e9, 0)} GB/s, GPM "
            f"{'supported' if device.gpm_supported else 'NOT supported'}"
        )


def sampler_fields(sampler: NvmlSampler) -> dict[str, Any]:
    """What the sampler found per GPU after running: disabled fields, lost, latest sample."""
    result: dict[str, Any] = {"stats": sampler.stats(), "devices": []}
    for state in getattr(sampler, "_states", []):
        latest = state.ring.latest()
        result["devices"].append(
            {
                "uuid": state.device.uuid,
                "disabled_fields": sorted(state.disabled),
                "lost": state.lost,
                "gpm_active": bool(state.gpm_samples),
                "latest_sample": None if latest is None else latest._asdict(),
            }
        )
    return result


# --- 2. workload -------------------------------------------------------------------------------

CHILD_SOURCE = r"""
import json, os, select, sys, time, traceback


def emit(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main():
    mode, phase_s, hold_gib = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    if mode == "cuda":
        import torch

        device = torch.device("cuda", 0)
        props = torch.cuda.get_device_properties(0)
        n = 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        c = torch.mm(a, b)  # cuBLAS initialised before the idle phase
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # no cached free blocks in the idle baseline of memory used
        sync = torch.cuda.synchronize
        emit(event="ready", pid=os.getpid(), uuid=str(getattr(props, "uuid", "")),
             name=props.name, torch=torch.__version__, cuda=torch.version.cuda,
             sms=props.multi_processor_count)
    else:
        sync = lambda: None  # noqa: E731
        emit(event="ready", pid=os.getpid(), uuid="", name="cpu", torch=None, cuda=None)

    def run(name, body):
        sync()
        emit(event="begin", phase=name)
        start = time.time_ns()
        extra = body(start + int(phase_s * 1e9)) or {}
        sync()
        end = time.time_ns()
        emit(event="phase", phase=name, start_ns=start, end_ns=end, **extra)

    def idle(until):
        time.sleep(max(0.0, (until - time.time_ns()) / 1e9))

    def matmul(until):
        iters = 0
        started = time.perf_counter()
        while time.time_ns() < until:
            if mode == "cuda":
                for _ in range(10):
                    torch.mm(a, b, out=c)
                sync()
                iters += 10
            else:
                sum(i * i for i in range(20000))
                iters += 1
        elapsed = time.perf_counter() - started
        if mode == "cuda":
            return {"iterations": iters, "tflops": 2 * n**3 * iters / elapsed / 1e12}
        return {"iterations": iters}

    def copy(until):
        iters = 0
        size = (1 << 30) if mode == "cuda" else (64 << 20)
        if mode == "cuda":
            src = torch.empty(size, dtype=torch.uint8, device=device).fill_(7)
            dst = torch.empty_like(src)
        else:
            src, dst = bytearray(size), None
        sync()
        started = time.perf_counter()
        while time.time_ns() < until:
            for _ in range(10):
                if mode == "cuda":
                    dst.copy_(src)
                else:
                    dst = bytes(src)
            sync()
            iters += 10
        elapsed = time.perf_counter() - started
        del src, dst
        if mode == "cuda":
            torch.cuda.empty_cache()
        return {"iterations": iters, "bytes_each": size,
                "gbps_read_plus_write": 2 * size * iters / elapsed / 1e9}

    held = []

    def hold(until):
        time.sleep(max(0.0, (until - time.time_ns()) / 1e9))

    run("idle", idle)
    run("matmul", matmul)
    run("copy", copy)
    if mode == "cuda":
        held.append(torch.empty(int(hold_gib * (1 << 30)), dtype=torch.uint8, device=device))
        held[0].fill_(0)
        sync()
    run("hold", hold)
    emit(event="holding", allocated_bytes=int(hold_gib * (1 << 30)))
    # Stay alive (GPU memory held) until told, for the process list and the end-to-end spans.
    ready, _, _ = select.select([sys.stdin], [], [], 40.0)
    if ready:
        sys.stdin.readline()
    emit(event="exit")


try:
    main()
except BaseException:
    emit(event="error", error=traceback.format_exc())
    sys.exit(1)
"""

# The stand-in's values per phase (device 0), so that a dry run exercises the checks too.
STAND_IN_BASE_MEMORY = 3 * GIB
STAND_IN_PHASES: dict[str, dict[str, float]] = {
    "idle": {"gpu_util": 0, "mem_util": 0, "dram_bw_util": 1, "power_mw": 70_000, "sm_clock": 345},
    "matmul": {"gpu_util": 98, "mem_util": 35, "dram_bw_util": 22, "power_mw": 650_000},
    "copy": {"gpu_util": 96, "mem_util": 90, "dram_bw_util": 88, "power_mw": 480_000},
    "hold": {"gpu_util": 0, "mem_util": 0, "dram_bw_util": 1, "power_mw": 75_000},
}


class Child:
    """The workload process: its JSON lines arrive on a queue; stderr goes to a file."""

    def __init__(self, mode: str, phase_s: float, hold_gib: float, workdir: Path) -> None:
        script = workdir / "gpu_workload_child.py"
        script.write_text(CHILD_SOURCE)
        self.stderr_path = workdir / "child.stderr"
        self._stderr = self.stderr_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(script), mode, str(phase_s), str(hold_gib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        _CHILD.append(self.process)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self.events.put(event)
        self.events.put({"event": "eof"})

    def next_event(self, deadline: float) -> dict[str, Any]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("child did not answer in time")
        try:
            return self.events.get(timeout=remaining)
        except queue.Empty:
            raise TimeoutError("child did not answer in time") from None

    def stderr_tail(self, chars: int = 3000) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        try:
            return self.stderr_path.read_text()[-chars:]
        except OSError:
            return ""

    def finish(self) -> int | None:
        process = self.process
        try:
            if process.poll() is None and process.stdin is not None:
                process.stdin.write("exit\n")
                process.stdin.flush()
        except OSError:
            pass
        try:
            return process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait(5)
        finally:
            self._stderr.close()


def run_workload(
    child: Child, stand_in: Any, ready_timeout_s: float, phase_s: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Wait for the child's phases; returns its ready event and the phase windows."""
    deadline = time.monotonic() + ready_timeout_s
    while True:
        event = child.next_event(deadline)
        if event.get("event") == "ready":
            break
        if event.get("event") in ("error", "eof"):
            raise RuntimeError(f"child failed before ready: {event}\n{child.stderr_tail()}")
    say(f"child ready after {time.monotonic() - _STARTED:.1f} s: {event}")
    if stand_in is not None:
        stand_in.add_process(0, pid=int(event["pid"]), used_memory_bytes=GIB, sm_util=0)
    phases: list[dict[str, Any]] = []
    deadline = time.monotonic() + 4 * phase_s + 60
    while True:
        item = child.next_event(deadline)
        kind = item.get("event")
        if kind == "begin":
            say(f"  phase {item['phase']} begins")
            if stand_in is not None:
                for field, value in STAND_IN_PHASES[item["phase"]].items():
                    stand_in.set(0, field, value)
                if item["phase"] == "hold":
                    stand_in.set(0, "mem_used", STAND_IN_BASE_MEMORY + 8 * GIB + (2 << 20))
        elif kind == "phase":
            phases.append(item)
            extra = {k: v for k, v in item.items() if k not in ("event", "phase")}
            say(f"  phase {item['phase']} done: {extra}")
        elif kind == "holding":
            return event, phases
        elif kind in ("error", "eof"):
            raise RuntimeError(f"child failed: {item}\n{child.stderr_tail()}")


SETTLE_NS = 500_000_000
"""Checks skip a phase's first 0.5 s: NVML's utilisation averages over a trailing period."""


def phase_rows(
    sampler: NvmlSampler, phases: Sequence[dict[str, Any]], settle_ns: int = 0
) -> list[dict[str, Any]]:
    rows = []
    for phase in phases:
        start, end = int(phase["start_ns"]) + settle_ns, int(phase["end_ns"])
        for device in sampler.devices:
            ring = sampler.ring(device.uuid)
            samples: list[GpuSample] = [] if ring is None else ring.window(start, end)[0]
            rows.append(row_of(phase["phase"], device, samples, (end - start) / 1e9))
    return rows


def row_of(
    phase: str, device: GpuDevice, samples: Sequence[GpuSample], seconds: float
) -> dict[str, Any]:
    aggregate = aggregate_window([(device, samples)], samples_inside=len(samples))
    powers = [s.power_watts for s in samples if s.power_watts is not None]
    row: dict[str, Any] = {
        "phase": phase,
        "gpu": device.index,
        "uuid": device.uuid,
        "seconds": round(seconds, 3),
        "samples": len(samples),
        "power_max_w": max(powers) if powers else None,
    }
    if aggregate is not None:
        row.update(
            {
                "util_mean": aggregate.utilization_mean,
                "util_max": aggregate.utilization_max,
                "mem_ctrl_util_mean": aggregate.memory_controller_utilization_mean,
                "bandwidth_gbps": None
                if aggregate.memory_bandwidth_bps is None
                else aggregate.memory_bandwidth_bps / 1e9,
                "bandwidth_source": aggregate.bandwidth_source,
                "peak_gbps": None
                if aggregate.peak_bandwidth_bps is None
                else aggregate.peak_bandwidth_bps / 1e9,
                "memory_used_bytes": aggregate.memory_used_bytes,
                "power_mean_w": aggregate.power_watts,
                "sm_clock_mhz": aggregate.sm_clock_mhz,
                "memory_clock_mhz": aggregate.memory_clock_mhz,
                "attributes": dict(aggregate.attributes()),
            }
        )
    return row


def print_table(title: str, rows: Sequence[dict[str, Any]]) -> None:
    say(f"== {title}")
    say(
        f"{'phase':7} {'gpu':>3} {'n':>4} {'util':>5} {'umax':>5} {'mctl':>5} {'BW GB/s':>8} "
        f"{'%peak':>6} {'src':>6} {'mem GiB':>8} {'P W':>6} {'Pmax':>6} {'SM MHz':>7}"
    )
    for r in rows:
        peak = r.get("peak_gbps")
        bandwidth = r.get("bandwidth_gbps")
        share = None if not peak or bandwidth is None else 100 * bandwidth / peak
        say(
            f"{r['phase']:7} {r['gpu']:>3} {r['samples']:>4} {fmt(r.get('util_mean'), 0.01, 0):>5} "
            f"{fmt(r.get('util_max'), 0.01, 0):>5} {fmt(r.get('mem_ctrl_util_mean'), 0.01, 0):>5} "
            f"{fmt(bandwidth, 1, 0):>8} {fmt(share, 1, 1):>6} "
            f"{str(r.get('bandwidth_source', '-'))[:6]:>6} "
            f"{fmt(r.get('memory_used_bytes'), GIB, 2):>8} {fmt(r.get('power_mean_w'), 1, 0):>6} "
            f"{fmt(r.get('power_max_w'), 1, 0):>6} {fmt(r.get('sm_clock_mhz'), 1, 0):>7}"
        )


def workload_checks(
    full: Sequence[dict[str, Any]],
    settled: Sequence[dict[str, Any]],
    uuid: str,
    interval_s: float,
    hold_bytes: int,
) -> None:
    def of(rows: Sequence[dict[str, Any]], phase: str) -> dict[str, Any]:
        return next((r for r in rows if r["phase"] == phase and r["uuid"] == uuid), {})

    def num(row: dict[str, Any], key: str) -> float:
        value = row.get(key)
        return float("nan") if value is None else float(value)

    idle, mm, cp, hold = (of(settled, p) for p in ("idle", "matmul", "copy", "hold"))
    u_idle, u_mm = num(idle, "util_mean"), num(mm, "util_mean")
    check(
        "matmul utilisation > 0.5 and > idle",
        u_mm > 0.5 and u_mm > u_idle,
        f"matmul {u_mm:.2f}, idle {u_idle:.2f} (settled windows)",
    )
    bw_mm, bw_cp, peak = num(mm, "bandwidth_gbps"), num(cp, "bandwidth_gbps"), num(cp, "peak_gbps")
    check(
        "copy bandwidth > matmul's or > 0.3 of peak",
        bw_cp > bw_mm or bw_cp > 0.3 * peak,
        f"copy {bw_cp:.0f} GB/s ({bw_cp / peak:.0%} of {peak:.0f}), matmul {bw_mm:.0f} GB/s, "
        f"source {cp.get('bandwidth_source')}",
    )
    m_idle, m_hold = num(idle, "memory_used_bytes"), num(hold, "memory_used_bytes")
    need = hold_bytes - 64 * (1 << 20)
    check(
        f"hold memory >= idle + {hold_bytes / GIB:.0f} GiB (less 64 MiB rounding)",
        m_hold - m_idle >= need,
        f"hold {m_hold / GIB:.2f} GiB, idle {m_idle / GIB:.2f} GiB, "
        f"difference {(m_hold - m_idle) / GIB:.3f} GiB",
    )
    p_idle, p_mm = num(idle, "power_mean_w"), num(mm, "power_mean_w")
    check("matmul power > idle power", p_mm > p_idle, f"matmul {p_mm:.0f} W, idle {p_idle:.0f} W")
    for phase in ("idle", "matmul", "copy", "hold"):
        row = of(full, phase)
        expected = row.get("seconds", 0) / interval_s
        n = row.get("samples", 0)
        check(
            f"{phase}: samples per window ~ {expected:.0f} (+-50%)",
            0.5 * expected <= n <= 1.5 * expected,
            f"{n} samples in {row.get('seconds')} s at {interval_s * 1000:.0f} ms",
        )


# --- 3. end to end through the node agent ----------------------------------------------------


class Upstream:
    """A small OTLP/gRPC receiver (traces and metrics) standing in for the collector."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import (
            metrics_service_pb2,
            metrics_service_pb2_grpc,
        )
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        self.traces: list[Any] = []
        self.metrics: list[Any] = []
        self.lock = threading.Lock()
        outer = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                with outer.lock:
                    outer.traces.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                with outer.lock:
                    outer.metrics.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        with self.lock:
            return [
                (attributes_of(rs.resource.attributes), span)
                for request in self.traces
                for rs in request.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            ]

    def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return predicate()

    def stop(self) -> None:
        self.server.stop(0.5).wait(3.0)


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(item) for item in value.array_value.values]
    return None if kind is None else getattr(value, kind)


def attributes_of(attributes: Any) -> dict[str, Any]:
    return {kv.key: value_of(kv.value) for kv in attributes}


def build_spans(
    phases: Sequence[dict[str, Any]], pid: int, uuid: str
) -> tuple[ExportTraceServiceRequest, dict[bytes, dict[str, Any]]]:
    """What an in-process agent on that GPU would send: resource A names its GPUs, resource B
    has only ``process.pid`` (the node agent maps it through NVML's process list)."""
    request = ExportTraceServiceRequest()
    expected: dict[bytes, dict[str, Any]] = {}
    windows = {p["phase"]: (int(p["start_ns"]), int(p["end_ns"])) for p in phases}

    def resource(named: bool) -> Any:
        rs = request.resource_spans.add()
        attrs = rs.resource.attributes
        attrs.add(key=semconv.SERVICE_NAME).value.string_value = "nvml-real-gpu-bench"
        attrs.add(key=semconv.PROCESS_PID).value.int_value = pid
        if named:
            entry = attrs.add(key=semconv.GPU_UUIDS)
            entry.value.array_value.values.add(string_value=uuid)
        return rs.scope_spans.add().spans

    def add(spans: Any, name: str, label: str, start: int, end: int, trace: bytes) -> Any:
        span = spans.add(name=name, start_time_unix_nano=start, end_time_unix_nano=end)
        span.trace_id = trace
        span.span_id = os.urandom(8)
        span.attributes.add(key="bench.phase").value.string_value = label
        expected[span.span_id] = {"name": name, "label": label, "start": start, "end": end}
        return span

    named = resource(True)
    for phase, (start, end) in windows.items():  # one request per phase
        add(named, semconv.SPAN_REQUEST, phase, start, end, os.urandom(16))
    # One request shaped like a real one: prefill = matmul, decode = copy, a 5 ms engine step.
    trace = os.urandom(16)
    weights = named.add(name=semconv.SPAN_COLD_START_WEIGHT_LOAD, trace_id=trace)
    weights.span_id = os.urandom(8)
    weights.start_time_unix_nano, weights.end_time_unix_nano = windows["idle"]
    weights.attributes.add(key=semconv.MODEL_WEIGHT_BYTES).value.int_value = 16_000_000_000
    first, last = windows["matmul"][0], windows["copy"][1]
    add(named, semconv.SPAN_REQUEST, "request(matmul+copy)", first, last, trace)
    add(named, semconv.SPAN_PREFILL, "prefill=matmul", *windows["matmul"], trace)
    decode = add(named, semconv.SPAN_DECODE, "decode=copy", *windows["copy"], trace)
    offsets = decode.attributes.add(key=semconv.DECODE_TOKEN_OFFSETS)
    step_us = (windows["copy"][1] - windows["copy"][0]) // 1000 // 100
    for k in range(101):  # 101 tokens evenly over the copy phase
        offsets.value.array_value.values.add(int_value=k * step_us)
    middle = (windows["copy"][0] + windows["copy"][1]) // 2
    add(named, semconv.SPAN_ENGINE_STEP, "step(5 ms in copy)", middle, middle + 5_000_000, trace)
    unnamed = resource(False)
    add(unnamed, semconv.SPAN_REQUEST, "matmul(pid only)", *windows["matmul"], os.urandom(16))
    return request, expected


def run_e2e(sampler: NvmlSampler, phases: Sequence[dict[str, Any]], pid: int, uuid: str) -> None:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from tokentrace.agent.node.service import NodeAgent, NodeAgentConfig
    from tokentrace.agent.otlp_config import OtlpExporterConfig

    out: dict[str, Any] = REPORT["e2e"]
    say("== end to end: spans -> NodeAgent (gRPC receiver) -> OTLP upstream")
    upstream = Upstream()
    endpoint = f"http://127.0.0.1:{upstream.port}"
    config = NodeAgentConfig(
        grpc_endpoint="127.0.0.1:0",
        http_endpoint=None,
        exporter=OtlpExporterConfig(endpoint=endpoint, protocol="grpc"),
        metrics_exporter=OtlpExporterConfig(endpoint=endpoint, protocol="grpc"),
    )
    agent = NodeAgent(config, sampler=sampler, environ={"K8S_NODE_NAME": "gpu-bench-node"})
    started = time.monotonic()
    agent.start()
    out["start_s"] = round(time.monotonic() - started, 3)
    try:
        request, expected = build_spans(phases, pid, uuid)
        port = agent.receivers[0].port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10)
        total = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        sent_at = time.monotonic()
        arrived = upstream.wait(lambda: len(upstream.spans()) >= total, 10.0)
        out["relay_s"] = round(time.monotonic() - sent_at, 3)
        points = agent.export_metrics()
        flushed = agent.metric_sender is not None and agent.metric_sender.force_flush(5.0)
        out["metric_points"] = points
        out["metrics_flushed"] = flushed
        out["stats"] = agent.stats()
    finally:
        agent.shutdown(3.0)  # also stops the sampler (it was handed in)
        upstream.stop()
    relayed = upstream.spans()
    check(
        "node agent relayed every span",
        arrived,
        f"{len(relayed)}/{total} spans upstream in {out['relay_s']} s",
    )
    own = {  # the same windows aggregated here from the same sampler's ring
        key: row_of(
            info["label"],
            next(d for d in sampler.devices if d.uuid == uuid),
            (sampler.ring(uuid) or _empty_ring()).window(info["start"], info["end"])[0],
            (info["end"] - info["start"]) / 1e9,
        )
        for key, info in expected.items()
    }
    out["spans"] = []
    say(
        f"{'span':16} {'label':22} {'n':>4} {'util':>5} {'BW GB/s':>8} {'%peak':>6} {'src':>6} "
        f"{'mem GiB':>8} {'P W':>6} {'SM MHz':>7} roofline"
    )
    for resource, span in relayed:
        info = expected.get(bytes(span.span_id))
        if info is None:
            continue
        attrs = attributes_of(span.attributes)
        gpu = {k: v for k, v in attrs.items() if k.startswith("tokentrace.gpu.")}
        if semconv.DECODE_ROOFLINE_RATIO in attrs:
            gpu[semconv.DECODE_ROOFLINE_RATIO] = attrs[semconv.DECODE_ROOFLINE_RATIO]
        out["spans"].append(
            {
                "name": span.name,
                "label": info["label"],
                "resource_gpu_uuids": resource.get(semconv.GPU_UUIDS),
                "attributes": gpu,
            }
        )
        ratio = attrs.get(semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO)
        say(
            f"{span.name:16} {info['label'][:22]:22} {attrs.get(semconv.GPU_SAMPLES, '-')!s:>4} "
            f"{fmt(attrs.get(semconv.GPU_UTILIZATION_MEAN), 0.01, 0):>5} "
            f"{fmt(attrs.get(semconv.GPU_MEMORY_BANDWIDTH_GBPS), 1, 0):>8} "
            f"{fmt(None if ratio is None else 100 * ratio, 1, 1):>6} "
            f"{str(attrs.get(semconv.GPU_MEMORY_BANDWIDTH_SOURCE, '-'))[:6]:>6} "
            f"{fmt(attrs.get(semconv.GPU_MEMORY_USED_BYTES), GIB, 2):>8} "
            f"{fmt(attrs.get(semconv.GPU_POWER_WATTS), 1, 0):>6} "
            f"{fmt(attrs.get(semconv.GPU_SM_CLOCK_MHZ), 1, 0):>7} "
            f"{fmt(attrs.get(semconv.DECODE_ROOFLINE_RATIO), 1, 3)}"
        )
        if info["name"] == semconv.SPAN_ENGINE_STEP:
            check(
                "engine step inside one sample period gets the covering sample",
                attrs.get(semconv.GPU_SAMPLES) == 0
                and attrs.get(semconv.GPU_UTILIZATION_MEAN) is not None,
                f"samples={attrs.get(semconv.GPU_SAMPLES)}, "
                f"util={attrs.get(semconv.GPU_UTILIZATION_MEAN)}",
            )
            continue
        mine = own[bytes(span.span_id)].get("attributes", {})
        differing = sorted(
            key
            for key in set(mine) | set(gpu)
            if key != semconv.DECODE_ROOFLINE_RATIO and not _close(mine.get(key), gpu.get(key))
        )
        check(
            f"{span.name} [{info['label']}] enriched, equal to aggregate_window here",
            bool(gpu.get(semconv.GPU_SAMPLES)) and not differing,
            f"{gpu.get(semconv.GPU_SAMPLES)} samples, "
            + ("all attributes equal" if not differing else f"differ: {differing}"),
        )
    by_label = {s["label"]: s for s in out["spans"]}
    mapped = by_label.get("matmul(pid only)", {})
    check(
        "pid-only resource mapped through NVML's process list",
        mapped.get("resource_gpu_uuids") == [uuid],
        f"resource tokentrace.gpu.uuids = {mapped.get('resource_gpu_uuids')}",
    )
    decode = by_label.get("decode=copy", {}).get("attributes", {})
    check(
        "decode roofline ratio attached (16 GB weights, 101 tokens)",
        decode.get(semconv.DECODE_ROOFLINE_RATIO) is not None,
        f"{decode.get(semconv.DECODE_ROOFLINE_RATIO)}",
        info=True,
    )
    names = sorted(
        {
            m.name
            for r in upstream.metrics
            for rm in r.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
        }
    )
    out["metric_names"] = names
    check(
        "GPU metrics exported upstream",
        bool(names),
        f"{out.get('metric_points')} points: {', '.join(names)}",
    )
    say(f"node agent stats: {out.get('stats')}")


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)))
        except (TypeError, ValueError):
            return False
    return bool(a == b)


def _empty_ring() -> Any:
    from tokentrace.agent.node.sampler import SampleRing

    return SampleRing(1)


# --- 4. cost -----------------------------------------------------------------------------------


def measure_ticks(interval_s: float, seconds: float) -> dict[str, Any]:
    sampler = NvmlSampler(interval_s=interval_s)
    if not sampler.start():
        return {"error": sampler.unavailable_reason}
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    cpu1, wall1 = time.process_time(), time.monotonic()
    stats = sampler.stats()
    sampler.stop()
    ticks = max(1, stats["ticks"])
    wall = wall1 - wall0
    passes = max(1, stats["slow_passes"])
    result = {
        "interval_ms": interval_s * 1000,
        "seconds": round(wall, 3),
        "ticks": stats["ticks"],
        "expected_ticks": round(wall / interval_s),
        "fast_tick_wall_us_mean": stats["tick_wall_ns"] / ticks / 1000,
        "fast_tick_wall_us_max": stats["max_tick_wall_ns"] / 1000,
        "thread_cpu_us_per_tick": stats["tick_cpu_ns"] / ticks / 1000,
        "slow_passes": stats["slow_passes"],
        "slow_cpu_us_per_tick": stats["slow_cpu_ns"] / ticks / 1000,
        "slow_cpu_us_per_pass": stats["slow_cpu_ns"] / passes / 1000,
        "slow_wall_us_per_pass": stats["slow_wall_ns"] / passes / 1000,
        "process_cpu_us_per_tick": (cpu1 - cpu0) * 1e6 / ticks,
        "share_of_one_core": (stats["tick_cpu_ns"] + stats["slow_cpu_ns"]) / 1e9 / wall,
        "fast_share_of_one_core": stats["tick_cpu_ns"] / 1e9 / wall,
        "read_errors": stats["read_errors"],
        "disabled_fields": stats["disabled_fields"],
    }
    say(
        f"sampler every {interval_s * 1000:.0f} ms for {wall:.1f} s: {stats['ticks']} ticks "
        f"(expected {result['expected_ticks']}); fast tick wall "
        f"{result['fast_tick_wall_us_mean']:.0f} µs mean (max "
        f"{result['fast_tick_wall_us_max']:.0f}), CPU {result['thread_cpu_us_per_tick']:.0f} "
        f"µs/tick; slow thread {stats['slow_passes']} passes, CPU "
        f"{result['slow_cpu_us_per_tick']:.0f} µs/tick ({result['slow_cpu_us_per_pass']:.0f} "
        f"µs/pass, wall {result['slow_wall_us_per_pass']:.0f} µs/pass); process CPU "
        f"{result['process_cpu_us_per_tick']:.0f} µs/tick; both threads "
        f"{100 * result['share_of_one_core']:.2f}% of one core"
    )
    check(
        f"sampler keeps its {interval_s * 1000:.0f} ms interval",
        stats["ticks"] >= 0.8 * result["expected_ticks"],
        f"{stats['ticks']} of {result['expected_ticks']} ticks, fast tick max "
        f"{result['fast_tick_wall_us_max']:.0f} µs",
        info=True,
    )
    return result


def _timed(call: Callable[[], Any], reps: int) -> dict[str, Any]:
    walls, cpus = [], []
    for _ in range(reps):
        wall0, cpu0 = time.perf_counter_ns(), time.thread_time_ns()
        call()
        walls.append((time.perf_counter_ns() - wall0) / 1000)
        cpus.append((time.thread_time_ns() - cpu0) / 1000)
    return {
        "reps": reps,
        "wall_us_median": statistics.median(walls),
        "wall_us_max": max(walls),
        "cpu_us_median": statistics.median(cpus),
    }


def time_tick_and_slow_pass(reps: int = 20) -> dict[str, Any]:
    """One fast tick (``tick()``: what the 100 ms thread does) and one slow pass
    (``read_slow()`` with everything due: PCIe TX/RX and the process list), each alone."""
    sampler = NvmlSampler(pcie_interval_s=1e-9, process_refresh_s=0.0)  # every pass is due
    if not sampler.open():
        return {"error": sampler.unavailable_reason}
    sampler.read_slow()
    fast = _timed(sampler.tick, reps)
    slow = _timed(sampler.read_slow, max(3, reps // 4))
    sampler.stop()
    for name, result in (("fast tick()", fast), ("slow pass read_slow()", slow)):
        say(
            f"{name} over all GPUs: wall median {result['wall_us_median']:.0f} µs "
            f"(max {result['wall_us_max']:.0f}), CPU median {result['cpu_us_median']:.0f} µs"
        )
    return {"fast_tick": fast, "slow_pass": slow}


def time_calls(budget_s: float = 0.25, max_reps: int = 200) -> list[dict[str, Any]]:
    """Wall time of each NVML call the sampler makes, on GPU 0."""
    sampler = NvmlSampler()
    if not sampler.open():
        return []
    if not sampler.devices:
        sampler.stop()
        return []
    import pynvml

    state = sampler._states[0]
    h = state.handle
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("GetUtilizationRates", lambda: pynvml.nvmlDeviceGetUtilizationRates(h)),
        ("GetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(h)),
        ("GetPowerUsage", lambda: pynvml.nvmlDeviceGetPowerUsage(h)),
        ("GetClockInfo(SM)", lambda: pynvml.nvmlDeviceGetClockInfo(h, 1)),
        ("GetClockInfo(MEM)", lambda: pynvml.nvmlDeviceGetClockInfo(h, 2)),
        ("GetTemperature", lambda: pynvml.nvmlDeviceGetTemperature(h, 0)),
        ("GetPcieThroughput(TX)", lambda: pynvml.nvmlDeviceGetPcieThroughput(h, 0)),
        ("GetPcieThroughput(RX)", lambda: pynvml.nvmlDeviceGetPcieThroughput(h, 1)),
        ("GetComputeRunningProcesses", lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
        ("GetProcessUtilization", lambda: pynvml.nvmlDeviceGetProcessUtilization(h, 0)),
        ("GetMemoryBusWidth", lambda: pynvml.nvmlDeviceGetMemoryBusWidth(h)),
        ("GetMaxClockInfo(MEM)", lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, 2)),
    ]
    if state.gpm_samples:
        calls.append(("GPM SampleGet+MetricsGet", lambda: sampler._gpm_dram_utilization(state)))
    rows = []
    say(f"{'NVML call (GPU 0)':28} {'reps':>5} {'median':>10} {'min':>8} {'max':>9}  (µs) note")
    for name, call in calls:
        times: list[float] = []
        error = None
        result: Any = None
        deadline = time.perf_counter() + budget_s
        while len(times) < max_reps and time.perf_counter() < deadline:
            started = time.perf_counter_ns()
            try:
                result = call()
            except Exception as failure:  # NVMLError mostly; anything else is reported too
                error = f"{type(failure).__name__}: {failure}"
            times.append((time.perf_counter_ns() - started) / 1000)
        row = {
            "call": name,
            "reps": len(times),
            "median_us": statistics.median(times),
            "min_us": min(times),
            "max_us": max(times),
            "error": error,
            "last_value": _short(result),
        }
        rows.append(row)
        say(
            f"{name:28} {row['reps']:>5} {row['median_us']:>10.1f} {row['min_us']:>8.1f} "
            f"{row['max_us']:>9.1f}  {error or row['last_value']}"
        )
    sampler.stop()
    return rows


def _short(value: Any) -> str:
    if value is None:
        return ""
    if hasattr(value, "_fields_"):
        return str({name: getattr(value, name, None) for name, *_ in value._fields_})[:120]
    if isinstance(value, list):
        return f"list of {len(value)}"
    return str(value)[:120]


# --- main --------------------------------------------------------------------------------------


def load_stand_in(device_count: int) -> Any:
    from tests.node.nvml_stand_in import build_stand_in, load_for_pynvml

    directory = Path(tempfile.mkdtemp(prefix="tokentrace-nvml-"))
    stand_in = load_for_pynvml(build_stand_in(directory))
    stand_in.reset(device_count)
    stand_in.set(0, "mem_used", STAND_IN_BASE_MEMORY)
    for field, value in STAND_IN_PHASES["idle"].items():
        stand_in.set(0, field, value)
    return stand_in


def main() -> int:
    global _OUT
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON report path")
    parser.add_argument("--stand-in", action="store_true", help="the tests' stand-in NVML + CPU")
    parser.add_argument("--phase-s", type=float, default=2.0)
    parser.add_argument("--hold-gib", type=float, default=8.0)
    parser.add_argument("--interval", type=float, default=0.1, help="sampler interval (s)")
    parser.add_argument("--ready-timeout", type=float, default=45.0, help="child start (s)")
    parser.add_argument("--watchdog", type=float, default=88.0, help="hard stop (s)")
    parser.add_argument(
        "--pcie-delay-us",
        type=int,
        default=0,
        help="stand-in only: each PCIe throughput call sleeps this long (an H100: ~21000)",
    )
    args = parser.parse_args()
    _OUT = args.out
    start_watchdog(args.watchdog)
    no_driver = not os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is None
    stand_in_mode = args.stand_in or no_driver
    if no_driver and not args.stand_in:
        say("no /dev/nvidiactl and no nvidia-smi here: running against the stand-in NVML")
    REPORT["mode"] = "stand-in" if stand_in_mode else "gpu"
    REPORT["args"] = {k: str(v) for k, v in vars(args).items()}
    say(f"== nvml_real_gpu: mode {REPORT['mode']}, pid {os.getpid()}, {time.ctime()}")
    stand_in = load_stand_in(2) if stand_in_mode else None
    if stand_in is not None and args.pcie_delay_us:
        stand_in.set_call_delay_us("nvmlDeviceGetPcieThroughput", args.pcie_delay_us)

    sampler = NvmlSampler(interval_s=args.interval)
    if not sampler.start():
        check("NVML opens", False, f"{sampler.unavailable_reason}")
        write_report()
        return 0
    try:
        facts(sampler)
    except Exception:
        record_error("facts")

    workdir = Path(tempfile.mkdtemp(prefix="nvml-real-gpu-"))
    child: Child | None = None
    phases: list[dict[str, Any]] = []
    uuid = sampler.devices[0].uuid if sampler.devices else ""
    pid = 0
    try:
        say("== workload (child process)")
        child = Child("cpu" if stand_in_mode else "cuda", args.phase_s, args.hold_gib, workdir)
        pid = child.process.pid
        ready, phases = run_workload(child, stand_in, args.ready_timeout, args.phase_s)
        REPORT["workload"] = {"ready": ready, "phases": phases}
        torch_uuid = str(ready.get("uuid") or "")
        for device in sampler.devices:
            if torch_uuid and device.uuid.endswith(torch_uuid):
                uuid = device.uuid
        say(f"child pid {pid} on GPU {uuid}")
        time.sleep(1.2)  # one more process-list refresh (once a second)
        gpus = sampler.gpus_of_pid(pid)
        usage = [dataclasses.asdict(u) for u in sampler.process_usage() if u.pid == pid]
        REPORT["workload"]["process_list"] = {
            "gpus_of_pid": list(gpus),
            "process_usage": usage,
            "all_pids": sorted({u.pid for u in sampler.process_usage()}),
        }
        check(
            "child pid in NVML's process list",
            uuid in gpus and bool(usage),
            f"gpus_of_pid({pid}) = {list(gpus)}, process_usage = {usage}, all pids "
            f"{REPORT['workload']['process_list']['all_pids']}",
        )
        full = phase_rows(sampler, phases)
        settled = phase_rows(sampler, phases, SETTLE_NS)
        REPORT["phases"] = {"full": full, "settled": settled}
        print_table("per phase, whole windows (what a span of that window gets)", full)
        print_table(f"per phase, first {SETTLE_NS / 1e9} s skipped (used by the checks)", settled)
        workload_checks(full, settled, uuid, args.interval, int(args.hold_gib * GIB))
        ring = sampler.ring(uuid)
        first, last = int(phases[0]["start_ns"]), int(phases[-1]["end_ns"])
        REPORT["raw_samples"] = {
            "uuid": uuid,
            "samples": [
                s._asdict()
                for s in (ring.snapshot() if ring else [])
                if first - 1_000_000_000 <= s.time_ns <= last + 1_000_000_000
            ],
        }
    except Exception as error:
        record_error("workload")
        check("workload ran to its end", False, f"{type(error).__name__}: {error}"[:2000])
        if child is not None:
            REPORT["workload"]["child_stderr_tail"] = child.stderr_tail()
            REPORT["workload"]["child_stdout"] = child.lines[-50:]

    try:
        REPORT["sampler_after_workload"] = sampler_fields(sampler)
        for device in REPORT["sampler_after_workload"]["devices"]:
            say(
                f"sampler on {device['uuid']}: unsupported fields {device['disabled_fields']}, "
                f"GPM active {device['gpm_active']}, lost {device['lost']}"
            )
            check(
                f"GPM DRAM bandwidth works on {device['uuid']}",
                device["gpm_active"] and "gpm_dram_bandwidth" not in device["disabled_fields"],
                f"gpm_active={device['gpm_active']}",
                info=True,
            )
        say(f"sampler stats: {sampler.stats()}")
    except Exception:
        record_error("sampler fields")

    if len(phases) == 4 and child is not None and child.process.poll() is None:
        try:
            run_e2e(sampler, phases, pid, uuid)
        except Exception:
            record_error("e2e")
    else:
        check("end to end through the node agent", False, "skipped: the workload did not finish")
    sampler.stop()  # no-op when the node agent stopped it already
    if child is not None:
        code = child.finish()
        REPORT["workload"]["child_exit"] = code
        REPORT["workload"]["child_stderr_tail"] = child.stderr_tail()
        say(f"child exited with {code}")

    say("== cost (GPU idle)")
    try:
        REPORT["cost"]["ticks_100ms"] = measure_ticks(0.1, 3.0)
        REPORT["cost"]["ticks_20ms"] = measure_ticks(0.02, 1.5)
        REPORT["cost"]["tick_and_slow_pass"] = time_tick_and_slow_pass()
        REPORT["call_timing"] = time_calls()
    except Exception:
        record_error("cost")

    write_report()
    summary = REPORT["summary"]
    say(
        f"== done in {REPORT['elapsed_s']} s: {summary['pass']} PASS, {summary['fail']} FAIL, "
        f"{summary['errors']} errors; report {_OUT}"
    )
    for item in REPORT["checks"]:
        if item["result"] == "FAIL":
            say(f"  FAIL {item['name']}: {item['detail']}")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:
        record_error("main")
        write_report()
        code = 1
    sys.stdout.flush()
    os._exit(code)  # do not wait for stray non-daemon threads (gRPC) at exit
