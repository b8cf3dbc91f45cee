"""What ``tokentrace load`` prints when it is done, and the client side of each SLO target.

A target is judged the way the collector judges it (``processors.slo.request_value``: each
request by its own value, ITL by the request's own gap at the target percentile); the window's
value at the target percentile interpolates like the rest of this report. A target whose
selector names a service cannot be judged here: the client does not know the server's
``service.name``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from tokentrace.agent import semconv
from tokentrace.loadgen.results import (
    CLIENT_METRICS,
    RequestResult,
    percentile,
)

if TYPE_CHECKING:
    from tokentrace.loadgen.record import RunRecord
    from tokentrace.processors.slo import SloTarget

_NS_PER_MS: Final = 1_000_000
_SATURATED_CLIENT_SHARE: Final = 0.05
"""Event-loop stalls this large a share of the run: the client's own numbers are suspect."""


def client_slo(
    results: Sequence[RequestResult], targets: Sequence[SloTarget], *, model: str
) -> list[dict[str, Any]]:
    """One entry per target: value at its percentile, met, compliance, requests judged; a
    ``note`` instead when the client cannot judge it."""
    from tokentrace.processors.budget import prompt_bucket
    from tokentrace.processors.model import RequestMetrics
    from tokentrace.processors.slo import SELECTOR_SERVICE, request_value

    entries: list[dict[str, Any]] = []
    for target in targets:
        entry: dict[str, Any] = {
            "target": target.name,
            "metric": target.metric,
            "percentile": target.percentile,
            "threshold_ms": target.threshold_ns / _NS_PER_MS,
        }
        entries.append(entry)
        if target.metric not in CLIENT_METRICS:
            entry["note"] = f"{target.metric} needs the server's spans: see tokentrace diagnose"
            continue
        if SELECTOR_SERVICE in target.selector:
            entry["note"] = "the selector names a service, which the client does not know"
            continue
        pooled: list[float] = []
        judged = inside = 0
        for result in results:
            if not result.ok:
                continue
            key = {
                "model": model,
                "operation": result.operation,
                "prompt_bucket": prompt_bucket(result.prompt_tokens),
            }
            if not target.matches_key(key):
                continue
            tpot = result.tpot_ns
            metrics = RequestMetrics(
                ttft=result.ttft_ns,
                tpot=None if tpot is None else round(tpot),
                e2e=result.e2e_ns,
                queue=None,
                prefill=None,
                decode=None,
                network=None,
                itl=result.chunk_gaps_ns,
            )
            value = request_value(metrics, target.metric, target.percentile)
            if value is None:
                continue
            judged += 1
            inside += value <= target.threshold_ns
            if target.metric == semconv.METRIC_ITL:
                pooled.extend(result.chunk_gaps_ns)
            else:
                pooled.append(value)
        entry["requests"] = judged
        if not judged:
            entry["note"] = "no request matched"
            continue
        pooled.sort()
        value_ns = percentile(pooled, target.percentile)
        entry["value_ms"] = round(value_ns / _NS_PER_MS, 3)
        entry["met"] = value_ns <= target.threshold_ns
        entry["compliance"] = round(inside / judged, 4)
    return entries


def render(record: RunRecord, *, record_path: str | None, store_hint: str | None = None) -> str:
    summary = record.summary
    config = record.config
    lines = [_title(record)]
    rows = [
        ("Model", record.model),
        ("Completed / failed", f"{summary['completed']:,} / {summary['failed']:,}"),
        ("Duration", f"{summary['duration_s']:.2f} s"),
    ]
    if summary.get("request_throughput") is not None:
        rows.append(("Request throughput", f"{summary['request_throughput']:.2f} req/s"))
        rows.append(("Output token throughput", f"{summary['output_token_throughput']:.1f} tok/s"))
    rows.append(
        ("Input / output tokens", f"{summary['input_tokens']:,} / {summary['output_tokens']:,}")
    )
    if record.http:
        opened = record.http.get("connections_opened", 0)
        reused = record.http.get("connections_reused", 0)
        rows.append(("Connections opened / reused", f"{opened:,} / {reused:,}"))
        stalled_ns = record.http.get("client_stall_ns", 0)
        if stalled_ns:
            longest = record.http.get("client_longest_stall_ns", 0)
            rows.append(
                (
                    "Client loop stalls",
                    f"{record.http.get('client_stalls', 0):,}, {stalled_ns / 1e6:,.0f} ms in all "
                    f"(longest {longest / 1e6:,.0f} ms)",
                )
            )
    width = max(len(label) for label, _ in rows) + 2
    lines += [f"{label + ':':<{width}}{value}" for label, value in rows]
    stalled_s = (record.http or {}).get("client_stall_ns", 0) / 1e9
    if summary["duration_s"] and stalled_s >= _SATURATED_CLIENT_SHARE * summary["duration_s"]:
        lines.append(
            f"WARNING: this client's event loop stalled for {stalled_s / summary['duration_s']:.0%}"
            " of the run: the client was itself saturated or short of CPU (concurrency, a busy"
            " server on this machine); its delays are in its latencies here and in the"
            " collector's `client` segment"
        )
    if summary.get("errors"):
        kinds = ", ".join(f"{kind} x{count}" for kind, count in sorted(summary["errors"].items()))
        lines.append(f"{'Errors:':<{width}}{kinds}")
        first = next((r.error for r in record.results if r.error), None)
        if first:
            lines.append(f"{'':<{width}}first: {first}")

    lines.append("")
    lines += _metric_table(summary["metrics"])
    if record.slo:
        lines.append("")
        lines.append("SLO targets, client side:")
        lines += [f"  {_slo_line(entry)}" for entry in record.slo]
    if record.export:
        sent = record.export.get("sent_spans", 0)
        lost = sum(
            record.export.get(name, 0)
            for name in ("dropped_spans", "rejected_spans", "unsent_spans")
        )
        lines.append("")
        lines.append(f"Client spans exported: {sent:,}" + (f", lost: {lost:,}" if lost else ""))
    elif config:
        lines.append("")
        lines.append(
            "Client spans were not exported (no OTLP endpoint): the collector cannot compute "
            "the network segment for this run"
        )
    if record_path:
        lines.append(f"Run record: {record_path}")
        store = store_hint or "STORE"
        lines.append(f"Next: tokentrace diagnose --run {record_path} --store {store}")
    return "\n".join(lines)


def _title(record: RunRecord) -> str:
    config = record.config
    if config.get("rate") is not None:
        shape = f"Poisson arrivals at {config['rate']:g} req/s"
        if config.get("concurrency"):
            shape += f", at most {config['concurrency']} in flight"
    else:
        shape = f"concurrency {config.get('concurrency') or 1}"
    api = config.get("api", "chat")
    stream = "streaming" if config.get("stream", True) else "not streaming"
    return f"==> tokentrace load: {len(record.results):,} requests, {shape}, {api}, {stream}"


def _metric_table(metrics: dict[str, dict[str, Any]]) -> list[str]:
    labels: list[str] = []
    for summary in metrics.values():
        labels += [key for key in summary if key not in ("count", *labels)]
    header = f"{'metric (ms)':<12}{'count':>8}" + "".join(f"{label:>10}" for label in labels)
    lines = [header]
    for metric in CLIENT_METRICS:
        summary = metrics.get(metric, {"count": 0})
        cells = "".join(
            f"{summary[label]:>10.2f}" if label in summary else f"{'-':>10}" for label in labels
        )
        lines.append(f"{semconv.METRIC_LABELS[metric]:<12}{summary.get('count', 0):>8,}{cells}")
    return lines


def target_text(entry: Mapping[str, Any]) -> str:
    """``name: metric pNN <= T ms`` of an SLO status entry (client's or collector's)."""
    return (
        f"{entry['target']}: {entry['metric']} p{entry['percentile']:g} "
        f"<= {entry['threshold_ms']:g} ms"
    )


def _slo_line(entry: dict[str, Any]) -> str:
    head = target_text(entry)
    if "note" in entry:
        return f"{head}  not judged ({entry['note']})"
    verdict = "met" if entry["met"] else "MISSED"
    return (
        f"{head}  {verdict}: {entry['value_ms']:.2f} ms, "
        f"{entry['compliance']:.1%} of {entry['requests']:,} requests inside"
    )
