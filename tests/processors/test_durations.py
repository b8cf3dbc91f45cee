"""``durations.ms_of`` / ``whole_us``: the one rounding of every ``*_ms`` figure."""

from __future__ import annotations

import math
from decimal import ROUND_FLOOR, Decimal

from hypothesis import given
from hypothesis import strategies as st

from tokentrace.processors.durations import ms_of, whole_us


def _exact_us(ns: int) -> int:
    """Whole µs, halves up (toward +inf), by decimal arithmetic."""
    return int((Decimal(ns) / 1000 + Decimal("0.5")).to_integral_value(rounding=ROUND_FLOOR))


def test_halves_go_up_where_binary_rounding_went_down() -> None:
    # 1.8135 ms has no exact binary form and the nearest double is below it:
    # round(1813500 / 1e6, 3) gives 1.813.
    assert round(1_813_500 / 1e6, 3) == 1.813
    assert ms_of(1_813_500) == 1.814
    assert ms_of(1_813_499) == 1.813
    assert ms_of(2_500) == 0.003 and ms_of(1_500) == 0.002
    assert ms_of(-1_500) == -0.001  # halves up, not away from zero
    assert whole_us(1_500) == 2 and whole_us(1_499) == 1


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_integers_round_exactly(ns: int) -> None:
    assert whole_us(ns) == _exact_us(ns)
    assert ms_of(ns) == float(Decimal(_exact_us(ns)) / 1000)


@given(st.floats(min_value=0, max_value=1e15))
def test_floats_round_to_the_microsecond(ns: float) -> None:
    # A gap median of an even count is a half ns; the figure is still whole µs, the nearest.
    us = ms_of(ns) * 1000
    assert math.isclose(us, round(us), rel_tol=1e-12, abs_tol=1e-9)
    assert abs(ms_of(ns) - ns / 1e6) <= 0.0005 * (1 + 1e-9)


def test_infinities_and_nan_stay() -> None:
    assert ms_of(math.inf) == math.inf
    assert ms_of(-math.inf) == -math.inf
    assert math.isnan(ms_of(math.nan))
