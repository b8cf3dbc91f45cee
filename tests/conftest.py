"""Fixtures shared across the test tree: a test-owned OTLP receiver, the tiny model and the
session's one traced vLLM server (tests/vllm/shared_server.py, registered here once so that
every directory shares the same instance)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.collector.upstream import UpstreamOtlp
from tests.node.nvml_fixtures import nvml, nvml_library_dir, nvml_stand_in_lib
from tests.postgres_server import PostgresServer, running_postgres
from tests.sglang.shared_server import sglang_server
from tests.vllm.shared_server import traced_server, vllm_server

# Fixtures, registered for the whole tree.
__all__ = [
    "nvml",
    "nvml_library_dir",
    "nvml_stand_in_lib",
    "sglang_server",
    "traced_server",
    "vllm_server",
]


@pytest.fixture
def upstream() -> Iterator[UpstreamOtlp]:
    """A test-owned OTLP receiver (gRPC and HTTP) on loopback, recording what it receives."""
    with UpstreamOtlp() as server:
        yield server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with its tokenizer (2048 positions), built once per session for
    every real-vLLM test."""
    from tokentrace.loadgen.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", autouse=True)
def no_store_left_in_the_working_directory() -> Iterator[None]:
    """A test that runs the collector with its default store path would leave ``tokentrace.db``
    in the working directory (a user's file there, in CI the clone): give tests a tmp path."""
    default_store = Path("tokentrace.db")
    existed = default_store.exists()
    yield
    assert existed or not default_store.exists(), "a test wrote ./tokentrace.db"


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for localhost / 127.0.0.1 and its key: (cert file, key file),
    made with the openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl command not available to make a test certificate")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-nodes", "-days", "1", "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return str(cert), str(key)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL server for the session (started on first use, ~1 s)."""
    with running_postgres() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The URL of a new empty database on the session's PostgreSQL server."""
    return postgres_server.create_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a store contract test opens its store (``store.open_store``), once per backend:
    a SQLite file in the test's directory, or a new database on the session's PostgreSQL."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    url: str = request.getfixturevalue("postgres_url")
    return url
