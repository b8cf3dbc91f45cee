"""Reading the SQLite request store: the shared reads (``store/reads.py``) through short-lived
read-only connections.

WAL lets these connections read while the collector's writer writes, and each sees only
committed batches. ``RequestStoreReader`` is the read half of ``store.RequestStore``: every
method that needs no writer connection, so the writer's batching, checkpoints and retention
(``store.py``) read apart from the many ways to read.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tokentrace.collector.store.contract import StoreError, StoreNotFoundError
from tokentrace.collector.store.reads import StoreReader
from tokentrace.collector.store.sqlite.list_query import run_page, run_rows


def _readonly_uri(path: str) -> str:
    return "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"


class RequestStoreReader(StoreReader):
    """Reads a store file; ``RequestStore`` adds the writer (and ``open_readonly`` gives one
    that only reads)."""

    _run_page = staticmethod(run_page)
    _run_rows = staticmethod(run_rows)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        super().__init__(os.fspath(path), clock=clock)
        self._busy_timeout_s = float(busy_timeout_s)

    def _connect_readonly(self) -> sqlite3.Connection:
        if not os.path.exists(self.path):
            raise StoreNotFoundError(
                f"no store at {self.path} - start `tokentrace collector` first or pass --store"
            )
        try:
            connection = sqlite3.connect(
                _readonly_uri(self.path), uri=True, timeout=self._busy_timeout_s
            )
        except sqlite3.Error as error:
            raise StoreError(f"cannot open store {self.path}: {error}") from error
        return connection

    @contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        connection = self._connect_readonly()
        try:
            yield connection
        except sqlite3.Error as error:
            raise StoreError(f"cannot read store {self.path}: {error}") from error
        finally:
            connection.close()
