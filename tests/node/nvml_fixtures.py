"""The NVML stand-in's fixtures, loaded where the real pynvml finds it: registered once for the
whole tree by tests/conftest.py (a second registration would build and load a second library,
and a process can hold only one), for the node agent's tests and the dashboard's.

The stand-in library is built once per test session and loaded once per process (a process can
hold only one `libnvidia-ml.so.1`). `nvml` resets it before and after each test: reset zeroes the
stand-in's init refcount, so every test starts with NVML uninitialised, as in a fresh process,
whether or not the previous test called nvmlShutdown. pynvml's own refcount is bookkeeping only
(nothing in pynvml reads it), and its cached function pointers stay valid because the library is
never unloaded; so no pynvml state needs undoing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.node.nvml_stand_in import NvmlStandIn, build_stand_in, load_for_pynvml

_DEFAULT_TEST_DEVICE_COUNT = 2


@pytest.fixture(scope="session")
def nvml_library_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the freshly built stand-in `libnvidia-ml.so.1`."""
    directory = tmp_path_factory.mktemp("nvml")
    build_stand_in(directory)
    return directory


@pytest.fixture(scope="session")
def nvml_stand_in_lib(nvml_library_dir: Path) -> NvmlStandIn:
    """The stand-in, loaded so that pynvml in this process uses it."""
    return load_for_pynvml(build_stand_in(nvml_library_dir))


@pytest.fixture
def nvml(nvml_stand_in_lib: NvmlStandIn) -> Iterator[NvmlStandIn]:
    """The stand-in with 2 default devices, NVML uninitialised; reset again after the test."""
    nvml_stand_in_lib.reset(_DEFAULT_TEST_DEVICE_COUNT)
    yield nvml_stand_in_lib
    nvml_stand_in_lib.reset(_DEFAULT_TEST_DEVICE_COUNT)
