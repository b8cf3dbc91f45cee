"""Every component a collector can run, one factory each: the table to read first.

| kind      | type          | makes                                                        |
|-----------|---------------|--------------------------------------------------------------|
| receiver  | ``otlp``      | ``OtlpReceiver``: OTLP/gRPC and OTLP/HTTP trace receivers    |
| processor | ``assembly``  | ``TraceAssembler``: spans grouped into finished traces       |
| processor | ``slo``       | marks each request against the SLO targets                   |
| processor | ``diagnosis`` | each request's verdict                                       |
| processor | ``percentiles`` | latency sketches, sliding window and cumulative            |
| processor | ``tail_sampling`` | ``TailSampler``: which traces the exporters get (off by default) |
| exporter  | ``store``     | ``StoreSink``: the request store (SQLite)                    |
| exporter  | ``otlp``      | ``UpstreamSink``: enriched spans and metrics, upstream       |
| extension | ``ui``        | ``ApiServer``: the drill-down API and web UI over the store  |
| extension | ``admin``     | ``AdminExtension``: /healthz, /readyz, Prometheus /metrics   |

Processors are listed in the order they run (each uses what the earlier ones derived). Each
config (defaults, ``validate()``, ``from_section``) is in ``component_configs.py``. A factory
imports what it makes only when it makes it, so reading a configuration loads neither gRPC nor
the store.

The ``admin`` extension is also fed by the pipeline: the collector hands its ``pipeline_sink``
every batch, as it hands the exporters (``service.py``), and injects its readiness checks.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from tokentrace.agent import semconv
from tokentrace.collector.assembly import TraceAssembler
from tokentrace.collector.component import (
    KIND_EXPORTER,
    KIND_EXTENSION,
    KIND_PROCESSOR,
    KIND_RECEIVER,
    CreateSettings,
    Factory,
)
from tokentrace.collector.component_configs import (
    AdminConfig,
    AssemblyConfig,
    DiagnosisProcessorConfig,
    OtlpReceiverConfig,
    PercentilesProcessorConfig,
    SloProcessorConfig,
    StoreConfig,
    TailSamplingProcessorConfig,
    UiConfig,
    UpstreamConfig,
)
from tokentrace.collector.record_processors import (
    RecordProcessor,
    diagnosis_processor,
    percentiles_processor,
    slo_processor,
)
from tokentrace.collector.tail_sampling import DROPPED_METRICS, KEPT_METRICS, TailSampler
from tokentrace.processors.percentiles import PercentileStore

if TYPE_CHECKING:
    from tokentrace.collector.admin import AdminExtension
    from tokentrace.collector.api.server import ApiServer
    from tokentrace.collector.exporters.store_sink import StoreSink
    from tokentrace.collector.exporters.upstream_sink import UpstreamSink
    from tokentrace.collector.receivers.otlp import OtlpReceiver


def _otlp_receiver(config: OtlpReceiverConfig, settings: CreateSettings) -> OtlpReceiver:
    from tokentrace.collector.receivers.otlp import OtlpReceiver

    return OtlpReceiver(config, settings)


def _assembler(config: AssemblyConfig, settings: CreateSettings) -> TraceAssembler:
    return TraceAssembler(
        quiet_period_s=config.quiet_period_s,
        root_grace_s=config.root_grace_s,
        max_traces=config.max_traces,
        max_spans_per_trace=config.max_spans_per_trace,
        max_pending_spans=config.max_pending_spans,
        clock=settings.clock,
        telemetry=settings.component_telemetry(),
    )


def _slo(config: SloProcessorConfig, settings: CreateSettings) -> RecordProcessor:
    return RecordProcessor(slo_processor(config.targets))


def _diagnosis(config: DiagnosisProcessorConfig, settings: CreateSettings) -> RecordProcessor:
    # The verdict answers the first SLO target a request breached.
    targets = settings.collector_config.slo_targets
    return RecordProcessor(diagnosis_processor(config.settings, targets))


def _percentiles(config: PercentilesProcessorConfig, settings: CreateSettings) -> RecordProcessor:
    store = PercentileStore(config=config.settings, clock=settings.wall_clock)

    settings.component_telemetry().observe_each(
        counters={
            semconv.SELF_METRIC_PERCENTILE_KEYS_EVICTED: (
                "keys evicted at max_keys",
                lambda: store.keys_evicted,
            ),
            semconv.SELF_METRIC_PERCENTILE_SLICES_DROPPED: (
                "slices dropped before export",
                lambda: store.slices_dropped,
            ),
            semconv.SELF_METRIC_PERCENTILE_RECORD_ERRORS: (
                "requests not recorded",
                lambda: store.record_errors,
            ),
        },
    )
    return percentiles_processor(store)


def _tail_sampler(config: TailSamplingProcessorConfig, settings: CreateSettings) -> TailSampler:
    sampler = TailSampler(config.settings, clock=settings.clock)
    counters: dict[str, tuple[str, Callable[[], float]]] = {
        name: (f"traces kept: {reason}", partial(sampler.kept.__getitem__, reason))
        for reason, name in KEPT_METRICS.items()
    }
    counters.update(
        {
            name: (f"traces dropped: {reason}", partial(sampler.dropped.__getitem__, reason))
            for reason, name in DROPPED_METRICS.items()
        }
    )
    counters[semconv.SELF_METRIC_SAMPLING_KEYS_EVICTED] = (
        "keys evicted at max_keys",
        lambda: sampler.keys_evicted,
    )
    settings.component_telemetry().observe_each(counters=counters)
    return sampler


def _store_exporter(config: StoreConfig, settings: CreateSettings) -> StoreSink:
    from tokentrace.collector.exporters.store_sink import SNAPSHOT_PREFIX, StoreSink

    collector = settings.collector_config
    return StoreSink(
        config,
        slo_targets=collector.slo_targets,
        diagnosis=collector.diagnosis,
        clock=settings.clock,
        telemetry=settings.component_telemetry(snapshot_prefix=SNAPSHOT_PREFIX),
    )


def _otlp_exporter(config: UpstreamConfig, settings: CreateSettings) -> UpstreamSink:
    from tokentrace.collector.exporters.upstream_sink import SNAPSHOT_PREFIX, UpstreamSink

    return UpstreamSink(
        config,
        clock=settings.clock,
        telemetry=settings.component_telemetry(snapshot_prefix=SNAPSHOT_PREFIX),
    )


def _ui(config: UiConfig, settings: CreateSettings) -> ApiServer:
    from tokentrace.collector.api import ApiSettings, create_app
    from tokentrace.collector.api.server import ApiServer

    store = settings.collector_config.store
    assert store is not None, "parse_config rejects a ui extension without a store exporter"
    app = create_app(
        ApiSettings(
            store_path=store.path, auth_token=config.auth_token, trace_link=config.trace_link
        )
    )
    return ApiServer(
        app,
        endpoint=config.endpoint,
        tls_cert_file=config.tls_cert_file,
        tls_key_file=config.tls_key_file,
    )


def _admin(config: AdminConfig, settings: CreateSettings) -> AdminExtension:
    from tokentrace.collector.admin import AdminExtension

    return AdminExtension(
        config,
        telemetry=settings.telemetry,
        slo_targets=settings.collector_config.slo_targets,
    )


FACTORIES: Final[tuple[Factory[Any], ...]] = (
    Factory(
        type="otlp",
        kind=KIND_RECEIVER,
        default_config=OtlpReceiverConfig,
        read_config=OtlpReceiverConfig.from_section,
        create=_otlp_receiver,
    ),
    Factory(
        type="assembly",
        kind=KIND_PROCESSOR,
        default_config=AssemblyConfig,
        read_config=AssemblyConfig.from_section,
        create=_assembler,
    ),
    Factory(
        type="slo",
        kind=KIND_PROCESSOR,
        default_config=SloProcessorConfig,
        read_config=SloProcessorConfig.from_section,
        create=_slo,
    ),
    Factory(
        type="diagnosis",
        kind=KIND_PROCESSOR,
        default_config=DiagnosisProcessorConfig,
        read_config=DiagnosisProcessorConfig.from_section,
        create=_diagnosis,
    ),
    Factory(
        type="percentiles",
        kind=KIND_PROCESSOR,
        default_config=PercentilesProcessorConfig,
        read_config=PercentilesProcessorConfig.from_section,
        create=_percentiles,
    ),
    Factory(
        type="tail_sampling",
        kind=KIND_PROCESSOR,
        default_config=TailSamplingProcessorConfig,
        read_config=TailSamplingProcessorConfig.from_section,
        create=_tail_sampler,
    ),
    Factory(
        type="store",
        kind=KIND_EXPORTER,
        default_config=StoreConfig,
        read_config=StoreConfig.from_section,
        create=_store_exporter,
    ),
    Factory(
        type="otlp",
        kind=KIND_EXPORTER,
        default_config=UpstreamConfig,
        read_config=UpstreamConfig.from_section,
        create=_otlp_exporter,
    ),
    Factory(
        type="ui",
        kind=KIND_EXTENSION,
        default_config=UiConfig,
        read_config=UiConfig.from_section,
        create=_ui,
    ),
    Factory(
        type="admin",
        kind=KIND_EXTENSION,
        default_config=AdminConfig,
        read_config=AdminConfig.from_section,
        create=_admin,
    ),
)
