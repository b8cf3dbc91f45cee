"""Both kinds of patch (agent/frameworks/patching.py): wrapt wrappers and plain patches, applied to
a real class and module and reverted."""

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


@pytest.fixture
def module() -> types.ModuleType:
    stand_in = types.ModuleType("engine_stand_in")
    stand_in.Engine = Engine  # type: ignore[attr-defined]
    stand_in.module_function = module_function  # type: ignore[attr-defined]
    return stand_in


@pytest.mark.parametrize("plain", [True, False])
def test_a_patched_method_calls_the_wrapper_as_wrapt_does_and_reverts(
    module: types.ModuleType, plain: bool
) -> None:
    original = vars(Engine)["step"]
    instrumentor = Instrumentor()
    applied: list[AppliedPatch] = []
    apply_patch(instrumentor, Patch("m", "Engine.step", "_wrap", plain=plain), module, applied)
    patched = vars(Engine)["step"]
    try:
        assert is_patch(patched) and patched.__wrapped__ is original
        assert isinstance(patched, wrapt.FunctionWrapper) is not plain
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


@pytest.mark.parametrize("qualname", ["Engine.helper", "module_function"])
def test_a_plain_patch_of_what_is_not_a_method_defined_in_a_class_is_a_wrapt_wrapper(
    module: types.ModuleType, qualname: str
) -> None:
    owner: Any = Engine if "." in qualname else module
    attribute = qualname.rpartition(".")[2]
    original = vars(owner)[attribute]
    applied: list[AppliedPatch] = []
    apply_patch(Instrumentor(), Patch("m", qualname, "_wrap", plain=True), module, applied)
    try:
        assert isinstance(vars(owner)[attribute], wrapt.FunctionWrapper)
        assert module.module_function(4) == 8
        assert Engine.helper(1) == 2
    finally:
        revert_patches(applied)
    assert vars(owner)[attribute] is original
