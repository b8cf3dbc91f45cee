"""Read histograms out of a Prometheus text exposition (vLLM's `/metrics`), for cross-checks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# `name{labels} value` or `name value`; timestamps are not used by vLLM's exposition.
_SAMPLE = re.compile(r"^(?P<name>[^\s{]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Histogram:
    """One histogram summed over its label sets: cumulative bucket counts by upper bound."""

    buckets: dict[float, float]
    count: float
    sum: float

    def bucket_counts(self) -> list[tuple[float, float]]:
        """(upper bound, cumulative count) pairs in increasing bound order, `+Inf` last."""
        return sorted(self.buckets.items())


def parse_histogram(text: str, name: str, *, labels: dict[str, str] | None = None) -> Histogram:
    """Sum the `_bucket`, `_count` and `_sum` samples of histogram `name` over label sets.

    `labels` keeps only samples carrying all those label values (e.g. one `model_name`). A name
    with no samples gives an empty histogram with count 0.
    """
    buckets: dict[float, float] = {}
    count = 0.0
    total = 0.0
    wanted = labels or {}
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        sample_labels = dict(_LABEL.findall(match.group("labels") or ""))
        if any(sample_labels.get(key) != value for key, value in wanted.items()):
            continue
        value = float(match.group("value"))
        suffix = match.group("name")[len(name) :]
        if suffix == "_bucket":
            bound = math.inf if sample_labels["le"] == "+Inf" else float(sample_labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
        elif suffix == "_count":
            count += value
        elif suffix == "_sum":
            total += value
    return Histogram(buckets=buckets, count=count, sum=total)


def gauge_value(text: str, name: str, *, labels: dict[str, str] | None = None) -> float:
    """Sum of gauge `name`'s samples over label sets (or those carrying all `labels`); 0 when
    the exposition has none."""
    total = 0.0
    wanted = labels or {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group("name") != name:
            continue
        sample_labels = dict(_LABEL.findall(match.group("labels") or ""))
        if all(sample_labels.get(key) == value for key, value in wanted.items()):
            total += float(match.group("value"))
    return total
