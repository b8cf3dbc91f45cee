"""``HookGuard.run``: in C (``_hooks.run``) where built, and its Python twin, the same answers."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tokentrace.agent import compiled
from tokentrace.agent.hooks import HookGuard

_HOOKS = compiled.load("tokentrace.agent._hooks")
RUNS = [pytest.param(HookGuard.run_python, id="python")]
if _HOOKS is not None:
    RUNS.append(pytest.param(_HOOKS.run, id="c"))


@pytest.fixture(params=RUNS)
def guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[HookGuard]:
    monkeypatch.setattr(HookGuard, "run", request.param)
    yield HookGuard()


def test_the_c_run_is_the_class_method_where_built() -> None:
    if _HOOKS is None:
        assert HookGuard.run is HookGuard.run_python
    else:
        assert HookGuard.run is _HOOKS.run


@pytest.mark.parametrize("args", [(), (1,), (1, "two", [3])])
def test_calls_the_hook_with_its_arguments_and_answers_its_value(
    guard: HookGuard, args: tuple[Any, ...]
) -> None:
    calls: list[tuple[Any, ...]] = []

    def hook(*received: Any) -> str:
        calls.append(received)
        return "answer"

    assert guard.run("hook", hook, *args) == "answer"
    assert calls == [args]
    assert guard.failures == {} and guard.disabled == set()


def test_bound_read_once_and_called_unbound(guard: HookGuard) -> None:
    run = guard.run  # a bound method, kept
    assert run("hook", lambda value: value + 1, 1) == 2
    assert HookGuard.run(guard, "hook", lambda: "unbound") == "unbound"


def test_a_failing_hook_is_counted_logged_disabled_and_answers_none(
    guard: HookGuard, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    def failing() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("broken hook")

    with caplog.at_level(logging.WARNING, logger="tokentrace.agent.hooks"):
        assert guard.run("failing", failing) is None
    assert guard.failures == {"failing": 1}
    assert guard.disabled == {"failing"}
    (record,) = caplog.records
    assert "'failing' failed and is now disabled" in record.getMessage()
    assert record.exc_info is not None
    error = record.exc_info[1]
    assert isinstance(error, ValueError) and str(error) == "broken hook"
    assert error.__traceback__ is not None  # the log shows where the hook failed

    # Disabled: not called again, None; another hook still runs.
    assert guard.run("failing", failing) is None
    assert calls == 1
    assert guard.run("other", lambda: 7) == 7


def test_the_exception_being_handled_by_the_caller_is_kept(guard: HookGuard) -> None:
    def failing() -> None:
        raise KeyError("inner")

    try:
        raise RuntimeError("the caller's")
    except RuntimeError as outer:
        assert guard.run("failing", failing) is None
        assert sys.exc_info()[1] is outer


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_what_is_not_an_exception_reaches_the_host(
    guard: HookGuard, error: type[BaseException]
) -> None:
    def stopping() -> None:
        raise error

    with pytest.raises(error):
        guard.run("stopping", stopping)
    assert guard.failures == {} and guard.disabled == set()


@pytest.mark.parametrize(
    "call",
    [
        lambda guard: guard.run("hook", lambda **_: None, value=1),
        lambda guard: guard.run("hook"),
    ],
    ids=["keyword arguments", "no hook"],
)
def test_misuse_is_a_type_error(guard: HookGuard, call: Callable[[HookGuard], Any]) -> None:
    with pytest.raises(TypeError):
        call(guard)
