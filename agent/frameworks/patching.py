"""What every engine instrumentation shares: its patch table's entries, applying and reverting
them, the check of the installed engine's version against the versions it was verified on, and
the instrumentor base class built on them (``EngineInstrumentor``).

Patches are ``wrapt`` wrappers set on the owning class or module when the module is imported (a
post-import hook), so importing an instrumentation never imports its engine, and each one is
reverted by putting the original back (only where it is still our wrapper). A method the engine
calls on every step may instead be replaced by a function the instrumentor builds for it
(``Patch.direct``), which calls the original and runs the hook itself: no wrapper call between.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from types import FunctionType, ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Final

import wrapt
from opentelemetry.instrumentation.dependencies import (
    DependencyConflict,
    DependencyConflictError,
)
from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
    BaseInstrumentor,  # the module opts out of type checking
)
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from tokentrace.agent.frameworks.asgi import HOOK_HTTP_SERVER, HttpServerTracer
from tokentrace.agent.frameworks.vllm_cold_start import (
    HOOK_COLD_START_ENGINE,
    HOOK_COLD_START_IMPORT,
    ColdStartTracer,
    process_cold_start_tracer,
)
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.spans import AttrValue

if TYPE_CHECKING:
    from tokentrace.agent.frameworks.vllm_engine import EngineStepTracer
    from tokentrace.agent.recorder import Recorder
    from tokentrace.agent.runtime import AgentRuntime

__all__ = [
    "USES_COLD_START",
    "USES_HTTP_TRACER",
    "USES_RECORDER",
    "USES_STEP_TRACER",
    "AppliedPatch",
    "EngineInstrumentor",
    "Patch",
    "apply_patch",
    "installed_distribution",
    "is_patch",
    "revert_patches",
    "unbound",
    "version_supported",
]

_log = logging.getLogger(__name__)

AppliedPatch = tuple[Any, str, Any, Any]
"""(owner, attribute, original, wrapper) of one applied patch."""

# What a patch's wrapper records into (``Patch.uses``): it is applied only when the instrumentor
# has it (the attribute of that name is not None).
USES_RECORDER: Final = "recorder"
USES_STEP_TRACER: Final = "step_tracer"
USES_COLD_START: Final = "cold_start_tracer"
USES_HTTP_TRACER: Final = "http_tracer"


@dataclass(frozen=True, slots=True)
class Patch:
    """One reversible patch: ``module``'s ``qualname`` is wrapped by the instrumentor's method
    ``wrapper`` (a ``wrapt`` wrapper: ``(wrapped, instance, args, kwargs)``), in the processes
    that play ``role``, when the instrumentor has what the wrapper ``uses``."""

    module: str
    qualname: str
    wrapper: str
    role: str = "frontend"
    uses: str = USES_RECORDER
    direct: str | None = None
    """The instrumentor's method that, given the original (a function defined in a class),
    returns the function to put in its place, called as the original is (``self`` first): no
    wrapper between the engine's call and the hook, for the methods called on every engine
    step (one call through wrapt's ``FunctionWrapper`` costs ~6,000 instructions more than the
    original's: ``python bench/engine_step_instructions.py --calls``). Where the original is
    something else, ``wrapper`` patches it with wrapt (``unbound`` makes the same function its
    body)."""


FASTAPI_HTTP_SERVER_PATCH: Final = Patch(
    "fastapi.applications",
    "FastAPI.build_middleware_stack",
    "_wrap_middleware_stack",
    uses=USES_HTTP_TRACER,
)
"""The HTTP server span (``asgi.py``) on an engine's FastAPI app: every engine's table has it."""


def installed_distribution(distributions: Iterable[str]) -> tuple[str, str] | None:
    """(distribution name, version) of the first of ``distributions`` installed, without
    importing it."""
    for distribution in distributions:
        try:
            return distribution, distribution_version(distribution)
        except PackageNotFoundError:
            continue
    return None


def version_supported(specifier: str, found_version: str) -> bool:
    try:
        return SpecifierSet(specifier).contains(Version(found_version), prereleases=True)
    except InvalidVersion:
        return False


def apply_patch(
    instrumentor: object, patch: Patch, module: ModuleType, applied: list[AppliedPatch]
) -> None:
    """Wrap ``patch``'s target in ``module`` (a post-import hook: never raises into the
    engine's import; a target that is not there is logged and left alone)."""
    try:
        owner: Any = module
        owner_path, _, attribute = patch.qualname.rpartition(".")
        for name in owner_path.split(".") if owner_path else ():
            owner = getattr(owner, name)
        original = vars(owner)[attribute]
        # type(), not isinstance(): a wrapt proxy (another tool's patch) passes for a function.
        in_class = isinstance(owner, type) and type(original) is FunctionType
        if patch.direct is not None and in_class:
            wrapper: Any = _marked(getattr(instrumentor, patch.direct)(original), original)
        else:
            wrapper = wrapt.FunctionWrapper(original, getattr(instrumentor, patch.wrapper))
        setattr(owner, attribute, wrapper)
        applied.append((owner, attribute, original, wrapper))
    except Exception:
        _log.warning(
            "tokentrace: cannot patch %s.%s; requests are traced without it",
            patch.module,
            patch.qualname,
            exc_info=True,
        )


_PATCH_MARK: Final = "__tokentrace_patch__"


def _marked(patched: Callable[..., Any], original: FunctionType) -> Callable[..., Any]:
    """``patched`` named as ``original``, ``__wrapped__`` the original (as with wrapt), marked
    as ours (``is_patch``)."""
    functools.update_wrapper(patched, original)
    setattr(patched, _PATCH_MARK, True)
    return patched


def unbound(bound: Callable[..., Any]) -> Callable[..., Any]:
    """``bound`` (wrapt's bound ``wrapped``) called as the function in the class is, ``self``
    first: a ``Patch.direct`` factory's patch as the wrapt fallback's body."""
    return lambda _self, *args, **kwargs: bound(*args, **kwargs)


def is_patch(value: object) -> bool:
    """Whether ``value`` is a patch of ours (any kind), not the original."""
    return isinstance(value, wrapt.FunctionWrapper) or getattr(value, _PATCH_MARK, False)


def revert_patches(applied: list[AppliedPatch]) -> None:
    """Put every original back, latest first, where our wrapper is still in place."""
    for owner, attribute, original, wrapper in reversed(applied):
        if vars(owner).get(attribute) is wrapper:
            setattr(owner, attribute, original)
    applied.clear()


class EngineInstrumentor(BaseInstrumentor):
    """What the engine instrumentors (vLLM, SGLang, transformers, llama-cpp-python) share: the
    version check (a version the patch table was not verified against is refused with one
    warning, whatever the caller asks), the patch table applied on import and reverted, the
    HTTP server span on the engine's ASGI app, the cold start's engine build and phases, and
    the tracers taken from the process's agent runtime.

    A subclass names its ``engine``, ``distributions``, ``supported_versions`` and ``patches``,
    returns the installed distribution from ``installed()`` and sets, in ``_instrument``, the
    state the wrappers use (``_recorder``, ``_guard``, ``_cold_start_tracer``, ``_http_tracer``)
    before ``_register_patches``. Its request hooks define ``_requests_disabled``.
    """

    engine: ClassVar[str]
    distributions: ClassVar[tuple[str, ...]]
    supported_versions: ClassVar[str]
    patches: ClassVar[tuple[Patch, ...]]
    _unsupported_warned: ClassVar[bool] = False

    _active = False
    _generation = 0
    _recorder: Recorder
    _guard: HookGuard
    _step_tracer: EngineStepTracer | None
    _cold_start_tracer: ColdStartTracer | None
    _http_tracer: HttpServerTracer | None
    _applied: list[AppliedPatch]

    def installed(self) -> tuple[str, str] | None:
        """(distribution name, version) of the installed engine, without importing it."""
        return installed_distribution(self.distributions)

    def _requests_disabled(self) -> bool:
        raise NotImplementedError

    def instrumentation_dependencies(self) -> Collection[str]:
        return (self._requirement(),)

    def _requirement(self) -> str:
        return f"{self.distributions[0]} {self.supported_versions}"

    def _check_dependency_conflicts(self) -> DependencyConflict | None:
        installed = self.installed()
        if installed is None:
            return DependencyConflict(self._requirement())
        distribution, found_version = installed
        if version_supported(self.supported_versions, found_version):
            return None
        cls = type(self)
        if not cls._unsupported_warned:
            cls._unsupported_warned = True
            _log.warning(
                "tokentrace: %s %s is not a supported %s version (supported: %s %s); %s runs "
                "untraced by tokentrace",
                distribution,
                found_version,
                self.engine,
                self.distributions[0],
                self.supported_versions,
                self.engine,
            )
        return DependencyConflict(
            f"{distribution} {self.supported_versions}", f"{distribution} {found_version}"
        )

    def instrument(self, **kwargs: Any) -> Any:
        # The base class logs a dependency conflict as an error on top of our one warning;
        # raising and catching keeps it to that warning unless the caller asked to raise.
        raise_on_conflict = bool(kwargs.pop("raise_exception_on_conflict", False))
        # `opentelemetry-instrument` asks to skip the check; patching an unsupported engine is
        # the one thing an instrumentor must never do, so the check always runs.
        kwargs.pop("skip_dep_check", None)
        try:
            return super().instrument(raise_exception_on_conflict=True, **kwargs)
        except DependencyConflictError:
            if raise_on_conflict:
                raise
            return None

    # --- the patch table ------------------------------------------------------------------------
    def _register_patches(self, roles: Collection[str] | None = None) -> None:
        """Activate, and register a post-import hook for each patch whose wrapper has what it
        ``uses`` and, with ``roles``, that is for one of the roles this process plays."""
        self._applied = []
        self._generation += 1
        self._active = True
        available = {
            uses
            for uses in (USES_RECORDER, USES_STEP_TRACER, USES_COLD_START, USES_HTTP_TRACER)
            if getattr(self, f"_{uses}", None) is not None
        }
        for patch in self.patches:
            if patch.uses in available and (roles is None or patch.role in roles):
                wrapt.register_post_import_hook(
                    partial(self._apply, patch, self._generation), patch.module
                )

    def _uninstrument(self, **kwargs: Any) -> None:
        self._active = False
        self._generation += 1  # patches whose module is not imported yet are never applied
        revert_patches(self._applied)

    def _apply(self, patch: Patch, generation: int, module: ModuleType) -> None:
        if generation == self._generation and self._active:
            apply_patch(self, patch, module, self._applied)

    # --- where the hooks' tracers come from ----------------------------------------------------
    def _instrument(self, **kwargs: Any) -> None:
        """The caller's tracers (tests: ``recorder=`` and ``guard=``, optionally
        ``step_tracer=``, ``cold_start_tracer=``, ``http_tracer=``), else this process's agent
        runtime's (``_tracers_from_runtime``; nothing happens when the agent is disabled); then
        the per-process state (``_reset_state``) and the patch table."""
        recorder: Recorder | None = kwargs.get("recorder")
        guard: HookGuard | None = kwargs.get("guard")
        self._step_tracer = self._cold_start_tracer = self._http_tracer = None
        if recorder is not None and guard is not None:
            self._recorder, self._guard = recorder, guard
            self._step_tracer = kwargs.get(USES_STEP_TRACER)
            self._cold_start_tracer = kwargs.get(USES_COLD_START)
            self._http_tracer = kwargs.get(USES_HTTP_TRACER)
        else:
            from tokentrace.agent.runtime import get_runtime

            runtime = get_runtime()
            if runtime is None:
                return
            self._recorder, self._guard = runtime.recorder, runtime.guard
            self._tracers_from_runtime(runtime)
        self._reset_state()
        self._register_patches()

    def _tracers_from_runtime(self, runtime: AgentRuntime) -> None:
        """Set the tracers this engine's hooks use besides the recorder (``_step_tracer``,
        ``_http_tracer``, ``_cold_start_tracer``) from ``runtime``; none by default."""

    def _reset_state(self) -> None:
        """The instrumentation's own per-process state, fresh at each ``instrument()``."""

    # --- the process's agent runtime --------------------------------------------------------------
    @staticmethod
    def _runtime_http_tracer(runtime: AgentRuntime) -> HttpServerTracer:
        """The HTTP server span tracer of this process, exporting through its runtime."""
        tracer = HttpServerTracer(
            runtime.emitter.submit,
            guard=runtime.guard,
            to_unix=runtime.clock,
            receive_wait=runtime.config.http_receive_wait,
        )
        runtime.add_stats_source(tracer.stats)
        return tracer

    @staticmethod
    def _runtime_cold_start(
        runtime: AgentRuntime, *, frontend: bool, inherit: bool
    ) -> ColdStartTracer | None:
        """This process's part of the cold start (``process_cold_start_tracer``): a new one in
        the process the user started (``inherit=False``), joined by the engine's children."""
        cold_start: ColdStartTracer | None = runtime.guard.run(
            HOOK_COLD_START_IMPORT,
            partial(
                process_cold_start_tracer, frontend=frontend, inherit=inherit, to_unix=runtime.clock
            ),
            runtime.emitter.submit,
        )
        if cold_start is not None:
            runtime.add_stats_source(cold_start.stats)
        return cold_start

    # --- the HTTP server span ---------------------------------------------------------------------
    def _wrap_middleware_stack(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        stack = wrapped(*args, **kwargs)
        tracer = self._http_tracer
        if not self._active or tracer is None:
            return stack
        # Checked per request: the built stack outlives ``uninstrument``.
        traced = self._guard.run(
            HOOK_HTTP_SERVER, partial(tracer.middleware, enabled=self._http_enabled), stack
        )  # (returns ``stack`` itself when it is traced already: a subclass calling its base)
        return stack if traced is None else traced

    def _http_enabled(self) -> bool:
        return self._active and not self._requests_disabled()

    # --- the cold start ---------------------------------------------------------------------
    def _build_engine(self, wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
        """``wrapped`` builds the engine: the cold start ends when the process's first engine
        is ready (or failed)."""
        cold_start = self._cold_start_tracer if self._active else None
        if cold_start is not None and not self._guard.run(
            HOOK_COLD_START_ENGINE, cold_start.engine_init_started
        ):
            cold_start = None
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            if cold_start is not None:
                self._guard.run(HOOK_COLD_START_ENGINE, cold_start.engine_ready, type(exc).__name__)
            raise
        if cold_start is not None:
            self._guard.run(HOOK_COLD_START_ENGINE, cold_start.engine_ready)
        return result

    def _cold_start_phase(
        self,
        hook: str,
        name: str,
        wrapped: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Any,
        *,
        attributes: Callable[[], Mapping[str, AttrValue]] | None = None,
    ) -> Any:
        """One phase of the cold start around ``wrapped``; ``attributes``: read once the phase
        returned, for its span (inside the guard)."""
        cold_start = self._cold_start_tracer
        if not self._active or cold_start is None or hook in self._guard.disabled:
            return wrapped(*args, **kwargs)
        if self._guard.run(hook, cold_start.phase_started, name) is None:
            return wrapped(*args, **kwargs)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            self._guard.run(hook, cold_start.phase_ended, name, type(exc).__name__)
            raise
        # Its own hook name: a failure here must not cost the phase's span.
        known = None if attributes is None else self._guard.run(f"{hook}.attributes", attributes)
        self._guard.run(hook, cold_start.phase_ended, name, None, known)
        return result
