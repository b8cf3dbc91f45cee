"""The request store: per-request documents, trace spans and sketch slices for drill-down.

Backend-neutral modules here (``row``, ``document``, ``sketch_report``, ``query``,
``contract``); the SQLite backend in ``sqlite/``.
"""

from tokentrace.collector.store.contract import (
    META_COLLECTOR_STARTED_NS,
    META_COLLECTOR_STATS,
    META_SLO_TARGETS,
    StoreError,
    StoreNotFoundError,
    StoreWriteError,
)
from tokentrace.collector.store.document import record_to_dict, summary_from_row
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
    "StoreError",
    "StoreNotFoundError",
    "StoreWriteError",
    "record_to_dict",
    "summary_from_row",
    "window_report",
]
