"""The component model: factories and their configs, the lifecycle order the service keeps, what
the pipeline hands its exporters, and the self-telemetry a running collector reports."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.collector.test_self_telemetry import attributes
from tests.collector.test_store import assembled, make_record
from tests.collector.upstream import FLUSH_S, UpstreamOtlp, exporter_options
from tests.spanbuild import request_spans
from tokentrace.agent import semconv
from tokentrace.collector.admin import AdminExtension
from tokentrace.collector.api.server import ApiServer
from tokentrace.collector.assembly import TraceAssembler
from tokentrace.collector.component import (
    KIND_EXPORTER,
    KIND_EXTENSION,
    KIND_PROCESSOR,
    KIND_RECEIVER,
    ConfigContext,
    ConfigError,
    ConfigSection,
    CreateSettings,
    Factory,
)
from tokentrace.collector.component_configs import (
    AssemblyConfig,
    DiagnosisProcessorConfig,
    OtlpReceiverConfig,
    PercentilesProcessorConfig,
    ReceiverConfig,
    StoreConfig,
    UiConfig,
    UpstreamConfig,
)
from tokentrace.collector.config import parse_config
from tokentrace.collector.consumer import Unavailable
from tokentrace.collector.exporters.otlp import OtlpExporterConfig
from tokentrace.collector.exporters.store_sink import StoreSink
from tokentrace.collector.exporters.upstream_sink import SNAPSHOT_PREFIX as UPSTREAM_SNAPSHOT_PREFIX
from tokentrace.collector.exporters.upstream_sink import UpstreamSink
from tokentrace.collector.factories import FACTORIES
from tokentrace.collector.pipeline import Pipeline, PipelineTick, ProcessedTrace
from tokentrace.collector.receivers.otlp import OtlpReceiver
from tokentrace.collector.record_processors import RecordProcessor
from tokentrace.collector.self_telemetry import SelfTelemetry
from tokentrace.collector.service import Collector
from tokentrace.collector.store import META_COLLECTOR_STATS, RequestStore
from tokentrace.collector.store.contract import (
    STATS_WRITTEN_AT,
    diagnosis_from_json,
    diagnosis_to_json,
)
from tokentrace.collector.tail_sampling import TailSampler
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.percentiles import ClosedSlice, PercentileConfig
from tokentrace.processors.sketches import LatencySketch, SketchKey
from tokentrace.processors.slo import SloTarget


def export_request() -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    attribute = resource_spans.resource.attributes.add(key=semconv.SERVICE_NAME)
    attribute.value.string_value = "svc"
    resource_spans.scope_spans.add().spans.extend(request_spans())
    return request


# --- factories and configs -------------------------------------------------------------------
def test_the_table_holds_one_factory_per_kind_and_type() -> None:
    kinds_and_types = [(factory.kind, factory.type) for factory in FACTORIES]
    assert kinds_and_types == [
        (KIND_RECEIVER, "otlp"),
        (KIND_PROCESSOR, "assembly"),
        (KIND_PROCESSOR, "slo"),
        (KIND_PROCESSOR, "diagnosis"),
        (KIND_PROCESSOR, "percentiles"),
        (KIND_PROCESSOR, "tail_sampling"),
        (KIND_EXPORTER, "store"),
        (KIND_EXPORTER, "otlp"),
        (KIND_EXTENSION, "ui"),
        (KIND_EXTENSION, "admin"),
    ]


_MADE: dict[tuple[str, str], type] = {
    (KIND_RECEIVER, "otlp"): OtlpReceiver,
    (KIND_PROCESSOR, "assembly"): TraceAssembler,
    (KIND_PROCESSOR, "slo"): RecordProcessor,
    (KIND_PROCESSOR, "diagnosis"): RecordProcessor,
    (KIND_PROCESSOR, "percentiles"): RecordProcessor,
    (KIND_PROCESSOR, "tail_sampling"): TailSampler,
    (KIND_EXPORTER, "store"): StoreSink,
    (KIND_EXPORTER, "otlp"): UpstreamSink,
    (KIND_EXTENSION, "ui"): ApiServer,
    (KIND_EXTENSION, "admin"): AdminExtension,
}
"""What each factory must make."""


def _from_defaults(factory: Factory[Any], tmp_path: Path, upstream: UpstreamOtlp) -> Any:
    """The factory's default config, where a default cannot run here: a store in ``tmp_path``,
    an upstream endpoint (the ``otlp`` exporter has none by default)."""
    config = factory.default_config()
    if isinstance(config, StoreConfig):
        return StoreConfig(path=str(tmp_path / "store.db"))
    if isinstance(config, UpstreamConfig):
        with pytest.raises(ConfigError, match=r"^endpoint: "):
            config.validate()
        return UpstreamConfig(exporter=OtlpExporterConfig(endpoint=upstream.grpc_endpoint))
    return config


@pytest.mark.parametrize("factory", FACTORIES, ids=lambda f: f"{f.kind}-{f.type}")
def test_every_factory_makes_its_component_from_defaults(
    factory: Factory[Any], tmp_path: Path, upstream: UpstreamOtlp
) -> None:
    config = _from_defaults(factory, tmp_path, upstream)
    config.validate()
    collector_config = parse_config(
        {"exporters": {"store": {"path": str(tmp_path / "store.db")}}}, environ={}
    )
    settings = CreateSettings(
        id=factory.type,
        kind=factory.kind,
        telemetry=SelfTelemetry(),
        collector_config=collector_config,
        consumer=Pipeline(collector_config) if factory.kind == KIND_RECEIVER else None,
    )
    component = factory.create(config, settings)  # made, not started: nothing is bound yet
    assert isinstance(component, _MADE[(factory.kind, factory.type)])
    if factory.kind == KIND_EXPORTER:
        component.shutdown(timeout_s=FLUSH_S)
    # Reading an empty section gives the defaults.
    empty = ConfigSection({}, f"{factory.kind}s.{factory.type}", ConfigContext(environ={}))
    if factory.kind == KIND_EXPORTER and factory.type == "otlp":
        with pytest.raises(ConfigError, match="needs an endpoint"):
            factory.read_config(empty)
    else:
        assert factory.read_config(empty) == factory.default_config()


_TARGET = SloTarget(name="t", metric="ttft", percentile=95, threshold_ns=1)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        (OtlpReceiverConfig(grpc=None, http=None), "protocols"),
        (
            OtlpReceiverConfig(grpc=ReceiverConfig(endpoint="nowhere", max_message_size=1)),
            "protocols.grpc.endpoint",
        ),
        (
            OtlpReceiverConfig(http=ReceiverConfig(endpoint="h:1", max_message_size=0)),
            "protocols.http.max_request_body_size_mib",
        ),
        (
            OtlpReceiverConfig(
                grpc=ReceiverConfig(endpoint="h:1", max_message_size=1, tls_cert_file="c")
            ),
            "protocols.grpc.tls",
        ),
        (
            OtlpReceiverConfig(
                grpc=ReceiverConfig(endpoint="h:1", max_message_size=1, auth_token="")
            ),
            "protocols.grpc.auth_token",
        ),
        (AssemblyConfig(quiet_period_s=0), "quiet_period"),
        (AssemblyConfig(root_grace_s=-1), "root_grace"),
        (AssemblyConfig(max_traces=0), "max_traces"),
        (AssemblyConfig(max_pending_spans=0), "max_pending_spans"),
        (PercentilesProcessorConfig(settings=PercentileConfig(window_s=0)), "window"),
        (PercentilesProcessorConfig(settings=PercentileConfig(slices=0)), "slices"),
        (PercentilesProcessorConfig(settings=PercentileConfig(max_keys=0)), "max_keys"),
        (StoreConfig(path=""), "path"),
        (StoreConfig(retention_s=0), "retention"),
        (StoreConfig(max_requests=0), "max_requests"),
        (
            UpstreamConfig(
                exporter=OtlpExporterConfig(endpoint="http://h:4317"), metrics_interval_s=0
            ),
            "metrics_interval",
        ),
        (
            UpstreamConfig(exporter=OtlpExporterConfig(endpoint="http://h:4317", protocol="x")),
            "protocol",
        ),
        (UiConfig(endpoint="nowhere"), "endpoint"),
        (UiConfig(trace_link="https://t/x"), "trace_link"),
        (UiConfig(tls_key_file="k"), "tls"),
    ],
)
def test_validate_names_the_key(config: Any, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        config.validate()
    assert str(error.value).startswith(f"{key}: ")


_DIAGNOSIS_OUT_OF_BOUNDS = [
    ("tie_ratio", 0.001),
    ("tie_ratio", 1.5),
    ("bandwidth_bound_ratio", 1.5),
    ("long_prompt_tokens", 0),
    ("itl_outlier_ratio", 0.5),
    ("itl_tail_spike_ratio", 0.9),
    ("interference_share", -0.1),
]


@pytest.mark.parametrize(("key", "value"), _DIAGNOSIS_OUT_OF_BOUNDS)
def test_the_diagnosis_limits_have_one_home(key: str, value: float) -> None:
    # DiagnosisConfig checks its limits when made; the YAML key is the field's name.
    with pytest.raises(ValueError, match=rf"^{key}: {value!r} is outside \["):
        DiagnosisConfig(**{key: value})
    with pytest.raises(ConfigError, match=rf"^processors\.diagnosis\.{key}: {value!r} is outside"):
        parse_config({"processors": {"diagnosis": {key: value}}}, environ={})
    # The processor config's validate() reuses the same check (here on settings changed after
    # they were made, which nothing in the collector does).
    settings = DiagnosisConfig()
    object.__setattr__(settings, key, value)
    with pytest.raises(ConfigError, match=rf"^{key}: {value!r} is outside"):
        DiagnosisProcessorConfig(settings=settings).validate()


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ({"processors": {"assembly": {"root_grace": "-1s"}}}, "processors.assembly.root_grace: "),
        ({"processors": {"percentiles": {"slices": 0}}}, "processors.percentiles.slices: "),
        (
            {
                "processors": {"diagnosis/strict": {"tie_ratio": 0.001}},
                "service": {
                    "pipelines": {"traces": {"processors": ["assembly", "diagnosis/strict"]}}
                },
            },
            "processors.diagnosis/strict.tie_ratio: ",
        ),
        ({"exporters": {"store": {"retention": "0s"}}}, "exporters.store.retention: "),
        (
            {"receivers": {"otlp": {"protocols": {"http": {"max_request_body_size_mib": 0}}}}},
            "receivers.otlp.protocols.http.max_request_body_size_mib: ",
        ),
    ],
)
def test_loading_puts_the_section_path_before_validate_errors(raw: Any, path: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(raw, environ={})
    assert str(error.value).startswith(path)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"processors": {"diagnosis": {"long_prompt_tokens": "x"}}},
            "processors.diagnosis.long_prompt_tokens: expected an integer, got 'x'",
        ),
        (
            {"processors": {"diagnosis": {"tie_ratio": "x"}}},
            "processors.diagnosis.tie_ratio: expected a number, got 'x'",
        ),
    ],
)
def test_a_diagnosis_key_of_the_wrong_type_is_named_once(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(raw, environ={})
    assert str(error.value) == message


def test_duplicate_slo_targets_are_rejected_when_read() -> None:
    target = {"name": "fast", "metric": "ttft", "percentile": 99, "threshold": "1s"}
    with pytest.raises(
        ConfigError, match=r"^processors\.slo\.targets\[1\]\.name: duplicate target name"
    ):
        parse_config({"processors": {"slo": {"targets": [target, dict(target)]}}}, environ={})


# Exactly what an earlier collector stored as its diagnosis settings (META_DIAGNOSIS).
_DIAGNOSIS_STORED_BY_AN_EARLIER_COLLECTOR = (
    '{"long_prompt_tokens": 1024, "bandwidth_bound_ratio": 0.8, "itl_spike_ratio": 4.5, '
    '"min_itl_gaps": 8, "preemption_share": 0.2, "interference_share": 0.25, "tie_ratio": 0.9, '
    '"p50_band": [40.0, 60.0], "tail_percentile": 95.0}'
)


def test_the_itl_outlier_and_tail_spike_ratios_are_configured_apart() -> None:
    config = parse_config(
        {"processors": {"diagnosis": {"itl_outlier_ratio": 5, "itl_tail_spike_ratio": 2.5}}},
        environ={},
    )
    assert config.diagnosis == DiagnosisConfig(itl_outlier_ratio=5.0, itl_tail_spike_ratio=2.5)


def test_the_old_itl_spike_ratio_key_keeps_its_meaning_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        config = parse_config({"processors": {"diagnosis": {"itl_spike_ratio": 4}}}, environ={})
    assert config.diagnosis == DiagnosisConfig(itl_outlier_ratio=4.0, itl_tail_spike_ratio=4.0)
    [warning] = [r.getMessage() for r in caplog.records if "itl_spike_ratio" in r.getMessage()]
    assert warning.startswith("processors.diagnosis.itl_spike_ratio is deprecated: write ")
    assert "itl_outlier_ratio: 4" in warning and "itl_tail_spike_ratio: 4" in warning
    with pytest.raises(ConfigError, match=r"^processors\.diagnosis\.itl_spike_ratio: replaced"):
        parse_config(
            {"processors": {"diagnosis": {"itl_spike_ratio": 4, "itl_outlier_ratio": 5}}},
            environ={},
        )


def test_diagnosis_settings_stored_by_an_earlier_collector_keep_their_itl_ratio() -> None:
    settings = diagnosis_from_json(_DIAGNOSIS_STORED_BY_AN_EARLIER_COLLECTOR)
    assert settings == DiagnosisConfig(itl_outlier_ratio=4.5, itl_tail_spike_ratio=4.5)
    assert diagnosis_from_json(diagnosis_to_json(settings)) == settings


# --- lifecycle ----------------------------------------------------------------------------------
Log = list[tuple[str, str, str]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeConfig:
    fail_start: bool = False

    def validate(self) -> None:
        pass

    @classmethod
    def from_section(cls, section: ConfigSection) -> ProbeConfig:
        section.allow_keys("fail_start")
        return cls(fail_start=bool(section.raw.get("fail_start", False)))


class Probe:
    """A receiver, exporter or extension that writes what happens to it into ``log``."""

    def __init__(self, config: ProbeConfig, settings: CreateSettings, log: Log) -> None:
        self._config = config
        self._settings = settings
        self._log = log

    def _note(self, event: str) -> None:
        self._log.append((self._settings.kind, self._settings.id, event))

    def start(self) -> None:
        self._note("start")
        if self._config.fail_start:
            raise RuntimeError("probe refuses to start")
        if self._settings.consumer is not None:  # a receiver: one trace, accepted
            self._settings.consumer.consume_traces(export_request())

    def shutdown(self, *, timeout_s: float) -> None:
        if self._settings.consumer is not None:
            try:
                self._settings.consumer.consume_traces(export_request())
                self._note("shutdown, pipeline still accepting")
            except Unavailable:
                self._note("shutdown, pipeline refusing")
            return
        self._note("shutdown")

    def export_traces(self, batch: list[ProcessedTrace]) -> None:
        self._note(f"batch of {len(batch)}")

    def tick(self, tick: PipelineTick) -> None:
        if tick.final:
            self._note("final tick")


def probe_table(log: Log) -> tuple[Factory[Any], ...]:
    probes = tuple(
        Factory(
            type="probe",
            kind=kind,
            default_config=ProbeConfig,
            read_config=ProbeConfig.from_section,
            create=lambda config, settings: Probe(config, settings, log),
        )
        for kind in (KIND_RECEIVER, KIND_EXPORTER, KIND_EXTENSION)
    )
    return (*FACTORIES, *probes)


def probed_collector(log: Log, **receiver: Any) -> Collector:
    table = probe_table(log)
    raw = {
        "receivers": {"probe": receiver},
        "exporters": {"probe/a": {}, "probe/b": {}},
        "extensions": {"probe": {}},
        # Exporters named: by default the pipeline would export to a store in the working dir.
        "service": {
            "pipelines": {"traces": {"receivers": ["probe"], "exporters": ["probe/a", "probe/b"]}}
        },
    }
    # The clock stands still: no trace finishes, no periodic tick comes; only shutdown drains.
    return Collector(
        parse_config(raw, environ={}, factories=table), factories=table, clock=lambda: 100.0
    )


def test_start_downstream_first_and_shut_down_upstream_first() -> None:
    log: Log = []
    collector = probed_collector(log)
    collector.start()
    started = list(log)
    collector.shutdown()
    assert started == [
        (KIND_EXPORTER, "probe/a", "start"),
        (KIND_EXPORTER, "probe/b", "start"),
        (KIND_EXTENSION, "probe", "start"),
        (KIND_RECEIVER, "probe", "start"),
    ]
    assert log[len(started) :] == [
        (KIND_RECEIVER, "probe", "shutdown, pipeline refusing"),
        (KIND_EXTENSION, "probe", "shutdown"),
        # The pipeline drains: the trace accepted at start reaches every exporter...
        (KIND_EXPORTER, "probe/a", "batch of 1"),
        (KIND_EXPORTER, "probe/b", "batch of 1"),
        # ...before the final tick and before any exporter stops.
        (KIND_EXPORTER, "probe/a", "final tick"),
        (KIND_EXPORTER, "probe/b", "final tick"),
        (KIND_EXPORTER, "probe/b", "shutdown"),
        (KIND_EXPORTER, "probe/a", "shutdown"),
    ]


def test_a_failing_start_shuts_down_what_started() -> None:
    log: Log = []
    collector = probed_collector(log, fail_start=True)
    with pytest.raises(RuntimeError, match="probe refuses to start"):
        collector.start()
    assert log == [
        (KIND_EXPORTER, "probe/a", "start"),
        (KIND_EXPORTER, "probe/b", "start"),
        (KIND_EXTENSION, "probe", "start"),
        (KIND_RECEIVER, "probe", "start"),
        (KIND_EXTENSION, "probe", "shutdown"),
        (KIND_EXPORTER, "probe/a", "final tick"),
        (KIND_EXPORTER, "probe/b", "final tick"),
        (KIND_EXPORTER, "probe/b", "shutdown"),
        (KIND_EXPORTER, "probe/a", "shutdown"),
    ]
    assert collector.exporters == {} and collector.pipeline is None


def test_a_failing_processor_is_counted_under_its_id_and_the_request_goes_on() -> None:
    def explode(record: Any) -> None:
        raise RuntimeError("boom")

    table = (
        *FACTORIES,
        Factory(
            type="explode",
            kind=KIND_PROCESSOR,
            default_config=ProbeConfig,
            read_config=ProbeConfig.from_section,
            create=lambda config, settings: RecordProcessor(explode),
        ),
    )
    raw = {"service": {"pipelines": {"traces": {"processors": ["assembly", "explode"]}}}}
    pipeline = Pipeline(parse_config(raw, environ={}, factories=table), factories=table)
    pipeline.consume_traces(export_request())
    (trace,) = pipeline.assembler.pop_finished(flush_all=True)
    assert len(pipeline.process_trace(trace).records) == 1
    assert pipeline.telemetry.snapshot()["processor_errors"] == {"explode": 1}


# --- what the pipeline hands the exporters -------------------------------------------------------
def test_the_store_exporter_writes_the_tick_and_prunes_on_the_final_one(tmp_path: Path) -> None:
    path = tmp_path / "requests.db"
    sink = StoreSink(StoreConfig(path=str(path), retention_s=3600.0, max_requests=1000))
    sink.store.prune_batch = 10  # more stale rows than one batch deletes
    records = [make_record(n, start_ns=n * 1_000_000_000) for n in range(1, 26)]  # 1970
    sink.export_traces([ProcessedTrace(assembled(record), [record]) for record in records])
    sketch = LatencySketch()
    sketch.add(0.25)
    key = SketchKey("svc", "m", "chat", "0-128")
    now_s = 1_800_000_000.0
    tick = PipelineTick(
        percentile_slices=[ClosedSlice(now_s, key, semconv.METRIC_TTFT, sketch)],
        collector_stats={"requests": 25, "processor_errors": {}},
    )
    sink.tick(tick)
    assert sink.store.count() == 25  # not pruned yet: its own interval has not passed
    sink.tick(PipelineTick(final=True, collector_stats={"requests": 25}))
    sink.shutdown(1.0)
    store = RequestStore.open_readonly(path)
    try:
        assert store.count() == 0
        written = json.loads(store.meta(META_COLLECTOR_STATS) or "")
        assert written == {"requests": 25, STATS_WRITTEN_AT: pytest.approx(time.time(), abs=60)}
        assert store.collector_stats() == written
        (stored,) = store.sketches_since(now_s - 1)
        assert stored[0] == now_s
    finally:
        store.close()


def test_tick_metrics_are_made_once_and_only_when_asked() -> None:
    made: list[int] = []

    def make() -> list[Any]:
        made.append(1)
        return []

    tick = PipelineTick(otlp_metrics=make)
    assert made == []
    tick.otlp_metrics()
    tick.otlp_metrics()
    assert made == [1]


def metric_points(upstream: UpstreamOtlp, name: str) -> list[Any]:
    return [
        point
        for request in upstream.metric_requests
        for resource_metrics in request.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
        if metric.name == name
        for point in getattr(metric, metric.WhichOneof("data")).data_points
    ]


def test_the_otlp_exporter_sends_the_self_telemetry_with_the_percentiles(
    upstream: UpstreamOtlp,
) -> None:
    telemetry = SelfTelemetry()
    options = exporter_options(upstream.http_endpoint, "http/protobuf")
    sink = UpstreamSink(
        UpstreamConfig(exporter=OtlpExporterConfig(**options), metrics_interval_s=3600),
        telemetry=telemetry.component(
            "otlp/tempo", KIND_EXPORTER, snapshot_prefix=UPSTREAM_SNAPSHOT_PREFIX
        ),
    )
    pipeline = Pipeline(
        parse_config({}, environ={}), sinks={"otlp/tempo": sink}, telemetry=telemetry
    )
    request = export_request()
    pipeline.consume_traces(request)
    pipeline.process_once(flush_all=True)
    pipeline.housekeeping()  # the interval is not due: no metrics yet
    pipeline.shutdown()  # the final tick sends them
    sink.shutdown(FLUSH_S)

    (resource_metrics,) = [r for q in upstream.metric_requests for r in q.resource_metrics]
    resource = {kv.key: kv.value.string_value for kv in resource_metrics.resource.attributes}
    assert resource[semconv.SERVICE_NAME] == "tokentrace-collector"
    (requests,) = metric_points(upstream, semconv.SELF_METRIC_REQUESTS)
    assert requests.as_int == 1
    assert attributes(requests) == {
        semconv.SELF_ATTR_COMPONENT_ID: "traces",
        semconv.SELF_ATTR_COMPONENT_KIND: "pipeline",
    }
    (received,) = metric_points(upstream, semconv.SELF_METRIC_RECEIVED_SPANS)
    assert received.as_int == len(request.resource_spans[0].scope_spans[0].spans)
    assert attributes(received)[semconv.SELF_ATTR_COMPONENT_ID] == "assembly"
    (sent,) = metric_points(upstream, semconv.SELF_METRIC_SENT_SPANS)
    assert attributes(sent) == {
        semconv.SELF_ATTR_COMPONENT_ID: "otlp/tempo",
        semconv.SELF_ATTR_COMPONENT_KIND: KIND_EXPORTER,
        semconv.SELF_ATTR_SIGNAL: "traces",
    }
    ttft = metric_points(upstream, semconv.OTLP_METRIC_NAMES[semconv.METRIC_TTFT])
    assert sum(point.count for point in ttft) == 1


# --- the snapshot `tokentrace top` and the API read ----------------------------------------------
_MEMORY_LIMITER_KEYS = {
    "memory_resident",
    "memory_limit",
    "memory_refused_requests",
    "memory_garbage_collections",
}
_PIPELINE_KEYS = {
    "received_spans",
    "traces",
    "requests",
    "pending_spans",
    "pending_traces",
    "traces_finished_early",
    "spans_dropped_trace_full",
    "late_spans",
    "late_traces_rederived",
    "late_traces_unmatched",
    "refused_batches",
    "retried_batches",
    "duplicate_spans",
    "processor_errors",
    "exporter_errors",
    "percentile_keys_evicted",
    "percentile_slices_dropped",
    "percentile_record_errors",
    # durability fsync (the default with a store): the write-ahead spool
    "spool_bytes",
    "spool_segments",
    "spool_refused_requests",
    "spool_replayed_requests",
    "spool_replayed_traces_stored",
    "spool_torn_records",
}
_RECEIVER_KEYS = (
    "accepted_spans",
    "rejected_spans",
    "refused_requests",
    "failed_requests",
    "malformed_requests",
    "unauthenticated_requests",
    "refused_connections",
)
_STORE_KEYS = (
    "written_requests",
    "rejected_records",
    "quarantined_records",
    "failed_batches",
    "checkpoints",
    "failed_checkpoints",
    "replaced_traces",
    "pruned_requests",
)
_SENDER_KEYS = {
    "traces": ("sent_spans", "dropped_spans", "rejected_spans", "retries", "queue_len"),
    "metrics": (
        "sent_data_points",
        "dropped_data_points",
        "rejected_data_points",
        "retries",
        "queue_len",
    ),
}


@pytest.fixture
def running(tmp_path: Path, upstream: UpstreamOtlp) -> Iterator[Collector]:
    raw = {
        "receivers": {
            "otlp": {
                "protocols": {
                    "grpc": {"endpoint": "127.0.0.1:0"},
                    "http": {"endpoint": "127.0.0.1:0"},
                }
            }
        },
        "exporters": {
            "store": {"path": str(tmp_path / "requests.db")},
            "otlp": {"endpoint": upstream.grpc_endpoint, "tls": {"insecure": True}},
        },
    }
    collector = Collector(parse_config(raw, environ={}))
    collector.start()
    try:
        yield collector
    finally:
        collector.shutdown()


def test_the_snapshot_keeps_the_keys_its_readers_read(running: Collector) -> None:
    expected = set(_PIPELINE_KEYS) | _MEMORY_LIMITER_KEYS
    for receiver in ("OtlpGrpcReceiver", "OtlpHttpReceiver"):
        expected |= {f"{receiver}.{key}" for key in _RECEIVER_KEYS}
    expected |= {f"StoreSink.{key}" for key in _STORE_KEYS}
    for signal, keys in _SENDER_KEYS.items():
        expected |= {f"UpstreamSink.{signal}.{key}" for key in keys}
    stats = running.stats()
    assert set(stats) == expected
    assert stats["processor_errors"] == stats["exporter_errors"] == {}
    assert all(isinstance(value, int) for key, value in stats.items() if not key.endswith("errors"))
