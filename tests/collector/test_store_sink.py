from __future__ import annotations

from pathlib import Path

from tests.collector.test_store import assembled, make_record
from tokentrace.collector.config import StoreConfig, parse_config
from tokentrace.collector.exporters.store_sink import StoreSink
from tokentrace.collector.pipeline import Pipeline, ProcessedTrace
from tokentrace.collector.store import RequestStore


def test_housekeeping_prunes_in_batches_until_retention_holds(tmp_path: Path) -> None:
    path = tmp_path / "requests.db"
    sink = StoreSink(StoreConfig(path=str(path), retention_s=3600.0, max_requests=1000))
    sink.store.prune_batch = 10  # more stale rows than one batch deletes
    batch = []
    for number in range(1, 26):
        record = make_record(number, start_ns=number * 1_000_000_000)  # 1970: long expired
        batch.append(ProcessedTrace(assembled(record), [record]))
    sink.export_traces(batch)
    pipeline = Pipeline(parse_config({}, environ={}))
    sink.housekeeping(pipeline, final=True)
    sink.shutdown(1.0)
    store = RequestStore.open_readonly(path)
    try:
        assert store.count() == 0
    finally:
        store.close()
