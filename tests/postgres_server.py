"""A real PostgreSQL server for the tests: ``initdb`` + ``pg_ctl`` in a temporary directory on a
free loopback port, one per test session, and a fresh database per test.

PostgreSQL refuses to run as root, so under root (CI, containers) its programs run as the
``postgres`` system user (``runuser``) and the data directory is handed to that user. The server
binaries come from ``pg_config --bindir``, else the newest ``/usr/lib/postgresql/*/bin``.
Durability is off (``fsync``, ``synchronous_commit``): the tests check what is stored, not what
survives a power cut.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_START_ATTEMPTS = 3


def server_bindir() -> Path | None:
    """Where ``initdb``, ``pg_ctl`` and ``postgres`` are; None when PostgreSQL is not installed."""
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        found = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        bindir = Path(found.stdout.strip())
        if (bindir / "initdb").exists():
            return bindir
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: (
            int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0
        ),
    )
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class PostgresServer:
    """A running server; ``url(database)`` gives a connection URL (trust authentication)."""

    port: int
    root: Path
    _created: itertools.count[int]

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        name = f"tokentrace_test_{next(self._created)}"
        with psycopg.connect(self.url(), autocommit=True) as admin:
            # FILE_COPY: a copy of the tiny template's files, faster than PostgreSQL 15's
            # default (WAL_LOG) here, where fsync is off.
            admin.execute(f"CREATE DATABASE {name} STRATEGY FILE_COPY")
        return self.url(name)


@contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """Start a server for as long as the block runs (stopped with ``-m immediate`` after it)."""
    bindir = server_bindir()
    if bindir is None:
        raise RuntimeError(
            "PostgreSQL's server binaries (initdb, pg_ctl) are not installed: "
            "apt-get install postgresql"
        )
    root = Path(tempfile.mkdtemp(prefix="tokentrace-pg-"))
    as_postgres: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_postgres = ["runuser", "-u", "postgres", "--"]
    data = root / "data"
    try:
        subprocess.run(
            [*as_postgres, str(bindir / "initdb"), "-D", str(data), "--auth=trust",
             "-U", "postgres", "--no-sync", "-E", "UTF8", "--locale=C"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        port = 0
        for _ in range(_START_ATTEMPTS):  # another program may take the port first
            port = _free_port()
            options = (
                f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
            )
            started = subprocess.run(
                [*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-w", "-t", "60",
                 "-o", options, "-l", str(root / "server.log"), "start"],
                capture_output=True, text=True,
            )  # fmt: skip
            if started.returncode == 0:
                break
        else:
            log = (root / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"PostgreSQL did not start: {started.stderr}\n{log}")
        try:
            yield PostgresServer(port, root, itertools.count(1))
        finally:
            subprocess.run(
                [*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate",
                 "-w", "stop"],
                capture_output=True,
            )  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
