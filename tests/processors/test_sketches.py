"""LatencySketch: OTLP bucket layout, accuracy, exact merges, serialisation, edge values."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from ddsketch.mapping import LogarithmicMapping
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.metrics.v1.metrics_pb2 import ExponentialHistogramDataPoint

from tokentrace.processors import sketches as sketches_module
from tokentrace.processors.sketches import MAX_SCALE, MIN_SCALE, KeyedValues, LatencySketch


def otlp_index(value: float, scale: int) -> int:
    """The OTLP spec's bucket index, found by search: the i with b**i < value <= b**(i+1),
    b = 2**(2**-scale) (bounds computed as 2**(i / 2**scale), so only exact at powers of two)."""
    guess = math.floor(math.log2(value) * 2**scale)
    for i in range(guess - 2, guess + 3):
        if 2.0 ** (i / 2**scale) < value <= 2.0 ** ((i + 1) / 2**scale):
            return i
    raise AssertionError(f"no bucket found for {value}")


def bucket_of(sketch: LatencySketch) -> int:
    """The OTLP index of the single non-empty bucket of a one-value sketch."""
    offset, counts = sketch.buckets()
    assert counts == [1]
    return offset


def comparable(sketch: LatencySketch) -> dict[str, Any]:
    """Everything but the float sum, whose rounding depends on addition order."""
    data = sketch.to_dict()
    data.pop("sum")
    return data


# --- bucket layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0, 3, 6, 10])
def test_gamma_equals_the_otlp_base(scale: int) -> None:
    base = 2.0 ** (2.0**-scale)
    sketch = LatencySketch(scale=scale)
    stock = LogarithmicMapping(sketch.relative_accuracy)
    assert stock.gamma == base
    assert sketch.relative_accuracy == pytest.approx((base - 1) / (base + 1), rel=1e-12)


@pytest.mark.parametrize("scale", [0, 6, 8])
def test_values_land_in_the_otlp_bucket_that_contains_them(scale: int) -> None:
    rng = np.random.default_rng(scale)
    for value in rng.lognormal(-3.0, 3.0, 2000).tolist():
        sketch = LatencySketch(scale=scale)
        sketch.add(value)
        assert bucket_of(sketch) == otlp_index(value, scale), value


def test_stock_ddsketch_keys_agree_with_otlp_index_plus_one_away_from_boundaries() -> None:
    # The documented claim: a DDSketch key k is OTLP index k - 1. ddsketch's own key() differs
    # from it only within float rounding of a boundary (why the sketch uses an exact multiplier).
    scale = 6
    sketch = LatencySketch(scale=scale)
    stock = LogarithmicMapping(sketch.relative_accuracy)
    rng = np.random.default_rng(7)
    for value in rng.lognormal(-3.0, 3.0, 5000).tolist():
        exact = math.log2(value) * 2**scale
        if abs(exact - round(exact)) < 1e-9:
            continue
        assert stock.key(value) - 1 == otlp_index(value, scale)


@pytest.mark.parametrize("scale", [0, 6])
@pytest.mark.parametrize("index", [-700, -64, -1, 0, 1, 63, 64, 65, 500])
def test_values_at_and_next_to_bucket_boundaries(scale: int, index: int) -> None:
    def bucket(value: float) -> int:
        sketch = LatencySketch(scale=scale)
        sketch.add(value)
        return bucket_of(sketch)

    boundary = 2.0 ** (index / 2**scale)  # upper edge of bucket index - 1
    assert bucket(boundary * (1 - 1e-12)) == index - 1
    assert bucket(boundary * (1 + 1e-12)) == index
    if (index / 2**scale).is_integer():
        # A power of two is exact and closes its bucket. The next float up may still land in it:
        # log2 of it rounds to the integer (the OTLP spec accepts this off-by-one).
        assert bucket(boundary) == index - 1
        assert bucket(math.nextafter(boundary, math.inf)) in (index - 1, index)
    else:
        # b**i itself is rounded: float rounding may put it in either neighbouring bucket.
        assert bucket(boundary) in (index - 1, index)


def test_to_otlp_places_each_value_in_its_bucket() -> None:
    scale = 6
    values = [1e-9, 3.7e-6, 0.000123, 0.01, 0.25, 0.5, 1.0, 1.5, 42.0, 3600.0]
    sketch = LatencySketch(scale=scale)
    sketch.add_many(values)
    sketch.add(0.0)
    point = ExponentialHistogramDataPoint()
    sketch.to_otlp(point)
    assert point.scale == scale
    assert point.zero_count == 1
    assert point.count == len(values) + 1
    assert point.sum == pytest.approx(sum(values))
    assert point.min == 0.0 and point.max == 3600.0
    assert sum(point.positive.bucket_counts) == len(values)
    assert not point.HasField("negative")
    base = 2.0 ** (2.0**-scale)
    for value in values:
        j = otlp_index(value, scale) - point.positive.offset
        assert 0 <= j < len(point.positive.bucket_counts)
        assert point.positive.bucket_counts[j] >= 1
        index = point.positive.offset + j
        assert base**index < value <= base ** (index + 1) * (1 + 1e-12)
    nonzero = [j for j, c in enumerate(point.positive.bucket_counts) if c]
    assert len(nonzero) == len(values)  # values are > 1% apart: one bucket each


def test_to_otlp_of_an_empty_sketch_leaves_min_and_max_unset() -> None:
    point = ExponentialHistogramDataPoint()
    point.min = 5.0
    LatencySketch().to_otlp(point)
    assert point.count == 0 and not point.HasField("min") and not point.HasField("max")
    assert list(point.positive.bucket_counts) == []


# --- accuracy --------------------------------------------------------------------------------


def test_accuracy_on_a_million_lognormal_samples() -> None:
    rng = np.random.default_rng(2024)
    samples = rng.lognormal(mean=-2.0, sigma=1.2, size=1_000_000)
    sketch = LatencySketch()
    sketch.add_many(samples)
    assert sketch.count == samples.size
    for q in (0.5, 0.95, 0.99):
        exact = float(np.quantile(samples, q, method="lower"))
        estimate = sketch.quantile(q)
        assert estimate is not None
        assert abs(estimate - exact) / exact <= 0.01, q
    assert sketch.quantile(0.0) == samples.min()
    assert sketch.quantile(1.0) == samples.max()
    assert sketch.sum == pytest.approx(float(samples.sum()), rel=1e-9)


def test_relative_error_bound_holds_for_every_quantile_of_a_small_skewed_sample() -> None:
    rng = np.random.default_rng(3)
    samples = np.sort(rng.pareto(1.5, 5000) + 1e-3)
    sketch = LatencySketch()
    sketch.add_many(samples)
    bound = sketch.relative_accuracy * (1 + 1e-9)
    for q in np.linspace(0, 1, 201):
        exact = samples[math.floor(q * (samples.size - 1))]
        estimate = sketch.quantile(float(q))
        assert estimate is not None
        assert abs(estimate - exact) / exact <= bound


def test_fraction_at_or_below_tracks_the_empirical_cdf() -> None:
    rng = np.random.default_rng(11)
    samples = rng.lognormal(-1.0, 1.0, 20_000)
    sketch = LatencySketch()
    sketch.add_many(samples)
    assert sketch.fraction_at_or_below(samples.min() / 2) == 0.0
    assert sketch.fraction_at_or_below(samples.max()) == 1.0
    base = 2.0 ** (2.0**-6)
    for threshold in (0.05, 0.2, 0.37, 1.0, 3.0):
        estimate = sketch.fraction_at_or_below(threshold)
        assert estimate is not None
        # The threshold's whole bucket counts as at-or-below: bracketed by the exact CDF at the
        # threshold and one bucket width above it.
        assert float(np.mean(samples <= threshold)) <= estimate
        assert estimate <= float(np.mean(samples <= threshold * base))


def test_zero_and_negative_values_count_in_the_zero_bucket() -> None:
    sketch = LatencySketch()
    sketch.add_many([0.0, -0.002, 0.5, 0.0])
    assert sketch.zero_count == 3 and sketch.count == 4
    assert sketch.min == 0.0
    assert sketch.quantile(0.5) == 0.0
    assert sketch.quantile(1.0) == pytest.approx(0.5, rel=0.01)
    assert sketch.fraction_at_or_below(0.0) == 0.75
    assert sketch.fraction_at_or_below(-1.0) == 0.0


def test_nan_and_infinity_are_dropped_and_counted() -> None:
    sketch = LatencySketch()
    sketch.add(math.nan)
    sketch.add_many([0.1, math.inf, math.nan, 0.2])
    sketch.add(-math.inf)  # a negative: recorded as 0
    assert sketch.dropped == 3
    assert sketch.count == 3 and sketch.zero_count == 1
    assert math.isfinite(sketch.sum)


def test_empty_sketch_answers_none() -> None:
    sketch = LatencySketch()
    assert sketch.quantile(0.5) is None
    assert sketch.fraction_at_or_below(1.0) is None
    assert sketch.min is None and sketch.max is None
    assert sketch.count == 0 and sketch.sum == 0.0


@pytest.mark.parametrize("q", [-0.1, 1.5, math.nan])
def test_quantile_outside_zero_one_is_an_error(q: float) -> None:
    sketch = LatencySketch()
    sketch.add(1.0)
    with pytest.raises(ValueError):
        sketch.quantile(q)


@pytest.mark.parametrize("scale", [MIN_SCALE - 1, MAX_SCALE + 1])
def test_unsupported_scale_is_rejected(scale: int) -> None:
    with pytest.raises(ValueError, match="scale"):
        LatencySketch(scale=scale)


def test_max_buckets_bounds_memory_by_collapsing_the_lowest_buckets() -> None:
    sketch = LatencySketch(max_buckets=256)
    sketch.add_many([1e-9 * 1.05**i for i in range(2000)])  # ~140 doublings of range
    assert sketch.collapsed
    _, counts = sketch.buckets()
    assert len(counts) <= 256
    assert sum(counts) == 2000
    top = 1e-9 * 1.05**1999
    assert sketch.quantile(1.0) == top
    estimate = sketch.quantile(0.99)
    assert estimate is not None
    assert estimate == pytest.approx(1e-9 * 1.05**1979, rel=0.01)  # the tail keeps accuracy


# --- add_many, merge ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.floats(min_value=1e-9, max_value=1e5),
            st.sampled_from([0.0, -1.0, 1.0, 2.0, 0.5, 2.0 ** (1 / 64)]),
        ),
        max_size=200,
    )
)
def test_add_many_gives_the_same_buckets_as_add(values: list[float]) -> None:
    one_by_one, batched = LatencySketch(), LatencySketch()
    for value in values:
        one_by_one.add(value)
    batched.add_many(values)
    assert comparable(batched) == comparable(one_by_one)
    assert batched.sum == pytest.approx(one_by_one.sum)


def test_add_many_accepts_numpy_arrays_and_generators() -> None:
    values = np.array([0.001, 0.01, 0.1])
    from_array, from_generator = LatencySketch(), LatencySketch()
    from_array.add_many(values)
    from_generator.add_many(v for v in values.tolist())
    assert comparable(from_array) == comparable(from_generator)
    assert from_array.count == 3


def boundary_values(scale: int, count: int) -> list[float]:
    """Powers of two, bucket boundaries 2**(i / 2**scale) and their float neighbours, plus
    lognormal samples: at least ``count`` values, the hardest for an exact key."""
    per_doubling = 2**scale
    values: list[float] = []
    for index in range(-40 * per_doubling, 40 * per_doubling, max(1, per_doubling // 16)):
        bound = 2.0 ** (index / per_doubling)
        values += [bound, math.nextafter(bound, 0.0), math.nextafter(bound, math.inf)]
    for exponent in range(-60, 60):
        power = math.ldexp(1.0, exponent)
        values += [power, math.nextafter(power, 0.0), math.nextafter(power, math.inf)]
    values += np.random.default_rng(scale).lognormal(-3.0, 3.0, count).tolist()
    return values


def scalar_key_counts(values: list[float], scale: int) -> dict[int, int]:
    sketch = LatencySketch(scale=scale)
    counts: dict[int, int] = {}
    for value in values:
        key = sketch.key(value)
        assert key is not None
        counts[key] = counts.get(key, 0) + 1
    return counts


def key_counts(batch: KeyedValues) -> dict[int, int]:
    counts = batch.counts if batch.counts is not None else [1] * len(batch.keys)
    merged: dict[int, int] = {}
    for key, count in zip(batch.keys, counts, strict=True):
        merged[key] = merged.get(key, 0) + count
    return merged


@pytest.mark.parametrize("scale", [0, 6, 12])
def test_vectorised_keys_equal_the_scalar_keys_at_boundaries(scale: int) -> None:
    values = boundary_values(scale, 2000)
    batch = KeyedValues.of(values, scale=scale)
    assert batch.counts is not None  # a batch this large takes the numpy path
    assert key_counts(batch) == scalar_key_counts(values, scale)
    batched, one_by_one = LatencySketch(scale=scale), LatencySketch(scale=scale)
    batched.add_many(values)
    for value in values:
        one_by_one.add(value)
    assert comparable(batched) == comparable(one_by_one)


def test_vectorised_keys_are_corrected_where_numpy_log2_is_an_ulp_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # np.log2 may differ from math.log2 in the last ulp; simulate the worst case both ways.
    values = boundary_values(6, 500)
    expected = scalar_key_counts(values, 6)
    real_log2 = np.log2
    for direction in (math.inf, -math.inf):

        def skewed(array: Any, direction: float = direction) -> Any:
            return np.nextafter(real_log2(array), direction)

        monkeypatch.setattr(sketches_module.np, "log2", skewed)
        assert key_counts(KeyedValues.of(values, scale=6)) == expected


@pytest.mark.parametrize("size", [0, 5, 100, 1000])
def test_keying_ns_durations_equals_keying_their_seconds(size: int) -> None:
    rng = np.random.default_rng(size)
    durations = rng.integers(1, 10**10, size).tolist()
    durations[:2] = [500_000_000, 250_000_000][:size]  # 0.5 s and 0.25 s: bucket boundaries
    from_ns = KeyedValues.of_ns(durations, scale=6)
    from_seconds = KeyedValues.of([ns / 1e9 for ns in durations], scale=6)
    assert key_counts(from_ns) == key_counts(from_seconds)
    assert (from_ns.count, from_ns.lowest, from_ns.highest) == (
        from_seconds.count,
        from_seconds.lowest,
        from_seconds.highest,
    )
    assert from_ns.total == pytest.approx(from_seconds.total, rel=1e-12)


def test_ns_durations_whose_sum_passes_64_bits_are_keyed_as_their_seconds() -> None:
    durations = [2**53 - 1] * 1025 + [7]  # the C pass declines (its sum would overflow)
    from_ns = KeyedValues.of_ns(durations, scale=6)
    from_seconds = KeyedValues.of([ns / 1e9 for ns in durations], scale=6)
    assert key_counts(from_ns) == key_counts(from_seconds)
    assert (from_ns.lowest, from_ns.highest, from_ns.total) == (
        7e-9,
        (2**53 - 1) / 1e9,
        sum(durations) / 1e9,
    )


def test_ns_durations_of_zero_or_below_go_to_the_zero_bucket() -> None:
    batch = KeyedValues.of_ns([0, -5, 1_000_000], scale=6)
    assert (batch.zeros, batch.positives, batch.lowest, batch.highest) == (2, 1, 0.0, 0.001)


def test_one_keyed_batch_added_to_several_sketches_equals_adding_the_values_to_each() -> None:
    values = [0.0, -1.0, math.nan, math.inf, 0.004, 0.25, *np.linspace(0.01, 3.0, 400).tolist()]
    batch = KeyedValues.of(values, scale=6)
    assert (batch.count, batch.dropped, batch.zeros) == (len(values) - 2, 2, 2)
    reference = LatencySketch()
    for value in values:
        reference.add(value)
    targets = [LatencySketch(), LatencySketch()]
    targets[1].add(0.5)  # a sketch with data already
    for target in targets:
        target.add_keyed(batch)
    assert comparable(targets[0]) == comparable(reference)
    assert targets[0].dropped == reference.dropped == 2
    reference.add(0.5)
    assert comparable(targets[1]) == comparable(reference)
    assert targets[1].sum == pytest.approx(reference.sum)


def test_a_batch_keyed_at_another_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="scale"):
        LatencySketch(scale=6).add_keyed(KeyedValues.of([0.1, 0.2], scale=5))
    with pytest.raises(ValueError, match="scale"):
        KeyedValues.of([0.1], scale=MAX_SCALE + 1)


def test_merge_of_shards_equals_the_sketch_of_the_union() -> None:
    rng = np.random.default_rng(5)
    samples = rng.lognormal(-3.0, 1.5, 60_000)
    samples[::97] = 0.0
    union = LatencySketch()
    union.add_many(samples)
    shards = [LatencySketch() for _ in range(7)]
    for j, shard in enumerate(shards):
        part = samples[j::7]
        if j % 2:
            shard.add_many(part)
        else:
            for value in part.tolist():
                shard.add(value)
    merged = LatencySketch()
    for shard in shards:
        merged.merge(shard)
    assert comparable(merged) == comparable(union)
    assert merged.sum == pytest.approx(union.sum, rel=1e-12)
    # Associativity: a different grouping gives the same buckets.
    left, right = LatencySketch(), LatencySketch()
    for shard in shards[:3]:
        left.merge(shard)
    for shard in shards[3:]:
        right.merge(shard)
    right.merge(left)
    assert comparable(right) == comparable(union)
    for q in (0.5, 0.9, 0.99):
        assert merged.quantile(q) == union.quantile(q)


def test_merge_leaves_the_other_sketch_unchanged_and_copy_is_independent() -> None:
    first, second = LatencySketch(), LatencySketch()
    first.add_many([0.1, 0.2])
    second.add_many([0.3])
    before = second.to_dict()
    first.merge(second)
    assert second.to_dict() == before
    assert first.count == 3
    duplicate = first.copy()
    duplicate.add(5.0)
    assert first.count == 3 and duplicate.count == 4
    empty = LatencySketch()
    empty.merge(first)
    empty.add(7.0)
    assert first.count == 3


def test_merge_of_different_scales_is_refused() -> None:
    with pytest.raises(ValueError, match="scale"):
        LatencySketch(scale=6).merge(LatencySketch(scale=5))
    with pytest.raises(ValueError, match="max_buckets"):
        LatencySketch(max_buckets=100).merge(LatencySketch(max_buckets=200))


# --- serialisation -----------------------------------------------------------------------------


def test_to_dict_round_trips_through_json() -> None:
    rng = np.random.default_rng(9)
    sketch = LatencySketch(scale=8)
    sketch.add_many(rng.lognormal(0.0, 2.0, 5000))
    sketch.add(0.0)
    data = sketch.to_dict()
    restored = LatencySketch.from_dict(json.loads(json.dumps(data)))
    assert restored.to_dict() == data
    assert restored.scale == 8
    for q in (0.0, 0.25, 0.5, 0.99, 1.0):
        assert restored.quantile(q) == sketch.quantile(q)
    # Compact: only the range of non-empty buckets.
    assert data["counts"][0] > 0 and data["counts"][-1] > 0
    empty = LatencySketch.from_dict(json.loads(json.dumps(LatencySketch().to_dict())))
    assert empty.count == 0 and empty.quantile(0.5) is None


def test_restored_sketch_merges_with_live_ones() -> None:
    live, stored = LatencySketch(), LatencySketch()
    live.add_many([0.1, 0.2])
    stored.add_many([0.4, 0.8])
    restored = LatencySketch.from_dict(stored.to_dict())
    restored.merge(live)
    union = LatencySketch()
    union.add_many([0.1, 0.2, 0.4, 0.8])
    assert comparable(restored) == comparable(union)


def _valid() -> dict[str, Any]:
    sketch = LatencySketch()
    sketch.add_many([0.1, 0.2])
    return sketch.to_dict()


@pytest.mark.parametrize(
    "garbage",
    [
        None,
        [],
        "sketch",
        {},
        {**_valid(), "scale": "6"},
        {**_valid(), "scale": 99},
        {**_valid(), "scale": True},
        {**_valid(), "zero": -1},
        {**_valid(), "counts": [1, -1]},
        {**_valid(), "counts": [1.5]},
        {**_valid(), "counts": "12"},
        {**_valid(), "offset": 2.5},
        {**_valid(), "offset": 10**9},
        {**_valid(), "sum": math.nan},
        {**_valid(), "sum": "1"},
        {**_valid(), "min": None},
        {**_valid(), "min": 0.3, "max": 0.1},
        {**_valid(), "max": math.inf},
        {**_valid(), "max_buckets": 0},
        {**_valid(), "counts": [1] * 5000},
        {"scale": 6, "zero": 0, "offset": 0, "counts": [], "sum": 0.0, "min": 1.0, "max": 1.0},
    ],
)
def test_from_dict_rejects_garbage(garbage: Any) -> None:
    with pytest.raises(ValueError):
        LatencySketch.from_dict(garbage)
