"""Typed readers of OTLP span values that never raise: None (or empty) when absent or malformed.

Every span dialect ``timeline.normalize`` reads goes through these, so that an attribute of the
wrong type, a negative count, a non-finite or negative latency or a zero (unset) timestamp reads
as absent instead of breaking the pipeline. An attribute is read once into a plain Python value
(``plain_value``; in C from the span's received bytes, ``native.attribute_slots``), which the
``plain_*`` readers type. Separate from the dialects because they are about the OTLP value types
(and one wire-format shortcut for integer arrays), not about any span's meaning.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from typing import Any, Final, TypeAlias

from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tokentrace.processors import native

_STATUS_ERROR: Final = Status.STATUS_CODE_ERROR
_DEFAULT_ERROR_MESSAGE: Final = "error"
_NS_PER_SECOND: Final = 1_000_000_000


# --- plain values: attributes read once into Python values ---------------------------------------
class _OtherValue:
    """The plain value of an attribute that holds no string, bool, int, double or array."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "OTHER_VALUE"


OTHER_VALUE: Final = _OtherValue()
"""An attribute that is there but holds no value these readers take (unset, bytes, a key-value
list, or, inside an array, an array): present, so ``slot is not None`` still says so."""

PlainValue: TypeAlias = "str | bool | int | float | list[PlainValue] | _OtherValue"


def plain_value(value: AnyValue, *, top: bool = True) -> PlainValue:
    """``value`` as a Python value: its string, bool, int or float, its array's elements (each
    read the same way, an array inside it as ``OTHER_VALUE``), else ``OTHER_VALUE``. What
    ``native.attribute_slots`` reads from a span's bytes, and what the ``plain_*`` readers
    below take."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return value.int_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "double_value":
        return value.double_value
    if kind == "array_value" and top:
        return [plain_value(element, top=False) for element in value.array_value.values]
    return OTHER_VALUE


def attribute_slots(
    span: Span,
    slot_of: Mapping[str, int],
    slot_count: int,
    int_arrays: frozenset[int] = frozenset(),
) -> list[Any]:
    """The plain values of ``span``'s attributes whose keys ``slot_of`` maps to a slot (the last
    of a key winning; the slots in ``int_arrays`` read by ``int_array``), None in the others:
    ``native.attribute_slots``'s twin, over the parsed span."""
    slots: list[Any] = [None] * slot_count
    for kv in span.attributes:
        slot = slot_of.get(kv.key)
        if slot is not None:
            slots[slot] = int_array(kv.value) if slot in int_arrays else plain_value(kv.value)
    return slots


def plain_int(value: PlainValue | None) -> int | None:
    """A non-negative integer (not a bool)."""
    return value if type(value) is int and value >= 0 else None


def plain_timestamp(value: PlainValue | None) -> int | None:
    """A Unix-ns integer; 0 means unset in OTLP."""
    number = plain_int(value)
    return number if number else None


def plain_str(value: PlainValue | None) -> str | None:
    return value if type(value) is str else None


def plain_bool(value: PlainValue | None) -> bool | None:
    return value if type(value) is bool else None


def plain_float(value: PlainValue | None) -> float | None:
    """A finite non-negative number (a double, or an int for lenient writers)."""
    kind = type(value)
    if kind is not float and kind is not int:
        return None
    number = float(value)  # type: ignore[arg-type]
    return number if math.isfinite(number) and number >= 0.0 else None


def plain_seconds_ns(value: PlainValue | None) -> int | None:
    """``plain_float`` seconds in ns."""
    seconds = plain_float(value)
    return None if seconds is None else round(seconds * _NS_PER_SECOND)


def plain_first_str(value: PlainValue | None) -> str | None:
    """A string, or a string array's first element (None when that is not a string)."""
    if type(value) is str:
        return value
    if type(value) is list and value and type(value[0]) is str:
        return value[0]
    return None


def plain_str_tuple(value: PlainValue | None) -> tuple[str, ...]:
    """An array's non-empty strings, a non-empty string as one; () for anything else."""
    if type(value) is list:
        return tuple(element for element in value if type(element) is str and element)
    if type(value) is str and value:
        return (value,)
    return ()


def int_array(value: AnyValue | None) -> array[int]:
    """An integer array (``array('q')``: protobuf's ints are int64s); elements of other types
    are skipped."""
    if value is None or value.WhichOneof("value") != "array_value":
        return array("q")
    array_value = value.array_value
    elements = array_value.values
    # Reading int_value per element costs ~230 ns (a Python wrapper per AnyValue); the array's
    # wire bytes read whole (``native.int_values``) cost a fraction of that.
    count = len(elements)
    exact = native.int_values(array_value.SerializeToString(), count)
    if exact is not None:
        return exact
    numbers = [element.int_value for element in elements]
    # A non-int element reads as 0, so only zeros need their type checked. Offsets start with a
    # genuine 0, which the fast path confirms with a single check.
    zeros = numbers.count(0)
    if not zeros or (zeros == 1 and numbers[0] == 0 and elements[0].HasField("int_value")):
        return array("q", numbers)
    return array(
        "q",
        [
            number
            for number, element in zip(numbers, elements, strict=True)
            if number or element.HasField("int_value")
        ],
    )


def error_of(span: Span) -> str | None:
    status = span.status
    if status.code != _STATUS_ERROR:
        return None
    return status.message or _DEFAULT_ERROR_MESSAGE


def span_times(span: Span) -> tuple[int, int] | None:
    """(start, end) of a span, or None when unset or negative in duration."""
    start = span.start_time_unix_nano
    end = span.end_time_unix_nano
    if not start or not end or end < start:
        return None
    return start, end
