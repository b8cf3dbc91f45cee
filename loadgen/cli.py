"""``tokentrace load URL``: send a reproducible load to an OpenAI-compatible server, trace every
request as a client span, print client-side TTFT/TPOT/ITL/E2E percentiles and save a run record.

Import-light (argparse only) like every command module: the work happens in ``run``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Final

_DEFAULT_OTLP_PROTOCOL: Final = "grpc"
_PROGRESS_INTERVAL_TTY_S: Final = 0.5
_PROGRESS_INTERVAL_PIPE_S: Final = 10.0
_MODELS_TIMEOUT_S: Final = 30.0
_API_KEY_ENV: Final = "OPENAI_API_KEY"
_AUTHORIZATION: Final = "Authorization"
_AUTH_REFUSED: Final = frozenset({401, 403})
_HEADERS_SET_BY_LOAD: Final = frozenset({"traceparent", "host", "connection"})
"""Set per request or per connection by the load client (``--no-reuse-connections`` decides
``Connection``); the HTTP client's framing headers (``http.FRAMING_HEADERS``) are refused too."""


class LoadCommand:
    name = "load"
    help = (
        "send a reproducible load to an OpenAI-compatible endpoint, trace each request, print "
        "client-side TTFT/TPOT/ITL/E2E percentiles and save a run record"
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
        parser.add_argument("--model", help="model name (default: the first of GET /v1/models)")
        parser.add_argument(
            "--api", choices=("chat", "completions"), default="chat", help="default: chat"
        )
        parser.add_argument(
            "--no-stream", dest="stream", action="store_false", help="ask for whole responses"
        )
        shape = parser.add_argument_group("arrivals (default: --concurrency 1)")
        shape.add_argument("--concurrency", type=int, help="requests in flight (closed loop)")
        shape.add_argument(
            "--rate",
            type=float,
            help="Poisson arrivals at this many requests/s (open loop; with --concurrency, "
            "that many in flight at most)",
        )
        shape.add_argument("--requests", type=int, help="measured requests (default: 100)")
        shape.add_argument("--duration", help="stop issuing after this long, e.g. 60s or 5m")
        shape.add_argument(
            "--warmup", type=int, default=0, help="unmeasured requests sent first (default: 0)"
        )
        shape.add_argument("--seed", type=int, default=0, help="same seed, same requests")
        lengths = parser.add_argument_group(
            "lengths: N | fixed:N | uniform:LOW:HIGH | normal:MEAN:STDDEV"
        )
        lengths.add_argument("--prompt-tokens", default="128", help="default: 128")
        lengths.add_argument("--output-tokens", default="64", help="default: 64")
        lengths.add_argument(
            "--dataset",
            help='JSONL prompts: {"prompt": ...} or {"messages": [...]}, optional "output_tokens"',
        )
        lengths.add_argument(
            "--tokenizer", help="tokenizer dir or name for exact prompt lengths (transformers)"
        )
        lengths.add_argument(
            "--shared-prefix-fraction",
            type=float,
            default=0.0,
            metavar="FRACTION",
            help="share of requests that start with one shared prefix (prefix-cache experiments)",
        )
        lengths.add_argument("--shared-prefix-tokens", type=int, default=512, help="default: 512")
        lengths.add_argument(
            "--no-ignore-eos",
            dest="ignore_eos",
            action="store_false",
            help="let the model stop early (by default vLLM's ignore_eos makes outputs exact)",
        )
        client = parser.add_argument_group("client")
        client.add_argument(
            "--no-reuse-connections",
            dest="reuse_connections",
            action="store_false",
            help="a new connection per request (default: keep-alive)",
        )
        client.add_argument("--timeout", default="600s", help="per request (default: 600s)")
        client.add_argument(
            "--api-key",
            help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY; never recorded)",
        )
        client.add_argument(
            "--header",
            dest="headers",
            action="append",
            default=[],
            metavar="'NAME: VALUE'",
            help="an extra request header, repeatable (never recorded)",
        )
        client.add_argument(
            "--otlp-endpoint",
            help="where client spans go, e.g. http://127.0.0.1:4317 "
            "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; none: spans are not exported)",
        )
        client.add_argument(
            "--otlp-protocol",
            choices=("grpc", "http/protobuf"),
            help="with --otlp-endpoint (default: grpc)",
        )
        out = parser.add_argument_group("output")
        out.add_argument("--slo", metavar="FILE", help="SLO targets file, judged client side")
        out.add_argument(
            "--out",
            metavar="FILE",
            help="run record path (default: tokentrace-run-<UTC time>.json here)",
        )
        out.add_argument(
            "--percentiles",
            default="50,90,95,99",
            help="reported percentiles (default: 50,90,95,99)",
        )
        out.add_argument("--json", action="store_true", help="print the run summary as JSON")
        out.add_argument("--quiet", action="store_true", help="no progress line")

    def run(self, args: argparse.Namespace) -> int:
        try:
            return _run(args)
        except _UsageError as error:
            print(f"tokentrace load: {error}", file=sys.stderr)
            return 2
        except _RunError as error:
            print(f"tokentrace load: {error}", file=sys.stderr)
            return 1


class _UsageError(Exception):
    pass


class _RunError(Exception):
    pass


def _run(args: argparse.Namespace) -> int:
    import json

    from tokentrace.loadgen import record as run_record
    from tokentrace.loadgen.lengths import WorkloadError
    from tokentrace.loadgen.report import client_slo, render
    from tokentrace.loadgen.results import summarize
    from tokentrace.loadgen.runner import LoadRunner
    from tokentrace.loadgen.workload import RequestPlanner, prompt_builder

    config = _config(args)
    if args.otlp_protocol and not args.otlp_endpoint:  # before any request reaches the server
        raise _UsageError("--otlp-protocol needs --otlp-endpoint")
    percents = _percents(args.percentiles)
    targets = _slo_targets(args.slo) if args.slo else []
    out_path = args.out or time.strftime("tokentrace-run-%Y%m%d-%H%M%S.json", time.gmtime())
    headers = _headers(args.headers, args.api_key or os.environ.get(_API_KEY_ENV) or None)
    model = args.model or _discover_model(
        config.server_url, headers=headers, timeout_s=_MODELS_TIMEOUT_S
    )
    try:
        planner = RequestPlanner(config, model=model, builder=prompt_builder(config))
    except WorkloadError as error:
        raise _UsageError(str(error)) from None
    exporter = _exporter(args)
    progress = None if args.quiet else _Progress(sys.stderr)
    runner = LoadRunner(
        config, model=model, planner=planner, spans=exporter, progress=progress, headers=headers
    )
    try:
        outcome = runner.run()
    finally:
        if progress is not None:
            progress.close()
        export_stats = exporter.shutdown() if exporter is not None else {}
    summary = summarize(outcome.results, duration_ns=outcome.duration_ns, percents=percents)
    record = run_record.RunRecord(
        config=config.to_dict(),
        identity=config.load_identity(),
        model=model,
        window_start_ns=outcome.window_start_ns,
        window_end_ns=outcome.window_end_ns,
        summary=summary,
        results=outcome.results,
        slo=client_slo(outcome.results, targets, model=model) if targets else [],
        warmup_failed=outcome.warmup_failed,
        export=export_stats,
        http=outcome.http_stats,
    )
    try:
        saved = run_record.save(record, out_path)
    except run_record.RunRecordError as error:
        raise _RunError(str(error)) from None
    if args.json:
        print(json.dumps({**summary, "slo": record.slo, "run_record": str(saved)}, indent=2))
    else:
        print(render(record, record_path=str(saved)))
    if summary["completed"] == 0 and summary["requests"] > 0:
        return 1
    return 0


def _config(args: argparse.Namespace) -> Any:
    from tokentrace.loadgen.lengths import WorkloadError, parse_length
    from tokentrace.loadgen.workload import LoadConfig
    from tokentrace.processors.durations import parse_duration_ns

    def seconds(option: str, text: str | None) -> float | None:
        if text is None:
            return None
        try:
            return parse_duration_ns(text) / 1e9
        except ValueError as error:
            raise _UsageError(f"{option}: {error}") from None

    try:
        config = LoadConfig(
            base_url=args.url,
            model=args.model,
            api=args.api,
            stream=args.stream,
            concurrency=args.concurrency,
            rate=args.rate,
            requests=args.requests,
            duration_s=seconds("--duration", args.duration),
            prompt_tokens=parse_length(args.prompt_tokens, option="--prompt-tokens"),
            output_tokens=parse_length(args.output_tokens, option="--output-tokens"),
            dataset=args.dataset,
            shared_prefix_fraction=args.shared_prefix_fraction,
            shared_prefix_tokens=args.shared_prefix_tokens,
            warmup_requests=args.warmup,
            seed=args.seed,
            reuse_connections=args.reuse_connections,
            ignore_eos=args.ignore_eos,
            timeout_s=seconds("--timeout", args.timeout) or 0.0,
            tokenizer=args.tokenizer,
        )
        config.validate()
    except WorkloadError as error:
        raise _UsageError(str(error)) from None
    return config


def _percents(text: str) -> tuple[float, ...]:
    try:
        percents = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise _UsageError(
            f"--percentiles: expected numbers such as 50,95,99, got {text!r}"
        ) from None
    if not percents or any(not 0 <= percent <= 100 for percent in percents):
        raise _UsageError(f"--percentiles: each must be within [0, 100], got {text!r}")
    return percents


def _slo_targets(path: str) -> list[Any]:
    try:
        from tokentrace.processors.slo import read_slo_file
    except ImportError as error:
        raise _UsageError(
            f"--slo needs the collector extra (pip install 'tokentrace[collector]'): {error}"
        ) from None
    try:
        return read_slo_file(path)
    except ImportError as error:  # PyYAML, imported when a file is read
        raise _UsageError(f"--slo needs PyYAML (pip install pyyaml): {error}") from None
    except ValueError as error:
        raise _UsageError(f"--slo: {error}") from None


def _headers(options: list[str], api_key: str | None) -> dict[str, str]:
    """``--header`` options and the API key as request headers; a usage error for bad ones."""
    from tokentrace.loadgen.http import FRAMING_HEADERS, check_header

    headers: dict[str, str] = {}
    if api_key is not None:
        headers[_AUTHORIZATION] = f"Bearer {api_key}"
    for option in options:
        name, colon, value = option.partition(":")
        name, value = name.strip(), value.strip()
        if not colon or not name:
            raise _UsageError(f"--header {option!r}: expected 'NAME: VALUE'")
        if name.lower() in _HEADERS_SET_BY_LOAD | FRAMING_HEADERS:
            raise _UsageError(f"--header {name}: tokentrace load sets this header itself")
        try:
            check_header(name, value)
        except ValueError as error:
            raise _UsageError(f"--header: {error}") from None
        headers[name] = value
    return headers


def _discover_model(server_url: str, *, headers: dict[str, str], timeout_s: float) -> str:
    import json
    import urllib.error
    import urllib.request

    url = server_url + "/v1/models"
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            data = json.loads(response.read())
        return str(data["data"][0]["id"])
    except urllib.error.HTTPError as error:
        hint = " (give --api-key or set $OPENAI_API_KEY)" if error.code in _AUTH_REFUSED else ""
        raise _RunError(f"{url} answered {error.code} {error.reason}{hint}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise _RunError(f"cannot reach {url}: {reason} (is the server up?)") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise _RunError(f"{url} did not list a model: give one with --model") from None


def _exporter(args: argparse.Namespace) -> Any:
    from tokentrace.agent.otlp_config import OtlpExporterConfig
    from tokentrace.loadgen.export import ClientSpanExporter

    config: OtlpExporterConfig | None
    try:
        if args.otlp_endpoint:
            config = OtlpExporterConfig(
                endpoint=args.otlp_endpoint,
                protocol=args.otlp_protocol or _DEFAULT_OTLP_PROTOCOL,
            )
        else:
            config = OtlpExporterConfig.from_env(os.environ, signal="traces")
            if config is None:
                return None
        service = os.environ.get("OTEL_SERVICE_NAME") or None
        if service:
            return ClientSpanExporter(config, service_name=service)
        return ClientSpanExporter(config)
    except ValueError as error:
        raise _UsageError(f"OTLP export: {error}") from None


class _Progress:
    """One progress line: redrawn in place on a terminal, an occasional line into a pipe."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._interval_s = _PROGRESS_INTERVAL_TTY_S if self._tty else _PROGRESS_INTERVAL_PIPE_S
        self._started = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def update(self, *, done: int, failed: int, in_flight: int, total: int | None) -> None:
        now = time.monotonic()
        if now - self._last < self._interval_s:
            return
        self._last = now
        elapsed = now - self._started
        rate = done / elapsed if elapsed > 0 else 0.0
        of_total = f"/{total:,}" if total is not None else ""
        line = (
            f"  {done:,}{of_total} requests done, {in_flight} in flight, {failed:,} failed, "
            f"{rate:.1f} req/s, {elapsed:.0f} s"
        )
        if self._tty:
            self._stream.write(f"\r{line}\x1b[K")
            self._drawn = True
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
