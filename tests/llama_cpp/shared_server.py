"""A real llama-cpp-python OpenAI server (``python -m llama_cpp.server``) as a child process.

llama-cpp-python lives in a virtual environment of its own: ``make llamacpp-venv`` builds it
outside the clone (it compiles llama.cpp; the Makefile reuses a cached wheel) and ``make pytest``
hands its interpreter to the tests in ``TOKENTRACE_LLAMACPP_PYTHON`` (`llamacpp_python`); a test
that needs it and finds it unset fails with one line saying so.

The model is a tiny random-weight Llama GGUF file written by ``gguf_writer.py`` with that venv's
interpreter (`tiny_gguf`; the project's venv has no ``gguf``). tokentrace is installed into the
server's environment as a user would (``tests/sglang/shared_server.py``'s `tokentrace_site`).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tokentrace.loadgen.local_vllm import (
    free_loopback_port,
    log_tail,
    spawn_until_healthy,
    stop_server,
)

LLAMACPP_PYTHON_ENV = "TOKENTRACE_LLAMACPP_PYTHON"
LLAMACPP_PYTHON_HINT = (
    f"{LLAMACPP_PYTHON_ENV} is not set: run `make llamacpp-venv` and export "
    f"{LLAMACPP_PYTHON_ENV}=<that venv>/bin/python (`make pytest` does both)"
)
SERVED_MODEL_NAME = "tiny-llama"
GGUF_WRITER = Path(__file__).parent / "gguf_writer.py"
N_BATCH = 64
"""Prompt tokens per ``llama_decode`` call: a longer prompt is prefilled in several chunks."""
_DEFAULT_READY_TIMEOUT_S = 60.0
_GGUF_TIMEOUT_S = 120
_HEALTH_PATH = "/v1/models"


class LlamaCppServerError(RuntimeError):
    """The server exited or did not become healthy; the message carries its log's tail."""


def llamacpp_python() -> str:
    """The llama-cpp-python venv's interpreter; fails the calling test with one line when it is
    not set."""
    python = os.environ.get(LLAMACPP_PYTHON_ENV)
    if not python:
        pytest.fail(LLAMACPP_PYTHON_HINT, pytrace=False)
    if not Path(python).exists():
        pytest.fail(
            f"{LLAMACPP_PYTHON_ENV}={python} does not exist: run `make llamacpp-venv`",
            pytrace=False,
        )
    return python


def tiny_gguf(python: str, path: Path, *, hidden: int | None = None) -> Path:
    """The tiny random Llama (``gguf_writer.py``, ``hidden`` wide if given) written to ``path``
    by ``python``."""
    subprocess.run(
        [python, str(GGUF_WRITER), str(path), *([str(hidden)] if hidden is not None else [])],
        check=True,
        capture_output=True,
        timeout=_GGUF_TIMEOUT_S,
    )
    return path


@dataclass(frozen=True)
class LlamaCppServer:
    base_url: str
    model_name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    started_in_s: float

    def log_tail(self) -> str:
        return log_tail(self.log_path)


def server_command(
    python: str,
    model_path: Path,
    *,
    port: int,
    interrupt_requests: bool,
    extra_args: Sequence[str] = (),
) -> list[str]:
    return [
        python,
        *("-m", "llama_cpp.server"),
        *("--model", str(model_path)),
        *("--model_alias", SERVED_MODEL_NAME),
        *("--n_ctx", "4096"),
        *("--n_batch", str(N_BATCH)),
        # One core for the model, prefill included (its default is every core, which starves
        # the load generator that shares this machine and shows as client time).
        *("--n_threads", "1"),
        *("--n_threads_batch", "1"),
        *("--interrupt_requests", str(interrupt_requests)),
        *("--verbose", "False"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *extra_args,
    ]


@contextmanager
def running_llama_cpp_server(
    python: str,
    model_path: Path,
    *,
    log_path: Path,
    interrupt_requests: bool = False,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = _DEFAULT_READY_TIMEOUT_S,
    extra_args: Sequence[str] = (),
    command_prefix: Sequence[str] = (),
) -> Iterator[LlamaCppServer]:
    """Start the server on a free loopback port, wait for ``/v1/models``, yield it, stop it
    afterwards. ``command_prefix`` runs it under another command (``tokentrace run --``)."""
    port = free_loopback_port()
    base_url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    process = spawn_until_healthy(
        [
            *command_prefix,
            *server_command(
                python,
                model_path,
                port=port,
                interrupt_requests=interrupt_requests,
                extra_args=extra_args,
            ),
        ],
        env={**os.environ, **(env or {})},
        log_path=log_path,
        health_url=f"{base_url}{_HEALTH_PATH}",
        ready_timeout_s=ready_timeout_s,
        name="llama-cpp-python's server",
        error=LlamaCppServerError,
    )
    try:
        yield LlamaCppServer(
            base_url=base_url,
            model_name=SERVED_MODEL_NAME,
            process=process,
            log_path=log_path,
            started_in_s=time.monotonic() - started,
        )
    finally:
        stop_server(process)
