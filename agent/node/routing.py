"""Trace-ID routing of the node agent's relay: every span of a trace goes to the same collector.

Several collector replicas each assemble the traces they receive in memory, so all spans of one
trace must reach one replica. ``TraceRouter`` owns one ``OtlpSender`` per upstream endpoint
(created on first use, with the configured exporter's options; only the endpoint differs) and
sends each span to the endpoint that owns its trace id by rendezvous (highest-random-weight)
hashing: the owner is the endpoint whose ``blake2b(endpoint, trace id)`` is highest. That choice
needs no coordination: every node agent with the same endpoint set picks the same owner, and
adding or removing one of N endpoints moves only the ~1/N of trace ids it gains or held.

The endpoint set is a static list, or the A/AAAA records of a name (a headless Service)
re-resolved every ``resolve_interval_s``; an empty or failing answer keeps the last known set.
When an endpoint leaves the set, what its sender still has queued is taken back and routed again
over the new set (counted in ``rerouted_spans``); the request in flight finishes or fails as it
would, and that sender then shuts down. A request a sender gives up on (retries exhausted,
endpoint unreachable) is dropped and counted, as with one upstream.

Splitting costs nothing in the common case: a request whose spans all belong to one endpoint
(one trace per export, or traces that hash alike) is serialised and sent as it is. Otherwise it
becomes one complete request per endpoint, each span under a copy of its own resource and scope.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final
from urllib.parse import urlsplit

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans

from tokentrace.agent.otlp_config import PROTOCOL_GRPC, OtlpExporterConfig
from tokentrace.agent.otlp_export import (
    SHUTDOWN_ABORT_GRACE_S,
    OtlpSender,
    RateLimitedWarning,
    shut_down_together,
)
from tokentrace.collector.receivers import join_endpoint, split_endpoint

_log = logging.getLogger(__name__)

DNS_SCHEME: Final = "dns:///"
"""gRPC's name syntax for a DNS name (``dns:///host:port``); a bare ``host:port`` means the same."""
DEFAULT_RESOLVE_INTERVAL_S: Final = 5.0
"""How often a DNS target is looked up again (a replica that joins gets traffic this late)."""
_DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 5.0
_HASH_BYTES: Final = 8
_RETIRE_POLL_S: Final = 0.2
_SENDER_TOTALS: Final = ("sent_spans", "dropped_spans", "rejected_spans", "retries")

Resolver = Callable[[str, int], Iterable[tuple[str, int]]]
"""``(host, port)`` -> the socket addresses ``(ip, port)`` the name has now; raises OSError when
the lookup fails. Like ``socket.getaddrinfo``, whose answers it reduces by default."""
SenderFactory = Callable[[OtlpExporterConfig], OtlpSender]


def _trace_sender(config: OtlpExporterConfig) -> OtlpSender:
    return OtlpSender(config, signal="traces")


def resolve_addresses(host: str, port: int) -> list[tuple[str, int]]:
    """Every A/AAAA record of ``host`` as ``(ip, port)``, through ``socket.getaddrinfo``."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({(str(info[4][0]), int(info[4][1])) for info in infos})


def parse_dns_target(target: str) -> tuple[str, int]:
    """``dns:///HOST:PORT`` or ``HOST:PORT`` -> (host, port); ValueError in one line."""
    name = target.strip()
    if name.startswith(DNS_SCHEME):
        name = name[len(DNS_SCHEME) :]
    elif "://" in name:
        raise ValueError(f"expected dns:///HOST:PORT or HOST:PORT, got {target!r}")
    try:
        return split_endpoint(name)
    except ValueError:
        raise ValueError(f"expected dns:///HOST:PORT or HOST:PORT, got {target!r}") from None


def endpoint_config(exporter: OtlpExporterConfig, endpoint: str) -> OtlpExporterConfig:
    """``exporter`` sending traces to ``endpoint`` (a base endpoint, as ``--upstream`` takes it),
    everything else as configured."""
    return dataclasses.replace(exporter, endpoint=endpoint, traces_endpoint="", metrics_endpoint="")


def address_endpoint(exporter: OtlpExporterConfig, host: str, port: int) -> str:
    """The endpoint of one resolved address, in the scheme of the configured upstream
    (``http://`` plaintext, ``https://`` TLS; gRPC without a scheme: TLS, as configured)."""
    configured = exporter.endpoint_for("traces") or ""
    scheme = urlsplit(configured).scheme.lower() if "://" in configured else ""
    address = join_endpoint(host, port)
    if scheme in ("http", "https"):
        return f"{scheme}://{address}"
    if exporter.protocol == PROTOCOL_GRPC:
        return address
    return f"http://{address}"


class EndpointHashes:
    """Rendezvous hashing over one endpoint set (immutable): ``owner(trace_id)``."""

    __slots__ = ("_hashes", "endpoints")

    def __init__(self, endpoints: Iterable[str]) -> None:
        self.endpoints: tuple[str, ...] = tuple(sorted(set(endpoints)))
        # The endpoint's part of each weight, hashed once: per trace id only a copy and update.
        self._hashes = [
            (endpoint, hashlib.blake2b(endpoint.encode() + b"\0", digest_size=_HASH_BYTES))
            for endpoint in self.endpoints
        ]

    def owner(self, trace_id: bytes) -> str:
        """The endpoint with the highest weight for ``trace_id`` (ties: the greater name)."""
        best_weight = -1
        best = ""
        for endpoint, prefix in self._hashes:
            digest = prefix.copy()
            digest.update(trace_id)
            weight = int.from_bytes(digest.digest(), "big")
            if weight > best_weight or (weight == best_weight and endpoint > best):
                best_weight, best = weight, endpoint
        return best


def split_by_owner(
    request: ExportTraceServiceRequest, owner: Callable[[bytes], str]
) -> dict[str, tuple[ExportTraceServiceRequest | None, int]]:
    """Each endpoint's part of ``request``: ``{endpoint: (request or None, spans)}``, None
    meaning the whole ``request`` (all its spans have that owner: nothing is copied). Each part
    keeps every span under a copy of its own resource and scope (attributes, schema URLs)."""
    owners: dict[bytes, str] = {}
    span_owners: list[list[list[str]]] = []
    counts: dict[str, int] = {}
    for resource_spans in request.resource_spans:
        per_scope = []
        for scope_spans in resource_spans.scope_spans:
            names = []
            for span in scope_spans.spans:
                trace_id = span.trace_id
                name = owners.get(trace_id)
                if name is None:
                    name = owners[trace_id] = owner(trace_id)
                names.append(name)
                counts[name] = counts.get(name, 0) + 1
            per_scope.append(names)
        span_owners.append(per_scope)
    if len(counts) <= 1:
        return {name: (None, spans) for name, spans in counts.items()}
    parts = {name: ExportTraceServiceRequest() for name in counts}
    for resource_spans, per_scope in zip(request.resource_spans, span_owners, strict=True):
        resource_parts: dict[str, ResourceSpans] = {}
        for scope_spans, names in zip(resource_spans.scope_spans, per_scope, strict=True):
            scope_parts: dict[str, ScopeSpans] = {}
            for span, name in zip(scope_spans.spans, names, strict=True):
                scope_part = scope_parts.get(name)
                if scope_part is None:
                    resource_part = resource_parts.get(name)
                    if resource_part is None:
                        resource_part = resource_parts[name] = parts[name].resource_spans.add()
                        resource_part.resource.CopyFrom(resource_spans.resource)
                        resource_part.schema_url = resource_spans.schema_url
                    scope_part = scope_parts[name] = resource_part.scope_spans.add()
                    scope_part.scope.CopyFrom(scope_spans.scope)
                    scope_part.schema_url = scope_spans.schema_url
                scope_part.spans.append(span)
    return {name: (parts[name], counts[name]) for name in counts}


class TraceRouter:
    """Sends each span of the node agent's requests to the collector replica owning its trace
    (module docstring). Give ``endpoints`` (a static set) or ``dns_target`` (re-resolved)."""

    def __init__(
        self,
        exporter: OtlpExporterConfig,
        *,
        endpoints: Sequence[str] = (),
        dns_target: str | None = None,
        resolver: Resolver | None = None,
        resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
        sender_factory: SenderFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Raises ValueError for an invalid endpoint or target, or neither or both given."""
        if bool(endpoints) == (dns_target is not None):
            raise ValueError("give either upstream endpoints or a DNS name to resolve them from")
        self._exporter = exporter
        self._sender_factory = sender_factory or _trace_sender
        self._resolver = resolver or resolve_addresses
        self._resolve_interval_s = resolve_interval_s
        self._dns: tuple[str, int] | None = None
        if dns_target is not None:
            self._dns = parse_dns_target(dns_target)
            # Until the first answer: the name itself, which the sender's own resolution reaches.
            initial = [address_endpoint(exporter, *self._dns)]
        else:
            initial = list(endpoints)
        for endpoint in initial:
            endpoint_config(exporter, endpoint).validate()
        self._description = dns_target.strip() if dns_target is not None else ", ".join(initial)
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._hashes = EndpointHashes(initial)
        self._senders: dict[str, OtlpSender] = {}
        self._routed: dict[str, int] = dict.fromkeys(self._hashes.endpoints, 0)
        self._retiring: dict[OtlpSender, threading.Thread] = {}
        self._retired_totals = dict.fromkeys(_SENDER_TOTALS, 0)
        self._rerouted_spans = 0
        self._set_changes = 0
        self._resolve_failures = 0
        self._resolved_once = False
        self._warning = RateLimitedWarning(clock, log=_log)
        self._stop = threading.Event()
        self._shutdown_timeout_s = _DEFAULT_SHUTDOWN_TIMEOUT_S
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """What the router sends to, for messages: the DNS target or the static list."""
        return self._description

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The current endpoint set, sorted."""
        return self._hashes.endpoints

    def owner(self, trace_id: bytes) -> str:
        """The endpoint that trace ``trace_id`` goes to now."""
        return self._hashes.owner(trace_id)

    def sender(self, endpoint: str) -> OtlpSender | None:
        """The sender of ``endpoint`` if one was made (it is made on first use)."""
        with self._lock:
            return self._senders.get(endpoint)

    # --- relay thread ------------------------------------------------------------------------
    def route(self, request: ExportTraceServiceRequest) -> int:
        """Queue ``request``'s spans with their owners' senders; returns the spans taken
        (the rest were dropped and counted by a full or closed sender)."""
        with self._lock:
            hashes = self._hashes
            return self._submit_parts(split_by_owner(request, hashes.owner), request)

    def _submit_parts(
        self,
        parts: dict[str, tuple[ExportTraceServiceRequest | None, int]],
        whole: ExportTraceServiceRequest,
        *,
        payload: bytes | None = None,
    ) -> int:
        """Submit each part to its endpoint's sender (the lock is held)."""
        taken = 0
        for endpoint, (part, spans) in parts.items():
            if part is None:
                encoded = payload if payload is not None else whole.SerializeToString()
            else:
                encoded = part.SerializeToString()
            sender = self._senders.get(endpoint)
            if sender is None:
                sender = self._senders[endpoint] = self._sender_factory(
                    endpoint_config(self._exporter, endpoint)
                )
                if self._closed:  # after shutdown: counted as dropped, no thread left behind
                    sender.shutdown(0.0)
            if sender.submit(encoded, spans):
                taken += spans
                self._routed[endpoint] = self._routed.get(endpoint, 0) + spans
        return taken

    # --- endpoint set --------------------------------------------------------------------------
    def start(self) -> None:
        """Resolve the name once now (a DNS target), then every ``resolve_interval_s`` on a
        thread of its own."""
        if self._dns is None or self._thread is not None:
            return
        self.refresh()
        self._thread = threading.Thread(
            target=self._resolve_loop, name="tokentrace-node-route-dns", daemon=True
        )
        self._thread.start()

    def _resolve_loop(self) -> None:
        while not self._stop.wait(self._resolve_interval_s):
            try:
                self.refresh()
            except Exception:  # the loop must outlive one bad answer
                _log.exception("tokentrace node agent: resolving the upstream replicas failed")

    def refresh(self) -> bool:
        """Resolve the DNS target now and apply a changed answer; False when the lookup failed
        or was empty (the last known set stays), True otherwise. Nothing to do for a static set."""
        if self._dns is None:
            return True
        host, port = self._dns
        with self._refresh_lock:
            try:
                addresses = list(self._resolver(host, port))
            except (OSError, UnicodeError) as error:  # UnicodeError: a name IDNA refuses
                self._resolve_failures += 1
                self._warning.warn(
                    "tokentrace node agent: resolving %s failed (%s); keeping %d upstream "
                    "endpoint(s)",
                    self._description,
                    error,
                    len(self._hashes.endpoints),
                )
                return False
            if not addresses:
                self._resolve_failures += 1
                self._warning.warn(
                    "tokentrace node agent: %s has no address; keeping %d upstream endpoint(s)",
                    self._description,
                    len(self._hashes.endpoints),
                )
                return False
            endpoints = {address_endpoint(self._exporter, ip, p) for ip, p in addresses}
            self._apply(endpoints)
            return True

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        """Replace the endpoint set (what ``refresh`` does with a new answer)."""
        endpoints = set(endpoints)
        if not endpoints:
            raise ValueError("the upstream endpoint set must not be empty")
        with self._refresh_lock:
            self._apply(endpoints)

    def _apply(self, endpoints: set[str]) -> None:
        """Switch to ``endpoints``: route what the leaving senders have queued again, then
        retire them (the refresh lock is held)."""
        with self._lock:
            old = self._hashes
            first = not self._resolved_once
            self._resolved_once = True
            if set(old.endpoints) == endpoints:
                return
            self._hashes = hashes = EndpointHashes(endpoints)
            if not first or self._dns is None:
                self._set_changes += 1
            leaving = [e for e in old.endpoints if e not in endpoints]
            for endpoint in leaving:
                self._routed.pop(endpoint, None)
            for endpoint in hashes.endpoints:
                self._routed.setdefault(endpoint, 0)
            retiring = [
                sender for e in leaving if (sender := self._senders.pop(e, None)) is not None
            ]
            rerouted = 0
            for sender in retiring:
                for payload, spans in sender.take_queued():
                    request = ExportTraceServiceRequest.FromString(payload)
                    rerouted += spans
                    self._submit_parts(
                        split_by_owner(request, hashes.owner), request, payload=payload
                    )
            self._rerouted_spans += rerouted
            # Registered before the lock is let go, so that ``stats`` always counts them.
            retirements = [self._retirement(sender) for sender in retiring]
        _log.info(
            "tokentrace node agent: upstream endpoints now %s (%d re-routed spans)",
            ", ".join(hashes.endpoints),
            rerouted,
        )
        for thread in retirements:
            thread.start()

    def _retirement(self, sender: OtlpSender) -> threading.Thread:
        """The thread (to start) that lets the request in flight finish or fail as it would (at
        most the exporter's retry time), then shuts ``sender`` down and keeps its counts: the
        relay must not wait for a dead endpoint. ``shutdown`` cuts the wait short. The lock is
        held."""
        exporter = self._exporter
        deadline = time.monotonic() + exporter.retry.max_elapsed_s + exporter.timeout_s + 1.0

        def run() -> None:
            while not self._stop.is_set() and time.monotonic() < deadline:
                if sender.force_flush(_RETIRE_POLL_S):
                    break
            sender.shutdown(self._shutdown_timeout_s)
            stats = sender.stats()
            with self._lock:
                for key in _SENDER_TOTALS:
                    self._retired_totals[key] += stats[key]
                self._retiring.pop(sender, None)

        thread = threading.Thread(target=run, name="tokentrace-node-route-retire", daemon=True)
        self._retiring[sender] = thread
        return thread

    # --- lifecycle and counters ----------------------------------------------------------------
    def force_flush(self, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> bool:
        """Wait until every current sender sent or gave up what it has; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            senders = list(self._senders.values())
        return all(s.force_flush(max(0.0, deadline - time.monotonic())) for s in senders)

    def shutdown(self, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Stop resolving; shut every sender down (``OtlpSender.shutdown``: send what can be
        sent within ``timeout_s``, drop and count the rest), retiring ones too, in parallel."""
        deadline = time.monotonic() + timeout_s
        self._shutdown_timeout_s = timeout_s
        self._stop.set()  # retiring senders stop waiting and shut down with timeout_s
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            self._closed = True
            senders = list(self._senders.values())
            threads = list(self._retiring.values())
        shut_down_together(
            [sender.shutdown for sender in senders], max(0.0, deadline - time.monotonic())
        )
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + SHUTDOWN_ABORT_GRACE_S)

    def endpoint_spans(self) -> dict[str, int]:
        """Spans routed to each current endpoint (re-routed ones included)."""
        with self._lock:
            return dict(self._routed)

    def stats(self) -> dict[str, int]:
        """The senders' counters summed, retired ones included: the keys of ``OtlpSender.stats``
        (``sent_spans``, ``dropped_spans``, ``rejected_spans``, ``retries``, ``queue_len``)."""
        with self._lock:
            senders = list(self._senders.values()) + list(self._retiring)
            totals = dict(self._retired_totals)
        totals["queue_len"] = 0
        for sender in senders:
            for key, value in sender.stats().items():
                totals[key] = totals.get(key, 0) + value
        return totals

    def routing_stats(self) -> dict[str, int]:
        """``endpoints`` (now), ``endpoint_set_changes`` (not counting the first DNS answer,
        which replaces the name itself), ``rerouted_spans`` (taken back from a leaving
        endpoint's queue and routed again), ``resolve_failures`` (failed or empty DNS answers),
        ``routed_spans.<endpoint>`` per current endpoint (re-routed spans included) and
        ``max_queue_len`` (the spans queued for the current endpoint with the most)."""
        with self._lock:
            counters = {
                "endpoints": len(self._hashes.endpoints),
                "endpoint_set_changes": self._set_changes,
                "rerouted_spans": self._rerouted_spans,
                "resolve_failures": self._resolve_failures,
            }
            counters.update({f"routed_spans.{e}": n for e, n in self._routed.items()})
            senders = list(self._senders.values())
        # The fullest replica's queue: when it is full, that replica's traces are dropped.
        counters["max_queue_len"] = max((s.stats()["queue_len"] for s in senders), default=0)
        return counters
