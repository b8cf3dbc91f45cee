"""Cost and accuracy of LatencySketch and PercentileStore.record.

Reproduce: ``python bench/sketches.py`` (about 10-20 s on 2 noisy cores; medians of repeats).

What it answers:
- ns per value for ``add`` one by one vs ``add_many`` at several batch sizes (ITL batches are one
  request's gaps: tens to thousands), with stock ``ddsketch.DDSketch.add`` as a reference.
  ``add_many`` computes the batch's keys in one list comprehension, grows the store once to the
  batch's key range and counts straight into its bins. Two measured alternatives lost:
  grouping equal keys (``Counter``) and one ``store.add`` per distinct key with its weight is
  slower unless batches are large and concentrated, because each ``store.add`` costs ~150 ns; and
  numpy-vectorised keys win only for batches of hundreds or more, ``np.log2`` differs from
  ``math.log2`` in the last ulp (``add`` and ``add_many`` could then disagree at a bucket
  boundary), and numpy is not a dependency of the processors.
- quantile and merge cost, size (buckets, JSON, OTLP data point), accuracy on 1e6 lognormal
  samples against numpy's exact percentiles, and the store's per-request recording cost.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Final

import numpy as np
from ddsketch import DDSketch
from ddsketch.store import CollapsingLowestDenseStore
from opentelemetry.proto.metrics.v1.metrics_pb2 import ExponentialHistogramDataPoint

from tokentrace.agent import semconv
from tokentrace.processors.model import RequestMetrics
from tokentrace.processors.percentiles import PercentileStore
from tokentrace.processors.sketches import LatencySketch, SketchKey

_SEED: Final = 42
_VALUES: Final = 200_000
_ACCURACY_VALUES: Final = 1_000_000
_REPEATS: Final = 5


def median_seconds(run: Callable[[], object], *, repeats: int = _REPEATS) -> float:
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def insert_costs(values: list[float]) -> None:
    print(f"insert cost, {len(values):,} lognormal values (ns/value, median of {_REPEATS})")

    def one_by_one() -> None:
        sketch = LatencySketch()
        for value in values:
            sketch.add(value)

    def stock_ddsketch() -> None:
        sketch = DDSketch(relative_accuracy=LatencySketch().relative_accuracy)
        for value in values:
            sketch.add(value)

    per_value = median_seconds(one_by_one) / len(values) * 1e9
    print(f"  LatencySketch.add                 {per_value:8.0f}")
    stock = median_seconds(stock_ddsketch) / len(values) * 1e9
    print(f"  ddsketch.DDSketch.add (reference) {stock:8.0f}")
    for batch in (8, 32, 128, 1024, len(values)):
        batches = [values[i : i + batch] for i in range(0, len(values), batch)]

        def batched(batches: list[list[float]] = batches) -> None:
            sketch = LatencySketch()
            for chunk in batches:
                sketch.add_many(chunk)

        def per_distinct_key(batches: list[list[float]] = batches) -> None:
            # Alternative: group equal keys, one store update per distinct key with its weight.
            store = CollapsingLowestDenseStore(4096)
            for chunk in batches:
                counts = Counter([math.ceil(math.log2(value) * 64.0) for value in chunk])
                for key, weight in counts.items():
                    store.add(key, float(weight))

        def numpy_keys(batches: list[list[float]] = batches) -> None:
            # Alternative: vectorised keys grouped with bincount (key step only, no store).
            for chunk in batches:
                keys = np.ceil(np.log2(np.asarray(chunk)) * 64.0).astype(np.int64)
                lowest = int(keys.min())
                weights = np.bincount(keys - lowest)
                nonzero = np.flatnonzero(weights)
                list(zip((nonzero + lowest).tolist(), weights[nonzero].tolist(), strict=True))

        cost = median_seconds(batched) / len(values) * 1e9
        grouped = median_seconds(per_distinct_key) / len(values) * 1e9
        vectorised = median_seconds(numpy_keys) / len(values) * 1e9
        print(
            f"  add_many, batches of {batch:>7,}     {cost:8.0f}  ({per_value / cost:3.1f}x add)"
            f"   per distinct key {grouped:4.0f}   numpy keys only {vectorised:4.0f}"
        )


def query_merge_size(values: list[float]) -> None:
    sketch = LatencySketch()
    sketch.add_many(values)
    other = LatencySketch()
    other.add_many([value * 1.7 for value in values[:50_000]])
    calls = 2_000
    quantile = median_seconds(lambda: [sketch.quantile(0.99) for _ in range(calls)]) / calls
    merge = median_seconds(lambda: sketch.copy().merge(other), repeats=50)
    copy = median_seconds(lambda: sketch.copy(), repeats=50)
    offset, counts = sketch.buckets()
    point = ExponentialHistogramDataPoint()
    sketch.to_otlp(point)
    print("query, merge, size (one sketch of the values above)")
    print(f"  quantile(0.99)                    {quantile * 1e6:8.1f} us")
    print(f"  copy                              {copy * 1e6:8.1f} us")
    print(f"  copy + merge                      {merge * 1e6:8.1f} us")
    print(f"  buckets (non-empty range)         {len(counts):8d} (OTLP offset {offset})")
    print(f"  to_dict as JSON                   {len(json.dumps(sketch.to_dict())):8d} bytes")
    print(f"  OTLP data point, serialised       {point.ByteSize():8d} bytes")


def accuracy() -> None:
    rng = np.random.default_rng(_SEED)
    samples = rng.lognormal(mean=-2.0, sigma=1.2, size=_ACCURACY_VALUES)
    sketch = LatencySketch()
    sketch.add_many(samples)
    print(
        f"accuracy, {_ACCURACY_VALUES:,} lognormal samples (bound {sketch.relative_accuracy:.2%})"
    )
    for q in (0.5, 0.95, 0.99, 0.999):
        exact = float(np.quantile(samples, q, method="lower"))
        estimate = sketch.quantile(q)
        assert estimate is not None
        print(
            f"  p{q * 100:<5g} exact {exact:.6f}  sketch {estimate:.6f}  "
            f"error {abs(estimate - exact) / exact:.3%}"
        )


def store_record_cost() -> None:
    rng = np.random.default_rng(_SEED)
    keys = [SketchKey("svc", f"model-{j}", semconv.OPERATION_CHAT, "short") for j in range(20)]
    requests = [
        RequestMetrics(
            ttft=int(rng.lognormal(-2, 1) * 1e9),
            tpot=int(rng.lognormal(-4, 0.5) * 1e9),
            e2e=int(rng.lognormal(0, 1) * 1e9),
            queue=int(rng.lognormal(-4, 1) * 1e9),
            prefill=int(rng.lognormal(-3, 1) * 1e9),
            decode=int(rng.lognormal(-1, 1) * 1e9),
            network=None,
            itl=(rng.lognormal(-4, 0.5, 32) * 1e9).astype(int).tolist(),
        )
        for _ in range(5_000)
    ]
    store = PercentileStore()

    def record_all() -> None:
        for j, metrics in enumerate(requests):
            store.record(keys[j % len(keys)], metrics)

    cost = median_seconds(record_all, repeats=3) / len(requests)
    snapshot = median_seconds(store.snapshot, repeats=10)
    print("PercentileStore (20 keys, 6 single-value metrics + 32 ITL gaps per request)")
    print(f"  record                            {cost * 1e6:8.1f} us/request")
    print(f"  snapshot (copy under the lock)    {snapshot * 1e3:8.2f} ms")


def main() -> None:
    started = time.perf_counter()
    values = np.random.default_rng(_SEED).lognormal(-2.0, 1.0, _VALUES).tolist()
    insert_costs(values)
    query_merge_size(values)
    accuracy()
    store_record_cost()
    print(f"total {time.perf_counter() - started:.1f} s; reproduce: python bench/sketches.py")


if __name__ == "__main__":
    main()
