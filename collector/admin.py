"""The ``admin`` extension: ``/healthz``, ``/readyz`` and a Prometheus ``/metrics`` on one port.

```yaml
extensions:
  admin: {endpoint: 127.0.0.1:13133}    # deploy/: ${env:POD_IP}:13133
service:
  extensions: [admin]
```

The listener is ``agent/admin_http.py``'s (shared with the node agent). ``/metrics`` renders one
``prometheus-client`` registry of this extension's own (never the process-global one) holding:

- the request metrics, from ``PrometheusSink`` (``collector/exporters/prometheus_sink.py``),
  which the collector hands every batch as it hands the exporters (``pipeline_sink``);
- the collector's self-telemetry, read from the ``SelfTelemetry`` registry at each scrape by
  ``SelfTelemetryCollector``: every series once, under ``semconv.prometheus_name`` (the one
  translation of ``tokentrace.collector.*`` names), labelled with ``semconv.prometheus_label`` of
  its attributes (``component_id``, ``component_kind``, ``transport``, ``signal``). Nothing is
  counted twice: the registry stays the only counter, Prometheus and OTLP are two encodings.

``/readyz`` asks the collector (``readiness``, injected by ``collector/service.py`` once the
components exist: receivers listening, store writable, upstream reachable or buffering, memory
below the limiter's soft limit; not ready while starting and once shutting down).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector as PrometheusCollector
from prometheus_client.utils import floatToGoString

from tokentrace.agent import semconv
from tokentrace.agent.admin_http import AdminHttpServer, Readiness, ReadinessCheck
from tokentrace.collector.component_configs import AdminConfig
from tokentrace.collector.exporters.prometheus_sink import PrometheusSink
from tokentrace.collector.receivers import split_endpoint
from tokentrace.collector.self_telemetry import (
    INSTRUMENT_COUNTER,
    INSTRUMENT_GAUGE,
    INSTRUMENT_HISTOGRAM,
    HistogramState,
    SelfTelemetry,
)
from tokentrace.processors.slo import SloTarget

_COUNTER_SUFFIX: Final = "_total"
_STARTING: Final = (ReadinessCheck("collector", False, "starting"),)
_PROMETHEUS_TYPES: Final = {
    INSTRUMENT_COUNTER: "counter",
    INSTRUMENT_GAUGE: "gauge",
    INSTRUMENT_HISTOGRAM: "histogram",
}


class SelfTelemetryCollector(PrometheusCollector):
    """The self-telemetry registry as Prometheus metric families, read at each scrape."""

    def __init__(self, telemetry: SelfTelemetry) -> None:
        self._telemetry = telemetry

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for reading in self._telemetry.readings():
            counter = reading.instrument == INSTRUMENT_COUNTER
            name = semconv.prometheus_name(reading.name, unit=reading.unit, counter=counter)
            family_name = name.removesuffix(_COUNTER_SUFFIX) if counter else name
            family = families.get(family_name)
            if family is None:
                family = families[family_name] = Metric(
                    family_name, reading.description, _PROMETHEUS_TYPES[reading.instrument]
                )
            labels = {semconv.prometheus_label(key): value for key, value in reading.attributes}
            value = reading.value
            if isinstance(value, HistogramState):
                _add_histogram(family, family_name, labels, value)
            else:
                family.add_sample(name, labels, float(value))
        yield from families.values()

    def describe(self) -> list[Metric]:
        """Nothing up front: the series exist only once components registered them (and the
        registry must not collect at registration)."""
        return []


def _add_histogram(
    family: Metric, name: str, labels: dict[str, str], state: HistogramState
) -> None:
    cumulative = 0
    for bound, count in zip(state.bounds, state.bucket_counts, strict=False):
        cumulative += count
        family.add_sample(f"{name}_bucket", {**labels, "le": floatToGoString(bound)}, cumulative)
    family.add_sample(f"{name}_bucket", {**labels, "le": "+Inf"}, state.count)
    family.add_sample(f"{name}_count", labels, state.count)
    family.add_sample(f"{name}_sum", labels, state.sum)


class AdminExtension:
    """The ``admin`` extension (module docstring); a ``Component``."""

    def __init__(
        self,
        config: AdminConfig,
        *,
        telemetry: SelfTelemetry,
        slo_targets: Sequence[SloTarget] = (),
    ) -> None:
        self.config = config
        self.registry = CollectorRegistry(auto_describe=False)
        self.pipeline_sink = PrometheusSink(
            self.registry, slo_targets=slo_targets, max_label_sets=config.max_label_sets
        )
        """What the collector hands every batch, as it does the exporters."""
        self.registry.register(SelfTelemetryCollector(telemetry))
        self.readiness: Readiness = lambda: _STARTING
        """The collector's readiness checks (the service sets it)."""
        host, port = split_endpoint(config.endpoint)
        self._server = AdminHttpServer(
            host=host, port=port, readiness=self._check_readiness, metrics=self.render_metrics
        )

    def _check_readiness(self) -> Sequence[ReadinessCheck]:
        return self.readiness()

    def render_metrics(self) -> tuple[bytes, str]:
        """The ``/metrics`` body (Prometheus text format) and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> None:
        try:
            self._server.start()
        except OSError as error:
            raise RuntimeError(
                f"admin extension cannot listen on {self.config.endpoint}: "
                f"{error.strerror or error}"
            ) from None

    def shutdown(self, *, timeout_s: float) -> None:
        self._server.shutdown(timeout_s)
