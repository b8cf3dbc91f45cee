"""The request store: per-request documents, trace spans and sketch slices for drill-down."""

from tokentrace.collector.store.codec import record_to_dict, summary_from_row, window_report
from tokentrace.collector.store.query import (
    SORT_KEYS,
    QueryTimeoutError,
    RequestFilter,
    RequestPage,
    RequestPageQuery,
)
from tokentrace.collector.store.sqlite import (
    META_COLLECTOR_STARTED_NS,
    META_COLLECTOR_STATS,
    META_SLO_TARGETS,
    RequestStore,
    StoreError,
    StoreNotFoundError,
    StoreWriteError,
)

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
