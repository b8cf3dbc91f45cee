"""Fuzz both OTLP receivers of a running collector (issue 15): mutated protobuf (bit flips,
truncation, spliced bytes, hostile field values: huge ints, bad ids, over-cap sizes) over
OTLP/gRPC and OTLP/HTTP, and mutated OTLP/JSON over HTTP, with well-formed traces interleaved.

Asserted: every answer is OK or one of the documented client-error codes for bad input, never a
crash (no 5xx, no consumer failure, no failed store batch); every well-formed trace sent between
the hostile ones is stored; each receiver still takes a valid export afterwards.

Seeded (``TOKENTRACE_FUZZ_SEED``, default 15); ``TOKENTRACE_FUZZ_CASES`` sets the number of
hostile cases (default 2000: ~20 s on a loaded 2-core machine, so marked slow), e.g.
``TOKENTRACE_FUZZ_CASES=100000`` for a long run.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import grpc
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue

from tokentrace.collector.config import parse_config
from tokentrace.collector.service import Collector
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate

CASES: Final = int(os.environ.get("TOKENTRACE_FUZZ_CASES", "2000"))
SEED: Final = int(os.environ.get("TOKENTRACE_FUZZ_SEED", "15"))
WELL_FORMED_EVERY: Final = 40
"""One well-formed trace is sent after every this many hostile cases."""
EXPORT_METHOD: Final = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

GRPC_ALLOWED: Final = frozenset(
    {
        grpc.StatusCode.OK,  # decodable: invalid spans answered in partial_success
        grpc.StatusCode.INVALID_ARGUMENT,  # undecodable (OTLP's answer for bad input)
        # INTERNAL: what grpc's own deserializer answers for undecodable bytes; allowed until
        # every receiver build parses the bytes itself. A consumer failure also answers INTERNAL,
        # so the receivers' ``failed_requests`` counter is asserted to stay 0 besides.
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # over the message size or the pending-span cap
    }
)
HTTP_ALLOWED: Final = frozenset(
    {
        200,  # decodable: invalid spans answered in partial_success
        400,  # undecodable protobuf or JSON, bad framing
        413,  # body over the size limit
        415,  # unsupported content type or encoding
        429,  # refused under load, with Retry-After
    }
)
REFUSED_RETRY: Final = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, 429, 503)
"""Answers after which a sender retries (well-formed traces are sent until taken)."""

HOSTILE_INTS: Final = (
    0,
    1,
    2**31,
    2**32 - 1,
    2**53 + 1,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
    7_258_118_400 * 10**9,  # the validator's upper bound
    1_700_000_000_000_000_000,
)


# --- the collector under test --------------------------------------------------------------------


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    store = tmp_path_factory.mktemp("fuzz") / "requests.db"
    raw: dict[str, Any] = {
        "receivers": {
            "otlp": {
                "protocols": {
                    "grpc": {"endpoint": "127.0.0.1:0"},
                    "http": {"endpoint": "127.0.0.1:0"},
                }
            }
        },
        "processors": {"assembly": {"quiet_period": "200ms", "root_grace": "50ms"}},
        "exporters": {"store": {"path": str(store)}},
    }
    running = Collector(parse_config(raw, environ={}))
    running.start()
    try:
        yield running
    finally:
        running.shutdown()


def store_path(collector: Collector) -> Path:
    sink = next(iter(collector.exporters.values()))
    return Path(sink.store.path)  # type: ignore[attr-defined]


def stored_trace_ids(collector: Collector) -> set[bytes]:
    with sqlite3.connect(f"file:{store_path(collector)}?mode=ro", uri=True) as db:
        return {bytes(row[0]) for row in db.execute("SELECT DISTINCT trace_id FROM requests")}


# --- clients: raw bytes in, status out --------------------------------------------------------


class Clients:
    def __init__(self, collector: Collector) -> None:
        assert collector.grpc_port is not None and collector.http_port is not None
        self.http_port = collector.http_port
        self._channel = grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}")
        self._export = self._channel.unary_unary(
            EXPORT_METHOD,
            request_serializer=lambda body: body,
            response_deserializer=lambda body: body,
        )

    def close(self) -> None:
        self._channel.close()

    def grpc(self, body: bytes) -> grpc.StatusCode:
        try:
            self._export(body, timeout=10)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    def http(self, body: bytes, content_type: str) -> int:
        # A new connection each time: one hostile request cannot spoil the next one's framing.
        connection = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=10)
        try:
            connection.request(
                "POST", "/v1/traces", body=body, headers={"Content-Type": content_type}
            )
            response = connection.getresponse()
            response.read()
            return response.status
        finally:
            connection.close()


@pytest.fixture(scope="module")
def clients(collector: Collector) -> Iterator[Clients]:
    made = Clients(collector)
    yield made
    made.close()


# --- inputs --------------------------------------------------------------------------------------


def to_otlp_json(request: ExportTraceServiceRequest) -> dict[str, Any]:
    """OTLP/JSON: lowerCamelCase keys, hex ids, enums as integers, 64-bit ints as strings."""
    document = json_format.MessageToDict(request, use_integers_for_enums=True)

    def hex_ids(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str):
                    node[key] = base64.b64decode(value).hex()
                else:
                    hex_ids(value)
        elif isinstance(node, list):
            for item in node:
                hex_ids(item)

    hex_ids(document)
    return document


def seeds(rng: random.Random) -> list[ExportTraceServiceRequest]:
    """Valid exports to mutate (ids of their own, never those of the well-formed traces)."""
    return to_otlp_requests(
        simulate("mixed", requests=12, seed=rng.randrange(10**6)), batch_spans=8
    )


def _sized(rng: random.Random, small: list[int], large: int) -> int:
    """A size from ``small``, or (one time in 50) ``large``: past a cap, but costly to build."""
    return large if rng.random() < 0.02 else rng.choice(small)


def random_value(rng: random.Random, depth: int = 0) -> AnyValue:
    pick = rng.randrange(7 if depth < 2 else 5)
    if pick == 0:
        number = rng.choice(HOSTILE_INTS) * rng.choice([1, -1])
        return AnyValue(int_value=(number + 2**63) % 2**64 - 2**63)  # int64's range, wrapped
    if pick == 1:
        return AnyValue(double_value=rng.choice([float("nan"), float("inf"), -1e308, 0.5]))
    if pick == 2:
        return AnyValue(string_value="s" * _sized(rng, [0, 1, 100], 65_537))
    if pick == 3:
        return AnyValue(bytes_value=rng.randbytes(rng.choice([0, 8, 300])))
    if pick == 4:
        return AnyValue()
    if pick == 5:
        count = _sized(rng, [0, 3, 200], 65_537)
        return AnyValue(
            array_value=ArrayValue(values=[AnyValue(int_value=i) for i in range(count)])
        )
    return AnyValue(array_value=ArrayValue(values=[random_value(rng, depth + 1) for _ in range(3)]))


def mutate_fields(rng: random.Random, request: ExportTraceServiceRequest) -> None:
    """Hostile values in the fields of a few spans (the message stays decodable)."""
    spans = [
        span
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]
    for span in rng.sample(spans, k=min(len(spans), rng.randint(1, 3))):
        field = rng.randrange(9)
        if field == 0:
            span.start_time_unix_nano = rng.choice(HOSTILE_INTS)
        elif field == 1:
            span.end_time_unix_nano = rng.choice(HOSTILE_INTS)
        elif field == 2:
            span.trace_id = rng.randbytes(rng.choice([0, 1, 15, 16, 17]))
        elif field == 3:
            span.parent_span_id = rng.randbytes(rng.choice([0, 7, 8, 9]))
        elif field == 4:
            span.attributes.add(
                key=rng.choice(["gen_ai.request.model", "x"]), value=random_value(rng)
            )
        elif field == 5:
            span.attributes.extend(
                KeyValue(key=f"k{i}", value=AnyValue(int_value=i))
                for i in range(_sized(rng, [10], 1025))
            )
        elif field == 6:
            event = span.events.add(time_unix_nano=rng.choice(HOSTILE_INTS))
            event.attributes.add(key="e", value=random_value(rng))
        elif field == 7:
            span.kind = rng.choice([0, 2, 3, 99, -1])  # type: ignore[assignment]
        else:
            for attribute in span.attributes:
                attribute.value.CopyFrom(random_value(rng))


def mutate_bytes(rng: random.Random, body: bytes) -> bytes:
    data = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        if not data:
            break
        operation = rng.randrange(5)
        position = rng.randrange(len(data))
        if operation == 0:  # bit flip
            data[position] ^= 1 << rng.randrange(8)
        elif operation == 1:  # truncation
            del data[position:]
        elif operation == 2:  # random bytes in
            data[position:position] = rng.randbytes(rng.randint(1, 16))
        elif operation == 3:  # a run deleted
            del data[position : position + rng.randint(1, 32)]
        else:  # a byte set to a varint/length edge value
            data[position] = rng.choice([0x00, 0x7F, 0x80, 0xFF])
    return bytes(data)


def hostile_json_value(rng: random.Random) -> Any:
    return rng.choice(
        [
            None,
            True,
            -1,
            2**64,
            str(2**64 - 1),
            str(2**63),
            "-9223372036854775809",
            1e308,
            "NaN",
            "",
            "zz" * 8,
            [],
            {},
            [1, [2, [3]]],
            {"intValue": "99999999999999999999"},
            "x" * 700,
        ]
    )


def mutate_json(rng: random.Random, document: Any) -> None:
    """Replace or delete a few values anywhere in the document."""
    for _ in range(rng.randint(1, 3)):
        node = document
        for _ in range(12):
            children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            if not children:
                break
            key, child = rng.choice(children)
            if isinstance(child, (dict, list)) and child and rng.random() < 0.8:
                node = child
                continue
            if isinstance(node, dict) and rng.random() < 0.2:
                del node[key]
            else:
                node[key] = hostile_json_value(rng)
            break


def hostile_case(rng: random.Random, seed: ExportTraceServiceRequest) -> tuple[str, bytes]:
    """(transport, body): transport is ``grpc``, ``http-protobuf`` or ``http-json``."""
    request = ExportTraceServiceRequest()
    request.CopyFrom(seed)
    transport = rng.choice(["grpc", "grpc", "http-protobuf", "http-json"])
    if transport == "http-json":
        if rng.random() < 0.5:
            mutate_fields(rng, request)
        document = to_otlp_json(request)
        if rng.random() < 0.7:
            mutate_json(rng, document)
        body = json.dumps(document).encode()
        if rng.random() < 0.3:
            body = mutate_bytes(rng, body)
        return transport, body
    if rng.random() < 0.5:
        mutate_fields(rng, request)
    body = request.SerializeToString()
    if rng.random() < 0.6:
        body = mutate_bytes(rng, body)
    return transport, body


# --- the test ------------------------------------------------------------------------------------


def send(clients: Clients, transport: str, body: bytes) -> grpc.StatusCode | int:
    if transport == "grpc":
        return clients.grpc(body)
    content_type = "application/json" if transport == "http-json" else "application/x-protobuf"
    return clients.http(body, content_type)


def send_until_taken(clients: Clients, transport: str, body: bytes) -> None:
    """A well-formed export, retried while refused (as any OTLP sender would)."""
    deadline = time.monotonic() + 30
    while True:
        status = send(clients, transport, body)
        if status in (grpc.StatusCode.OK, 200):
            return
        assert status in REFUSED_RETRY and time.monotonic() < deadline, (transport, status)
        time.sleep(0.1)


@pytest.mark.slow  # ~20 s: thousands of round trips, each decodable one processed and stored
def test_fuzzed_exports_through_both_receivers(collector: Collector, clients: Clients) -> None:
    rng = random.Random(SEED)
    seed_requests = seeds(rng)
    well_formed = to_otlp_requests(
        simulate("mixed", requests=CASES // WELL_FORMED_EVERY + 3, seed=SEED), batch_spans=1
    )
    expected: set[bytes] = set()
    answers: dict[str, dict[str, int]] = {}
    unexpected: list[tuple[int, str, Any]] = []
    started = time.monotonic()
    next_well_formed = iter(well_formed)

    def send_well_formed(transport: str) -> None:
        request = next(next_well_formed)
        expected.update(
            span.trace_id
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        )
        if transport == "http-json":
            body = json.dumps(to_otlp_json(request)).encode()
        else:
            body = request.SerializeToString()
        send_until_taken(clients, transport, body)

    transports = ("grpc", "http-protobuf", "http-json")
    for case in range(CASES):
        transport, body = hostile_case(rng, rng.choice(seed_requests))
        status = send(clients, transport, body)
        allowed: Callable[[Any], bool] = (
            GRPC_ALLOWED.__contains__ if transport == "grpc" else HTTP_ALLOWED.__contains__
        )
        key = status.name if isinstance(status, grpc.StatusCode) else str(status)
        answers.setdefault(transport, {}).setdefault(key, 0)
        answers[transport][key] += 1
        if not allowed(status):
            unexpected.append((case, transport, status))
        if case % WELL_FORMED_EVERY == WELL_FORMED_EVERY - 1:
            send_well_formed(transports[(case // WELL_FORMED_EVERY) % 3])
    # Afterwards each receiver still takes a valid export.
    for transport in transports:
        send_well_formed(transport)
    elapsed = time.monotonic() - started
    print(f"\n{CASES} hostile cases in {elapsed:.1f} s; answers: {answers}")
    assert not unexpected, unexpected[:20]

    collector.flush()
    missing = expected - stored_trace_ids(collector)
    assert not missing, f"{len(missing)} of {len(expected)} well-formed traces not stored"
    stats = collector.stats()
    assert stats["OtlpGrpcReceiver.failed_requests"] == 0  # INTERNAL only for undecodable bytes
    assert stats["OtlpHttpReceiver.failed_requests"] == 0
    assert stats["StoreSink.failed_batches"] == 0
    assert not stats["exporter_errors"]
    # Every answer the receivers count as taken or rejected was counted; none was lost.
    assert stats["OtlpGrpcReceiver.accepted_spans"] + stats["OtlpHttpReceiver.accepted_spans"] > 0
