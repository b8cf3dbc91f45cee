"""The node agent: receive the node's OTLP, put each span's GPU samples on it, relay it upstream.

Data flow (one per GPU node, a Kubernetes DaemonSet):

    inference processes --OTLP gRPC/HTTP--> receivers --consume_traces--> hold queue
        --enricher thread (GPU aggregates, node identity)--> OtlpSender --OTLP--> collector
    NvmlSampler (100 ms) ---------------------------------------------^   GpuMetrics --OTLP-->

Spans are usually sent after the request ends, so their windows are already sampled; a request
whose spans end after the last sample waits in the hold queue until the sampler passes them or
``max_hold_s`` runs out, then goes on with what exists. The hold queue is bounded in spans: when
it is full the receivers answer RESOURCE_EXHAUSTED / 429 with a retry hint, so senders back off
and nothing is lost silently. The receivers are the collector's, with its bearer-token and TLS
options; one bound to a non-loopback address needs a token (or ``allow_unauthenticated``),
because what it takes goes on to the collector under the node agent's own credentials. Upstream
sending is the agent's ``OtlpSender`` (bounded queue, retry with backoff and jitter, drop
counters); with several collector replicas (``upstream_endpoints`` / ``upstream_dns``) a
``TraceRouter`` (``agent/node/routing.py``) holds one per replica and sends every span of a trace
to the same one. Components start downstream first (sender, sampler, enricher, then receivers) and
stop upstream first.

With ``admin_endpoint`` set, an admin listener serves ``/healthz``, ``/readyz`` and a Prometheus
``/metrics`` (``agent/node/admin.py``, imported only then): it starts before the receivers (alive
while starting, ready once they listen) and stops last.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.agent import semconv
from tokentrace.agent.identity import host_resource
from tokentrace.agent.node.enrich import SpanEnricher
from tokentrace.agent.node.local_relay import LocalSocketReceiver, validate_socket_path
from tokentrace.agent.node.metrics import GpuMetrics
from tokentrace.agent.node.routing import (
    DEFAULT_RESOLVE_INTERVAL_S,
    Resolver,
    TraceRouter,
    endpoint_config,
    parse_dns_target,
)
from tokentrace.agent.node.sampler import NvmlSampler
from tokentrace.agent.otlp_config import PROTOCOL_GRPC, TOKENTRACE_VERSION, OtlpExporterConfig
from tokentrace.agent.otlp_export import OtlpSender, shut_down_together
from tokentrace.collector.consumer import Overloaded, Unavailable
from tokentrace.collector.receivers import ReceiverStartError, is_loopback_endpoint

_log = logging.getLogger(__name__)

_DEFAULT_GRPC_ENDPOINT: Final = "127.0.0.1:4317"
_DEFAULT_HTTP_ENDPOINT: Final = "127.0.0.1:4318"
DEFAULT_UPSTREAM: Final = "http://tokentrace-collector:4317"
"""The collector's Service in ``deploy/`` (plaintext gRPC inside the cluster)."""
_DEFAULT_SAMPLE_INTERVAL_S: Final = 0.1
_DEFAULT_RING_SAMPLES: Final = 6000
_DEFAULT_MAX_HOLD_S: Final = 1.0
_DEFAULT_MAX_HELD_SPANS: Final = 100_000
_DEFAULT_METRICS_INTERVAL_S: Final = 10.0
_DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 5.0
_STAGE_CAP_S: Final = 2.0
"""At most this much of the shutdown for the receivers' in-flight calls, and for the admin
listener."""
_SERVICE_NAME: Final = "tokentrace-node-agent"


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeAgentConfig:
    """Everything the node agent can be told; ``validate()`` raises ValueError naming the field."""

    grpc_endpoint: str | None = _DEFAULT_GRPC_ENDPOINT
    """OTLP/gRPC receiver (None: off). Loopback by default; a DaemonSet binds the pod IP."""
    http_endpoint: str | None = _DEFAULT_HTTP_ENDPOINT
    """OTLP/HTTP receiver, protobuf and JSON (None: off)."""
    exporter: OtlpExporterConfig = field(
        default_factory=lambda: OtlpExporterConfig(
            endpoint=DEFAULT_UPSTREAM, protocol=PROTOCOL_GRPC
        )
    )
    """Where spans go: the collector. With ``upstream_endpoints`` or ``upstream_dns``, the
    options of every replica's sender, whose endpoint comes from there (for resolved addresses,
    the scheme of ``endpoint`` still says plaintext or TLS)."""
    upstream_endpoints: tuple[str, ...] = ()
    """Several collector replicas, given as base endpoints like ``exporter.endpoint``: each span
    goes to the one owning its trace id (``agent/node/routing.py``). Empty: not routed."""
    upstream_dns: str | None = None
    """``dns:///HOST:PORT`` or ``HOST:PORT`` of a headless Service whose every A/AAAA record is a
    collector replica, re-resolved every ``upstream_resolve_interval_s``; routed like
    ``upstream_endpoints``. None: not routed."""
    upstream_resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S
    """How often ``upstream_dns`` is looked up again."""
    metrics_exporter: OtlpExporterConfig | None = None
    """Where GPU metrics go every ``metrics_interval_s`` (a metrics backend or an OpenTelemetry
    Collector; the tokentrace collector takes traces only). None: not exported."""
    sample_interval_s: float = _DEFAULT_SAMPLE_INTERVAL_S
    ring_samples: int = _DEFAULT_RING_SAMPLES
    max_hold_s: float = _DEFAULT_MAX_HOLD_S
    max_held_spans: int = _DEFAULT_MAX_HELD_SPANS
    metrics_interval_s: float = _DEFAULT_METRICS_INTERVAL_S
    auth_token: str | None = None
    """Bearer token the receivers require (``Authorization: Bearer <token>``; gRPC
    UNAUTHENTICATED / HTTP 401 without it). None: none, which only a loopback endpoint or
    ``allow_unauthenticated`` permits. The collector's receivers' ``auth_token``."""
    tls_cert_file: str | None = None
    """PEM certificate (chain) the receivers serve TLS with; both files or neither."""
    tls_key_file: str | None = None
    """PEM private key of ``tls_cert_file``."""
    allow_unauthenticated: bool = False
    """Permit a receiver on a non-loopback address without ``auth_token``: whoever reaches it
    could then put spans into the collector under the node agent's upstream credentials."""
    local_socket: str | None = None
    """A Unix socket (absolute path) where the node's agents hand over finished requests as
    plain data (``TOKENTRACE_NODE_SOCKET`` on their side): this process builds their spans, not
    theirs (``agent/node/local_relay.py``). None: off."""
    admin_endpoint: str | None = None
    """``/healthz``, ``/readyz`` and Prometheus ``/metrics`` (unauthenticated: scraped inside the
    cluster, a NetworkPolicy limits who reaches it). None: off."""

    def validate(self) -> None:
        if not self.grpc_endpoint and not self.http_endpoint and not self.local_socket:
            raise ValueError(
                "grpc_endpoint/http_endpoint/local_socket: at least one receiver is needed"
            )
        if self.local_socket is not None:
            validate_socket_path(self.local_socket)
        if self.auth_token is not None:
            if not self.auth_token:
                raise ValueError("auth_token: must not be empty (None: no token)")
            if not all("!" <= char <= "~" for char in self.auth_token):
                # Never echoed: the message names the rule, not the token.
                raise ValueError(
                    "auth_token: must be printable ASCII without spaces (it travels in a header)"
                )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file/tls_key_file: give both or neither")
        for name in ("grpc_endpoint", "http_endpoint"):
            endpoint = getattr(self, name)
            if not endpoint:
                continue
            exposed = not is_loopback_endpoint(endpoint, name)
            if exposed and self.auth_token is None and not self.allow_unauthenticated:
                raise ValueError(
                    f"{name}: {endpoint} is not a loopback address, and without a bearer token "
                    "anyone who reaches it can relay spans to the collector; set a token "
                    "(--auth-token-file) or allow it explicitly (--allow-unauthenticated)"
                )
        if self.admin_endpoint is not None:
            is_loopback_endpoint(self.admin_endpoint, "admin_endpoint")  # HOST:PORT, or raise
        for name in ("sample_interval_s", "metrics_interval_s", "upstream_resolve_interval_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be > 0, got {value}")
        if not (math.isfinite(self.max_hold_s) and self.max_hold_s >= 0):
            raise ValueError(f"max_hold_s: must be >= 0, got {self.max_hold_s}")
        if self.ring_samples < 1:
            raise ValueError(f"ring_samples: must be >= 1, got {self.ring_samples}")
        if self.max_held_spans < 1:
            raise ValueError(f"max_held_spans: must be >= 1, got {self.max_held_spans}")
        self.exporter.validate()
        if self.metrics_exporter is not None:
            self.metrics_exporter.validate()
        if self.upstream_endpoints and self.upstream_dns is not None:
            raise ValueError("upstream_endpoints/upstream_dns: give one or the other, not both")
        if self.upstream_dns is not None:
            try:
                parse_dns_target(self.upstream_dns)
            except ValueError as error:
                raise ValueError(f"upstream_dns: {error}") from None
        for endpoint in self.upstream_endpoints:
            if not endpoint.strip():
                raise ValueError("upstream_endpoints: an endpoint is empty")
            try:
                endpoint_config(self.exporter, endpoint).validate()
            except ValueError as error:
                raise ValueError(f"upstream_endpoints: {endpoint!r}: {error}") from None


def bind_endpoint(endpoint: str) -> str:
    """``endpoint`` as the receivers bind it: an IPv6 host in brackets (``fd00::5:4317``, what
    ``$(POD_IP):4317`` gives on an IPv6 pod network, becomes ``[fd00::5]:4317``)."""
    from tokentrace.collector.receivers import join_endpoint, split_endpoint

    return join_endpoint(*split_endpoint(endpoint))


class _Held:
    __slots__ = ("deadline", "end_ns", "request", "spans")

    def __init__(
        self, request: ExportTraceServiceRequest, spans: int, end_ns: int, deadline: float
    ) -> None:
        self.request = request
        self.spans = spans
        self.end_ns = end_ns
        self.deadline = deadline


class NodeAgent:
    """The consumer behind the receivers, and the owner of sampler, enricher and senders."""

    never_blocks = True
    """TraceConsumer: ``consume_traces`` takes a short lock and notifies the relay thread."""

    def __init__(
        self,
        config: NodeAgentConfig,
        *,
        sampler: NvmlSampler | None = None,
        environ: Mapping[str, str] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        resolver: Resolver | None = None,
    ) -> None:
        """``resolver``: how ``upstream_dns`` is looked up (``socket.getaddrinfo`` when None)."""
        config.validate()
        self._config = config
        self._monotonic = monotonic
        env = os.environ if environ is None else environ
        self.identity = host_resource(env)
        self.sampler = sampler or NvmlSampler(
            interval_s=config.sample_interval_s, ring_samples=config.ring_samples
        )
        self.enricher = SpanEnricher(self.sampler)
        self.trace_sender: OtlpSender | TraceRouter
        """One sender to ``exporter``, or the router over the collector replicas."""
        if config.upstream_endpoints or config.upstream_dns is not None:
            self.trace_sender = TraceRouter(
                config.exporter,
                endpoints=config.upstream_endpoints,
                dns_target=config.upstream_dns,
                resolver=resolver,
                resolve_interval_s=config.upstream_resolve_interval_s,
            )
        else:
            self.trace_sender = OtlpSender(config.exporter, signal="traces")
        self.metric_sender = (
            None
            if config.metrics_exporter is None
            else OtlpSender(config.metrics_exporter, signal="metrics")
        )
        self._gpu_metrics = GpuMetrics(
            self.sampler,
            resource_attributes={semconv.SERVICE_NAME: _SERVICE_NAME, **self.identity},
            scope_version=TOKENTRACE_VERSION or "",
        )
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._held: deque[_Held] = deque()
        self._held_spans = 0
        self._stopping = False
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._receivers: list[Any] = []
        self.refused_spans = 0
        """Spans refused because the hold queue was full (senders were told to retry)."""
        self.released_unsampled = 0
        """Requests sent on at ``max_hold_s`` before the sampler covered their windows."""
        self.failed_requests = 0
        self.relayed_spans = 0
        self._shutting_down = False
        self._admin: Any = None
        """The admin listener (``agent/node/admin.py``) when ``admin_endpoint`` is set."""

    @property
    def config(self) -> NodeAgentConfig:
        return self._config

    @property
    def shutting_down(self) -> bool:
        """Set when ``shutdown`` begins (``/readyz`` says not ready from then on)."""
        return self._shutting_down

    @property
    def admin_port(self) -> int | None:
        """The admin listener's port (None: not running)."""
        return None if self._admin is None else int(self._admin.server.port)

    # --- consumer (receiver threads) -------------------------------------------------------------
    def consume_traces(
        self, request: ExportTraceServiceRequest, *, encoded: bytes | None = None
    ) -> None:
        spans = 0
        end_ns = 0
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                spans += len(scope_spans.spans)
                for span in scope_spans.spans:
                    end_ns = max(end_ns, span.end_time_unix_nano)
        with self._lock:
            if self._stopping:
                raise Unavailable("node agent shutting down")
            if self._held_spans + spans > self._config.max_held_spans and self._held:
                self.refused_spans += spans
                raise Overloaded(
                    f"node agent hold queue full ({self._held_spans} spans)",
                    retry_after_s=self._config.max_hold_s or 0.5,
                )
            self._held.append(
                _Held(request, spans, end_ns, self._monotonic() + self._config.max_hold_s)
            )
            self._held_spans += spans
            self._ready.notify()

    # --- enricher thread -------------------------------------------------------------------------
    def _next_ready(self) -> _Held | None:
        """The oldest held request once its windows are sampled or its hold ran out."""
        with self._lock:
            while True:
                if self._held:
                    head = self._held[0]
                    sampling = self.sampler.available and self.sampler.sampled_gpus > 0
                    sampled = self.sampler.sampled_until_ns() if sampling else None
                    now = self._monotonic()
                    if (
                        not sampling
                        or (sampled is not None and sampled >= head.end_ns)
                        or now >= head.deadline
                        or self._stopping
                    ):
                        if sampling and (sampled is None or sampled < head.end_ns):
                            self.released_unsampled += 1
                        self._held.popleft()
                        self._held_spans -= head.spans
                        return head
                    # Sampling is periodic: look again within one interval.
                    self._ready.wait(min(head.deadline - now, self._config.sample_interval_s))
                elif self._stopping:
                    return None
                else:
                    self._ready.wait()

    def _relay_loop(self) -> None:
        while True:
            held = self._next_ready()
            if held is None:
                return
            try:
                self.relay(held.request, held.spans)
            except Exception:  # one bad request must not stop the relay
                self.failed_requests += 1
                _log.exception(
                    "tokentrace node agent: relaying a %d-span request failed", held.spans
                )

    def relay(self, request: ExportTraceServiceRequest, spans: int) -> None:
        """Enrich ``request`` in place, add node identity, and queue it for upstream."""
        if self.sampler.available:
            self.enricher.enrich(request)
        for resource_spans in request.resource_spans:
            attributes = resource_spans.resource.attributes
            present = {kv.key for kv in attributes}
            for key, value in self.identity.items():
                if key not in present:
                    attributes.add(key=key).value.string_value = value
        if isinstance(self.trace_sender, TraceRouter):
            # Parsed already: split by trace id here, serialised once per part.
            self.relayed_spans += self.trace_sender.route(request)
        elif self.trace_sender.submit(request.SerializeToString(), spans):
            self.relayed_spans += spans

    def _metrics_loop(self) -> None:
        interval = self._config.metrics_interval_s
        while not self._stopped.wait(interval):
            self.export_metrics()
        self.export_metrics()

    def export_metrics(self) -> int:
        """Queue one GPU metrics request now; returns its data points (0: nothing new)."""
        if self.metric_sender is None or not self.sampler.available:
            return 0
        collected = self._gpu_metrics.collect(time.time_ns())
        if collected is None:
            return 0
        request, points = collected
        self.metric_sender.submit(request.SerializeToString(), points)
        return points

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start downstream first: sampler, relay and metric threads, then the receivers.
        Raises ReceiverStartError when a receiver cannot bind."""
        from tokentrace.collector.receivers.otlp_grpc import OtlpGrpcReceiver
        from tokentrace.collector.receivers.otlp_http import OtlpHttpReceiver

        # A sampler handed in already open is driven by its owner (tests, benchmarks).
        if not self.sampler.available:
            self.sampler.start()
        if isinstance(self.trace_sender, TraceRouter):
            self.trace_sender.start()  # resolves the replicas once before the first relay
        self._spawn("tokentrace-node-relay", self._relay_loop)
        if self.metric_sender is not None and self.sampler.available:
            self._spawn("tokentrace-node-metrics", self._metrics_loop)
        config = self._config
        try:
            if config.admin_endpoint:
                self._start_admin(config.admin_endpoint)
            # The collector's receivers, with the same auth and TLS options as its config.
            if config.grpc_endpoint:
                receiver: Any = OtlpGrpcReceiver(
                    self,
                    endpoint=bind_endpoint(config.grpc_endpoint),
                    auth_token=config.auth_token,
                    tls_cert_file=config.tls_cert_file,
                    tls_key_file=config.tls_key_file,
                )
                receiver.start()
                self._receivers.append(receiver)
            if config.http_endpoint:
                receiver = OtlpHttpReceiver(
                    self,
                    endpoint=bind_endpoint(config.http_endpoint),
                    auth_token=config.auth_token,
                    tls_cert_file=config.tls_cert_file,
                    tls_key_file=config.tls_key_file,
                )
                receiver.start()
                self._receivers.append(receiver)
            if config.local_socket:
                local = LocalSocketReceiver(config.local_socket, self.consume_traces)
                try:
                    local.start()
                except OSError as error:
                    raise ReceiverStartError(
                        f"local socket {config.local_socket}: {error.strerror or error}"
                    ) from None
                self._receivers.append(local)
        except Exception:
            self.shutdown()
            raise

    def _start_admin(self, endpoint: str) -> None:
        from tokentrace.agent.node.admin import NodeAdmin
        from tokentrace.collector.receivers import ReceiverStartError

        admin = NodeAdmin(self, bind_endpoint(endpoint))
        try:
            admin.start()
        except OSError as error:
            raise ReceiverStartError(
                f"admin listener cannot bind {endpoint}: {error.strerror or error}"
            ) from None
        self._admin = admin

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    @property
    def receivers(self) -> list[Any]:
        return list(self._receivers)

    def shutdown(self, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Stop upstream first: receivers, then relay what is held, then sampler and senders;
        the admin listener last. All of it within about ``timeout_s``: each stage gets what is
        left of it (a pod has its termination grace period, 30 s by default, for the whole; a
        bound per stage added up past it), and the two senders flush side by side."""
        deadline = self._monotonic() + timeout_s

        def left(cap: float = timeout_s) -> float:
            return max(0.0, min(cap, deadline - self._monotonic()))

        self._shutting_down = True
        for receiver in self._receivers:
            receiver.shutdown(left(_STAGE_CAP_S))
        self._receivers.clear()
        with self._lock:
            self._stopping = True
            self._ready.notify_all()
        self._stopped.set()
        for thread in self._threads:
            thread.join(left())
        self._threads.clear()
        self.sampler.stop()
        senders = [self.trace_sender, self.metric_sender]
        shut_down_together([sender.shutdown for sender in senders if sender is not None], left())
        admin, self._admin = self._admin, None
        if admin is not None:
            admin.shutdown(left(_STAGE_CAP_S))

    def stats(self) -> dict[str, int]:
        with self._lock:
            held = self._held_spans
        stats = {
            "held_spans": held,
            "refused_spans": self.refused_spans,
            "released_unsampled": self.released_unsampled,
            "failed_requests": self.failed_requests,
            "relayed_spans": self.relayed_spans,
        }
        stats.update({f"sampler.{k}": v for k, v in self.sampler.stats().items()})
        stats.update({f"enricher.{k}": v for k, v in self.enricher.stats().items()})
        stats.update({f"sender.{k}": v for k, v in self.trace_sender.stats().items()})
        if isinstance(self.trace_sender, TraceRouter):
            stats.update({f"route.{k}": v for k, v in self.trace_sender.routing_stats().items()})
        if self.metric_sender is not None:
            stats.update({f"metrics_sender.{k}": v for k, v in self.metric_sender.stats().items()})
        for receiver in self._receivers:
            kind = type(receiver).__name__
            stats.update({f"{kind}.{k}": v for k, v in receiver.stats().items()})
        return stats
