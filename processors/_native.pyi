# The C functions of _native.c (see native.py for what they answer).
from array import array

def int_values(serialized_array: bytes, count: int, /) -> array[int] | None: ...
def gaps_ns(offsets_us: object, /) -> array[int] | None: ...
def gap_median(gaps_ns: object, min_gaps: int, /) -> tuple[float | None, int] | None: ...
def count_keys_ns(
    durations_ns: object, multiplier: float, /
) -> tuple[list[int], list[int], int, int, int] | None: ...
def outlier_positions(gaps_ns: object, threshold_ns: int, /) -> list[int] | None: ...
def attribute_slots(
    entry: bytes,
    slot_of: dict[str, int],
    slot_count: int,
    other: object,
    int_arrays: frozenset[int] = ...,
    /,
) -> list[object] | None: ...
def has_attribute_key(
    entry: bytes, keys: frozenset[str], prefixes: tuple[str, ...], /
) -> bool | None: ...
def outlier_gap_parts(
    gaps_ns: object,
    offsets_us: object,
    first_token: int,
    median_rounded: int,
    threshold_floor: int,
    steps: object,
    preempted: object,
    with_prefill: int,
    /,
) -> list[tuple[int, int, int, int, int]] | None: ...
