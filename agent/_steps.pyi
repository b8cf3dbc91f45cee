# The C functions of _steps.c (see frameworks/vllm_engine.py, which holds their Python twins).
from collections.abc import Sequence

def append_index(
    scheduled: dict[str, int],
    skip: set[str] | frozenset[str],
    tracked: dict[str, object],
    attribute: str,
    index: object,
    /,
) -> list[str] | None: ...
def ids_where_set(items: Sequence[object], flag: str, name: str, /) -> list[object] | None: ...
