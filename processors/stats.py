"""Small order statistics shared by the processors and the store's documents (stdlib only)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

_T = TypeVar("_T")


def nearest_rank(sorted_values: Sequence[_T], percentile: float) -> _T:
    """The nearest-rank ``percentile`` (0-100) of a non-empty ascending sequence.

    The value at rank ``ceil(percentile / 100 * n)``, clamped into ``[1, n]``: always one of the
    values, never an interpolation (p0 is the smallest value, p100 the largest).
    """
    count = len(sorted_values)
    # Rounded first: 99.9 / 100 * 1000 is 999.0000000000001 in floating point, not 999.
    rank = math.ceil(round(percentile / 100 * count, 9))
    return sorted_values[min(max(rank, 1), count) - 1]
