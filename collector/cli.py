"""``tokentrace collector``, ``explain``, ``top``, ``ui``, ``diagnose`` and ``compare``.

Registered under the ``tokentrace.commands`` entry-point group. Only argparse, the standard
library and the duration parser (itself standard library only) are imported here at module
level: ``tokentrace --help`` stays fast and works where only ``tokentrace[agent]`` is installed.
Everything else is imported inside ``run()``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any, Final, TextIO

# Standard library only, like this module.
from tokentrace.agent import semconv
from tokentrace.processors.durations import parse_duration_ns

if TYPE_CHECKING:
    from tokentrace.collector.store.document import RequestDocument

_DEFAULT_STORE: Final = "./tokentrace.db"
_DEFAULT_WINDOW_S: Final = 60.0
_DEFAULT_DIAGNOSE_WINDOW_S: Final = 900.0
_DEFAULT_RUN_WAIT_S: Final = 15.0
_DEFAULT_INTERVAL_S: Final = 2.0
_DEFAULT_TERMINAL: Final = (100, 24)
_EXIT_OK: Final = 0
_EXIT_USAGE: Final = 2
_CLEAR_SCREEN: Final = "\x1b[H\x1b[2J"
_NS_PER_S: Final = 1_000_000_000
_DEFAULT_UI_LISTEN: Final = "127.0.0.1:8700"
UI_TOKEN_ENV: Final = "TOKENTRACE_UI_TOKEN"
_EXIT_CANNOT_START: Final = 1


def parse_duration(text: str) -> float:
    """``500ms``, ``60s``, ``5m``, ``2min``, ``1h``, ``7d`` or plain seconds -> seconds (> 0).

    The units are those of every tokentrace duration (``processors.durations``)."""
    try:
        duration_ns = parse_duration_ns(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if duration_ns <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be positive")
    return duration_ns / _NS_PER_S


def _non_negative_duration(text: str) -> float:
    """A duration that may be 0 (``--wait 0``: do not wait)."""
    try:
        duration_ns = parse_duration_ns(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if duration_ns < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration cannot be negative")
    return duration_ns / _NS_PER_S


def _add_store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        metavar="PATH|URL",
        default=_DEFAULT_STORE,
        help=f"the collector's request store: a SQLite file or a postgresql:// URL "
        f"(default: {_DEFAULT_STORE})",
    )


def _add_store_arguments(parser: argparse.ArgumentParser) -> None:
    _add_store_argument(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _emit(text: str) -> bool:
    """Write to stdout; False when the reader went away (``| head``), without a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return False
    return True


def _fail(command: str, message: str) -> int:
    print(f"tokentrace {command}: {message}", file=sys.stderr)
    return _EXIT_USAGE


def _terminal(stream: TextIO) -> tuple[int, bool, Any]:
    """(width, colour, glyphs) for writing to ``stream``."""
    from tokentrace.collector.render import glyphs_for

    width = shutil.get_terminal_size(_DEFAULT_TERMINAL).columns
    is_tty = bool(getattr(stream, "isatty", lambda: False)())
    color = is_tty and "NO_COLOR" not in os.environ
    return width, color, glyphs_for(getattr(stream, "encoding", None))


class CollectorCommand:
    name = "collector"
    help = "run the tokentrace collector (OTLP receivers, processors, exporters, request store)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", metavar="FILE", help="collector configuration (YAML)")
        parser.add_argument(
            "--store",
            metavar="PATH|URL",
            default=None,
            help="request store: a SQLite file or a postgresql:// URL that several collectors "
            f"share (overrides the config; default: {_DEFAULT_STORE})",
        )
        parser.add_argument(
            "--check-config",
            action="store_true",
            help="validate the configuration, print what would run, and exit",
        )

    def run(self, args: argparse.Namespace) -> int:
        from tokentrace.collector.service import run_from_args

        result: int = run_from_args(args)
        return result


class ExplainCommand:
    name = "explain"
    help = "explain one request: waterfall, latency budget and the verdict on what made it slow"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "trace_id",
            nargs="?",
            metavar="TRACE_ID",
            help="trace id in hex (a prefix of at least 8 digits is enough)",
        )
        parser.add_argument("--span", metavar="SPAN_ID", help="pick one request of the trace")
        parser.add_argument(
            "--slowest", action="store_true", help="explain the slowest stored request instead"
        )
        parser.add_argument(
            "--metric",
            choices=semconv.VERDICT_METRICS,
            help="the metric the verdict answers about, and what --slowest orders by (default: "
            "the metric of the first SLO target the request breached, else E2E; --slowest "
            "orders by E2E)",
        )
        parser.add_argument(
            "--since",
            metavar="DURATION",
            type=parse_duration,
            help="with --slowest: only requests that started within this long (e.g. 15m)",
        )
        parser.add_argument(
            "--limit",
            metavar="N",
            type=int,
            default=1,
            help="with --slowest: list the N slowest instead of explaining the slowest one",
        )
        _add_store_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        from tokentrace.collector.store import StoreError, open_store_readonly
        from tokentrace.collector.store.row import METRIC_COLUMNS

        if args.slowest == (args.trace_id is not None):
            return _fail(self.name, "give a TRACE_ID or --slowest (not both)")
        if args.limit < 1:
            return _fail(self.name, "--limit must be at least 1")
        try:
            store = open_store_readonly(args.store)
            if args.slowest:
                order = args.metric or semconv.METRIC_E2E
                if order not in METRIC_COLUMNS:
                    return _fail(
                        self.name,
                        f"--slowest cannot order by {order} (no per-request column): give a "
                        f"TRACE_ID, or order by one of {', '.join(METRIC_COLUMNS)}",
                    )
                since_ns = None
                if args.since is not None:
                    since_ns = int((time.time() - args.since) * 1e9)
                docs = store.slowest(metric=order, since_ns=since_ns, limit=args.limit)
                if not docs:
                    window = " in that window" if args.since is not None else ""
                    return _fail(self.name, f"no requests with {order} in {store.path}{window}")
                if args.limit > 1:
                    return self._print_list(docs, args)
                doc = docs[0]
            else:
                found = store.get(args.trace_id, span_id=args.span)
                if found is None:
                    return _fail(
                        self.name, f"no request with trace id {args.trace_id} in {store.path}"
                    )
                doc = found
        except (StoreError, ValueError) as error:
            return _fail(self.name, str(error))
        if args.json:
            _emit(json.dumps(doc, indent=2) + "\n")
            return _EXIT_OK
        from tokentrace.collector.render import render_explain

        width, color, glyphs = _terminal(sys.stdout)
        _emit(render_explain(doc, metric=args.metric, width=width, color=color, glyphs=glyphs))
        return _EXIT_OK

    @staticmethod
    def _print_list(docs: list[RequestDocument], args: argparse.Namespace) -> int:
        if args.json:
            _emit(json.dumps(docs, indent=2) + "\n")
        else:
            from tokentrace.collector.render import render_slowest_list

            _emit(render_slowest_list(docs, metric=args.metric or semconv.METRIC_E2E))
        return _EXIT_OK


class TopCommand:
    name = "top"
    help = "live TTFT/TPOT/ITL/E2E percentiles per model, operation and prompt size, with SLOs"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--window",
            metavar="DURATION",
            type=parse_duration,
            default=_DEFAULT_WINDOW_S,
            help="how far back the percentiles reach (default: 60s)",
        )
        parser.add_argument(
            "--interval",
            metavar="DURATION",
            type=parse_duration,
            default=_DEFAULT_INTERVAL_S,
            help="refresh period in live mode (default: 2s)",
        )
        parser.add_argument("--once", action="store_true", help="print once and exit")
        _add_store_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        from tokentrace.collector.render_top import render_top
        from tokentrace.collector.store import StoreError, open_store_readonly

        try:
            store = open_store_readonly(args.store)
            report = self._report(store, args.window)
        except (StoreError, ValueError) as error:
            return _fail(self.name, str(error))
        if args.json:
            _emit(json.dumps(report, indent=2) + "\n")
            return _EXIT_OK
        width, color, glyphs = _terminal(sys.stdout)
        del width  # the table is as wide as its columns
        if args.once:
            _emit(render_top(report, color=color, glyphs=glyphs, title=store.path))
            return _EXIT_OK
        clear = sys.stdout.isatty()
        try:
            while True:
                text = render_top(report, color=color, glyphs=glyphs, title=store.path)
                if not _emit((_CLEAR_SCREEN if clear else "") + text + ("" if clear else "\n")):
                    return _EXIT_OK
                time.sleep(args.interval)
                try:
                    report = self._report(store, args.window)
                except (StoreError, ValueError) as error:
                    return _fail(self.name, str(error))
        except KeyboardInterrupt:
            return _EXIT_OK

    @staticmethod
    def _report(store: Any, window_s: float) -> dict[str, Any]:
        from tokentrace.collector.store import window_report
        from tokentrace.collector.tail_sampling import sampling_summary

        now_s = time.time()
        slices = store.sketches_since(now_s - window_s)
        targets, problems = store.slo_targets()
        for problem in problems:
            print(f"tokentrace top: ignoring SLO targets: {problem}", file=sys.stderr)
        report: dict[str, Any] = window_report(
            slices, window_s=window_s, now_s=now_s, slo_targets=targets, slo_errors=problems
        )
        stats = store.collector_stats()
        if stats is not None:
            report["collector"] = stats
        # The traces the store holds may be a sample (tail sampling); the percentiles are not.
        report["sampling"] = sampling_summary(report.get("collector"))
        return report


class UiCommand:
    name = "ui"
    help = "serve the drill-down web UI and API over a request store (open it in a browser)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_store_argument(parser)
        parser.add_argument(
            "--listen",
            metavar="HOST:PORT",
            default=_DEFAULT_UI_LISTEN,
            help=f"where to serve (default: {_DEFAULT_UI_LISTEN}; port 0 picks a free one)",
        )
        parser.add_argument(
            "--trace-link",
            metavar="URL",
            help="link to a trace in your tracing backend, with {trace_id} where the id goes",
        )
        parser.add_argument(
            "--open", action="store_true", help="open the UI in the default web browser"
        )
        parser.epilog = (
            f"Set {UI_TOKEN_ENV} to require that bearer token on the API (the page asks for it)."
        )

    def run(self, args: argparse.Namespace) -> int:
        import signal
        import threading

        from tokentrace.collector.api import ApiSettings, create_app
        from tokentrace.collector.api.server import ApiServer, ApiServerStartError
        from tokentrace.collector.config import validate_trace_link
        from tokentrace.collector.store import StoreError, open_store_readonly

        if args.trace_link is not None:
            try:
                validate_trace_link(args.trace_link)
            except ValueError as error:
                return _fail(self.name, f"--trace-link {error}")
        try:
            store = open_store_readonly(args.store)  # fail now, not on the first page view
            store.close()
            server = ApiServer(
                create_app(
                    ApiSettings(
                        store_path=args.store,
                        auth_token=os.environ.get(UI_TOKEN_ENV) or None,
                        trace_link=args.trace_link,
                    )
                ),
                endpoint=args.listen,
            )
        except (StoreError, ValueError) as error:
            return _fail(self.name, str(error))
        try:
            server.start()
        except ApiServerStartError as error:
            print(f"tokentrace {self.name}: {error}", file=sys.stderr)
            return _EXIT_CANNOT_START
        auth = (
            f" (bearer token from {UI_TOKEN_ENV} required)" if os.environ.get(UI_TOKEN_ENV) else ""
        )
        print(f"tokentrace ui: serving {store.path} at {server.url}/{auth}", flush=True)
        if args.open:
            import webbrowser

            webbrowser.open(f"{server.url}/")
        stop = threading.Event()

        def request_stop(_signum: int, _frame: object) -> None:
            stop.set()

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)
        stop.wait()
        server.shutdown()
        return _EXIT_OK


def _slo_targets_for(command: str, args: argparse.Namespace, store: Any) -> list[Any]:
    """Targets from ``--slo FILE``, else the ones the collector wrote into the store."""
    from tokentrace.processors.slo import read_slo_file

    if args.slo:
        try:
            return read_slo_file(args.slo)
        except ValueError as error:
            raise ValueError(f"--slo: {error}") from None
    if store is None:
        return []
    targets, problems = store.slo_targets()
    for problem in problems:
        print(f"tokentrace {command}: ignoring SLO targets: {problem}", file=sys.stderr)
    return targets


class DiagnoseCommand:
    name = "diagnose"
    help = (
        "for a load run or a time window: percentiles per metric and budget segment; per SLO "
        "target, the segment that dominates its metric, its cause, one fix and what removing "
        "it would give; the same for the typical and tail requests of the other metrics; "
        "perceived speed and SLO status"
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        source = parser.add_mutually_exclusive_group()
        source.add_argument("--run", metavar="FILE", help="a run record of tokentrace load")
        source.add_argument(
            "--since", type=parse_duration, help="requests that started this long ago or later"
        )
        parser.add_argument(
            "--until",
            type=parse_duration,
            help="with --since: up to this long ago (default: now)",
        )
        parser.add_argument("--slo", metavar="FILE", help="SLO targets (default: the store's)")
        parser.add_argument(
            "--wait",
            type=_non_negative_duration,
            default=_DEFAULT_RUN_WAIT_S,
            help="for a run that just ended: wait this long for its last requests to reach the "
            "store (default: 15s)",
        )
        _add_store_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        from tokentrace.collector.diagnose import diagnose_range, diagnose_run, render_diagnosis
        from tokentrace.collector.store import StoreError, open_store_readonly
        from tokentrace.loadgen.record import RunRecordError, load

        if args.until is not None and args.since is None:
            return _fail(self.name, "--until needs --since")
        store = None
        try:
            store = open_store_readonly(args.store)
            targets = _slo_targets_for(self.name, args, store)
            if args.run:
                record = load(args.run)
                analysis = diagnose_run(store, record, targets=targets, wait_s=args.wait)
                title = f"run {args.run}"
            else:
                since_s = args.since if args.since is not None else _DEFAULT_DIAGNOSE_WINDOW_S
                now_ns = time.time_ns()
                until_ns = None if args.until is None else now_ns - int(args.until * _NS_PER_S)
                analysis = diagnose_range(
                    store,
                    since_ns=now_ns - int(since_s * _NS_PER_S),
                    until_ns=until_ns,
                    targets=targets,
                )
                title = f"{store.path}, from {since_s:g} s ago"
                title += " to now" if args.until is None else f" to {args.until:g} s ago"
        except (StoreError, RunRecordError, ValueError) as error:
            return _fail(self.name, str(error))
        finally:
            if store is not None:
                store.close()
        if args.json:
            _emit(json.dumps(analysis, indent=2) + "\n")
        else:
            _emit(render_diagnosis(analysis, title=title) + "\n")
        return _EXIT_OK


class CompareCommand:
    name = "compare"
    help = (
        "compare two runs of the same load: percentiles side by side with deltas, SLO targets, "
        "which segments shrank or grew, and a warning when the loads differ"
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run_a", metavar="RUN_A", help="run record of the first run (before)")
        parser.add_argument("run_b", metavar="RUN_B", help="run record of the second run (after)")
        parser.add_argument("--slo", metavar="FILE", help="SLO targets (default: the store's)")
        parser.add_argument(
            "--store",
            metavar="PATH",
            help="the collector's request store, for server-side numbers and segments "
            "(without it: the client's numbers only)",
        )
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
        parser.add_argument(
            "--wait",
            type=_non_negative_duration,
            default=_DEFAULT_RUN_WAIT_S,
            help="for a run that just ended: wait this long for its last requests to reach the "
            "store (default: 15s)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from tokentrace.collector.diagnose import compare_runs, diagnose_run, render_comparison
        from tokentrace.collector.store import StoreError, open_store_readonly
        from tokentrace.loadgen.record import RunRecordError, load

        store = None
        try:
            record_a, record_b = load(args.run_a), load(args.run_b)
            analysis_a = analysis_b = None
            store = open_store_readonly(args.store) if args.store else None
            targets = _slo_targets_for(self.name, args, store)
            if store is not None:
                analysis_a = diagnose_run(store, record_a, targets=targets, wait_s=args.wait)
                analysis_b = diagnose_run(store, record_b, targets=targets, wait_s=args.wait)
            elif targets:
                from tokentrace.loadgen.report import client_slo

                record_a.slo = client_slo(record_a.results, targets, model=record_a.model)
                record_b.slo = client_slo(record_b.results, targets, model=record_b.model)
            comparison = compare_runs(
                record_a, record_b, analysis_a=analysis_a, analysis_b=analysis_b
            )
        except (StoreError, RunRecordError, ValueError) as error:
            return _fail(self.name, str(error))
        finally:
            if store is not None:
                store.close()
        if args.json:
            _emit(json.dumps(comparison, indent=2) + "\n")
        else:
            _emit(render_comparison(comparison, name_a=args.run_a, name_b=args.run_b) + "\n")
        return _EXIT_OK
