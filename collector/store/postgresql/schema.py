"""The PostgreSQL store's tables, in a schema of their own, and the versioned migrations that
create and upgrade them.

Every replica applies the missing migrations when it opens the store, inside one transaction
holding an advisory lock, so replicas starting together create the tables once; a database
whose schema is newer than this code knows is refused, never downgraded. The ``requests``
columns and their types come from ``row.StoredRow``, the one list of what a request row holds.
"""

from __future__ import annotations

import typing
from typing import Final

from tokentrace.collector.store.contract import StoreError
from tokentrace.collector.store.row import StoredRow

NAMESPACE: Final = "tokentrace"
"""The PostgreSQL schema holding every table, so a database shared with other programs keeps
their tables and ours apart."""
REQUESTS: Final = f"{NAMESPACE}.requests"
TRACES: Final = f"{NAMESPACE}.traces"
SKETCH_SLICES: Final = f"{NAMESPACE}.sketch_slices"
META: Final = f"{NAMESPACE}.meta"
_VERSIONS: Final = f"{NAMESPACE}.schema_versions"

_MIGRATION_LOCK: Final = 0x746F6B656E7472
"""``pg_advisory_xact_lock`` key of the migrations (any fixed number; "tokentr")."""

_SQL_TYPES: Final = {bytes: "bytea", int: "bigint", str: "text"}


def _column_types() -> dict[str, tuple[str, bool]]:
    """``requests`` column -> (SQL type, nullable), from ``StoredRow``'s annotations."""
    columns: dict[str, tuple[str, bool]] = {}
    for name, annotation in typing.get_type_hints(StoredRow).items():
        members = typing.get_args(annotation) or (annotation,)
        base = next(member for member in members if member is not type(None))
        columns[name] = (_SQL_TYPES[base], type(None) in members)
    return columns


REQUEST_COLUMN_TYPES: Final = _column_types()
"""``requests`` column -> (SQL type, nullable), in ``REQUEST_COLUMNS`` order."""

_REQUESTS_TABLE: Final = (
    f"CREATE TABLE {REQUESTS} ("
    + ", ".join(
        f"{name} {sql_type}{'' if nullable else ' NOT NULL'}"
        for name, (sql_type, nullable) in REQUEST_COLUMN_TYPES.items()
    )
    + ", PRIMARY KEY (trace_id, span_id))"
)

MIGRATIONS: Final[tuple[tuple[int, tuple[str, ...]], ...]] = (
    (
        1,
        (
            _REQUESTS_TABLE,
            # The list's orders and filters; PostgreSQL's planner picks among them with its
            # statistics (no hints needed, unlike SQLite's).
            f"CREATE INDEX requests_start ON {REQUESTS} (start_ns)",
            f"CREATE INDEX requests_e2e ON {REQUESTS} (e2e_ns)",
            f"CREATE INDEX requests_ttft ON {REQUESTS} (ttft_ns)",
            f"CREATE INDEX requests_service ON {REQUESTS} (service, start_ns)",
            f"CREATE INDEX requests_model ON {REQUESTS} (model, start_ns)",
            f"CREATE INDEX requests_operation ON {REQUESTS} (operation, start_ns)",
            f"CREATE INDEX requests_bucket ON {REQUESTS} (prompt_bucket, start_ns)",
            f"CREATE INDEX requests_cause ON {REQUESTS} (cause, start_ns)",
            f"CREATE INDEX requests_segment ON {REQUESTS} (segment, start_ns)",
            f"CREATE INDEX requests_breached ON {REQUESTS} (start_ns) WHERE slo_breached > 0",
            f"CREATE TABLE {TRACES} (trace_id bytea PRIMARY KEY, received_ns bigint NOT NULL, "
            "otlp bytea NOT NULL)",
            f"CREATE INDEX traces_received ON {TRACES} (received_ns)",
            # `writer`: the replica that wrote the slice. Each replica rewrites its own open
            # slices with their cumulative content; readers merge every replica's slices.
            f"CREATE TABLE {SKETCH_SLICES} (slice_start_s double precision NOT NULL, "
            "service text NOT NULL, model text NOT NULL, operation text NOT NULL, "
            "prompt_bucket text NOT NULL, metric text NOT NULL, writer text NOT NULL, "
            "sketch text NOT NULL, PRIMARY KEY (slice_start_s, service, model, operation, "
            "prompt_bucket, metric, writer))",
            f"CREATE TABLE {META} (key text PRIMARY KEY, value text NOT NULL)",
        ),
    ),
    (
        2,
        # Each trace's OTLP bytes compressed with lz4 instead of pglz: the server's CPU per
        # stored request falls by about a third at the same size (docs/performance.md). Only
        # where the server was built with lz4 (PostgreSQL 14+): elsewhere pglz stays.
        (
            "DO $$ BEGIN IF EXISTS (SELECT FROM pg_settings WHERE name = "
            "'default_toast_compression' AND 'lz4' = ANY(enumvals)) THEN "
            f"ALTER TABLE {TRACES} ALTER COLUMN otlp SET COMPRESSION lz4; END IF; END $$",
        ),
    ),
)
"""(version, statements) in order; a store at version N gets every later one at start."""

SCHEMA_VERSION: Final = MIGRATIONS[-1][0]


def migrate(connection: typing.Any, where: str) -> int:
    """Bring the store's schema to ``SCHEMA_VERSION`` (one transaction, under the advisory
    lock); returns the version found before. Raises StoreError for a newer schema."""
    with connection.transaction():
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        found = stored_version(connection)
        if found is None:
            connection.execute(f"CREATE SCHEMA IF NOT EXISTS {NAMESPACE}")
            connection.execute(f"CREATE TABLE {_VERSIONS} (version integer PRIMARY KEY)")
            found = 0
        _refuse_newer(found, where)
        for version, statements in MIGRATIONS:
            if version > found:
                for statement in statements:
                    connection.execute(statement)
                connection.execute(f"INSERT INTO {_VERSIONS} (version) VALUES (%s)", (version,))
    return found


def stored_version(connection: typing.Any) -> int | None:
    """The newest migration applied; None when the database holds no tokentrace store."""
    (exists,) = connection.execute("SELECT to_regclass(%s) IS NOT NULL", (_VERSIONS,)).fetchone()
    if not exists:
        return None
    (version,) = connection.execute(f"SELECT COALESCE(MAX(version), 0) FROM {_VERSIONS}").fetchone()
    return int(version)


def check_readable(connection: typing.Any, where: str) -> bool:
    """Whether the database holds a store this code reads; StoreError for a newer one."""
    version = stored_version(connection)
    if version is None:
        return False
    _refuse_newer(version, where)
    if version < SCHEMA_VERSION:
        raise StoreError(
            f"store {where} has schema version {version}, older than this tokentrace uses "
            f"({SCHEMA_VERSION}); start a collector of this version on it to upgrade it"
        )
    return True


def _refuse_newer(version: int, where: str) -> None:
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"store {where} has schema version {version}, newer than this tokentrace "
            f"supports ({SCHEMA_VERSION}); upgrade tokentrace or use another --store"
        )
