"""Which backend a store location names, and opening it: a file path is the embedded SQLite
store, a ``postgresql://`` (or ``postgres://``) URL the shared PostgreSQL store.

The CLI's ``--store``, the ``store`` exporter's ``path`` and the API all open stores here, so a
location means the same everywhere. Messages name a URL without its password.
"""

from __future__ import annotations

import os
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Final

from tokentrace.collector.store.contract import Store, StoreError

_POSTGRESQL_SCHEMES: Final = ("postgresql://", "postgres://")


def is_postgresql(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is a PostgreSQL URL (else a SQLite file path)."""
    return isinstance(location, str) and location.lower().startswith(_POSTGRESQL_SCHEMES)


def display_location(location: str | os.PathLike[str]) -> str:
    """``location`` as messages show it: a URL's password replaced by ``***``."""
    text = os.fspath(location)
    if not is_postgresql(text):
        return text
    try:
        parts = urllib.parse.urlsplit(text)
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        netloc = parts.netloc
        if parts.password is not None:
            user = urllib.parse.quote(parts.username or "", safe="")
            netloc = f"{user}:***@{netloc.rpartition('@')[2]}"
    except ValueError:
        return text.split("@")[-1].split("?")[0]
    hidden = "&".join(
        f"{key}={'***' if key.lower() == 'password' else value}" for key, value in query
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=hidden))


def open_store(location: str | os.PathLike[str], **options: Any) -> Store:
    """The store at ``location`` for writing (created when missing); ``options`` are the
    backend's keyword options (retention_s, max_requests, clock, ...)."""
    if is_postgresql(location):
        from tokentrace.collector.store.postgresql.store import PostgresRequestStore

        _require_psycopg()
        return PostgresRequestStore(os.fspath(location), **options)
    from tokentrace.collector.store.sqlite.store import RequestStore

    return RequestStore(location, **options)


def open_store_readonly(
    location: str | os.PathLike[str], *, clock: Callable[[], float] = time.time
) -> Store:
    """A reader of the existing store at ``location``; StoreNotFoundError when there is none."""
    if is_postgresql(location):
        from tokentrace.collector.store.postgresql.store import PostgresRequestStore

        _require_psycopg()
        return PostgresRequestStore.open_readonly(os.fspath(location), clock=clock)
    from tokentrace.collector.store.sqlite.store import RequestStore

    return RequestStore.open_readonly(location, clock=clock)


def _require_psycopg() -> None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        raise StoreError(
            "a PostgreSQL store needs the psycopg driver: pip install 'tokentrace[postgresql]'"
        ) from None
