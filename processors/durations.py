"""Durations written by people (``500ms``, ``2s``, ``5m``) as integer nanoseconds, and
nanoseconds as the milliseconds documents show.

The one parser for every duration tokentrace reads: configuration (SLO thresholds, exporter
timeouts) and command-line options; the one rounding of every ``*_ms`` figure (verdicts, window
findings, stored documents). Standard library only: ``tokentrace --help`` imports it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Final

_NS_PER_S: Final = 1_000_000_000
_NS_PER_US: Final = 1_000
_US_PER_MS: Final = 1_000

_NS_PER_UNIT: Final[Mapping[str, int]] = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,  # MICRO SIGN
    "μs": 1_000,  # GREEK SMALL LETTER MU
    "ms": 1_000_000,
    "s": _NS_PER_S,
    "m": 60 * _NS_PER_S,
    "min": 60 * _NS_PER_S,
    "h": 3600 * _NS_PER_S,
    "d": 86400 * _NS_PER_S,
}
"""Unit (lower case) -> nanoseconds; a bare number is seconds."""

_DURATION_PATTERN: Final = re.compile(
    r"""^\s*
    (?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)
    \s*
    (?P<unit>ns|us|µs|μs|ms|min|s|m|h|d)?
    \s*$""",
    re.IGNORECASE | re.VERBOSE,
)


def parse_duration_ns(value: object) -> int:
    """A duration in integer ns from ``"500ms"``, ``"2s"``, ``"1.5m"`` (or ``"1.5min"``),
    ``"750us"``, ``"100ns"``, ``"1h"``, ``"7d"``, or a bare number (int, float or numeric
    string) of seconds. Units are case-insensitive.

    Raises ``ValueError`` (with the offending value) for anything else, negative or non-finite.
    """
    if isinstance(value, bool):
        raise ValueError(
            f"expected a duration such as '500ms' or a number of seconds, got {value!r}"
        )
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"must be a finite, non-negative duration, got {value!r}")
        # Via Decimal(str()) so that 0.1 s is exactly 100 ms, not 100000000.00000001 ns.
        return int((Decimal(str(value)) * _NS_PER_S).to_integral_value())
    if not isinstance(value, str):
        raise ValueError(
            f"expected a duration such as '500ms' or a number of seconds, "
            f"got {type(value).__name__}"
        )
    match = _DURATION_PATTERN.match(value)
    if match is None:
        raise ValueError(
            f"cannot parse duration {value!r} (a number with unit ns, us, ms, s, m, min, h or d, "
            f"or a bare number of seconds)"
        )
    unit = (match.group("unit") or "s").lower()
    try:
        number = Decimal(match.group("number"))
    except InvalidOperation as error:  # the pattern admits only valid numbers; belt and braces
        raise ValueError(f"cannot parse duration {value!r}") from error
    return int((number * _NS_PER_UNIT[unit]).to_integral_value())


def whole_us(ns: int) -> int:
    """Integer ns to whole µs, halves up (float division would round 0.5 µs either way)."""
    return (ns + _NS_PER_US // 2) // _NS_PER_US


def ms_of(ns: int | float) -> float:
    """ns as a ``*_ms`` figure: ``whole_us`` in ms (exact on integers, where
    ``round(ns / 1e6, 3)`` rounds the nearest binary fraction, at a quarter of its cost: this
    runs several times per request). Infinities and NaN stay as they are."""
    us = (ns + _NS_PER_US // 2) // _NS_PER_US  # whole_us inline: one call fewer
    return us / _US_PER_MS if us == us else ns / 1e6  # NaN from an infinity
