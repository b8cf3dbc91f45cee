"""Record real SGLang spans for the dialect's fast tests (``tests/sglang/data/``).

Run in the project's environment, naming SGLang's interpreter::

    TOKENTRACE_SGLANG_PYTHON=<sglang venv>/bin/python python -m tests.sglang.record_capture OUT.json

It builds the tiny random Llama, starts SGLang with ``--enable-trace`` exporting to a recording
OTLP receiver (``tests/collector/upstream.py``), sends two streaming completions one after the
other (a ``traceparent`` each, so that the capture also shows SGLang continuing a caller's
trace) and writes every ``ExportTraceServiceRequest`` it received as OTLP/JSON (protobuf's JSON
mapping, one request per list entry) together with what the client measured.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

import httpx
from google.protobuf import json_format

from tests.collector.upstream import UpstreamOtlp
from tests.sglang.shared_server import SGLANG_PYTHON_ENV, running_sglang_server
from tests.sglang.streaming import stream_completion
from tokentrace.agent import semconv
from tokentrace.loadgen.tiny_model import build_tiny_model

_REQUESTS = 2
_MAX_TOKENS = 8
_SPANS_TIMEOUT_S = 30.0


def main(out: Path) -> None:
    python = os.environ[SGLANG_PYTHON_ENV]
    with tempfile.TemporaryDirectory() as tmp, UpstreamOtlp() as upstream:
        model_dir = build_tiny_model(Path(tmp) / "model")
        endpoint = upstream.grpc_endpoint.removeprefix("http://")
        with running_sglang_server(
            python, model_dir, log_path=Path(tmp) / "server.log", otlp_endpoint=endpoint
        ) as server:
            clients = []
            with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
                for _ in range(_REQUESTS):
                    trace_id = secrets.token_hex(16)
                    result = stream_completion(
                        http, model=server.model_name, max_tokens=_MAX_TOKENS, trace_id=trace_id
                    )
                    clients.append(result.as_dict())
            deadline = time.monotonic() + _SPANS_TIMEOUT_S
            while time.monotonic() < deadline:
                time.sleep(1.0)
                names = [
                    span.name
                    for request in upstream.trace_requests
                    for rs in request.resource_spans
                    for ss in rs.scope_spans
                    for span in ss.spans
                ]
                if sum(semconv.SGLANG_SPAN_REQUEST_MARK in name for name in names) >= _REQUESTS:
                    break
            time.sleep(1.0)
        requests = [json_format.MessageToDict(r) for r in upstream.trace_requests]
    out.write_text(
        json.dumps({"clients": clients, "export_requests": requests}, indent=1) + "\n",
        encoding="utf-8",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
