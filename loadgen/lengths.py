"""Token-length distributions and their spec syntax, and the error every load option raises.

- ``LengthDistribution`` / ``parse_length``: token counts per request (``128``, ``fixed:128``,
  ``uniform:64:256``, ``normal:128:32``), as ``--prompt-tokens`` and ``--output-tokens`` give them.
- ``WorkloadError``, ``is_int``, ``is_number``: the error and the value checks that the load
  configuration, the dataset reader and the planner share; they live here because this module is
  at the bottom of their imports.

Standard library only.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Final


class WorkloadError(ValueError):
    """A bad load option or dataset line; the message names the option (``--rate: ...``) or the
    place in the dataset (``dataset FILE:LINE: ...``)."""


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (JSON's whole numbers)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


# --- length distributions ---------------------------------------------------------------------

KIND_FIXED: Final = "fixed"
KIND_UNIFORM: Final = "uniform"
KIND_NORMAL: Final = "normal"
_KINDS: Final = (KIND_FIXED, KIND_UNIFORM, KIND_NORMAL)

MAX_LENGTH_TOKENS: Final = 1_048_576
"""Largest token count one prompt or output may ask for (and where normal samples are clipped):
beyond any context window in use, and it bounds one prompt's text to a few MB."""

_SPEC_HELP: Final = "expected N, fixed:N, uniform:MIN:MAX or normal:MEAN:STDDEV"


def _format_number(value: float) -> str:
    """``128`` for whole numbers, the exact shortest repr otherwise (so specs round-trip)."""
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


def _whole_tokens(value: float) -> bool:
    return math.isfinite(value) and float(value).is_integer()


def _distribution_problem(kind: str, a: float, b: float) -> str | None:
    """What is wrong with these parameters, or None."""
    if kind not in _KINDS:
        return f"unknown kind {kind!r}; {_SPEC_HELP}"
    if not (math.isfinite(a) and math.isfinite(b)):
        return "values must be finite numbers"
    if kind == KIND_NORMAL:
        if a <= 0:
            return f"the mean must be positive, got {_format_number(a)}"
        if a > MAX_LENGTH_TOKENS:
            return f"the mean must be at most {MAX_LENGTH_TOKENS}, got {_format_number(a)}"
        if b < 0:
            return f"the standard deviation must not be negative, got {_format_number(b)}"
        return None
    bounds = (a,) if kind == KIND_FIXED else (a, b)
    for bound in bounds:
        if not _whole_tokens(bound):
            return f"token counts must be whole numbers, got {_format_number(bound)}"
        if bound < 1:
            return f"token counts must be at least 1, got {_format_number(bound)}"
        if bound > MAX_LENGTH_TOKENS:
            return f"token counts must be at most {MAX_LENGTH_TOKENS}, got {_format_number(bound)}"
    if kind == KIND_UNIFORM and a > b:
        return f"the minimum {_format_number(a)} is above the maximum {_format_number(b)}"
    return None


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """A distribution of token counts; every sample is a whole number in
    ``[1, MAX_LENGTH_TOKENS]``.

    - ``fixed``: always ``a``.
    - ``uniform``: a whole number in ``[a, b]``, both ends included.
    - ``normal``: mean ``a``, standard deviation ``b``, rounded and clipped to the range above.
    """

    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        problem = _distribution_problem(self.kind, self.a, self.b)
        if problem is not None:
            raise WorkloadError(f"length distribution: {problem}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == KIND_FIXED:
            return int(self.a)
        if self.kind == KIND_UNIFORM:
            return rng.randint(int(self.a), int(self.b))
        return min(MAX_LENGTH_TOKENS, max(1, round(rng.gauss(self.a, self.b))))

    def describe(self) -> str:
        """For people: ``fixed 128``, ``uniform 64-256``, ``normal 128±32``."""
        a, b = _format_number(self.a), _format_number(self.b)
        if self.kind == KIND_FIXED:
            return f"fixed {a}"
        if self.kind == KIND_UNIFORM:
            return f"uniform {a}-{b}"
        return f"normal {a}±{b}"

    def to_spec(self) -> str:
        """The text ``parse_length`` reads back into an equal distribution."""
        a, b = _format_number(self.a), _format_number(self.b)
        if self.kind == KIND_FIXED:
            return f"fixed:{a}"
        return f"{self.kind}:{a}:{b}"


def _parse_number(text: str, *, option: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise WorkloadError(f"{option}: {text!r} is not a number in {spec!r}") from None


def parse_length(text: str, *, option: str) -> LengthDistribution:
    """``128`` | ``fixed:128`` | ``uniform:64:256`` | ``normal:128:32``; every problem is a
    ``WorkloadError`` that names ``option``."""
    spec = text.strip()
    parts = [part.strip() for part in spec.split(":")]
    kind = parts[0].lower()
    if len(parts) == 1:
        kind, values = KIND_FIXED, parts
    else:
        values = parts[1:]
    expected_values = {KIND_FIXED: 1, KIND_UNIFORM: 2, KIND_NORMAL: 2}.get(kind)
    if expected_values is None or len(values) != expected_values or not all(values):
        raise WorkloadError(f"{option}: {_SPEC_HELP}, got {text!r}")
    numbers = [_parse_number(value, option=option, spec=text) for value in values]
    a = numbers[0]
    b = numbers[1] if len(numbers) > 1 else 0.0
    problem = _distribution_problem(kind, a, b)
    if problem is not None:
        raise WorkloadError(f"{option}: {problem} in {text!r}")
    return LengthDistribution(kind, a, b)
