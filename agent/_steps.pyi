# The C functions of _steps.c (see frameworks/vllm_engine.py, which holds their Python twins, and
# frameworks/vllm_requests.py for outputs_hook's).
from collections.abc import Callable

def step_facts(
    step_type: type,
    requests: dict[str, object],
    scheduler: object,
    output: object,
    outputs_by_client: object,
    index: int,
    start_ns: int,
    clock: Callable[[], int],
    /,
) -> tuple[object, ...] | None: ...
def track_request(
    parts: tuple[str, object, Callable[..., object], Callable[[object], object]],
    request: object,
    /,
) -> object: ...
def step_hook(
    updates: bool,
    original: Callable[..., object],
    tracer: object,
    step_type: type,
    gate: object,
    guard: object,
    name: str,
    other: str,
    native_clock: bool,
    max_open_steps: int,
    sweep_every_steps: int,
    /,
) -> Callable[..., object]: ...
def outputs_hook(
    original: Callable[..., object],
    twin: Callable[..., object],
    hooks: object,
    recorder: object,
    guard: object,
    name: str,
    request_hooks: tuple[str, ...],
    apply_events: Callable[[object, object], object],
    /,
) -> Callable[..., object]: ...
def token_step_ends(
    ring: list[object], first: int, last: int, request_id: str, prefill_step: int | None, /
) -> list[tuple[int, int]] | None: ...
def outlier_gap_ends(
    token_step_ends: list[tuple[int, int]], ratio: float, min_gaps: int, /
) -> list[int] | None: ...
