"""The request store: per-request documents, trace spans and sketch slices for drill-down.

Backend-neutral modules here (``row``, ``document``, ``sketch_report``, ``query``, ``reads``,
``contract``, ``location``); the embedded SQLite backend in ``sqlite/``, the shared PostgreSQL
one in ``postgresql/``; ``open_store`` picks by the location (a path or a ``postgresql://`` URL).
"""

from tokentrace.collector.store.contract import (
    META_COLLECTOR_STARTED_NS,
    META_COLLECTOR_STATS,
    META_SLO_TARGETS,
    Store,
    StoreError,
    StoreNotFoundError,
    StoreWriteError,
)
from tokentrace.collector.store.document import record_to_dict, summary_from_row
from tokentrace.collector.store.location import (
    display_location,
    is_postgresql,
    open_store,
    open_store_readonly,
)
from tokentrace.collector.store.query import (
    SORT_KEYS,
    QueryTimeoutError,
    RequestFilter,
    RequestPage,
    RequestPageQuery,
)
from tokentrace.collector.store.sketch_report import window_report
from tokentrace.collector.store.sqlite.store import RequestStore

__all__ = [
    "META_COLLECTOR_STARTED_NS",
    "META_COLLECTOR_STATS",
    "META_SLO_TARGETS",
    "SORT_KEYS",
    "QueryTimeoutError",
    "RequestFilter",
    "RequestPage",
    "RequestPageQuery",
    "RequestStore",
    "Store",
    "StoreError",
    "StoreNotFoundError",
    "StoreWriteError",
    "display_location",
    "is_postgresql",
    "open_store",
    "open_store_readonly",
    "record_to_dict",
    "summary_from_row",
    "window_report",
]
