"""LLM-aware tail sampling: which processed traces the exporters (the store, upstream) get.

The ``tail_sampling`` processor decides after assembly and after every record processor ran, so
the percentile sketches, the SLO marks and the admin extension's request metrics have seen every
request: percentiles and SLO compliance stay exact; only the traces stored and exported are
sampled. Off unless configured (every trace is kept).

A trace is kept, for the first of these reasons that holds (its ``reason``):

- ``always``: it is a late fragment that replaces stored rows (its earlier part was stored, so
  the fragment must join it), or it holds no request records and is not a late fragment (a
  cold start's spans);
- ``breach``: one of its requests breached an SLO target (the ``slo`` processor's mark) or
  failed (an error status, or ``finish_reason`` ``error``);
- ``slowest``: one of its requests is among the ``slowest_per_window`` slowest by E2E *seen so
  far* in the current window for its (service, model, operation). The rule is online: a request
  is judged when it arrives, against those before it, so a window keeps its first
  ``slowest_per_window`` requests and then each one slower than the N-th slowest so far; it
  cannot take back a request that a slower one later pushed out of the top N;
- ``rare``: one of its requests has a verdict cause that is rare so far in the window for its
  key: it is one of the first ``rare_min_count`` of that cause, or the cause's share of the
  key's requests (this one included) is below ``rare_share`` (requests without a verdict count
  under the cause ``none``);
- ``random``: the trace id's hash falls inside ``random_share``. A hash, not a random draw:
  every collector replica makes the same choice for one trace, and a late fragment of a dropped
  trace is dropped too.

The rest is dropped (``DROP_RANDOM``: outside the random share). Every request updates the
window's statistics, whatever its trace's fate, so the rules do not depend on each other's order.
Windows are aligned on the injected clock (``window_s``): a key's statistics start again when
its window ends. At most ``max_keys`` keys are held (the least recently seen is evicted, and
counted), so memory stays bounded whatever the label cardinality.

Pure and deterministic given its inputs (the records, the trace ids and the clock); it runs on
the pipeline thread only.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from tokentrace.agent import semconv
from tokentrace.collector.self_telemetry import metric_key
from tokentrace.processors.model import RequestRecord

if TYPE_CHECKING:
    from tokentrace.collector.pipeline import ProcessedTrace

KEEP_ALWAYS: Final = "always"
KEEP_BREACH: Final = "breach"
KEEP_SLOWEST: Final = "slowest"
KEEP_RARE: Final = "rare"
KEEP_RANDOM: Final = "random"
KEEP_REASONS: Final = (KEEP_ALWAYS, KEEP_BREACH, KEEP_SLOWEST, KEEP_RARE, KEEP_RANDOM)
"""Why a trace was kept, in the order the rules are tried."""
DROP_RANDOM: Final = "random"
"""Why a trace was dropped: no keep rule held and its hash fell outside ``random_share``."""
DROP_REASONS: Final = (DROP_RANDOM,)
KEPT_METRICS: Final = {
    KEEP_ALWAYS: semconv.SELF_METRIC_SAMPLING_KEPT_ALWAYS,
    KEEP_BREACH: semconv.SELF_METRIC_SAMPLING_KEPT_BREACH,
    KEEP_SLOWEST: semconv.SELF_METRIC_SAMPLING_KEPT_SLOWEST,
    KEEP_RARE: semconv.SELF_METRIC_SAMPLING_KEPT_RARE,
    KEEP_RANDOM: semconv.SELF_METRIC_SAMPLING_KEPT_RANDOM,
}
"""Keep reason -> the self-telemetry counter of the traces kept for it."""
DROPPED_METRICS: Final = {DROP_RANDOM: semconv.SELF_METRIC_SAMPLING_DROPPED_RANDOM}
"""Drop reason -> the self-telemetry counter of the traces dropped for it."""
NO_VERDICT: Final = "none"
_FINISH_REASON_ERROR: Final = "error"
_HASH_SPACE: Final = 1 << 64

DEFAULT_WINDOW_S: Final = 60.0
DEFAULT_SLOWEST_PER_WINDOW: Final = 5
DEFAULT_RARE_SHARE: Final = 0.05
DEFAULT_RARE_MIN_COUNT: Final = 3
DEFAULT_RANDOM_SHARE: Final = 0.1
DEFAULT_MAX_KEYS: Final = 1000

SamplingKey = tuple[str, str, str]
"""(service, model, operation)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TailSamplingSettings:
    window_s: float = DEFAULT_WINDOW_S
    slowest_per_window: int = DEFAULT_SLOWEST_PER_WINDOW
    rare_share: float = DEFAULT_RARE_SHARE
    rare_min_count: int = DEFAULT_RARE_MIN_COUNT
    random_share: float = DEFAULT_RANDOM_SHARE
    max_keys: int = DEFAULT_MAX_KEYS


@dataclass(slots=True)
class _KeyWindow:
    """One key's statistics in its current window."""

    window: int
    slowest: list[int] = field(default_factory=list)
    """A min-heap of the largest E2E values (ns) seen in the window, at most N."""
    causes: dict[str, int] = field(default_factory=dict)
    requests: int = 0


def in_random_share(trace_id: bytes, share: float) -> bool:
    """Whether ``trace_id`` is inside the ``share`` of trace ids a hash picks: the same answer
    on every replica and in every run."""
    if share >= 1.0:
        return True
    if share <= 0.0:
        return False
    digest = hashlib.blake2b(trace_id, digest_size=8).digest()
    return int.from_bytes(digest, "big") < share * _HASH_SPACE


def failed(record: RequestRecord) -> bool:
    timeline = record.timeline
    return timeline.status_error is not None or timeline.finish_reason == _FINISH_REASON_ERROR


def breached(record: RequestRecord) -> bool:
    return any(met is False for met in record.slo.values())


class TailSampler:
    """The ``tail_sampling`` processor's decisions (module docstring)."""

    def __init__(
        self,
        settings: TailSamplingSettings,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._keys: OrderedDict[SamplingKey, _KeyWindow] = OrderedDict()
        self.kept: dict[str, int] = dict.fromkeys(KEEP_REASONS, 0)
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.keys_evicted = 0

    @property
    def keys_held(self) -> int:
        return len(self._keys)

    def sample(self, batch: Sequence[ProcessedTrace]) -> list[ProcessedTrace]:
        """The traces of ``batch`` to keep, in their order; counts each decision."""
        window = int(self._clock() // self.settings.window_s)
        kept: list[ProcessedTrace] = []
        for item in batch:
            reason = self._keep_reason(
                item.trace.trace_id,
                item.records,
                window=window,
                late=item.trace.late,
                replaces_stored=bool(item.replaces_stored),
            )
            if reason is None:
                self.dropped[DROP_RANDOM] += 1
            else:
                self.kept[reason] += 1
                kept.append(item)
        return kept

    def _keep_reason(
        self,
        trace_id: bytes,
        records: Sequence[RequestRecord],
        *,
        window: int,
        late: bool,
        replaces_stored: bool,
    ) -> str | None:
        if replaces_stored:  # its requests were counted in their window when first seen
            return KEEP_ALWAYS
        # Every request updates its window first: the rules see the same statistics whatever
        # rule decides the trace.
        slowest = rare = False
        for record in records:
            is_slowest, is_rare = self._observe(record, window)
            slowest = slowest or is_slowest
            rare = rare or is_rare
        if not records and not late:
            # (A late fragment with neither requests nor stored rows to join belongs to a trace
            # that was dropped or pruned: the hash decides, as it did for the rest.)
            return KEEP_ALWAYS
        if any(breached(record) or failed(record) for record in records):
            return KEEP_BREACH
        if slowest:
            return KEEP_SLOWEST
        if rare:
            return KEEP_RARE
        if in_random_share(trace_id, self.settings.random_share):
            return KEEP_RANDOM
        return None

    def _observe(self, record: RequestRecord, window: int) -> tuple[bool, bool]:
        """Adds ``record`` to its key's window; whether it is among the slowest so far, and
        whether its verdict cause is rare so far."""
        settings = self.settings
        timeline = record.timeline
        key = (timeline.service, timeline.model, timeline.operation)
        state = self._keys.get(key)
        if state is None or state.window != window:
            if state is None and len(self._keys) >= settings.max_keys:
                self._keys.popitem(last=False)
                self.keys_evicted += 1
            state = self._keys[key] = _KeyWindow(window)
        self._keys.move_to_end(key)

        is_slowest = False
        if settings.slowest_per_window > 0:
            e2e = record.metrics.e2e
            if len(state.slowest) < settings.slowest_per_window:
                heapq.heappush(state.slowest, e2e)
                is_slowest = True
            elif e2e > state.slowest[0]:
                heapq.heapreplace(state.slowest, e2e)
                is_slowest = True

        cause = record.verdict.cause if record.verdict is not None else NO_VERDICT
        count = state.causes.get(cause, 0) + 1
        state.causes[cause] = count
        state.requests += 1
        is_rare = count <= settings.rare_min_count or count < settings.rare_share * state.requests
        return is_slowest, is_rare


def sampling_summary(stats: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What the fleet view and ``tokentrace top`` say of sampling, from the collector's stats
    snapshot: the traces kept by reason, dropped, and the kept share; None when sampling is off
    (the snapshot has no sampling counters)."""
    if not isinstance(stats, Mapping):
        return None
    if not any(metric_key(name) in stats for name in KEPT_METRICS.values()):
        return None

    def count(name: str) -> int:
        value = stats.get(metric_key(name), 0)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    kept = {reason: count(name) for reason, name in KEPT_METRICS.items()}
    dropped = {reason: count(name) for reason, name in DROPPED_METRICS.items()}
    kept_total = sum(kept.values())
    dropped_total = sum(dropped.values())
    traces = kept_total + dropped_total
    return {
        "traces": traces,
        "kept": kept_total,
        "dropped": dropped_total,
        "kept_share": kept_total / traces if traces else None,
        "kept_by_reason": kept,
        "dropped_by_reason": dropped,
    }


def render_sampling_line(summary: Mapping[str, Any]) -> str:
    """``sampling: kept 12.5% of traces (breach 40, slowest 120, ...; dropped 3100)``."""
    share = summary.get("kept_share")
    share_text = "-" if share is None else f"{share * 100:.3g}%"
    by_reason: Mapping[str, int] = summary.get("kept_by_reason") or {}
    reasons = ", ".join(f"{reason} {n}" for reason, n in by_reason.items() if n)
    inside = f"{reasons}; " if reasons else ""
    return f"sampling: kept {share_text} of traces ({inside}dropped {summary.get('dropped', 0)})"
