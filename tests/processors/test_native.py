"""The per-token work and the attribute reading in C (processors/_native.c) against their
pure-Python twins.

Each C function must give its twin's answer or ``None`` (the twin then answers), on generated
input including what a malformed span can carry; and the whole pipeline must produce the same
bytes, records and percentiles with the C functions as without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import compiled
from tokentrace.agent.span_encoding import length_delimited
from tokentrace.processors import native, span_attributes
from tokentrace.processors.sketches import KeyedValues

_native = pytest.importorskip("tokentrace.processors._native") if native.BUILT else None
needs_c = pytest.mark.skipif(_native is None, reason="the C functions are not built here")

_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_ELEMENT = st.one_of(
    _INT64.map(lambda number: AnyValue(int_value=number)),
    st.booleans().map(lambda flag: AnyValue(bool_value=flag)),
    st.text(max_size=4).map(lambda text: AnyValue(string_value=text)),
    st.floats(allow_nan=False).map(lambda number: AnyValue(double_value=number)),
    st.binary(max_size=4).map(lambda data: AnyValue(bytes_value=data)),
    st.just(AnyValue()),
)


@needs_c
@settings(max_examples=400, deadline=None)
@given(st.lists(_ELEMENT, max_size=40))
def test_int_values_reads_exactly_the_arrays_of_ints(elements: list[AnyValue]) -> None:
    serialized = ArrayValue(values=elements).SerializeToString()
    all_ints = all(element.WhichOneof("value") == "int_value" for element in elements)
    expected = array("q", [element.int_value for element in elements]) if all_ints else None
    answer = _native.int_values(serialized, len(elements))
    assert answer == expected and type(answer) is type(expected)  # an array('q'), not a list
    twin = native.int_values_python(serialized, len(elements))
    assert twin == expected and type(twin) is type(expected)
    # The wrong element count is never read as a shorter or longer array.
    assert _native.int_values(serialized, len(elements) + 1) is None
    if elements:
        assert _native.int_values(serialized, len(elements) - 1) is None


@needs_c
@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64), st.integers(min_value=0, max_value=20))
def test_int_values_answers_arbitrary_bytes_only_as_protobuf_reads_them(
    data: bytes, count: int
) -> None:
    values = _native.int_values(data, count)
    if values is not None:
        parsed = ArrayValue.FromString(data)
        assert [element.int_value for element in parsed.values] == values.tolist()
        assert all(element.WhichOneof("value") == "int_value" for element in parsed.values)


@needs_c
def test_int_values_reads_non_canonical_varints_as_the_agent_writes_them() -> None:
    # The agent writes each offset as a 5-byte varint (0x0a 0x06 0x18 + 5 bytes).
    one = bytes([0x0A, 0x06, 0x18, 0x85, 0x80, 0x80, 0x80, 0x00])
    assert _native.int_values(one * 3, 3) == array("q", [5, 5, 5])
    assert ArrayValue.FromString(one).values[0].int_value == 5


_OFFSETS = st.lists(
    st.one_of(
        st.integers(min_value=0, max_value=10**7),
        st.integers(min_value=-(2**64), max_value=2**64),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(_OFFSETS)
def test_gaps_match_the_python_twin(offsets: list[int]) -> None:
    expected = native.gaps_ns_python(offsets)
    assert type(expected) is array and expected.typecode == "q"
    assert native.gaps_ns(offsets) == expected
    if _native is not None:
        assert _native.gaps_ns(offsets) in (expected, None)
        if all(-(2**63) <= offset < 2**63 for offset in offsets):
            # Offsets as the wire carries them (int64): C answers itself, from a list or an
            # array('q'), and leaves out the gaps past 64 bits in ns as the twin does.
            assert _native.gaps_ns(offsets) == expected
            assert _native.gaps_ns(array("q", offsets)) == expected


def test_gaps_leave_out_negative_gaps_and_gaps_past_64_bits() -> None:
    offsets = [0, 10, 5, 2**62, 2**62 + 7]  # -5 µs, and ~4.6e18 µs: past int64 in ns
    assert native.gaps_ns_python(offsets).tolist() == [10_000, 7_000]
    assert native.gaps_ns(offsets).tolist() == [10_000, 7_000]


@needs_c
@pytest.mark.parametrize(
    "values", [array("d", [1.0, 2.0]), array("i", [1, 2]), b"12345678", (1, 2), [1, "x"]]
)
def test_the_int64_readers_leave_other_containers_to_python(values: object) -> None:
    # Only a list of ints or an int64 buffer is read in C; a buffer of another type would be
    # read as the wrong numbers.
    assert _native.gaps_ns(values) is None
    assert _native.gap_median(values, 2) is None
    assert _native.outlier_positions(values, 0) is None
    assert _native.count_keys_ns(values, 1.0) is None


@settings(max_examples=400, deadline=None)
@given(_OFFSETS)
def test_gap_median_matches_the_python_twin(gaps: list[int]) -> None:
    expected = native.gap_median_python(gaps)
    assert native.gap_median(gaps) == expected
    if _native is not None and all(abs(gap) < 2**52 for gap in gaps):
        assert _native.gap_median(gaps, 2) == expected
        assert _native.gap_median(array("q", gaps), 2) == expected


def test_gap_median_is_the_mean_of_the_middle_two_and_ignores_negative_gaps() -> None:
    assert native.gap_median([5, -3, 1, 9, 3]) == (4.0, 9)
    assert native.gap_median([-1, 7]) == (None, 7)
    assert native.gap_median([-1, -2]) == (None, -1)


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=-(2**64), max_value=2**64), max_size=60), st.integers())
def test_outlier_positions_match_python(gaps: list[int], threshold: int) -> None:
    expected = native.outlier_positions_python(gaps, threshold)
    assert native.outlier_positions(gaps, threshold) == expected
    answer = _native.outlier_positions(gaps, threshold)
    fits = all(-(2**63) <= value < 2**63 for value in (*gaps, threshold))
    assert answer == (expected if fits else None)
    if fits:
        assert _native.outlier_positions(array("q", gaps), threshold) == expected


def _python_keys(
    durations_ns: list[int], scale: int
) -> tuple[list[int], list[int], int, int, int] | None:
    """The sketch's own keying in Python (``KeyedValues.of`` over the seconds), counted, with
    the durations' min, max and sum (None for no durations: ``count_keys_ns``'s answer)."""
    if not durations_ns:
        return None
    keyed = KeyedValues.of([ns / 1e9 for ns in durations_ns], scale=scale)
    counted = (
        Counter(keyed.keys)
        if keyed.counts is None
        else dict(zip(keyed.keys, keyed.counts, strict=True))
    )
    keys = sorted(counted)
    counts = [counted[key] for key in keys]
    return keys, counts, min(durations_ns), max(durations_ns), sum(durations_ns)


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=2**53 - 1), max_size=300),
    st.integers(min_value=0, max_value=12),
)
def test_sketch_keys_match_python_for_every_scale(durations: list[int], scale: int) -> None:
    multiplier = float(2**scale)  # the OTLP-aligned mapping's (KeyedValues' own)
    assert native.count_keys_ns(durations, multiplier) == _python_keys(durations, scale)
    assert native.count_keys_ns(array("q", durations), multiplier) == _python_keys(durations, scale)


@needs_c
def test_sketch_keys_over_a_wide_range_are_counted_by_sorting() -> None:
    durations = [1, 2**52, 3, 2**52, 1_000_000]  # keys ~ 2**16 apart at scale 12
    assert native.count_keys_ns(durations, float(2**12)) == _python_keys(durations, 12)


@needs_c
@pytest.mark.parametrize(
    "durations",
    [[], [0, 5], [-3], [2**53], [1.5], ["x"], [2**53 - 1] * 1025, (5, 3)],  # sum > 2**63; a tuple
)
def test_sketch_keys_leave_what_python_must_check_to_python(durations: list[object]) -> None:
    assert _native.count_keys_ns(durations, 1.0) is None


# --- request span attributes read from the span's bytes ----------------------------------------
_KEYS = ("gen_ai.request.model", "a", "", "unmapped")
_SLOT_OF = {"gen_ai.request.model": 0, "a": 1, "": 2}
_ANY_VALUE = st.recursive(
    _ELEMENT,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: AnyValue(array_value=ArrayValue(values=xs))),
        st.lists(st.tuples(st.sampled_from(_KEYS), inner), max_size=2).map(
            lambda pairs: AnyValue(
                kvlist_value=KeyValueList(values=[KeyValue(key=k, value=v) for k, v in pairs])
            )
        ),
    ),
    max_leaves=8,
)
_ATTRIBUTE = st.tuples(st.sampled_from(_KEYS), st.none() | _ANY_VALUE).map(
    lambda pair: KeyValue(key=pair[0]) if pair[1] is None else KeyValue(key=pair[0], value=pair[1])
)


def _typed(value: object) -> object:
    """``value`` with every element's type beside it (so that True and 1 differ)."""
    if isinstance(value, list):
        return ["list", [_typed(element) for element in value]]
    return [type(value).__name__, value]


def _entry(span_bytes: bytes) -> bytes:
    return length_delimited(b"\x12", span_bytes)  # a ScopeSpans.spans entry, as SpanRef.wire


@needs_c
@settings(max_examples=400, deadline=None)
@given(st.lists(_ATTRIBUTE, max_size=12), st.text(max_size=3), st.booleans())
def test_attribute_slots_read_from_the_bytes_as_from_the_parsed_span(
    attributes: list[KeyValue], name: str, int_array_slot: bool
) -> None:
    span_bytes = Span(
        name=name, attributes=attributes, kind=Span.SPAN_KIND_SERVER
    ).SerializeToString()
    int_arrays = frozenset({1}) if int_array_slot else frozenset()
    parsed = Span.FromString(span_bytes)
    expected = span_attributes.attribute_slots(parsed, _SLOT_OF, 3, int_arrays)
    answer = _native.attribute_slots(
        _entry(span_bytes), _SLOT_OF, 3, span_attributes.OTHER_VALUE, int_arrays
    )
    assert _typed(answer) == _typed(expected)


@needs_c
def test_attribute_slots_read_any_number_of_distinct_keys_as_the_parsed_span() -> None:
    # More distinct keys than C's key cache holds, keys past its length bound, non-ASCII keys,
    # all read twice: what the cache answers must be what a fresh decode gives.
    keys = [f"k{number}" for number in range(3000)] + ["é" * 100, "x" * 129, "ключ", ""]
    slot_of = {key: number % 3 for number, key in enumerate(keys[::7] + keys[-4:])}
    for _ in range(2):
        for start in range(0, len(keys), 50):
            attributes = [
                KeyValue(key=key, value=AnyValue(int_value=number))
                for number, key in enumerate(keys[start : start + 50])
            ]
            span_bytes = Span(attributes=attributes).SerializeToString()
            expected = span_attributes.attribute_slots(Span.FromString(span_bytes), slot_of, 3)
            answer = _native.attribute_slots(
                _entry(span_bytes), slot_of, 3, span_attributes.OTHER_VALUE
            )
            assert _typed(answer) == _typed(expected)
            assert answer != [None, None, None]


@needs_c
@pytest.mark.parametrize(
    "attribute",
    [
        # a key-value's value given twice, and an AnyValue's oneof set twice: the parser merges
        KeyValue(key="a", value=AnyValue(int_value=1)).SerializeToString()
        + KeyValue(value=AnyValue(string_value="x")).SerializeToString(),
        KeyValue(key="a").SerializeToString()
        + b"\x12\x05"
        + AnyValue(int_value=1).SerializeToString()
        + AnyValue(string_value="x").SerializeToString(),
        KeyValue(key="a").SerializeToString() + KeyValue(key="b").SerializeToString(),
    ],
)
def test_attribute_slots_leave_fields_the_parser_merges_to_the_parsed_span(
    attribute: bytes,
) -> None:
    span_bytes = b"\x4a" + bytes([len(attribute)]) + attribute
    assert Span.FromString(span_bytes).attributes  # protobuf reads it (merging)
    assert _native.attribute_slots(_entry(span_bytes), _SLOT_OF, 3, object()) is None


@needs_c
@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=48))
def test_attribute_slots_answer_arbitrary_bytes_only_as_protobuf_reads_them(data: bytes) -> None:
    wrong_tag = b"\x0a" + _entry(data)[1:]  # not a ScopeSpans.spans entry
    assert _native.attribute_slots(wrong_tag, _SLOT_OF, 3, object()) is None
    try:
        parsed = Span.FromString(data)
    except DecodeError:
        return  # never asked: every span whose bytes the collector keeps was parsed from them
    answer = _native.attribute_slots(_entry(data), _SLOT_OF, 3, span_attributes.OTHER_VALUE)
    if answer is not None:
        assert _typed(answer) == _typed(span_attributes.attribute_slots(parsed, _SLOT_OF, 3))


@needs_c
def test_attribute_slots_of_bytes_protobuf_rejects_are_never_asked_but_do_not_fail() -> None:
    # A name (field 5) that is not UTF-8: the parser refuses the span, the walk skips the field.
    data = b"\x2a\x02\x00\x80" + KeyValue(key="a", value=AnyValue(int_value=3)).SerializeToString()
    data = data[:4] + b"\x4a" + bytes([len(data) - 4]) + data[4:]
    with pytest.raises(DecodeError):
        Span.FromString(data)
    assert _native.attribute_slots(_entry(data), _SLOT_OF, 3, object()) == [None, 3, None]


_OWNED = frozenset({"a"})
_OWNED_PREFIXES = ("gen_ai.", "un")


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.lists(_ATTRIBUTE, max_size=8))
def test_has_attribute_key_reads_the_bytes_as_the_parsed_span_says(
    attributes: list[KeyValue],
) -> None:
    span_bytes = Span(name="request", attributes=attributes).SerializeToString()
    expected = any(
        kv.key in _OWNED or kv.key.startswith(_OWNED_PREFIXES)
        for kv in Span.FromString(span_bytes).attributes
    )
    assert _native.has_attribute_key(_entry(span_bytes), _OWNED, _OWNED_PREFIXES) is expected
    assert native.has_attribute_key(b"\x0a" + _entry(span_bytes)[1:], _OWNED, ()) is None


_NAN = float("nan")


@pytest.mark.parametrize(
    ("reader", "value", "expected"),
    [
        (span_attributes.plain_int, 7, 7),
        (span_attributes.plain_int, -1, None),  # a count below zero is no count
        (span_attributes.plain_int, True, None),  # a bool is not an int here
        (span_attributes.plain_int, "7", None),
        (span_attributes.plain_timestamp, 0, None),  # 0: unset in OTLP
        (span_attributes.plain_timestamp, 1_700_000_000_000_000_000, 1_700_000_000_000_000_000),
        (span_attributes.plain_str, "m", "m"),
        (span_attributes.plain_str, span_attributes.OTHER_VALUE, None),
        (span_attributes.plain_bool, False, False),
        (span_attributes.plain_bool, 0, None),
        (span_attributes.plain_float, 2, 2.0),  # ints from lenient writers
        (span_attributes.plain_float, _NAN, None),
        (span_attributes.plain_float, float("inf"), None),
        (span_attributes.plain_float, -0.5, None),
        (span_attributes.plain_float, True, None),
        (span_attributes.plain_seconds_ns, 0.25, 250_000_000),
        (span_attributes.plain_seconds_ns, -1.0, None),
        (span_attributes.plain_first_str, ["stop", "length"], "stop"),
        (span_attributes.plain_first_str, [3, "stop"], None),  # the first element decides
        (span_attributes.plain_first_str, [], None),
        (span_attributes.plain_first_str, "", ""),
        (span_attributes.plain_str_tuple, ["a", "", 3, "b"], ("a", "b")),
        (span_attributes.plain_str_tuple, "a", ("a",)),
        (span_attributes.plain_str_tuple, "", ()),
        (span_attributes.plain_str_tuple, None, ()),
    ],
)
def test_plain_value_readers(reader: Any, value: object, expected: object) -> None:
    assert _typed(reader(value)) == _typed(expected)


_PIPELINE_DIGEST = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[1])
from collector_throughput import _collector_config
from tokentrace.agent import semconv
from tokentrace.collector.pipeline import Pipeline, group_by_trace
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate
from tokentrace.agent import compiled
from tokentrace.processors import native
simulated = simulate("mixed", requests=300, seed=7, start_unix_ns=int(sys.argv[2]))
pipeline = Pipeline(_collector_config("unused.db", 1))
for message in to_otlp_requests(simulated, batch_spans=512, pid=1):
    # As a receiver hands them over: parsed from the bytes, which C keeps per span.
    received = message.SerializeToString()
    groups, count = group_by_trace(type(message).FromString(received), encoded=received)
    pipeline.assembler.add(groups, count)
digest = hashlib.sha256()
for trace in pipeline.assembler.pop_finished(flush_all=True):
    processed = pipeline.process_trace(trace)
    digest.update(processed.otlp)
    digest.update(repr(processed.records).encode())
snapshot = pipeline.percentiles.snapshot()
for key in sorted(snapshot.keys(), key=repr):
    for metric in semconv.LATENCY_METRICS:
        sketch = snapshot.cumulative(key, metric).to_dict()
        digest.update(json.dumps([repr(key), metric, sketch], sort_keys=True).encode())
print(json.dumps({"built": native.BUILT, "digest": digest.hexdigest()}))
"""


@needs_c
@pytest.mark.slow
def test_the_pipeline_gives_the_same_answers_with_and_without_c(tmp_path: Path) -> None:
    bench = str(Path(__file__).resolve().parents[2] / "bench")
    start_ns = str(time.time_ns() // 3_600_000_000_000 * 3_600_000_000_000 - 3_600_000_000_000)
    answers = []
    for pure in ("", "1"):
        environment = {**os.environ, compiled.PURE_PYTHON_ENV: pure}
        done = subprocess.run(
            [sys.executable, "-c", _PIPELINE_DIGEST, bench, start_ns],
            capture_output=True,
            text=True,
            env=environment,
            cwd=tmp_path,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        answers.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert [answer["built"] for answer in answers] == [True, False]
    assert answers[0]["digest"] == answers[1]["digest"]
