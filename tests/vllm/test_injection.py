"""The injection image on the real vLLM: the engine's own install, nothing but the environment
that the injection sets, and the collector receives full traces.

The engine is `engine_environment` (tests/deploy/injection.py): the project's environment
without tokentrace, opentelemetry-instrumentation and wrapt, i.e. vLLM as its own image has it,
protobuf, grpcio and opentelemetry included. vLLM starts there with no ``tokentrace run``, no
plugin allow-list, no change to its install: only what our Kustomize component sets
(``PYTHONPATH=<tree>/bootstrap``, the tree being deploy/images/install.sh's output) and OTEL_*
variables naming an in-process collector, which stores the requests and forwards everything to a
test-owned receiver. Two more variables are the test's, not the injection's:
``TOKENTRACE_STEP_SAMPLE_RATE=1`` (every engine step exported: EngineCore's own spans are
checked) and ``PYTHONVERBOSE=1`` (Python logs the file of every module each process loads, so
the test can tell which copy of protobuf, grpcio and opentelemetry the engine ran on).

Its own server (one start, ~40 s): the shared one runs under the project's environment, where
tokentrace is installed, and could not show that the injected tree alone traces vLLM.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.collector.upstream import UpstreamOtlp
from tests.deploy.injection import (
    PACKAGES_DIR,
    engine_environment,
    engine_site_packages,
    injection_tree,
    kustomize_pythonpath,
)
from tests.spanbuild import attributes_of
from tests.vllm.openai_api import REQUEST_TIMEOUT_S
from tests.vllm.shared_server import require_vllm
from tests.vllm.test_instrumentation import Sent, check_request, cold_start_spans, send
from tests.vllm.traces import RequestTree, exported_spans, request_trees
from tokentrace.agent import semconv
from tokentrace.collector.config import parse_config
from tokentrace.collector.service import Collector
from tokentrace.collector.store import RequestStore
from tokentrace.loadgen.local_vllm import VllmServer, running_vllm_server

require_vllm()
pytestmark = pytest.mark.slow

SERVICE_NAME = "vllm-injected"
_MAX_TOKENS = 6
_REQUESTS = 3
_WAIT_S = 30.0
_HOST_PACKAGES = ("google/protobuf", "grpc", "opentelemetry/trace", "opentelemetry/sdk")
"""Packages the engine has: every process must load them from the engine's site-packages."""
_FILLED_PACKAGES = {"tokentrace", "wrapt", "opentelemetry/instrumentation"}
"""What the engine lacks: the only packages the processes may load from the tree."""
_NATIVE_MODULES = ("cygrpc", "_upb/_message")
"""grpcio's and protobuf's extension modules, as their mapped files are named."""
_LOADED_FILE = re.compile(
    r"^# (?:code object from |extension module '[^']+' loaded from )'([^']+)'"
)


@dataclass(frozen=True)
class InjectedServer:
    server: VllmServer
    upstream: UpstreamOtlp
    """What the collector forwards: every span the engine's processes exported."""
    store_path: Path
    tree: Path
    site_packages: Path
    """The engine's site-packages (a mirror of links: files resolve into the project's)."""


# Own server: vLLM in an environment without tokentrace, traced by the injected tree alone.
@pytest.fixture(scope="module")
def injected(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InjectedServer]:
    workdir = tmp_path_factory.mktemp("injected-vllm")
    tree = injection_tree()
    engine_python = engine_environment(workdir / "engine")
    store_path = workdir / "store.db"
    with UpstreamOtlp() as upstream:
        collector = Collector(
            parse_config(
                {
                    "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}},
                    "processors": {"assembly": {"quiet_period": "1s", "root_grace": "500ms"}},
                    "exporters": {
                        "store": {"path": str(store_path)},
                        "otlp": {"endpoint": upstream.grpc_endpoint},
                    },
                },
                environ={},
            )
        )
        collector.start()
        env = {
            # What the injection sets: the tree, and where the spans go (gRPC, as to a node
            # agent), for every process the server starts.
            "PYTHONPATH": kustomize_pythonpath(tree),
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.grpc_port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_SERVICE_NAME": SERVICE_NAME,
            # The test's own (see the module docstring).
            "TOKENTRACE_STEP_SAMPLE_RATE": "1",
            "PYTHONVERBOSE": "1",
            # No working directory on sys.path (a stale egg-info there would be a tokentrace).
            "PYTHONSAFEPATH": "1",
        }
        try:
            with running_vllm_server(
                tiny_model_dir,
                log_path=workdir / "server.log",
                env=env,
                # running_vllm_server runs this interpreter; the engine's runs in its place
                # (the shell drops the first argument, this interpreter's path).
                command_prefix=[
                    "sh",
                    "-c",
                    f'shift; exec {shlex.quote(str(engine_python))} "$@"',
                    "sh",
                ],
            ) as server:
                yield InjectedServer(
                    server,
                    upstream,
                    store_path,
                    tree,
                    engine_site_packages(engine_python),
                )
        finally:
            collector.shutdown()


def loaded_files(log_path: Path) -> list[str]:
    """Every module file a server process loaded (PYTHONVERBOSE's lines in the server log)."""
    text = log_path.read_text(encoding="utf-8", errors="replace")
    return [match[1] for line in text.splitlines() if (match := _LOADED_FILE.match(line))]


@dataclass(frozen=True)
class _Exports:
    """Stored OTLP exports in the shape `request_trees` reads (``UpstreamOtlp.trace_requests``)."""

    trace_requests: list[ExportTraceServiceRequest]


def stored_trees(store_path: Path, sent: list[Sent]) -> dict[str, RequestTree] | None:
    """The sent requests' trees from the traces the collector stored (their HTTP server spans
    included); None until every one is there."""
    store = RequestStore.open_readonly(store_path)
    try:
        stored = [store.trace_otlp(cast(bytes, s.trace_id)) for s in sent]
    finally:
        store.close()
    if any(otlp is None for otlp in stored):
        return None
    exports = [ExportTraceServiceRequest.FromString(cast(bytes, otlp)) for otlp in stored]
    trees = request_trees(cast(UpstreamOtlp, _Exports(exports)))
    by_marker = {s.marker: [t for i, t in trees.items() if s.marker in i] for s in sent}
    if not all(len(found) == 1 and found[0].parent is not None for found in by_marker.values()):
        return None
    return {s.marker: by_marker[s.marker][0] for s in sent}


def engine_steps_of(upstream: UpstreamOtlp, request_id: str) -> list[Any]:
    """The sampled engine steps (roots of their own traces) that ran `request_id`."""

    def ran(span: Any) -> bool:
        ids = attributes_of(span)[semconv.ENGINE_STEP_REQUEST_IDS]
        return isinstance(ids, list) and any(str(i).startswith(request_id) for i in ids)

    return [
        span
        for _, span in exported_spans(upstream)
        if span.name == semconv.SPAN_ENGINE_STEP and not span.parent_span_id and ran(span)
    ]


def mapped_files(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
        return {line.split(maxsplit=5)[5].strip() for line in maps if len(line.split()) == 6}


def package_of(path: Path) -> str:
    """``grpc`` for grpc/..., ``opentelemetry/trace`` for a namespace package's portion."""
    parts = path.parts
    return "/".join(parts[:2]) if parts[0] in ("opentelemetry", "google") else parts[0]


def test_the_injected_tree_alone_traces_the_real_vllm_on_the_engines_own_packages(
    injected: InjectedServer,
) -> None:
    async def send_all() -> list[Sent]:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            requests = [
                send(
                    client,
                    injected.server,
                    chat=index % 2 == 1,
                    stream=True,
                    max_tokens=_MAX_TOKENS,
                    with_traceparent=True,
                )
                for index in range(_REQUESTS)
            ]
            return list(await asyncio.gather(*requests))

    sent = asyncio.run(send_all())
    log = injected.server.log_tail
    # The collector stored each request's whole trace: the HTTP server span under the caller's
    # traceparent holding llm.request, its queue -> prefill -> decode -> postprocess, the usage.
    assert injected.upstream.wait_for(
        lambda: stored_trees(injected.store_path, sent) is not None, _WAIT_S
    ), log()
    trees = stored_trees(injected.store_path, sent)
    assert trees is not None
    store = RequestStore.open_readonly(injected.store_path)
    try:
        documents = [store.get(cast(bytes, s.trace_id).hex()) for s in sent]
    finally:
        store.close()
    for s, document in zip(sent, documents, strict=True):
        check_request(s, trees[s.marker], _MAX_TOKENS)
        assert document is not None
        assert document["service"] == SERVICE_NAME
        assert document["tokens"]["output"] == _MAX_TOKENS

    # EngineCore was injected too: every engine step that ran a request (one prefill, then one
    # per later token) reached the collector, which forwarded it.
    request_ids = [str(trees[s.marker].attributes[semconv.REQUEST_ID]) for s in sent]
    assert injected.upstream.wait_for(
        lambda: all(len(engine_steps_of(injected.upstream, i)) >= _MAX_TOKENS for i in request_ids),
        _WAIT_S,
    ), log()
    for request_id in request_ids:
        assert len(engine_steps_of(injected.upstream, request_id)) == _MAX_TOKENS

    # Each process reported its part of the cold start: the API server its root, EngineCore
    # the KV cache, the worker the weights; their process ids say whose memory to look at.
    assert injected.upstream.wait_for(
        lambda: any(
            s.name == semconv.SPAN_COLD_START_KV_CACHE
            for _, s in cold_start_spans(injected.upstream)
        ),
        _WAIT_S,
    ), log()
    spans = cold_start_spans(injected.upstream)
    (api_server,) = [pid for pid, span in spans if span.name == semconv.SPAN_COLD_START]
    (engine_core,) = [pid for pid, span in spans if span.name == semconv.SPAN_COLD_START_KV_CACHE]
    (worker,) = [pid for pid, span in spans if span.name == semconv.SPAN_COLD_START_WEIGHT_LOAD]
    assert api_server != engine_core

    # grpcio's and protobuf's native modules in the exporting processes' memory are the
    # engine's (the engine's site-packages are links: the mapped files are their targets).
    engine_files = (injected.site_packages / "grpc").resolve().parent
    for pid in {api_server, engine_core, worker}:
        files = mapped_files(pid)
        for native in _NATIVE_MODULES:
            paths = [Path(f) for f in files if native in f]
            assert paths or pid == worker, (pid, native)
            for path in paths:
                assert path.is_relative_to(engine_files), (pid, path)
                assert not path.is_relative_to(injected.tree), (pid, path)

    # And every module file any server process loaded (PYTHONVERBOSE) of protobuf, grpcio and
    # opentelemetry's API and SDK is the engine's; from the tree came only what it lacks.
    packages = injected.tree / PACKAGES_DIR
    loaded = [Path(f) for f in loaded_files(injected.server.log_path)]
    from_tree = {package_of(p.relative_to(packages)) for p in loaded if p.is_relative_to(packages)}
    assert {"tokentrace", "wrapt"} <= from_tree <= _FILLED_PACKAGES, from_tree
    from_engine = {
        package_of(p.relative_to(injected.site_packages))
        for p in loaded
        if p.is_relative_to(injected.site_packages)
    }
    assert set(_HOST_PACKAGES) <= from_engine, sorted(from_engine)[:50]
    print(
        f"\ninjected vLLM ready in {injected.server.started_in_s:.1f} s; processes "
        f"{sorted({api_server, engine_core, worker})}; {len(loaded)} module files loaded, "
        f"from the tree only: {sorted(from_tree)}"
    )
