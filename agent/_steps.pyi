# The C functions of _steps.c (see frameworks/vllm_engine.py, which holds their Python twins).
from collections.abc import Callable, Sequence

def ids_where_set(items: Sequence[object], flag: str, name: str, /) -> list[object] | None: ...
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
