"""A stand-in NVML library for tests on machines without a GPU, loaded by the real `pynvml`.

`fake_nvml.c` beside this module builds into `libnvidia-ml.so.1` (that is also its SONAME): it
exports the NVML functions the node agent calls through pynvml, with pynvml's argument and struct
layouts, and serves scripted per-device values. `NvmlStandIn` drives its control API.

Two ways to make pynvml use it:

* In this process: `load_for_pynvml(build_stand_in(directory))` loads the library by absolute
  path before pynvml loads anything. pynvml then calls `CDLL("libnvidia-ml.so.1")`; glibc's
  dlopen matches a name without a slash against the SONAMEs of objects already loaded, so that
  call returns the stand-in (load_for_pynvml checks this).
* In a subprocess: pynvml finds `libnvidia-ml.so.1` through the dynamic linker's search path, so
  run the child with `env=library_env(directory)`, which puts the directory first on
  `LD_LIBRARY_PATH`. The child's stand-in starts with `NVML_STAND_IN_DEVICE_COUNT` devices
  (default 2) and default values; only the in-process control API can script more.

A process can hold one `libnvidia-ml.so.1` only: once the stand-in (or a real NVML) is loaded,
later loads by that name return it, and a rebuilt .so takes effect in new processes only.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

LIBRARY_NAME = "libnvidia-ml.so.1"
"""The file name and SONAME of the stand-in, the name pynvml loads on Linux."""

SOURCE_PATH = Path(__file__).with_name("fake_nvml.c")
DEVICE_COUNT_ENV = "NVML_STAND_IN_DEVICE_COUNT"
"""Read once when the library loads: the number of devices a fresh process sees."""

ALL_DEVICES = -1
"""Device argument meaning every device; for set_error also functions that take no device."""

MAX_DEVICES = 16
MAX_PROCESSES_PER_DEVICE = 64

FIELDS = frozenset(
    {
        "gpu_util",
        "mem_util",
        "mem_used",
        "mem_total",
        "mem_reserved",
        "power_mw",
        "sm_clock",
        "mem_clock",
        "max_mem_clock",
        "max_sm_clock",
        "bus_width",
        "temperature",
        "pcie_tx_kbps",
        "pcie_rx_kbps",
        "dram_bw_util",
    }
)
"""Scriptable per-device values. mem_used is the v1 `used` (it includes mem_reserved); the v2
struct reports used = mem_used - mem_reserved. Units: bytes, mW, MHz, bits, degrees C, KB/s and
percent."""

_DEFAULT_COMPILER = "cc"
_DEFAULT_DEVICE_COUNT = 2
_COMPILE_FLAGS = (
    "-shared",
    "-fPIC",
    "-O2",
    "-Wall",
    "-Werror",
    f"-Wl,-soname,{LIBRARY_NAME}",
    "-pthread",
)
_UNKNOWN_NAME = -1
_BAD_DEVICE = -2
_TABLE_FULL = -3


def build_stand_in(directory: Path) -> Path:
    """Compile the stand-in into `directory/libnvidia-ml.so.1` and return that path.

    Skips the compiler when the library is newer than the source. Uses `$CC` when set. Raises
    RuntimeError, with the compiler's output, when compiling fails.
    """
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / LIBRARY_NAME
    if target.exists() and target.stat().st_mtime >= SOURCE_PATH.stat().st_mtime:
        return target
    # Build beside the target and rename: concurrent builders never see a half-written file.
    partial = directory / f".{LIBRARY_NAME}.{os.getpid()}.tmp"
    compiler = os.environ.get("CC", _DEFAULT_COMPILER)
    command = [compiler, *_COMPILE_FLAGS, "-o", str(partial), str(SOURCE_PATH)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as error:
        raise RuntimeError(f"cannot run the C compiler {compiler!r}: {error}") from error
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(
            f"building the NVML stand-in failed (exit {result.returncode}): {' '.join(command)}\n"
            f"{result.stdout}{result.stderr}"
        )
    os.replace(partial, target)
    return target


def library_env(directory: Path, *, device_count: int | None = None) -> dict[str, str]:
    """os.environ with `directory` first on LD_LIBRARY_PATH, for a child process using pynvml."""
    env = dict(os.environ)
    inherited = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = f"{directory}{os.pathsep}{inherited}" if inherited else str(directory)
    if device_count is not None:
        env[DEVICE_COUNT_ENV] = str(device_count)
    return env


def load_for_pynvml(path: Path) -> NvmlStandIn:
    """Load the stand-in so that pynvml's `CDLL("libnvidia-ml.so.1")` resolves to it.

    Raises RuntimeError when pynvml already loaded another NVML library in this process, or when
    loading by name does not reach the stand-in.
    """
    pynvml = sys.modules.get("pynvml")
    loaded = getattr(pynvml, "nvmlLib", None)
    if loaded is not None and not hasattr(loaded, "standin_reset"):
        raise RuntimeError("pynvml already loaded a different NVML library in this process")
    stand_in = NvmlStandIn(path)
    by_name = ctypes.CDLL(LIBRARY_NAME)
    if not hasattr(by_name, "standin_reset"):
        raise RuntimeError(f"{LIBRARY_NAME} resolves to another library, not {path}")
    return stand_in


class NvmlStandIn:
    """Typed access to the stand-in's control API. Device indexes start at 0."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        self._declare()

    def _declare(self) -> None:
        lib = self._lib
        c_int, c_uint, c_double = ctypes.c_int, ctypes.c_uint, ctypes.c_double
        c_char_p, c_longlong = ctypes.c_char_p, ctypes.c_longlong
        signatures: dict[str, tuple[list[type], type | None]] = {
            "standin_reset": ([c_int], c_int),
            "standin_set": ([c_int, c_char_p, c_double], c_int),
            "standin_set_ramp": ([c_int, c_char_p, c_double, c_double], c_int),
            "standin_set_error": ([c_int, c_char_p, c_int], c_int),
            "standin_set_gpm_supported": ([c_int, c_int], c_int),
            "standin_set_call_delay_us": ([c_char_p, c_uint], c_int),
            "standin_lose_gpu": ([c_int], c_int),
            "standin_set_init_error": ([c_int], None),
            "standin_add_process": (
                [c_int, c_uint, ctypes.c_ulonglong, c_uint, c_uint],
                c_int,
            ),
            "standin_calls": ([c_char_p], c_longlong),
            "standin_gpm_samples_live": ([], c_longlong),
            "standin_gpm_metric_max": ([], c_uint),
            "standin_struct_size": ([c_char_p], c_longlong),
        }
        for name, (argtypes, restype) in signatures.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = restype

    @staticmethod
    def _check(status: int, *, what: str) -> None:
        if status == _UNKNOWN_NAME:
            raise ValueError(f"unknown name: {what}")
        if status == _BAD_DEVICE:
            raise IndexError(f"device out of range (0..{MAX_DEVICES - 1} or ALL_DEVICES): {what}")
        if status == _TABLE_FULL:
            raise OverflowError(f"process table full ({MAX_PROCESSES_PER_DEVICE}): {what}")

    def reset(self, device_count: int = _DEFAULT_DEVICE_COUNT) -> None:
        """Defaults on every device; clears errors, lost GPUs, processes, call counts and init.

        NVML is left uninitialised (its init refcount is zeroed), as in a fresh process.
        """
        self._check(self._lib.standin_reset(device_count), what=f"device_count={device_count}")

    def set(self, device: int, field: str, value: float) -> None:
        """Every read of `field` on `device` (or ALL_DEVICES) returns `value`."""
        self._check(self._lib.standin_set(device, field.encode(), value), what=field)

    def set_ramp(self, device: int, field: str, start: float, step: float) -> None:
        """The k-th read of `field` from now on (k = 0, 1, ...) returns start + step * k."""
        status = self._lib.standin_set_ramp(device, field.encode(), start, step)
        self._check(status, what=field)

    def set_error(self, device: int, function: str, code: int) -> None:
        """NVML `function` (e.g. "nvmlDeviceGetPowerUsage") returns `code` for `device`; 0 clears.

        ALL_DEVICES also covers functions without a device (nvmlDeviceGetCount_v2, ...).
        """
        self._check(self._lib.standin_set_error(device, function.encode(), code), what=function)

    def set_call_delay_us(self, function: str, us: int) -> None:
        """Every call of NVML `function` on any device first sleeps `us` µs; 0 clears.

        The sleep happens before the stand-in takes its lock, so other threads' calls go on (as
        with a real driver's slow query: nvmlDeviceGetPcieThroughput takes ~21 ms on an H100).
        Reset clears every delay.
        """
        if us < 0:
            raise ValueError("us must not be negative")
        self._check(self._lib.standin_set_call_delay_us(function.encode(), us), what=function)

    def set_gpm_supported(self, device: int, supported: bool) -> None:
        self._check(self._lib.standin_set_gpm_supported(device, int(supported)), what="gpm")

    def lose_gpu(self, device: int) -> None:
        """Every call for `device` now fails with NVML_ERROR_GPU_IS_LOST, until reset."""
        self._check(self._lib.standin_lose_gpu(device), what="lose_gpu")

    def set_init_error(self, code: int) -> None:
        """nvmlInit returns `code` (0 clears), as a missing driver or a version mismatch would."""
        self._lib.standin_set_init_error(code)

    def add_process(
        self,
        device: int,
        pid: int,
        *,
        used_memory_bytes: int,
        sm_util: int = 0,
        mem_util: int = 0,
    ) -> None:
        """A compute process on `device`; adding a pid again updates it.

        It shows in nvmlDeviceGetComputeRunningProcesses and, with a fresh sample stamped with
        the query time, in every nvmlDeviceGetProcessUtilization query.
        """
        status = self._lib.standin_add_process(device, pid, used_memory_bytes, sm_util, mem_util)
        self._check(status, what=f"pid {pid}")

    def calls(self, function: str) -> int:
        """How often NVML `function` was called since the last reset, over all devices."""
        count = int(self._lib.standin_calls(function.encode()))
        self._check(count if count < 0 else 0, what=function)
        return count

    def gpm_samples_live(self) -> int:
        """GPM samples allocated and not freed yet, over the life of the process."""
        return int(self._lib.standin_gpm_samples_live())

    def gpm_metric_max(self) -> int:
        """Length of the metrics array the stand-in assumes in nvmlGpmMetricsGet_t."""
        return int(self._lib.standin_gpm_metric_max())

    def struct_size(self, pynvml_struct_name: str) -> int:
        """sizeof of the stand-in's C struct matching pynvml's ctypes struct of that name."""
        size = int(self._lib.standin_struct_size(pynvml_struct_name.encode()))
        self._check(size if size < 0 else 0, what=pynvml_struct_name)
        return size
