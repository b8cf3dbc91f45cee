"""Reading the PostgreSQL request store: the shared reads (``store/reads.py``) through a small
pool of autocommit connections, each statement seeing every batch committed before it.

Connections are opened on demand and kept (at most ``_DEFAULT_IDLE_CONNECTIONS`` idle), so the
API's reads pay no connection set-up; a connection the server or network broke is dropped, and
the read that saw it fails with a StoreError saying so (the next one connects anew).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Final

import psycopg
from psycopg.pq import TransactionStatus

from tokentrace.collector.store.batch import first_line
from tokentrace.collector.store.contract import StoreError
from tokentrace.collector.store.postgresql.list_query import run_page, run_rows
from tokentrace.collector.store.postgresql.schema import NAMESPACE
from tokentrace.collector.store.reads import StoreReader

_DEFAULT_IDLE_CONNECTIONS: Final = 4
_DEFAULT_CONNECT_TIMEOUT_S: Final = 10
_APPLICATION_NAME: Final = "tokentrace-collector"


def connect(url: str, *, shown_as: str, purpose: str) -> psycopg.Connection[Any]:
    """An autocommit connection whose unqualified table names are the store's."""
    try:
        return psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=_DEFAULT_CONNECT_TIMEOUT_S,
            application_name=f"{_APPLICATION_NAME} ({purpose})",
            options=f"-c search_path={NAMESPACE}",
        )
    except psycopg.Error as error:
        raise StoreError(f"cannot connect to store {shown_as}: {first_line(error)}") from error


class PostgresStoreReader(StoreReader):
    """Reads the store in ``url``'s database; ``PostgresRequestStore`` adds the writer."""

    _run_page = staticmethod(run_page)
    _run_rows = staticmethod(run_rows)

    def __init__(self, url: str, *, shown_as: str, clock: Callable[[], float]) -> None:
        super().__init__(shown_as, clock=clock)
        self.shared = True
        self._url = url
        self._idle: list[psycopg.Connection[Any]] = []
        self._idle_lock = threading.Lock()

    def _sql(self, text: str) -> str:
        return text.replace("?", "%s")

    @contextmanager
    def _reader(self) -> Iterator[psycopg.Connection[Any]]:
        with self._idle_lock:
            connection = self._idle.pop() if self._idle else None
        if connection is None:
            connection = connect(self._url, shown_as=self.path, purpose="reads")
        try:
            yield connection
        except psycopg.Error as error:
            raise StoreError(f"cannot read store {self.path}: {first_line(error)}") from error
        finally:
            self._release(connection)

    def _release(self, connection: psycopg.Connection[Any]) -> None:
        reusable = (
            not connection.closed and connection.info.transaction_status == TransactionStatus.IDLE
        )
        if reusable:
            with self._idle_lock:
                if len(self._idle) < _DEFAULT_IDLE_CONNECTIONS:
                    self._idle.append(connection)
                    return
        with suppress(psycopg.Error):
            connection.close()

    def close_readers(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            with suppress(psycopg.Error):
                connection.close()
