"""The request store's write path, SQLite against PostgreSQL, interleaved in one run.

The same processed traces (simulated ``mixed`` traffic from ``tokentrace replay``, run through
the collector's processors once) are written in batches the way the store exporter writes them,
alternating between a SQLite store in a temporary directory and a PostgreSQL store on a server
this benchmark starts (``tests/postgres_server.py``: PostgreSQL's own binaries, fsync off, as in
the tests; a production server's commit waits for its disk). Prints µs per stored request (this
process's CPU and wall clock) for each backend and their ratio per pass; the PostgreSQL server's
own CPU is measured from its processes' ``/proc`` times.

    python bench/store_write.py                      # 4 passes of 4,000 requests
    python bench/store_write.py --requests 20000 --batch 512
    python bench/store_write.py --pglz               # also schema 1's pglz trace bytes
    python bench/store_write.py --stdlib-json        # also SQLite with the row's detail
                                                     # written by the standard library's json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.postgres_server


def _processed(requests: int, seed: int) -> list[Any]:
    from tokentrace.collector.config import parse_config
    from tokentrace.collector.pipeline import Pipeline, group_by_trace
    from tokentrace.loadgen.replay.emit import to_otlp_requests
    from tokentrace.loadgen.replay.simulation import simulate

    pipeline = Pipeline(parse_config({"exporters": {"store": {"path": "unused.db"}}}, environ={}))
    for message in to_otlp_requests(simulate("mixed", requests=requests, seed=seed)):
        groups, count = group_by_trace(message)
        pipeline.assembler.add(groups, count)
    traces = pipeline.assembler.pop_finished(flush_all=True)
    return [p for p in (pipeline.process_trace(t) for t in traces) if p is not None]


def _server_cpu_s(pids: Callable[[], list[int]]) -> float:
    """User + system CPU seconds of the PostgreSQL server's processes (``/proc``)."""
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return total / ticks


def _run_sql(location: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(location, autocommit=True) as connection:
        connection.execute(statement)


@contextlib.contextmanager
def _detail_encoder(*, stdlib: bool) -> Iterator[None]:
    """The row's detail written by the standard library's encoder while inside, if ``stdlib``."""
    from tokentrace.collector.store import row

    chosen = row.encode_detail
    if stdlib:
        row.encode_detail = row._standard_encode_detail  # the A/B's other arm
    try:
        yield
    finally:
        row.encode_detail = chosen


def _write_all(store: Any, processed: list[Any], batch: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(processed), batch):
        chunk = processed[start : start + batch]
        store.write([(p.trace, p.records, p.otlp) for p in chunk])
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--pglz",
        action="store_true",
        help="also write a PostgreSQL store whose trace bytes use pglz, the compression before "
        "schema version 2 (lz4), in the same passes",
    )
    parser.add_argument(
        "--stdlib-json",
        action="store_true",
        help="also write a SQLite store whose rows' detail the standard library's json encoder "
        "writes (the encoder before msgspec's), in the same passes",
    )
    args = parser.parse_args()

    from tests.postgres_server import running_postgres
    from tokentrace.collector.store import open_store

    print(f"processing {args.requests} simulated requests once ...", flush=True)
    processed = _processed(args.requests, args.seed)
    stored = sum(len(p.records) for p in processed)
    print(f"{len(processed)} traces, {stored} requests; batches of {args.batch} traces\n")
    backends = ["sqlite", "postgresql"] + (["postgresql-pglz"] if args.pglz else [])
    backends += ["sqlite-stdlib-json"] if args.stdlib_json else []
    rows: dict[str, list[tuple[float, float, float]]] = {backend: [] for backend in backends}
    with running_postgres() as server, tempfile.TemporaryDirectory() as tmp:

        def server_pids() -> list[int]:
            import psycopg

            with psycopg.connect(server.url(), autocommit=True) as admin:
                return [int(pid) for (pid,) in admin.execute("SELECT pid FROM pg_stat_activity")]

        for number in range(args.passes):
            order = backends if number % 2 == 0 else backends[::-1]
            for backend in order:
                postgresql = backend.startswith("postgresql")
                location = (
                    server.create_database() if postgresql else str(Path(tmp) / f"pass{number}.db")
                )
                store = open_store(location)
                if backend == "postgresql-pglz":
                    _run_sql(
                        location,
                        "ALTER TABLE tokentrace.traces ALTER COLUMN otlp SET COMPRESSION pglz",
                    )
                before = _server_cpu_s(server_pids) if postgresql else 0.0
                pids = server_pids() if postgresql else []
                with _detail_encoder(stdlib=backend == "sqlite-stdlib-json"):
                    wall, cpu = _write_all(store, processed, args.batch)
                server_cpu = _server_cpu_s(lambda p=pids: p) - before if postgresql else 0.0
                assert store.count() == stored, (backend, store.count(), stored)
                store.close()
                rows[backend].append((wall, cpu, server_cpu))
                print(
                    f"  pass {number + 1} {backend:<15} {wall / stored * 1e6:7.1f} us/request "
                    f"wall, {cpu / stored * 1e6:7.1f} us/request collector CPU"
                    + (f", {server_cpu / stored * 1e6:6.1f} us server CPU" if server_cpu else ""),
                    flush=True,
                )
    print()
    for backend, results in rows.items():
        wall = statistics.median(r[0] for r in results) / stored * 1e6
        cpu = statistics.median(r[1] for r in results) / stored * 1e6
        server = statistics.median(r[2] for r in results) / stored * 1e6
        print(
            f"median {backend:<15} {wall:7.1f} us/request wall, {cpu:7.1f} us collector CPU"
            + (f", {server:6.1f} us server CPU" if server else "")
        )
    ratios = [p[0] / s[0] for p, s in zip(rows["postgresql"], rows["sqlite"], strict=True)]
    print(
        f"postgresql / sqlite wall per pass: {', '.join(f'{r:.2f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.2f})"
    )
    print(
        f"\nreproduce: python bench/store_write.py --requests {args.requests} "
        f"--batch {args.batch} --passes {args.passes} --seed {args.seed}"
        + (" --pglz" if args.pglz else "")
        + (" --stdlib-json" if args.stdlib_json else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
