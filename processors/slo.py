"""SLO targets (``metric, percentile, threshold, selector``): per-request marks and window status.

A target such as "chat TTFT p95 < 500 ms" applies to the requests its selector matches. Each
such request is marked inside or outside the threshold (``mark_request``); a window's merged
sketch gives the value at the target percentile, the compliance (the share of requests inside
the threshold) and the error-budget burn rate (``evaluate_window``).

ITL is per token, not per request: a request is marked against ITL by its own inter-token gap at
the target percentile (nearest rank), so a p99 ITL target judges each request by its p99 gap
rather than its single worst one.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from tokentrace.agent import semconv

# Re-exported: configuration code imports the duration parser from here as well.
from tokentrace.processors.durations import parse_duration_ns as parse_duration_ns
from tokentrace.processors.model import RequestMetrics, RequestRecord
from tokentrace.processors.sketches import LatencySketch
from tokentrace.processors.stats import nearest_rank

SELECTOR_SERVICE: Final = "service"
SELECTOR_MODEL: Final = "model"
SELECTOR_OPERATION: Final = "operation"
SELECTOR_PROMPT_BUCKET: Final = "prompt_bucket"
SELECTOR_KEYS: Final = (
    SELECTOR_SERVICE,
    SELECTOR_MODEL,
    SELECTOR_OPERATION,
    SELECTOR_PROMPT_BUCKET,
)
"""The request dimensions a target's selector may constrain (the percentile key)."""

_TARGET_FIELDS: Final = ("name", "metric", "percentile", "threshold", "selector")
_REQUIRED_TARGET_FIELDS: Final = ("name", "metric", "percentile", "threshold")
_GLOB_CHARACTERS: Final = frozenset("*?[")
_NS_PER_S: Final = 1_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class SloTarget:
    name: str
    metric: str
    """One of ``semconv.LATENCY_METRICS``."""
    percentile: float
    """In (0, 100), e.g. 95."""
    threshold_ns: int
    selector: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Keys among service, model, operation, prompt_bucket; values exact or ``*`` globs."""
    _matchers: tuple[tuple[str, str, bool], ...] = field(
        init=False, repr=False, compare=False, default=()
    )
    """(selector key, pattern, is a glob) per selector entry, prepared once."""

    def __post_init__(self) -> None:
        # Messages name the field first so that parse_targets can prefix the config path.
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"name: must be a non-empty string, got {self.name!r}")
        if self.metric not in semconv.LATENCY_METRICS:
            raise ValueError(
                f"metric: unknown metric {self.metric!r} "
                f"(one of {', '.join(semconv.LATENCY_METRICS)})"
            )
        percentile = self.percentile
        if (
            isinstance(percentile, bool)
            or not isinstance(percentile, int | float)
            or not 0 < percentile < 100
        ):
            raise ValueError(
                f"percentile: must be a number strictly between 0 and 100, got {percentile!r}"
            )
        threshold = self.threshold_ns
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold <= 0:
            raise ValueError(
                f"threshold: must be a positive integer number of ns, got {threshold!r}"
            )
        if not isinstance(self.selector, Mapping):
            raise ValueError(f"selector: must be a mapping, got {type(self.selector).__name__}")
        matchers: list[tuple[str, str, bool]] = []
        for key, pattern in self.selector.items():
            if key not in SELECTOR_KEYS:
                raise ValueError(
                    f"selector: unknown key {key!r} (allowed: {', '.join(SELECTOR_KEYS)})"
                )
            if not isinstance(pattern, str):
                raise ValueError(
                    f"selector.{key}: must be a string (exact value or * glob), got {pattern!r}"
                )
            matchers.append((key, pattern, not _GLOB_CHARACTERS.isdisjoint(pattern)))
        # Frozen: a private copy so that later changes to the caller's dict cannot leak in.
        object.__setattr__(self, "selector", MappingProxyType(dict(self.selector)))
        object.__setattr__(self, "_matchers", tuple(matchers))

    def matches(self, record: RequestRecord) -> bool:
        """Whether the selector selects ``record`` (an empty selector selects every request)."""
        if not self._matchers:  # the usual case; skips building the value getter
            return True
        return self._selects(lambda key: _selector_value(record, key))

    def matches_key(self, key: Mapping[str, str]) -> bool:
        """Whether the selector selects the requests of one percentile key (``service``,
        ``model``, ``operation``, ``prompt_bucket`` -> value); a field the key lacks never
        matches a selector entry for it."""
        return self._selects(key.get)

    def _selects(self, value_of: Callable[[str], str | None]) -> bool:
        for key, pattern, is_glob in self._matchers:
            value = value_of(key)
            if value is None or not (fnmatchcase(value, pattern) if is_glob else value == pattern):
                return False
        return True


def _selector_value(record: RequestRecord, key: str) -> str:
    if key == SELECTOR_PROMPT_BUCKET:
        return record.prompt_bucket
    timeline = record.timeline
    if key == SELECTOR_SERVICE:
        return timeline.service
    if key == SELECTOR_MODEL:
        return timeline.model
    return timeline.operation


class _RequestValues:
    """The values targets judge one request by; the ITL gaps are sorted once, however many ITL
    targets ask."""

    __slots__ = ("_metrics", "_sorted_itl")

    def __init__(self, metrics: RequestMetrics) -> None:
        self._metrics = metrics
        self._sorted_itl: list[int] | None = None

    def value(self, metric: str, percentile: float) -> int | None:
        metrics = self._metrics
        if metric != semconv.METRIC_ITL:
            return metrics.value(metric)
        if not metrics.itl:
            return None
        if self._sorted_itl is None:
            self._sorted_itl = sorted(metrics.itl)
        return nearest_rank(self._sorted_itl, percentile)


def request_value(metrics: RequestMetrics, metric: str, percentile: float) -> int | None:
    """The value a target judges one request by, in ns, or None when the request lacks it.

    ITL: the request's own gap at ``percentile`` (nearest rank); every other metric: its one
    value (``RequestMetrics.value``).
    """
    return _RequestValues(metrics).value(metric, percentile)


def mark_request(record: RequestRecord, targets: list[SloTarget]) -> dict[str, bool]:
    """target name -> whether this request met it (targets whose selector or metric does not
    apply to the request are left out). Each target judges ``request_value``."""
    marks: dict[str, bool] = {}
    values = _RequestValues(record.metrics)
    for target in targets:
        if not target.matches(record):
            continue
        value = values.value(target.metric, target.percentile)
        if value is not None:
            marks[target.name] = value <= target.threshold_ns
    return marks


@dataclass(slots=True)
class SloWindowStatus:
    target: str
    requests: int
    value_ns: int | None
    """The window's value at the target percentile."""
    met: bool | None
    """None when the window holds no request."""
    compliance: float | None
    """Fraction of requests inside the threshold."""
    burn_rate: float | None
    """(1 - compliance) / (1 - percentile/100): 1.0 spends the error budget exactly."""


def burn_rate_of(compliance: float, percentile: float) -> float:
    """How fast a window spends the error budget: (1 - compliance) / (1 - percentile/100);
    1.0 spends it exactly."""
    return (1.0 - compliance) / (1.0 - percentile / 100)


def evaluate_window(target: SloTarget, sketch: LatencySketch) -> SloWindowStatus:
    """Status of ``target`` over a window whose matching values are merged in ``sketch``.

    The sketch holds seconds; its relative error (<= 1%) carries over to ``value_ns`` and, for
    values within 1% of the threshold, to ``compliance``.
    """
    requests = sketch.count
    value_s = sketch.quantile(target.percentile / 100) if requests > 0 else None
    if value_s is None:
        return SloWindowStatus(
            target=target.name,
            requests=requests,
            value_ns=None,
            met=None,
            compliance=None,
            burn_rate=None,
        )
    value_ns = round(value_s * _NS_PER_S)
    compliance = sketch.fraction_at_or_below(target.threshold_ns / _NS_PER_S)
    burn_rate = None
    if compliance is not None:
        compliance = min(max(compliance, 0.0), 1.0)
        burn_rate = burn_rate_of(compliance, target.percentile)
    return SloWindowStatus(
        target=target.name,
        requests=requests,
        value_ns=value_ns,
        met=value_ns <= target.threshold_ns,
        compliance=compliance,
        burn_rate=burn_rate,
    )


# --- configuration --------------------------------------------------------------------------------
def parse_percentile(value: object) -> float:
    """A percentile from ``95``, ``99.9``, ``"95"`` or ``"p95"`` (range checked by SloTarget)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number such as 95 or 'p95', got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("p")
        try:
            parsed = float(text)
        except ValueError:
            pass
        else:
            if math.isfinite(parsed):
                return parsed
    raise ValueError(f"expected a number such as 95 or 'p95', got {value!r}")


def parse_targets(raw: object, *, path: str = "slo.targets") -> list[SloTarget]:
    """SLO targets from configuration: a list of mappings with ``name``, ``metric``,
    ``percentile``, ``threshold`` (``"500ms"``, ``"2s"``, or seconds) and optional ``selector``.

    Errors are ``ValueError`` naming the entry and field, e.g.
    ``slo.targets[1].threshold: cannot parse duration 'fast' ...``.
    """
    if raw is None:
        return []
    if not isinstance(raw, list | tuple):
        raise ValueError(f"{path}: expected a list of targets, got {type(raw).__name__}")
    targets: list[SloTarget] = []
    first_index_by_name: dict[str, int] = {}
    for index, entry in enumerate(raw):
        where = f"{path}[{index}]"
        target = _parse_target(entry, where)
        if target.name in first_index_by_name:
            raise ValueError(
                f"{where}.name: duplicate target name {target.name!r} "
                f"(also {path}[{first_index_by_name[target.name]}])"
            )
        first_index_by_name[target.name] = index
        targets.append(target)
    return targets


def _parse_target(entry: object, where: str) -> SloTarget:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = [str(key) for key in entry if key not in _TARGET_FIELDS]
    if unknown:
        raise ValueError(
            f"{where}.{unknown[0]}: unknown field (allowed: {', '.join(_TARGET_FIELDS)})"
        )
    for required in _REQUIRED_TARGET_FIELDS:
        if required not in entry:
            raise ValueError(f"{where}.{required}: missing")
    fields: dict[str, Any] = {"name": entry["name"], "metric": entry["metric"]}
    try:
        fields["percentile"] = parse_percentile(entry["percentile"])
    except ValueError as error:
        raise ValueError(f"{where}.percentile: {error}") from None
    try:
        fields["threshold_ns"] = parse_duration_ns(entry["threshold"])
    except ValueError as error:
        raise ValueError(f"{where}.threshold: {error}") from None
    selector = entry.get("selector")
    if selector is not None:
        fields["selector"] = selector
    try:
        return SloTarget(**fields)
    except ValueError as error:
        # SloTarget's messages start with the field name.
        raise ValueError(f"{where}.{error}") from None


def read_slo_file(path: str | os.PathLike[str]) -> list[SloTarget]:
    """The targets of an SLO file: YAML with one key, ``targets``, a list in the format of
    ``parse_targets``. The one reader of the file the collector (``processors.slo.file``),
    ``tokentrace load``, ``diagnose`` and ``compare`` share; it lives here because the load
    command is on the agent side, which never imports the collector. ValueError names the file
    and the entry."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read SLO file {path}: {error.strerror or error}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping) or set(raw) - {"targets"}:
        raise ValueError(
            f"{path}: expected a mapping with one key, targets (a list of "
            "{name, metric, percentile, threshold, selector})"
        )
    return parse_targets(raw.get("targets"), path=f"{path}: targets")


# --- the store's copy -----------------------------------------------------------------------------
STORED_TARGETS_SOURCE: Final = "the store's SLO targets"
"""How problems with the targets a store keeps name them."""


def target_to_dict(target: SloTarget) -> dict[str, Any]:
    """A target as ``parse_targets`` reads it, exactly (the threshold in integer ns)."""
    return {
        "name": target.name,
        "metric": target.metric,
        "percentile": target.percentile,
        "threshold": f"{target.threshold_ns}ns",
        "selector": dict(target.selector),
    }


def targets_to_json(targets: Sequence[SloTarget]) -> str:
    """The targets as the collector keeps them in its store (``META_SLO_TARGETS``): a JSON list
    of ``target_to_dict``; ``targets_from_json`` reads it back."""
    return json.dumps([target_to_dict(target) for target in targets])


def targets_from_json(text: str | None) -> tuple[list[SloTarget], list[str]]:
    """(targets, problems) from ``targets_to_json`` text; never raises.

    No text means no targets. Text that is not a JSON list gives no targets and one problem.
    A bad entry (e.g. written by a newer collector, or by hand) is left out with a problem
    naming it, and the others are kept.
    """
    if not text:
        return [], []
    try:
        loaded = json.loads(text)
    except ValueError as error:
        return [], [f"{STORED_TARGETS_SOURCE} are not JSON ({error}); none are evaluated"]
    if not isinstance(loaded, list):
        return [], [f"{STORED_TARGETS_SOURCE} are a {type(loaded).__name__}, not a list"]
    targets: list[SloTarget] = []
    problems: list[str] = []
    for index, entry in enumerate(loaded):
        try:
            targets.append(_parse_target(entry, f"{STORED_TARGETS_SOURCE}[{index}]"))
        except (ValueError, TypeError) as error:
            problems.append(str(error))
    return targets, problems
