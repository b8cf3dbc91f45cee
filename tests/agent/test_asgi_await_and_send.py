"""The HTTP server span's await and send in C (``_asgi.traced_await``, ``_asgi.traced_send``)
against their Python twins (``asgi._traced_await``, ``asgi._traced_send``): the same coroutines
and messages through each give the same results, exceptions, exits and span stamps."""

from __future__ import annotations

import asyncio
import gc
import itertools
import types
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentrace.agent.frameworks import asgi
from tokentrace.agent.frameworks.asgi import HttpServerSpan

pytestmark = pytest.mark.skipif(
    asgi._ASGI is None, reason="the C extension is not built here (or TOKENTRACE_PURE_PYTHON)"
)

Wrap = Callable[[Coroutine[Any, Any, Any], Callable[[BaseException | None], object]], Any]


def _c_await(call: Coroutine[Any, Any, Any], on_exit: Callable[..., object]) -> Any:
    assert asgi._ASGI is not None
    return asgi._ASGI.traced_await(call, on_exit)


@pytest.fixture(params=["C", "Python"])
def wrap(request: pytest.FixtureRequest) -> Wrap:
    return _c_await if request.param == "C" else asgi._traced_await


class Exits(list[BaseException | None]):
    """What on_exit was called with, in order."""

    def __call__(self, exc: BaseException | None) -> None:
        self.append(exc)


@types.coroutine
def _suspend(value: object = "yielded") -> Iterator[object]:
    """One suspension of the awaiting coroutine: what a task's resume passes through."""
    return (yield value)


async def _app(
    log: list[str],
    *,
    result: object = "answer",
    fail: BaseException | None = None,
    suspensions: int = 2,
) -> object:
    try:
        for n in range(suspensions):
            log.append(f"resumed with {await _suspend(n)}")
        if fail is not None:
            raise fail
        return result
    finally:
        log.append("finally")


async def _outer(awaitable: Awaitable[Any]) -> object:
    """A host's frame awaiting the wrapper (Starlette's ``await self.middleware_stack(...)``)."""
    return await awaitable


def _drive(coroutine: Coroutine[Any, Any, Any], sends: list[object]) -> tuple[list[object], Any]:
    """Sends each value in turn; what it yielded, and how it ended (a return value or the
    exception it raised; None while still suspended)."""
    yielded: list[object] = []
    try:
        for value in sends:
            yielded.append(coroutine.send(value))
    except StopIteration as stop:
        return yielded, ("returned", stop.value)
    except BaseException as exc:  # the outcome under test
        return yielded, ("raised", exc)
    return yielded, None


def test_a_return_passes_through_and_exits_once_with_none(wrap: Wrap) -> None:
    log: list[str] = []
    exits = Exits()
    yielded, ended = _drive(_outer(wrap(_app(log), exits)), [None, "a", "b"])
    assert yielded == [0, 1]
    assert ended == ("returned", "answer")
    assert log == ["resumed with a", "resumed with b", "finally"]
    assert exits == [None]


def test_an_exception_propagates_as_itself_and_exits_with_it(wrap: Wrap) -> None:
    log: list[str] = []
    exits = Exits()
    failure = KeyError("route")
    _, ended = _drive(_outer(wrap(_app(log, fail=failure), exits)), [None, 1, 2])
    assert ended == ("raised", failure)
    assert failure.__traceback__ is not None
    assert exits == [failure]


def test_a_throw_the_app_does_not_catch_ends_it_and_exits_with_the_exception(wrap: Wrap) -> None:
    log: list[str] = []
    exits = Exits()
    outer = _outer(wrap(_app(log), exits))
    assert outer.send(None) == 0
    cancelled = asyncio.CancelledError()
    with pytest.raises(asyncio.CancelledError) as raised:
        outer.throw(cancelled)
    assert raised.value is cancelled
    assert log == ["finally"]
    assert exits == [cancelled]


def test_a_throw_the_app_catches_goes_on_and_a_later_return_exits_with_none(wrap: Wrap) -> None:
    exits = Exits()

    async def forgiving() -> str:
        try:
            await _suspend()
        except ValueError:
            await _suspend("after the throw")
        return "done"

    outer = _outer(wrap(forgiving(), exits))
    outer.send(None)
    assert outer.throw(ValueError("ignored")) == "after the throw"
    assert exits == []
    with pytest.raises(StopIteration) as stop:
        outer.send(None)
    assert stop.value.value == "done"
    assert exits == [None]


def test_a_throw_that_ends_the_app_with_a_return_exits_with_none(wrap: Wrap) -> None:
    exits = Exits()

    async def returns_on_throw() -> str:
        try:
            await _suspend()
        except ValueError:
            return "caught"
        return "not thrown"

    outer = _outer(wrap(returns_on_throw(), exits))
    outer.send(None)
    with pytest.raises(StopIteration) as stop:
        outer.throw(ValueError())
    assert stop.value.value == "caught"
    assert exits == [None]


def test_closing_a_suspended_call_closes_the_app_and_exits_with_generator_exit(
    wrap: Wrap,
) -> None:
    log: list[str] = []
    exits = Exits()
    outer = _outer(wrap(_app(log), exits))
    outer.send(None)
    outer.close()
    assert log == ["finally"]
    assert len(exits) == 1 and isinstance(exits[0], GeneratorExit)


def test_a_suspended_call_collected_unfinished_exits_with_generator_exit(wrap: Wrap) -> None:
    log: list[str] = []
    exits = Exits()
    outer = _outer(wrap(_app(log), exits))
    outer.send(None)
    del outer
    gc.collect()
    assert log == ["finally"]
    assert len(exits) == 1 and isinstance(exits[0], GeneratorExit)


def test_a_call_never_started_never_exits(wrap: Wrap) -> None:
    exits = Exits()
    call = _app([])
    wrapped = wrap(call, exits)
    wrapped.close()
    del wrapped
    gc.collect()
    call.close()
    assert exits == []


def test_an_ended_call_cannot_be_resumed_and_does_not_exit_again(wrap: Wrap) -> None:
    exits = Exits()
    wrapped = wrap(_app([], suspensions=0), exits)
    with pytest.raises(StopIteration):
        wrapped.send(None)
    with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
        wrapped.send(None)
    with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
        wrapped.throw(KeyError("late"))
    wrapped.close()
    assert exits == [None]


def test_an_on_exit_that_raises_replaces_the_error_chained_to_it(wrap: Wrap) -> None:
    failure = KeyError("route")

    def broken(exc: BaseException | None) -> None:
        raise RuntimeError("on_exit")

    _, ended = _drive(_outer(wrap(_app([], fail=failure, suspensions=0), broken)), [None])
    assert ended is not None and ended[0] == "raised"
    assert isinstance(ended[1], RuntimeError)
    assert ended[1].__context__ is failure
    _, ended = _drive(_outer(wrap(_app([], suspensions=0), broken)), [None])
    assert ended is not None and isinstance(ended[1], RuntimeError)


def test_the_c_wrapper_takes_only_coroutines() -> None:
    async def call() -> None:
        return None

    coroutine = call()
    with pytest.raises(TypeError):
        _c_await(coroutine.__await__(), Exits())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        asgi._ASGI.traced_await(coroutine)  # type: ignore[union-attr, call-arg]
    coroutine.close()


def test_in_asyncio_sleeps_pass_through_and_a_cancelled_task_exits_cancelled(wrap: Wrap) -> None:
    exits = Exits()
    started = asyncio.Event()

    async def app(result: str) -> str:
        started.set()
        for _ in range(3):
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        return result

    async def main() -> None:
        assert await wrap(app("ok"), exits) == "ok"
        started.clear()
        task = asyncio.ensure_future(_outer(wrap(app("never"), exits)))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert exits[0] is None
    assert len(exits) == 2 and isinstance(exits[1], asyncio.CancelledError)


# --- traced_send ----------------------------------------------------------------------------------
class _Message(Mapping[str, object]):
    """A message that is not a dict: read through its ``get``, as the twin does."""

    def __init__(self, fields: dict[str, object]) -> None:
        self._fields = fields

    def __getitem__(self, key: str) -> object:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


_ABSENT = object()
_fields = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(
            ["http.response.start", "http.response.body", "http.disconnect", None, 3]
        ),
        "body": st.sampled_from([b"", b"data: {}\n\n", None, bytearray(b"x")]),
        "more_body": st.sampled_from([True, False, None, 0, 1]),
        "status": st.sampled_from([200, 500, "200", True, None]),
    },
)
_messages = st.lists(st.tuples(_fields, st.booleans()), max_size=8)


def _span() -> HttpServerSpan:
    return HttpServerSpan(b"t" * 16, b"s" * 8, b"", "POST", "/v1/completions", 1)


def _sends(
    make: Callable[..., Any], messages: list[tuple[dict[str, object], bool]]
) -> tuple[HttpServerSpan, list[object], list[object]]:
    span = _span()
    ticks = itertools.count(100)
    sent: list[object] = []

    def server_send(message: object) -> object:
        sent.append(message)
        return ("awaitable of", len(sent))

    traced = make(server_send, span, lambda: next(ticks))
    returned = [traced(_Message(fields) if mapping else fields) for fields, mapping in messages]
    assert [getattr(m, "_fields", m) for m in sent] == [fields for fields, _ in messages]
    return span, returned, sent


@settings(max_examples=300, deadline=None)
@given(_messages)
def test_the_c_send_stamps_the_span_as_its_twin_does(
    messages: list[tuple[dict[str, object], bool]],
) -> None:
    assert asgi._ASGI is not None
    c_span, c_returned, _ = _sends(asgi._ASGI.traced_send, messages)
    py_span, py_returned, _ = _sends(asgi._traced_send, messages)
    assert c_span == py_span
    assert c_returned == py_returned


@pytest.mark.parametrize("variant", ["C", "Python"])
def test_a_stream_stamps_status_first_body_and_end(variant: str) -> None:
    assert asgi._ASGI is not None
    make = asgi._ASGI.traced_send if variant == "C" else asgi._traced_send
    stream = [
        ({"type": "http.response.start", "status": 200, "headers": []}, False),
        ({"type": "http.response.body", "body": b"", "more_body": True}, False),
        ({"type": "http.response.body", "body": b"data: 1", "more_body": True}, False),
        ({"type": "http.response.body", "body": b"data: 2", "more_body": True}, True),
        ({"type": "http.response.body", "body": b""}, False),
    ]
    span, returned, _ = _sends(make, stream)
    # Ticks: the first non-empty body is the third message (100), the last one ends it (101).
    assert (span.status_code, span.first_body_ns, span.end_ns) == (200, 100, 101)
    assert returned == [("awaitable of", n) for n in range(1, 6)]


@pytest.mark.parametrize("variant", ["C", "Python"])
def test_a_send_that_raises_and_a_message_that_is_no_mapping_raise_to_the_app(
    variant: str,
) -> None:
    assert asgi._ASGI is not None
    make = asgi._ASGI.traced_send if variant == "C" else asgi._traced_send

    def server_send(message: object) -> None:
        raise OSError("connection lost")

    traced = make(server_send, _span(), lambda: 1)
    with pytest.raises(OSError, match="connection lost"):
        traced({"type": "http.response.body", "body": b"x"})
    with pytest.raises(AttributeError):
        traced(["not", "a", "mapping"])
