"""The collector's per-token work: token-offset arrays from their wire bytes, inter-token gaps.

Token offsets and inter-token gaps are ``array('q')``: a request's ~160 of each in one buffer,
not a Python int per token (making and freeing those ints was a large part of
``Pipeline.process_trace``).

Each function here runs in C (``_native.c``, built with the package where a C compiler is at
hand) and has a pure-Python twin that gives the same answers; the C function answers ``None``
where its fast path does not apply and the twin answers instead. ``TOKENTRACE_PURE_PYTHON=1``
skips the C functions (to compare, or to rule them out). ``BUILT`` says which ones run.
"""

from __future__ import annotations

import operator
from array import array
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from itertools import compress, islice
from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from tokentrace.agent import compiled
from tokentrace.agent.finished_request import MIN_GAPS_FOR_OUTLIERS, median_of_sorted

_NS_PER_US: Final = 1_000
_INT64_MAX: Final = 2**63 - 1
_INT_VALUE_TAG: Final = 0x18
"""``AnyValue.int_value``'s wire tag (field 3, varint)."""


@cache  # built on first use: with the C functions built it never is
def _packed_int64_message() -> type[Message]:
    """A message type whose field 1 is a packed ``repeated int64`` (see ``int_values_python``)."""
    field_type = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="tokentrace/processors/packed_int64.proto",
        package="tokentrace.processors.internal",
        syntax="proto3",
    )
    message = file.message_type.add(name="PackedInt64")
    message.field.add(
        name="words", number=1, type=field_type.TYPE_INT64, label=field_type.LABEL_REPEATED
    )
    pool = descriptor_pool.DescriptorPool()  # private: nothing else can clash with the name
    pool.AddSerializedFile(file.SerializeToString())
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("tokentrace.processors.internal.PackedInt64")
    )


def int_values_python(serialized_array: bytes, count: int) -> array[int] | None:
    """The ``int_value`` of every element of a serialised ``ArrayValue`` of ``count`` elements
    when every element is exactly an int (``None`` otherwise: the caller reads element by
    element).

    An int element serialises as field 1 holding ``0x18 <varint>``, so parsed as a packed int64
    field 1 the array reads [0x18, v0, 0x18, v1, ...] in C. Exact: the first number of every
    element's bytes is its first field's tag, 0x18 only for int_value, which (a oneof) has no
    other known field beside it; any element that is not exactly an int (another type, unset,
    unknown fields) therefore puts a tag other than 0x18 at an even position or changes the
    number of words from ``2 * count``."""
    try:
        parsed: Any = _packed_int64_message().FromString(serialized_array)
    except DecodeError:
        return None
    words: Sequence[int] = parsed.words
    if len(words) != 2 * count or list(words[::2]).count(_INT_VALUE_TAG) != count:
        return None
    return array("q", words[1::2])


def gaps_ns_python(offsets_us: Sequence[int]) -> array[int]:
    """Gaps between consecutive offsets (µs), in ns, in order; negative gaps and gaps past 64
    bits in ns (malformed offsets, both) left out."""
    # Per token, in C builtins (map, min, max).
    gaps = list(map(_NS_PER_US.__mul__, map(operator.sub, islice(offsets_us, 1, None), offsets_us)))
    if gaps and (min(gaps) < 0 or max(gaps) > _INT64_MAX):
        gaps = [gap for gap in gaps if 0 <= gap <= _INT64_MAX]
    return array("q", gaps)


def gap_median_python(gaps_ns: Sequence[int]) -> tuple[float | None, int]:
    """``finished_request.median_of_sorted`` of the non-negative gaps, and the largest of them
    (-1 when none)."""
    ordered = sorted(gaps_ns)
    if ordered and ordered[0] < 0:  # malformed offsets: negative gaps are no gaps
        ordered = ordered[bisect_left(ordered, 0) :]
    return median_of_sorted(ordered), ordered[-1] if ordered else -1


_NATIVE: Final[Any] = compiled.load("tokentrace.processors._native")
BUILT: Final = _NATIVE is not None
"""Whether the C functions run (built, and not turned off by ``TOKENTRACE_PURE_PYTHON``)."""

int_values: Callable[[bytes, int], array[int] | None] = (
    _NATIVE.int_values if _NATIVE is not None else int_values_python
)
"""``int_values_python``'s answer (in C when built)."""


def gaps_ns(offsets_us: Sequence[int]) -> array[int]:
    """``gaps_ns_python``'s answer (in C when built and the offsets fit 64 bits)."""
    if _NATIVE is not None:
        gaps: array[int] | None = _NATIVE.gaps_ns(offsets_us)
        if gaps is not None:
            return gaps
    return gaps_ns_python(offsets_us)


def gap_median(gaps_ns: Sequence[int]) -> tuple[float | None, int]:
    """``gap_median_python``'s answer (in C, without sorting, when built and the gaps fit)."""
    if _NATIVE is not None:
        answer: tuple[float | None, int] | None = _NATIVE.gap_median(gaps_ns, MIN_GAPS_FOR_OUTLIERS)
        if answer is not None:
            return answer
    return gap_median_python(gaps_ns)


def outlier_positions_python(gaps_ns: Sequence[int], threshold_ns: int) -> list[int]:
    """The 1-based positions of the gaps longer than ``threshold_ns``, in order."""
    return list(compress(range(1, len(gaps_ns) + 1), map(threshold_ns.__lt__, gaps_ns)))


def outlier_positions(gaps_ns: Sequence[int], threshold_ns: int) -> list[int]:
    """``outlier_positions_python``'s answer (in C when built and the values fit 64 bits)."""
    if _NATIVE is not None:
        positions: list[int] | None = _NATIVE.outlier_positions(gaps_ns, threshold_ns)
        if positions is not None:
            return positions
    return outlier_positions_python(gaps_ns, threshold_ns)


def outlier_gap_parts(
    gaps_ns: Sequence[int],
    offsets_us: Sequence[int],
    first_token: int,
    median_rounded: int,
    threshold_floor: int,
    steps: Sequence[tuple[int, int, int]],
    preempted: Sequence[tuple[int, int]],
    with_prefill: int,
) -> list[tuple[int, int, int, int, int]] | None:
    """``decode_split.gap_parts``' outlier gaps past its median, in C: (gap, decode,
    interference, stall, preempted) ns per gap above ``threshold_floor``, in token order; None
    when not built or where the twin must answer (arithmetic past 64 bits, a step coverage past
    2**53, a negative ``with_prefill``, other types)."""
    if _NATIVE is None:
        return None
    parts: list[tuple[int, int, int, int, int]] | None = _NATIVE.outlier_gap_parts(
        gaps_ns,
        offsets_us,
        first_token,
        median_rounded,
        threshold_floor,
        steps,
        preempted,
        with_prefill,
    )
    return parts


def count_keys_ns(
    durations_ns: Sequence[int], multiplier: float
) -> tuple[list[int], list[int], int, int, int] | None:
    """The distinct sketch keys (ascending) of positive durations in ns taken as seconds,
    ``ceil(log2(ns / 1e9) * multiplier)`` each, how many durations have each key, and the
    durations' ``min``, ``max`` and ``sum``: in one pass in C, or ``None`` when not built, when
    there is no duration or one is not an int in (0, 2**53), or when the sum passes 64 bits (the
    caller, ``KeyedValues.of_ns``, keys them in Python then)."""
    if _NATIVE is None:
        return None
    counted: tuple[list[int], list[int], int, int, int] | None = _NATIVE.count_keys_ns(
        durations_ns, multiplier
    )
    return counted


def attribute_slots(
    entry: bytes,
    slot_of: Mapping[str, int],
    slot_count: int,
    other: object,
    int_arrays: frozenset[int] = frozenset(),
) -> list[Any] | None:
    """``span_attributes.attribute_slots`` of the span whose ``ScopeSpans.spans`` entry (as
    received: ``SpanRef.wire``) is ``entry``, read from its bytes in C (``other``: the
    ``OTHER_VALUE`` marker); None when not built, or for bytes the walk leaves to the parsed
    span (malformed, a field the parser would merge, a string that is not UTF-8)."""
    if _NATIVE is None or type(slot_of) is not dict:
        return None
    slots: list[Any] | None = _NATIVE.attribute_slots(entry, slot_of, slot_count, other, int_arrays)
    return slots


def has_attribute_key(entry: bytes, keys: frozenset[str], prefixes: tuple[str, ...]) -> bool | None:
    """Whether an attribute of the span whose ``ScopeSpans.spans`` entry is ``entry`` has a key
    in ``keys`` or starting with one of ``prefixes``, read from its bytes in C; None when not
    built or where ``attribute_slots`` would be (the caller asks the parsed span then)."""
    if _NATIVE is None:
        return None
    found: bool | None = _NATIVE.has_attribute_key(entry, keys, prefixes)
    return found
