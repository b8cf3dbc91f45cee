"""What only the PostgreSQL request store does: its own schema in a shared database, versioned
migrations under an advisory lock, URLs with passwords, NUL characters, several replicas writing
one database, and a server connection that breaks. The contract both backends keep is tested
in test_store.py (``store_location``)."""

from __future__ import annotations

import random
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.collector.test_store import (
    BASE_NS,
    assembled,
    make_record,
    run_sql,
    sketch_of,
    trace_id,
    write_records,
)
from tests.postgres_server import PostgresServer
from tokentrace.collector.encoding import encode_trace_request
from tokentrace.collector.store import (
    StoreError,
    StoreNotFoundError,
    StoreWriteError,
    window_report,
)
from tokentrace.collector.store.contract import Store
from tokentrace.collector.store.location import open_store, open_store_readonly
from tokentrace.collector.store.postgresql import schema
from tokentrace.processors.sketches import LatencySketch, SketchKey

_PASSWORD = "s3cret-Passw0rd"


@pytest.fixture
def pg_store(postgres_url: str) -> Iterator[Store]:
    """A PostgreSQL store in a new database, its clock at ``BASE_NS``."""
    opened = open_store(postgres_url, clock=lambda: BASE_NS / 1e9)
    yield opened
    opened.close()


def admin_sql(server: PostgresServer, statement: str) -> list[tuple[Any, ...]]:
    """Run one statement as the server's administrator, on its ``postgres`` database."""
    with psycopg.connect(server.url(), autocommit=True) as connection:
        cursor = connection.execute(statement)
        return cursor.fetchall() if cursor.description else []


def terminate_connections(location: str, purpose: str) -> int:
    """Kill the store's connections of ``purpose`` (writer, reads) to its database, as a
    restarting server or a proxy would, waiting until they are gone; how many were killed."""
    killed = run_sql(
        location,
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
        "WHERE datname = current_database() "
        f"AND application_name LIKE 'tokentrace-collector ({purpose})%'",
    )
    return sum(1 for (done,) in killed if done)


def with_password(url: str, password: str, *, port: int | None = None) -> str:
    """``url`` with ``password`` (and ``port``, when given) in it."""
    parts = urllib.parse.urlsplit(url)
    netloc = f"{parts.username}:{password}@{parts.hostname}:{port or parts.port}"
    return parts._replace(netloc=netloc).geturl()


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- the schema ---------------------------------------------------------------------------------


def test_a_newer_schema_is_refused_in_one_line(postgres_url: str) -> None:
    open_store(postgres_url).close()
    run_sql(postgres_url, "INSERT INTO tokentrace.schema_versions (version) VALUES (99)")
    for opener in (open_store, open_store_readonly):
        with pytest.raises(StoreError, match="schema version 99, newer") as caught:
            opener(postgres_url)
        assert "\n" not in str(caught.value)
    # Refused, not downgraded.
    versions = run_sql(postgres_url, "SELECT version FROM schema_versions ORDER BY version")
    assert versions == [(1,), (2,), (99,)]


def _otlp_compression(url: str) -> str:
    """The compression of ``traces.otlp`` values: 'l' lz4, 'p' pglz, '' the server's default."""
    ((method,),) = run_sql(
        url,
        "SELECT attcompression FROM pg_attribute "
        "WHERE attrelid = 'tokentrace.traces'::regclass AND attname = 'otlp'",
    )
    return str(method)


def test_a_version_1_store_is_migrated_to_lz4_trace_bytes_keeping_its_rows(
    postgres_url: str,
) -> None:
    # A store as version 1 left it: its first migration only, a row in it.
    with psycopg.connect(postgres_url, autocommit=True) as connection, connection.transaction():
        connection.execute("CREATE SCHEMA tokentrace")
        connection.execute("CREATE TABLE tokentrace.schema_versions (version integer PRIMARY KEY)")
        for statement in schema.MIGRATIONS[0][1]:
            connection.execute(statement)
        connection.execute("INSERT INTO tokentrace.schema_versions VALUES (1)")
        connection.execute(
            "INSERT INTO tokentrace.traces VALUES (%s, 1, %s)", (b"\x01" * 16, b"old" * 1000)
        )
    assert _otlp_compression(postgres_url) == ""
    store = open_store(postgres_url)  # this code on a version 1 store: migrates at start
    write_records(store, make_record(1))
    store.close()
    assert run_sql(postgres_url, "SELECT version FROM tokentrace.schema_versions") == [(1,), (2,)]
    assert run_sql(postgres_url, "SELECT otlp FROM tokentrace.traces WHERE received_ns = 1") == [
        (b"old" * 1000,)
    ]
    lz4 = run_sql(
        postgres_url,
        "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'",
    )
    assert _otlp_compression(postgres_url) == ("l" if lz4 == [(True,)] else "")
    reader = open_store_readonly(postgres_url)
    assert reader.count() == 1
    reader.close()


def test_another_programs_requests_table_is_left_alone(postgres_url: str) -> None:
    run_sql(postgres_url, "CREATE TABLE public.requests (name text)")
    run_sql(postgres_url, "INSERT INTO public.requests VALUES ('theirs')")
    store = open_store(postgres_url)
    write_records(store, make_record(1))
    assert store.count() == 1
    store.close()
    assert run_sql(postgres_url, "SELECT * FROM public.requests") == [("theirs",)]
    ours = run_sql(
        postgres_url,
        "SELECT table_schema, table_name FROM information_schema.tables "
        "WHERE table_name = 'requests' ORDER BY table_schema",
    )
    assert ours == [("public", "requests"), ("tokentrace", "requests")]


def test_reading_a_database_without_a_store_says_what_to_do(postgres_url: str) -> None:
    with pytest.raises(StoreNotFoundError, match=r"no tokentrace store in .* start `tokentrace"):
        open_store_readonly(postgres_url)
    # A reader creates nothing.
    assert run_sql(postgres_url, "SELECT to_regnamespace('tokentrace')") == [(None,)]


@pytest.mark.parametrize("attempt", range(3))
def test_writers_opening_a_new_database_together_create_the_schema_once(
    postgres_url: str, attempt: int
) -> None:
    writers = 4
    start = threading.Barrier(writers)
    opened: list[Store] = []
    errors: list[BaseException] = []

    def open_writer() -> None:
        start.wait()
        try:
            opened.append(open_store(postgres_url))
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=open_writer) for _ in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert run_sql(postgres_url, "SELECT version FROM tokentrace.schema_versions") == [(1,), (2,)]
    for number, store in enumerate(opened, start=1):
        write_records(store, make_record(number))
    assert opened[0].count() == writers
    for store in opened:
        store.close()


# --- what is stored -----------------------------------------------------------------------------


def test_a_password_in_the_url_is_never_shown(postgres_url: str) -> None:
    url = with_password(postgres_url, _PASSWORD)  # trust authentication: any password works
    store = open_store(url)
    assert _PASSWORD not in store.path and ":***@" in store.path
    write_records(store, make_record(1))
    reader = open_store_readonly(url)
    assert _PASSWORD not in reader.path
    with pytest.raises(StoreError) as refused:
        write_records(reader, make_record(2))
    assert _PASSWORD not in str(refused.value)
    reader.close()
    store.close()
    # No server on that port: the connection is refused.
    unreachable = with_password(postgres_url, _PASSWORD, port=unused_port())
    for opener in (open_store, open_store_readonly):
        with pytest.raises(StoreError) as caught:
            opener(unreachable)
        assert _PASSWORD not in str(caught.value)
        assert "cannot connect" in str(caught.value)


def test_a_password_given_as_a_url_parameter_is_never_shown(postgres_url: str) -> None:
    url = f"{postgres_url}?password={_PASSWORD}&application_name=x"
    store = open_store(url)
    assert _PASSWORD not in store.path and "password=***" in store.path
    store.close()
    unreachable = with_password(postgres_url, "", port=unused_port()).replace(":@", "@")
    with pytest.raises(StoreError) as caught:
        open_store_readonly(f"{unreachable}?password={_PASSWORD}")
    assert _PASSWORD not in str(caught.value)


def test_text_with_nul_characters_is_stored_with_a_replacement_character(
    pg_store: Store,
) -> None:
    record = make_record(1, model="llama\x00-7b")
    record.timeline.service = "svc\x00"
    other = make_record(2)
    pg_store.write([(assembled(record), [record]), (assembled(other), [other])])
    assert pg_store.count() == 2 and pg_store.rejected_records == 0
    doc = pg_store.get(trace_id(1).hex())
    assert doc is not None
    assert (doc["model"], doc["service"]) == ("llama\ufffd-7b", "svc\ufffd")
    pg_store.set_meta("note\x00", "a\x00b")
    assert pg_store.meta("note\ufffd") == "a\ufffdb"
    pg_store.write_sketch_slices([(1000, ("svc\x00", "m", "chat", "0-127"), "e2e", sketch_of([1]))])
    [(start, key, metric, _)] = pg_store.sketches_since(0)
    assert (start, key, metric) == (1000, ("svc\ufffd", "m", "chat", "0-127"), "e2e")


def test_sketch_slices_of_two_replicas_are_both_kept_and_merged(postgres_url: str) -> None:
    key = SketchKey("svc", "llama", "chat", "128-511")
    first, second = open_store(postgres_url), open_store(postgres_url)
    first.write_sketch_slices([(1000, key, "ttft", sketch_of([100, 200]))])
    second.write_sketch_slices([(1000, key, "ttft", sketch_of([300]))])
    # Each replica rewrites its own open slice with its cumulative content.
    second.write_sketch_slices([(1000, key, "ttft", sketch_of([300, 400, 500]))])
    slices = first.sketches_between(1000, 1010)
    assert sorted(LatencySketch.from_dict(s[3]).count for s in slices) == [2, 3]
    report = window_report(slices, window_s=10, now_s=1010)
    [merged] = report["keys"]
    assert merged["metrics"]["ttft"]["count"] == 5
    first.close()
    second.close()


# --- a broken connection and concurrent replicas ------------------------------------------------


def test_a_write_on_a_killed_connection_is_retryable_and_the_next_one_reconnects(
    pg_store: Store, postgres_url: str
) -> None:
    write_records(pg_store, make_record(1))
    assert terminate_connections(postgres_url, "writer") == 1
    batch = [make_record(2), make_record(3)]
    with pytest.raises(StoreWriteError) as caught:
        write_records(pg_store, *batch)
    assert (caught.value.retryable, caught.value.rejected, caught.value.written) == (True, 0, 0)
    assert (pg_store.failed_batches, pg_store.rejected_records) == (1, 0)
    write_records(pg_store, *batch)  # the same batch again, on a new connection
    assert pg_store.count() == 3
    pg_store.set_meta("k", "v")
    assert terminate_connections(postgres_url, "writer") == 1
    with pytest.raises(StoreError):
        pg_store.set_meta("k", "w")
    pg_store.set_meta("k", "w")
    assert pg_store.meta("k") == "w"


def test_a_write_while_the_server_refuses_connections_is_retryable(
    pg_store: Store, postgres_url: str, postgres_server: PostgresServer
) -> None:
    database = urllib.parse.urlsplit(postgres_url).path.lstrip("/")
    write_records(pg_store, make_record(1))
    assert terminate_connections(postgres_url, "writer") == 1
    admin_sql(postgres_server, f"ALTER DATABASE {database} WITH ALLOW_CONNECTIONS false")
    batch = [make_record(2), make_record(3)]
    for _ in range(2):  # the broken connection, then a new one refused
        with pytest.raises(StoreWriteError) as caught:
            write_records(pg_store, *batch)
        assert (caught.value.retryable, caught.value.rejected) == (True, 0)
    assert (pg_store.rejected_records, pg_store.quarantined_records) == (0, 0)
    admin_sql(postgres_server, f"ALTER DATABASE {database} WITH ALLOW_CONNECTIONS true")
    write_records(pg_store, *batch)
    assert pg_store.count() == 3


def test_a_read_on_a_killed_connection_fails_and_the_next_one_reconnects(
    pg_store: Store, postgres_url: str
) -> None:
    write_records(pg_store, make_record(1))
    assert pg_store.count() == 1  # a reader connection now waits in the pool
    assert terminate_connections(postgres_url, "reads") == 1
    with pytest.raises(StoreError, match="cannot read store"):
        pg_store.count()
    assert pg_store.count() == 1


_SLOW_UPSERTS = (
    "CREATE OR REPLACE FUNCTION tokentrace.slowly() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN PERFORM pg_sleep(0.0005); RETURN NEW; END $$; "
    "CREATE TRIGGER slowly BEFORE INSERT ON tokentrace.{table} "
    "FOR EACH ROW EXECUTE FUNCTION tokentrace.slowly()"
)


def test_two_replicas_writing_the_same_traces_store_every_row(postgres_url: str) -> None:
    # Every batch touches most traces, in an order of its own: unsorted, two batches would
    # lock the same rows in opposite orders. Built beforehand so that the writes overlap.
    traces, batches, per_batch = 30, 10, 24
    replicas = [open_store(postgres_url), open_store(postgres_url)]
    # Each row a statement upserts takes a moment: the two replicas' statements run at once,
    # each locking its rows one by one, as under load.
    for table in ("requests", "traces"):
        run_sql(postgres_url, _SLOW_UPSERTS.format(table=table))
    planned: list[list[list[Any]]] = []
    for index in range(len(replicas)):
        shuffle = random.Random(index)
        planned.append([])
        for _ in range(batches):
            numbers = shuffle.sample(range(1, traces + 1), per_batch)
            records = [make_record(n, span=shuffle.choice((1, 2))) for n in numbers]
            planned[-1].append(
                [(assembled(r), [r], encode_trace_request(assembled(r).spans)) for r in records]
            )
    start = threading.Barrier(len(replicas))
    retried: list[StoreWriteError] = []
    errors: list[BaseException] = []

    def replica(index: int) -> None:
        start.wait()
        try:
            for batch in planned[index]:
                while True:
                    try:
                        replicas[index].write(batch)
                        break
                    except StoreWriteError as error:
                        if not error.retryable:
                            raise
                        retried.append(error)  # e.g. a deadlock the server broke
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=replica, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    written = {
        (record.timeline.trace_id, record.timeline.span_id)
        for batches_of_one in planned
        for batch in batches_of_one
        for _, records, _ in batch
        for record in records
    }
    stored = {
        (bytes(trace), bytes(span))
        for trace, span in run_sql(postgres_url, "SELECT trace_id, span_id FROM requests")
    }
    assert stored == written
    assert all(replicas[0].trace_otlp(trace) is not None for trace, _ in written)
    # Rows sorted by key are locked in one order: no deadlock to retry.
    assert retried == []
    for store in replicas:
        store.close()


def test_prune_by_count_follows_the_planners_estimate_once_the_table_is_analysed(
    postgres_url: str,
) -> None:
    store = open_store(postgres_url, max_requests=100, retention_s=10**9)
    write_records(store, *(make_record(n, start_ns=BASE_NS + n) for n in range(1, 11)))
    run_sql(postgres_url, "ANALYZE requests")  # the estimate: 10 rows, far under 100
    assert store.prune() == 0 and store.count() == 10
    store.max_requests = 4  # now the estimate (10) is over: the exact count prunes the oldest
    assert store.prune() == 6
    assert store.count() == 4
    assert sorted(doc["trace_id"] for doc in store.slowest(limit=10)) == sorted(
        trace_id(n).hex() for n in range(7, 11)
    )
    store.close()
