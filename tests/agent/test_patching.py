"""The kinds of patch (agent/frameworks/patching.py): wrapt wrappers and direct ones, applied to a
real class and module and reverted."""

from __future__ import annotations

import types
from typing import Any

import pytest
import wrapt

from tokentrace.agent.frameworks.patching import (
    AppliedPatch,
    Patch,
    apply_patch,
    is_patch,
    revert_patches,
    unbound,
)


class Engine:
    def step(self, batch: list[int], *, scale: int = 1) -> int:
        return sum(batch) * scale

    @staticmethod
    def helper(value: int) -> int:
        return value + 1


class FasterEngine(Engine):
    def step(self, batch: list[int], *, scale: int = 1) -> int:
        return super().step(batch, scale=scale) + 1000


def module_function(value: int) -> int:
    return value * 2


class Instrumentor:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, tuple[Any, ...], dict[str, Any]]] = []

    def _wrap(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        self.calls.append((wrapped, instance, args, dict(kwargs)))
        return wrapped(*args, **kwargs)

    def _direct(self, original: Any) -> Any:
        """A direct patch's factory: the function put in the class, ``self`` first."""

        def step(engine: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((original, engine, args, dict(kwargs)))
            return original(engine, *args, **kwargs) + 1

        return step

    def _wrap_direct(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        """The direct patch's wrapt fallback: the same function around wrapt's bound callee."""
        return self._direct(unbound(wrapped))(instance, *args, **kwargs)


@pytest.fixture
def module() -> types.ModuleType:
    stand_in = types.ModuleType("engine_stand_in")
    stand_in.Engine = Engine  # type: ignore[attr-defined]
    stand_in.module_function = module_function  # type: ignore[attr-defined]
    return stand_in


def test_a_wrapt_patch_calls_the_wrapper_with_the_bound_method_and_reverts(
    module: types.ModuleType,
) -> None:
    original = vars(Engine)["step"]
    instrumentor = Instrumentor()
    applied: list[AppliedPatch] = []
    apply_patch(instrumentor, Patch("m", "Engine.step", "_wrap"), module, applied)
    patched = vars(Engine)["step"]
    try:
        assert is_patch(patched) and patched.__wrapped__ is original
        assert isinstance(patched, wrapt.FunctionWrapper)
        engine = Engine()
        assert engine.step([1, 2], scale=3) == 9
        assert Engine.step(engine, [4]) == 4  # called on the class, as super() and vLLM do
        assert FasterEngine().step([5]) == 1005  # a subclass's super() call reaches it
        assert [(instance, args, kwargs) for _, instance, args, kwargs in instrumentor.calls][
            :2
        ] == [(engine, ([1, 2],), {"scale": 3}), (engine, ([4],), {})]
        wrapped_first = instrumentor.calls[0][0]
        assert wrapped_first.__self__ is engine and wrapped_first.__func__ is original
        assert len(instrumentor.calls) == 3
    finally:
        revert_patches(applied)
    assert vars(Engine)["step"] is original and not is_patch(original)


def test_a_direct_patch_is_the_instrumentors_function_in_the_class_and_reverts(
    module: types.ModuleType,
) -> None:
    original = vars(Engine)["step"]
    instrumentor = Instrumentor()
    applied: list[AppliedPatch] = []
    patch = Patch("m", "Engine.step", "_wrap_direct", direct="_direct")
    apply_patch(instrumentor, patch, module, applied)
    patched = vars(Engine)["step"]
    try:
        assert is_patch(patched) and patched.__wrapped__ is original
        assert not isinstance(patched, wrapt.FunctionWrapper)
        assert patched.__name__ == "step" and patched.__qualname__ == original.__qualname__
        engine = Engine()
        assert engine.step([1, 2], scale=3) == 10
        assert Engine.step(engine, [4]) == 5  # called on the class, as super() and vLLM do
        assert FasterEngine().step([5]) == 1006  # a subclass's super() call reaches it
        assert [call[:3] for call in instrumentor.calls[:2]] == [
            (original, engine, ([1, 2],)),
            (original, engine, ([4],)),
        ]
        assert instrumentor.calls[0][3] == {"scale": 3}
    finally:
        revert_patches(applied)
    assert vars(Engine)["step"] is original and not is_patch(original)


@pytest.mark.parametrize(
    ("qualname", "call", "expected"),
    [
        ("Engine.helper", lambda module: Engine.helper(1), 2 + 1),
        ("module_function", lambda module: module.module_function(4), 8 + 1),
    ],
)
def test_a_direct_patch_of_what_is_not_a_method_defined_in_a_class_is_its_wrapt_fallback(
    module: types.ModuleType, qualname: str, call: Any, expected: int
) -> None:
    owner: Any = Engine if "." in qualname else module
    attribute = qualname.rpartition(".")[2]
    original = vars(owner)[attribute]
    applied: list[AppliedPatch] = []
    instrumentor = Instrumentor()
    patch = Patch("m", qualname, "_wrap_direct", direct="_direct")
    apply_patch(instrumentor, patch, module, applied)
    try:
        assert isinstance(vars(owner)[attribute], wrapt.FunctionWrapper)
        assert call(module) == expected  # the factory's function, around wrapt's callee
        assert len(instrumentor.calls) == 1
    finally:
        revert_patches(applied)
    assert vars(owner)[attribute] is original
