"""A full disk as SQLite sees it, for the store's tests: no page beyond those the database has,
so the next write that needs one fails with SQLITE_FULL (``sqlite3.OperationalError``: "database
or disk is full") on the store's own writer connection."""

from __future__ import annotations

from tokentrace.collector.store import RequestStore

_SQLITE_MAX_PAGE_COUNT = 1073741823


def fill_the_disk(store: RequestStore) -> None:
    writer = store._require_writer()
    pages = writer.execute("PRAGMA page_count").fetchone()[0]
    writer.execute(f"PRAGMA max_page_count = {pages}")


def free_the_disk(store: RequestStore) -> None:
    store._require_writer().execute(f"PRAGMA max_page_count = {_SQLITE_MAX_PAGE_COUNT}")
