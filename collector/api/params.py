"""Query parameters shared by the API's routes: the time window and the dimension filters.

Each is a FastAPI dependency, so the routes declare them once and the OpenAPI document
describes them once. Bad values raise ``ApiError`` (400 with one sentence), never a 5xx.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Final

from fastapi import Query, Request

from tokentrace.processors.durations import parse_duration_ns

_NS_PER_S: Final = 1_000_000_000
_MAX_UNIX_S: Final = 4_102_444_800.0  # 2100-01-01: beyond it a value is a unit mistake


class ApiError(Exception):
    """A request the API answers with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Window:
    """A time window in unix ns; None on a side means unbounded."""

    since_ns: int | None
    until_ns: int | None

    @property
    def since_s(self) -> float | None:
        return None if self.since_ns is None else self.since_ns / _NS_PER_S

    @property
    def until_s(self) -> float | None:
        return None if self.until_ns is None else self.until_ns / _NS_PER_S


@dataclass(frozen=True, slots=True)
class Dimensions:
    """Exact-match filters on the percentile key; None matches everything."""

    service: str | None = None
    model: str | None = None
    operation: str | None = None
    prompt_bucket: str | None = None

    def as_selector(self) -> dict[str, str]:
        """The filters that are set, keyed like ``processors.slo.SELECTOR_KEYS``."""
        return {
            name: value
            for name, value in (
                ("service", self.service),
                ("model", self.model),
                ("operation", self.operation),
                ("prompt_bucket", self.prompt_bucket),
            )
            if value is not None
        }

    def matches(self, key: dict[str, str]) -> bool:
        return all(key.get(name) == value for name, value in self.as_selector().items())


def unix_s_to_ns(value: float, *, name: str) -> int:
    if not math.isfinite(value) or value < 0 or value > _MAX_UNIX_S:
        raise ApiError(400, f"{name}: expected unix seconds between 0 and {_MAX_UNIX_S:.0f}")
    return int(value * _NS_PER_S)


def parse_window(
    since: float | None,
    until: float | None,
    last: str | None,
    *,
    now_s: float,
    default_last_s: float | None,
) -> Window:
    """``since``/``until`` (unix s), or ``last`` (a duration ending now), or the default."""
    if last is not None and (since is not None or until is not None):
        raise ApiError(400, "give either last or since/until, not both")
    if last is not None:
        try:
            last_ns = parse_duration_ns(last)
        except ValueError as error:
            raise ApiError(400, f"last: {error}") from None
        if last_ns <= 0:
            raise ApiError(400, "last: must be a positive duration")
        now_ns = int(now_s * _NS_PER_S)
        return Window(max(0, now_ns - last_ns), now_ns)
    if since is None and until is None:
        if default_last_s is None:
            return Window(None, None)
        now_ns = int(now_s * _NS_PER_S)
        return Window(max(0, now_ns - int(default_last_s * _NS_PER_S)), now_ns)
    since_ns = None if since is None else unix_s_to_ns(since, name="since")
    until_ns = None if until is None else unix_s_to_ns(until, name="until")
    if since_ns is not None and until_ns is not None and until_ns <= since_ns:
        raise ApiError(400, "until must be after since")
    return Window(since_ns, until_ns)


SinceParam = Annotated[float | None, Query(description="window start, unix seconds")]
UntilParam = Annotated[float | None, Query(description="window end, unix seconds")]
LastParam = Annotated[
    str | None,
    Query(
        description="a window ending now, as a duration (15m, 1h, 7d); instead of since/until",
        max_length=32,
    ),
]


def window_dependency(default_last_s: float | None) -> Callable[..., Window]:
    """A dependency reading ``since``/``until``/``last`` (default: ``default_last_s`` back),
    with "now" from the app's clock (``app.state.clock``, injectable for tests)."""

    def window(
        request: Request,
        since: SinceParam = None,
        until: UntilParam = None,
        last: LastParam = None,
    ) -> Window:
        clock: Callable[[], float] = request.app.state.clock
        return parse_window(since, until, last, now_s=clock(), default_last_s=default_last_s)

    return window


_DIMENSION_MAX_LENGTH: Final = 256


def dimensions(
    service: Annotated[
        str | None, Query(description="exact service.name", max_length=_DIMENSION_MAX_LENGTH)
    ] = None,
    model: Annotated[
        str | None, Query(description="exact model name", max_length=_DIMENSION_MAX_LENGTH)
    ] = None,
    operation: Annotated[
        str | None,
        Query(description="exact operation (chat, text_completion, ...)", max_length=64),
    ] = None,
    prompt_bucket: Annotated[
        str | None, Query(description="exact prompt-length bucket, e.g. 128-511", max_length=64)
    ] = None,
) -> Dimensions:
    return Dimensions(service, model, operation, prompt_bucket)
