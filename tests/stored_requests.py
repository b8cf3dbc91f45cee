"""Waiting for a collector to store requests: what tests read once the pipeline has settled."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tokentrace.collector.store import window_report
from tokentrace.collector.store.contract import Store
from tokentrace.collector.store.document import RequestDocument
from tokentrace.collector.store.sqlite.store import RequestStore

_DEFAULT_TIMEOUT_S = 60.0
_POLL_S = 0.5


def stored_documents(
    store_path: Path,
    trace_ids: Iterable[str],
    *,
    timeout_s: float = _DEFAULT_TIMEOUT_S,
    context: Callable[[], str] = str,
) -> dict[str, RequestDocument]:
    """The stored request of each trace, waiting (bounded) for the collector to store them;
    the failure names how many came and ``context()`` (a server's log tail, say)."""
    wanted = list(trace_ids)
    deadline = time.monotonic() + timeout_s
    found: dict[str, RequestDocument] = {}
    while True:
        if store_path.exists():
            store = RequestStore.open_readonly(store_path)
            try:
                for trace_id in wanted:
                    if trace_id not in found and (doc := store.get(trace_id)) is not None:
                        found[trace_id] = doc
            finally:
                store.close()
        if len(found) == len(wanted):
            return found
        assert time.monotonic() < deadline, (
            f"stored {len(found)} of {len(wanted)} requests after {timeout_s:.0f} s\n{context()}"
        )
        time.sleep(_POLL_S)


def stored_document(
    store_path: Path,
    trace_id: str,
    *,
    timeout_s: float = _DEFAULT_TIMEOUT_S,
    context: Callable[[], str] = str,
) -> RequestDocument:
    """``stored_documents`` of one trace."""
    return stored_documents(store_path, [trace_id], timeout_s=timeout_s, context=context)[trace_id]


def all_time_report(store: Store) -> dict[str, Any]:
    """``window_report`` over every sketch slice the store holds, with the SLO targets stored in
    it (what ``top`` shows for a window reaching back past the first request)."""
    targets, problems = store.slo_targets()
    return window_report(
        store.sketches_between(0, None),
        window_s=10**9,
        now_s=store.now(),
        slo_targets=targets,
        slo_errors=problems,
    )
