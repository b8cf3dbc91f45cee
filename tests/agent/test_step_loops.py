"""The engine-step tracer's per-request loops in C (agent/_steps.c) against their Python twins
in vllm_engine: the same appends, the same answers, and the same errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokentrace.agent.frameworks import vllm_engine
from tokentrace.agent.frameworks.vllm_engine import append_index_python, ids_where_set_python

_steps = pytest.importorskip("tokentrace.agent._steps") if vllm_engine.BUILT else None
pytestmark = pytest.mark.skipif(_steps is None, reason="the C loops are not built here")


@dataclass(slots=True)
class _Tracked:
    decode_steps: list[int] = field(default_factory=list)


@dataclass
class _Output:
    request_id: str
    finish_reason: str | None


_IDS = st.text(alphabet="abcdef", min_size=1, max_size=3)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[dict[str, int], set[str], dict[str, str | None]]:
    """A step's scheduled requests, the prefill ones among them (and strangers), and what the
    tracer holds: "t" tracked, None untracked, absent unseen."""
    scheduled = draw(st.dictionaries(_IDS, st.integers(0, 512), max_size=12))
    skip = draw(
        st.sets(st.sampled_from(sorted(scheduled)) | _IDS, max_size=6)
        if scheduled
        else st.sets(_IDS, max_size=2)
    )
    held = draw(
        st.dictionaries(
            st.sampled_from(sorted(scheduled)) | _IDS, st.sampled_from(["t", None]), max_size=12
        )
        if scheduled
        else st.just({})
    )
    return scheduled, skip, held


def _tables(held: dict[str, str | None]) -> dict[str, Any]:
    return {key: (_Tracked([7]) if kind == "t" else None) for key, kind in held.items()}


def _lists(tracked: dict[str, Any]) -> dict[str, list[int] | None]:
    return {key: (None if entry is None else entry.decode_steps) for key, entry in tracked.items()}


@given(_batches(), st.booleans())
def test_append_index_appends_and_answers_like_its_twin(
    batch: tuple[dict[str, int], set[str], dict[str, str | None]], frozen: bool
) -> None:
    scheduled, skip, held = batch
    skipped: set[str] | frozenset[str] = frozenset(skip) if frozen else skip
    in_c, in_python = _tables(held), _tables(held)
    unseen = _steps.append_index(scheduled, skipped, in_c, "decode_steps", 41)
    assert unseen == append_index_python(scheduled, skipped, in_python, "decode_steps", 41)
    assert _lists(in_c) == _lists(in_python)
    # What the loop is for: every tracked request scheduled outside the skip set got the step.
    for request_id, entry in in_c.items():
        if entry is not None:
            got_step = request_id in scheduled and request_id not in skip
            assert entry.decode_steps == ([7, 41] if got_step else [7])
    assert set(unseen) == {key for key in scheduled if key not in skip and key not in held}


@given(
    st.lists(st.tuples(_IDS, st.sampled_from([None, "stop", "length"])), max_size=12), st.booleans()
)
def test_ids_where_set_answers_like_its_twin(
    pairs: list[tuple[str, str | None]], as_tuple: bool
) -> None:
    outputs: list[_Output] | tuple[_Output, ...] = [_Output(i, reason) for i, reason in pairs]
    if as_tuple:
        outputs = tuple(outputs)
    found = _steps.ids_where_set(outputs, "finish_reason", "request_id")
    assert found == ids_where_set_python(outputs, "finish_reason", "request_id")
    assert found == [i for i, reason in pairs if reason is not None]


class _Mapping(dict[str, int]):
    pass


@pytest.mark.parametrize(
    "arguments",
    [
        (_Mapping(a=1), set(), {}, "decode_steps", 0),  # a dict subclass: the twin walks it
        ({"a": 1}, ["a"], {}, "decode_steps", 0),  # a skip list, not a set
        ({"a": 1}, set(), _Mapping(), "decode_steps", 0),
        ({"a": 1}, set(), {}, b"decode_steps", 0),
    ],
)
def test_append_index_declines_what_it_does_not_walk(arguments: tuple[Any, ...]) -> None:
    assert _steps.append_index(*arguments) is None


def test_ids_where_set_declines_what_it_does_not_walk() -> None:
    assert _steps.ids_where_set(iter([]), "finish_reason", "request_id") is None
    assert _steps.ids_where_set([], b"finish_reason", "request_id") is None


@pytest.mark.parametrize("loop", ["C", "Python"])
def test_errors_reach_the_caller_as_they_would_from_the_twin(loop: str) -> None:
    # The hook guard catches them; the C loop must neither swallow them nor crash.
    append = _steps.append_index if loop == "C" else append_index_python
    where_set = _steps.ids_where_set if loop == "C" else ids_where_set_python
    with pytest.raises(AttributeError):
        append({"a": 1}, set(), {"a": object()}, "decode_steps", 0)
    with pytest.raises(AttributeError):
        append({"a": 1}, set(), {"a": _Tracked(decode_steps=())}, "decode_steps", 0)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        where_set([object()], "finish_reason", "request_id")
    with pytest.raises(AttributeError):
        where_set(
            [_Output("a", None), type("Odd", (), {"finish_reason": "stop"})()],
            "finish_reason",
            "request_id",
        )


def test_append_index_with_wrong_argument_count_raises() -> None:
    with pytest.raises(TypeError):
        _steps.append_index({}, set(), {})
    with pytest.raises(TypeError):
        _steps.ids_where_set([])
