"""What a request store's callers rely on besides its methods, whichever database backs it:
the errors it raises, the items a write batch holds, and the metadata it keeps (the keys and
the formats of their values).

Separate from the SQLite store so that the collector's sink, the CLI and the API depend on the
store's contract, not on one backend's module.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.model import AssembledTrace, RequestRecord

if TYPE_CHECKING:
    from tokentrace.collector.store.document import RequestDocument
    from tokentrace.collector.store.query import RequestFilter, RequestPage, RequestPageQuery
    from tokentrace.collector.store.sketch_report import SketchSlice
    from tokentrace.processors.slo import SloTarget

META_SLO_TARGETS: Final = "slo_targets"
"""Meta key: the collector's SLO targets (``processors.slo.targets_to_json``)."""
META_COLLECTOR_STARTED_NS: Final = "collector_started_ns"
"""Meta key: unix ns at which the collector writing this store started."""
META_COLLECTOR_STATS: Final = "collector_stats"
"""Meta key: the collector's counters as JSON, rewritten about once a second. On a store that
several replicas share, each writes ``collector_stats/<writer id>`` and readers merge them
(``collector_stats_key``, ``merge_collector_stats``)."""
STATS_WRITTEN_AT: Final = "stats_written_unix_s"
"""In a replica's stats: when it wrote them (unix s), so that readers leave stopped ones out."""
_STATS_FRESH_S: Final = 60.0
"""A replica whose stats are this much older than the newest replica's is not counted."""
META_DIAGNOSIS: Final = "diagnosis"
"""Meta key: the collector's diagnosis settings as JSON (``DiagnosisConfig`` fields), by which
a document's verdicts about its other metrics are derived when it is read."""

DEFAULT_RETENTION_S: Final = 7 * 24 * 3600.0
DEFAULT_MAX_REQUESTS: Final = 1_000_000
DEFAULT_PRUNE_BATCH: Final = 10_000
"""Rows one ``prune()`` call deletes at most, so the writer never stalls for long."""
DEFAULT_MAX_TRACE_BYTES: Final = 4 * 1024 * 1024
"""Stored spans of one trace at most (a client may reuse one trace id for a whole session)."""

_DEFAULT_DIAGNOSIS: Final = DiagnosisConfig()
_OLD_ITL_SPIKE_RATIO: Final = "itl_spike_ratio"
"""Stored by earlier collectors: the value of both ``itl_outlier_ratio`` and
``itl_tail_spike_ratio``."""

WriteItem: TypeAlias = (
    "tuple[AssembledTrace, Sequence[RequestRecord]]"
    " | tuple[AssembledTrace, Sequence[RequestRecord], bytes]"
)
"""One trace to store: its spans, its request records and, when the caller has it, the trace
already serialised as an ``ExportTraceServiceRequest`` (else the store encodes it)."""


class StoreError(Exception):
    """A request store cannot be opened or used; the message says what to do."""


class StoreNotFoundError(StoreError):
    """No store file at the given path."""


class StoreWriteError(StoreError):
    """Part or all of a ``write`` batch was not stored.

    ``rejected``: request records not stored and given up (malformed or quarantined records,
    or the rest of a batch the database refused part-way). ``written``: records stored despite
    the error. ``retryable``: the database refused the whole batch (full, locked, an I/O error)
    and nothing of it was written: the same batch may be written again later (its records are
    not counted in ``rejected``).
    """

    def __init__(
        self, message: str, *, rejected: int, written: int, retryable: bool = False
    ) -> None:
        super().__init__(message)
        self.rejected = rejected
        self.written = written
        self.retryable = retryable


def collector_stats_key(writer_id: str | None) -> str:
    """The meta key a collector writes its stats under (``META_COLLECTOR_STATS``)."""
    return META_COLLECTOR_STATS if writer_id is None else f"{META_COLLECTOR_STATS}/{writer_id}"


def merge_collector_stats(snapshots: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Several replicas' stats as one: numbers summed (nested counters too), other values the
    newest replica's, ``replicas`` the replicas counted; replicas whose stats are more than
    ``_STATS_FRESH_S`` older than the newest are left out (stopped). None for no snapshots."""

    def written_at(snapshot: Mapping[str, Any]) -> float:
        value = snapshot.get(STATS_WRITTEN_AT)
        return float(value) if isinstance(value, (int, float)) else 0.0

    if not snapshots:
        return None
    newest = max(written_at(snapshot) for snapshot in snapshots)
    live = sorted(
        (s for s in snapshots if written_at(s) >= newest - _STATS_FRESH_S),
        key=written_at,
        reverse=True,
    )

    def merged(values: list[Any]) -> Any:
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return sum(values)
        if all(isinstance(v, Mapping) for v in values):
            keys = dict.fromkeys(k for v in values for k in v)
            return {k: merged([v[k] for v in values if k in v]) for k in keys}
        return values[0]

    keys = dict.fromkeys(k for snapshot in live for k in snapshot)
    result = {k: merged([s[k] for s in live if k in s]) for k in keys}
    result[STATS_WRITTEN_AT] = newest
    result["replicas"] = len(live)
    return result


def diagnosis_to_json(config: DiagnosisConfig) -> str:
    """The collector's diagnosis settings as the store keeps them (``META_DIAGNOSIS``)."""
    return json.dumps(dataclasses.asdict(config))


def diagnosis_from_json(raw: str | None) -> DiagnosisConfig:
    """Settings from ``diagnosis_to_json``; the defaults for none or unreadable ones, and
    settings this version does not know are ignored."""
    if not raw:
        return _DEFAULT_DIAGNOSIS
    try:
        loaded = json.loads(raw)
        known = {field.name for field in dataclasses.fields(DiagnosisConfig)}
        settings = {k: v for k, v in loaded.items() if k in known}
        if _OLD_ITL_SPIKE_RATIO in loaded:  # a store written before the two settings were apart
            for setting in ("itl_outlier_ratio", "itl_tail_spike_ratio"):
                settings.setdefault(setting, loaded[_OLD_ITL_SPIKE_RATIO])
        if "p50_band" in settings:
            settings["p50_band"] = tuple(settings["p50_band"])
        return DiagnosisConfig(**settings)
    except (ValueError, TypeError, AttributeError):
        return _DEFAULT_DIAGNOSIS


class Store(Protocol):
    """What the collector, the CLI and the API use of a request store, whichever backend
    (``location.open_store``): the SQLite ``sqlite.store.RequestStore`` or the PostgreSQL
    ``postgresql.store.PostgresRequestStore``. The SQLite store's docstrings define the
    behaviour; a backend differs only where its own docstring says so."""

    path: str
    """Where the store is, as messages show it (a URL without its password)."""
    shared: bool
    """Whether other collectors may write the same store (PostgreSQL) or only this one."""
    writer_id: str | None
    """This collector's name among the writers of a shared store (None: not shared)."""
    readonly: bool
    max_trace_bytes: int
    prune_batch: int
    written_requests: int
    written_traces: int
    rejected_records: int
    failed_traces: int
    written_slices: int
    failed_batches: int
    pruned_requests: int
    pruned_traces: int
    pruned_slices: int
    replaced_traces: int
    quarantined_records: int
    quarantined_traces: int

    @property
    def checkpoints(self) -> int: ...
    @property
    def failed_checkpoints(self) -> int: ...

    # --- reads
    def get(self, trace_id: str, *, span_id: str | None = None) -> RequestDocument | None: ...
    def trace_otlp(
        self, trace_id: str | bytes, *, max_bytes: int | None = None
    ) -> bytes | None: ...
    def traces_otlp(self, trace_ids: Iterable[bytes]) -> Iterator[tuple[bytes, bytes]]: ...
    def stored_trace_ids(self, trace_ids: Iterable[bytes]) -> set[bytes]: ...
    def trace_ids_between(
        self, since_ns: int, until_ns: int | None, *, limit: int
    ) -> tuple[list[bytes], bool]: ...
    def slowest(
        self, *, metric: str = ..., since_ns: int | None = None, limit: int = 10
    ) -> list[RequestDocument]: ...
    def diagnosis_settings(self) -> DiagnosisConfig: ...
    def list_requests(self, query: RequestPageQuery) -> RequestPage: ...
    def segment_means(
        self, filter: RequestFilter, *, limit: int = ...
    ) -> tuple[int, dict[str, float]]: ...
    def sketches_since(self, since_s: float) -> list[SketchSlice]: ...
    def sketches_between(self, since_s: float, until_s: float | None) -> list[SketchSlice]: ...
    def slo_targets(self) -> tuple[list[SloTarget], list[str]]: ...
    def meta(self, key: str) -> str | None: ...
    def collector_stats(self) -> dict[str, Any] | None: ...
    def count(self) -> int: ...
    def now(self) -> float: ...

    # --- writes
    def write(
        self,
        batch: Sequence[WriteItem],
        *,
        replacing: Mapping[bytes, Collection[bytes]] | None = None,
    ) -> None: ...
    def write_sketch_slices(self, slices: Iterable[tuple[float, Any, str, Any]]) -> None: ...
    def set_meta(self, key: str, value: str) -> None: ...
    def prune(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> Store: ...
    def __exit__(self, *exc_info: object) -> None: ...
