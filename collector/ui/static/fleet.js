// The fleet view: SLO status, what dominates each target's metric (the diagnosis), the
// percentile table per model and bucket, distributions, where time goes at p50 vs p99, and the
// slowest and breaching requests one click away.

import { ApiError, apiGet } from "./api.js";
import { add, clear, el } from "./dom.js";
import { budgetBars, budgetParts, histogram, segmentLegend } from "./charts.js";
import { formatChange, formatCount, formatMs, formatPercent, formatUnixS, isNumber, segmentClass } from "./format.js";
import { requestRow } from "./list.js";

const TIME_PARAMS = ["since", "until", "last"];
const DIMENSION_PARAMS = ["service", "model", "operation", "prompt_bucket"];
const WINDOW_PARAMS = [...TIME_PARAMS, ...DIMENSION_PARAMS];
const LAST_CHOICES = [
  ["5m", "last 5 min"],
  ["15m", "last 15 min"],
  ["1h", "last hour"],
  ["6h", "last 6 hours"],
  ["24h", "last 24 hours"],
  ["7d", "last 7 days"],
];

/** (header, metric, quantile) of the percentile table's columns (the CLI's `top` columns). */
export const PERCENTILE_COLUMNS = [
  ["TTFT p50", "ttft", "p50"],
  ["p95", "ttft", "p95"],
  ["p99", "ttft", "p99"],
  ["TPOT p50", "tpot", "p50"],
  ["p95", "tpot", "p95"],
  ["p99", "tpot", "p99"],
  ["ITL p50", "itl", "p50"],
  ["p99", "itl", "p99"],
  ["E2E p50", "e2e", "p50"],
  ["p95", "e2e", "p95"],
  ["p99", "e2e", "p99"],
];

const DISTRIBUTIONS = [
  ["ttft", "TTFT"],
  ["tpot", "TPOT"],
  ["itl", "ITL"],
  ["e2e", "E2E"],
];

export function windowParams(params) {
  const picked = {};
  for (const name of WINDOW_PARAMS) {
    const value = params.get(name);
    if (value !== null && value !== "") picked[name] = value;
  }
  if (!picked.since && !picked.until && !picked.last) picked.last = "1h";
  return picked;
}

export async function renderFleet(context) {
  const picked = windowParams(context.params);
  const data = await apiGet("fleet", picked);
  if (!context.isCurrent()) return el("div");
  const report = data.window ?? {};
  const view = el("div", { class: "view fleet-view", "data-testid": "fleet-view" });
  view.append(
    el("h1", { text: "Fleet" }),
    windowForm(picked, context),
    el(
      "p",
      { class: "summary", "data-testid": "fleet-summary" },
      `${formatCount(report.requests ?? 0)} requests · ${formatUnixS(report.since_s)} → ${formatUnixS(report.until_s)}`,
    ),
    sloTable(report.slo ?? [], report.slo_errors ?? []),
    diagnosisSection(picked, context),
    percentileTable(report.keys ?? [], context),
    distributions(data.distributions ?? {}, report.slo ?? []),
    budgetSection(data.budget ?? {}),
    requestsSection("Slowest requests", "slowest-row", data.slowest ?? [], context, "No requests in this window."),
    requestsSection("Requests outside an SLO", "breaching-row", data.breaching ?? [], context, "No request breached an SLO target in this window."),
  );
  return view;
}

function windowForm(picked, context) {
  const last = el("select", { name: "last", "data-filter": "last" });
  for (const [value, label] of LAST_CHOICES) {
    const option = el("option", { value, text: label });
    if (value === picked.last) option.selected = true;
    last.appendChild(option);
  }
  const inputs = {};
  for (const name of ["service", "model", "operation", "prompt_bucket"]) {
    inputs[name] = el("input", { type: "text", name, "data-filter": name });
    inputs[name].value = picked[name] ?? "";
  }
  const form = el(
    "form",
    { class: "filters", "data-testid": "fleet-filters" },
    el("label", { class: "field" }, el("span", { text: "Window" }), last),
    el("label", { class: "field" }, el("span", { text: "Service" }), inputs.service),
    el("label", { class: "field" }, el("span", { text: "Model" }), inputs.model),
    el("label", { class: "field" }, el("span", { text: "Operation" }), inputs.operation),
    el("label", { class: "field" }, el("span", { text: "Prompt bucket" }), inputs.prompt_bucket),
    el("div", { class: "actions" }, el("button", { type: "submit", text: "Apply" })),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const next = { last: last.value };
    for (const [name, input] of Object.entries(inputs)) next[name] = input.value.trim();
    context.navigate(context.routeHash("fleet", next));
  });
  return form;
}

export function sloStatus(entry) {
  if (!entry || entry.met === null || entry.met === undefined) return { text: "no data", cls: "muted" };
  return entry.met ? { text: "met", cls: "good" } : { text: "breached", cls: "bad" };
}

function sloTable(entries, errors) {
  const section = el("section", { class: "slo-section" }, el("h2", { text: "SLO targets" }));
  if (entries.length === 0) {
    section.appendChild(el("p", { class: "muted", text: "No SLO targets are configured for this collector." }));
  } else {
    const head = el(
      "tr",
      {},
      el("th", { text: "target" }),
      el("th", { text: "objective" }),
      el("th", { class: "num", text: "value" }),
      el("th", { text: "status" }),
      el("th", { class: "num", text: "compliance" }),
      el("th", { class: "num", text: "burn rate" }),
      el("th", { class: "num", text: "requests" }),
    );
    const body = el("tbody");
    for (const entry of entries) {
      const status = sloStatus(entry);
      body.appendChild(
        el(
          "tr",
          { "data-testid": "slo-row", "data-target": String(entry.target ?? ""), "data-met": String(entry.met) },
          el("td", { text: String(entry.target ?? "") }),
          el("td", { text: `${entry.metric ?? "?"} p${entry.percentile ?? "?"} < ${formatMs(entry.threshold_ms)}${selectorText(entry.selector)}` }),
          el("td", { class: "num", "data-cell": "value", text: formatMs(entry.value_ms) }),
          el("td", { class: status.cls, "data-cell": "status", text: status.text }),
          el("td", { class: "num", "data-cell": "compliance", text: formatPercent(entry.compliance, 2) }),
          el("td", { class: ["num", isNumber(entry.burn_rate) && entry.burn_rate > 1 ? "bad" : ""], "data-cell": "burn_rate", text: isNumber(entry.burn_rate) ? entry.burn_rate.toFixed(2) : "-" }),
          el("td", { class: "num", text: formatCount(entry.requests) }),
        ),
      );
    }
    section.appendChild(el("table", { class: "data", "data-testid": "slo-table" }, el("thead", {}, head), body));
  }
  for (const error of errors) section.appendChild(el("p", { class: "bad", text: `target not evaluated: ${error}` }));
  return section;
}

/**
 * The diagnosis of the window (GET /diagnose): it re-derives every request from its spans, so it
 * loads after the rest of the view, into this section.
 */
function diagnosisSection(picked, context) {
  const body = el("div", {}, el("p", { class: "muted", text: "Diagnosing the window's requests…" }));
  const section = el(
    "section",
    { class: "diagnosis-section", "data-testid": "diagnosis", "data-state": "loading", "aria-busy": "true" },
    el("h2", { text: "Diagnosis: what dominates each target's metric" }),
    body,
  );
  const times = Object.fromEntries(TIME_PARAMS.filter((name) => picked[name]).map((name) => [name, picked[name]]));
  const filtered = DIMENSION_PARAMS.some((name) => picked[name]);
  const settle = (state, ...children) => {
    if (!context.isCurrent()) return;
    add(clear(body), children);
    section.setAttribute("data-state", state);
    section.removeAttribute("aria-busy");
  };
  apiGet("diagnose", times).then(
    (analysis) => settle("ready", diagnosisContent(analysis, filtered)),
    (error) => {
      const status = error instanceof ApiError ? error.status : 0;
      section.setAttribute("data-status", String(status));
      const what = status === 503 ? "The diagnosis did not finish: " : "No diagnosis: ";
      settle("error", el("p", { class: "message error", "data-testid": "diagnosis-error" }, el("strong", { text: what }), error?.message ?? String(error)));
    },
  );
  return section;
}

function diagnosisContent(analysis, filtered) {
  const findings = Array.isArray(analysis.findings) ? analysis.findings : [];
  // As `tokentrace diagnose` prints them: targets first, then the metrics no target judges.
  const judged = new Set(findings.map((finding) => finding.metric));
  const perMetric = (Array.isArray(analysis.metric_findings) ? analysis.metric_findings : []).filter((finding) => !judged.has(finding.metric));
  const read = analysis.window ?? {};
  // Exact nearest-rank percentiles: in a small window they can differ from the SLO table's,
  // which come from the stored sketches.
  const notes = [`${formatCount(analysis.requests ?? 0)} requests re-derived from their spans; exact percentiles.`];
  if (isNumber(read.cut_at)) notes.push(`The window held more: only its most recent ${formatCount(read.cut_at)} traces were read.`);
  if (read.undecodable) notes.push(`${formatCount(read.undecodable)} stored traces could not be re-derived.`);
  if (read.client_only) notes.push(`${formatCount(read.client_only)} requests have only their client span so far: their server's spans are missing or still being assembled.`);
  if (filtered) notes.push("Over every request of the window: the diagnosis does not apply the service, model, operation and prompt filters.");
  const parts = [el("p", { class: "muted", "data-testid": "diagnosis-summary", text: notes.join(" ") })];
  for (const error of analysis.slo_errors ?? []) parts.push(el("p", { class: "bad", text: `target not judged: ${error}` }));
  if (findings.length) {
    parts.push(el("h3", { text: "Targets, breached first" }), findings.map((finding) => findingCard(finding, "finding-card")));
  }
  if (perMetric.length) {
    parts.push(el("h3", { text: findings.length ? "Where the time goes in the metrics without a target" : "Where the time goes" }), perMetric.map((finding) => findingCard(finding, "metric-finding-card")));
  }
  if (!findings.length && !perMetric.length) parts.push(el("p", { class: "muted", text: "No requests in this window." }));
  parts.push(el("h3", { text: "Perceived speed" }), perceivedList(analysis.perceived ?? {}));
  return parts;
}

function findingStatus(finding) {
  if (!finding.target) return null;
  if (finding.met === false) return { text: "MISSED", cls: "bad" };
  return finding.met ? { text: "met", cls: "good" } : { text: "no data", cls: "muted" };
}

/** One finding: its lines as `tokentrace diagnose` prints them, the first as its head. */
function findingCard(finding, testid) {
  const lines = Array.isArray(finding.lines) ? finding.lines.map(String) : [String(finding.sentence ?? "")];
  const [head, ...rest] = lines;
  const status = findingStatus(finding);
  return el(
    "article",
    {
      class: ["finding-card", finding.segment ? segmentClass(finding.segment) : ""],
      "data-testid": testid,
      "data-target": finding.target ?? undefined,
      "data-met": finding.target ? String(finding.met) : undefined,
      "data-metric": String(finding.metric ?? ""),
      "data-group": finding.group ?? undefined,
      "data-segment": finding.segment ?? undefined,
    },
    el(
      "p",
      { class: "finding-head" },
      status ? el("span", { class: ["status-badge", status.cls], "data-testid": "finding-status", text: status.text }) : null,
      el("span", { text: head }),
    ),
    rest.map((line) => el("p", { class: "finding-line", "data-testid": "finding-line", text: line })),
  );
}

function perceivedList(perceived) {
  const issues = Array.isArray(perceived.issues) ? perceived.issues : [];
  if (!perceived.requests) {
    return el("p", { class: "muted", "data-testid": "perceived-unknown", text: "No client spans in this window: how users perceived it is unknown (send the load with tokentrace load --otlp-endpoint)." });
  }
  if (!issues.length) {
    return el("p", { class: "muted", "data-testid": "perceived-fine", text: `No perceived-speed issue among the ${formatCount(perceived.requests)} requests with a client span.` });
  }
  return el(
    "ul",
    { class: "issues" },
    issues.map((issue) => el("li", { "data-testid": "perceived-issue", "data-kind": String(issue.kind ?? ""), text: String(issue.sentence ?? "") })),
  );
}

function selectorText(selector) {
  if (!selector || typeof selector !== "object") return "";
  const parts = Object.entries(selector).map(([key, value]) => `${key}=${value}`);
  return parts.length ? ` (${parts.join(", ")})` : "";
}

function percentileTable(keys, context) {
  const section = el("section", {}, el("h2", { text: "Percentiles per model and prompt bucket" }));
  if (keys.length === 0) {
    section.appendChild(el("p", { class: "muted", "data-testid": "fleet-empty", text: "No requests in this window." }));
    return section;
  }
  const head = el(
    "tr",
    {},
    ["service", "model", "operation", "prompt"].map((label) => el("th", { text: label })),
    el("th", { class: "num", text: "count" }),
    PERCENTILE_COLUMNS.map(([label]) => el("th", { class: "num", text: label })),
    el("th", { text: "SLO" }),
  );
  const body = el("tbody");
  for (const key of keys) {
    const metrics = key.metrics ?? {};
    const slo = Array.isArray(key.slo) ? key.slo : [];
    const breached = slo.filter((entry) => entry.met === false).map((entry) => String(entry.target));
    const met = slo.length > 0 && breached.length === 0 && slo.every((entry) => entry.met === true);
    const sloCell = el("td", { class: breached.length ? "bad" : met ? "good" : "muted", "data-cell": "slo" });
    sloCell.textContent = breached.length ? `✗ ${breached.join(", ")}` : met ? "✓ met" : slo.length ? "?" : "-";
    const filters = { service: key.service, model: key.model, operation: key.operation, prompt_bucket: key.prompt_bucket };
    const row = el(
      "tr",
      {
        "data-testid": "fleet-row",
        "data-service": String(key.service ?? ""),
        "data-model": String(key.model ?? ""),
        "data-operation": String(key.operation ?? ""),
        "data-prompt-bucket": String(key.prompt_bucket ?? ""),
        class: "clickable",
        title: "open these requests, slowest first",
        onclick: () => context.navigate(context.routeHash("requests", { ...filters, sort: "e2e", order: "desc" })),
      },
      el("td", { text: String(key.service ?? "") }),
      el("td", { text: String(key.model ?? "") }),
      el("td", { text: String(key.operation ?? "") }),
      el("td", { text: String(key.prompt_bucket ?? "") }),
      el("td", { class: "num", "data-cell": "requests", text: formatCount(key.requests) }),
      PERCENTILE_COLUMNS.map(([, metric, quantile]) =>
        el("td", { class: "num", "data-cell": `${metric}.${quantile}`, text: formatMs((metrics[metric] ?? {})[quantile], { unit: false }) }),
      ),
      sloCell,
    );
    body.appendChild(row);
  }
  section.append(
    el("div", { class: "table-scroll" }, el("table", { class: "data", "data-testid": "fleet-table" }, el("thead", {}, head), body)),
    el("p", { class: "muted", text: "ms; ITL pooled over all token gaps. Click a row for its requests." }),
  );
  return section;
}

function distributions(histograms, slo) {
  const grid = el("div", { class: "chart-grid" });
  for (const [metric, label] of DISTRIBUTIONS) {
    const data = histograms[metric];
    const markers = slo
      .filter((entry) => entry.metric === metric && isNumber(entry.threshold_ms))
      .map((entry) => ({ label: `${entry.target} target`, ms: entry.threshold_ms, cls: entry.met === false ? "bad" : "target" }));
    grid.appendChild(
      el("figure", { class: "chart-card" }, el("figcaption", { text: `${label} · ${formatCount(data?.count ?? 0)} values` }), histogram(data, { metric, markers })),
    );
  }
  return el("section", {}, el("h2", { text: "Distributions" }), grid);
}

export function budgetEntries(budget, prefix = "") {
  return ["p50", "p99"].map((key) => {
    const band = budget?.[key] ?? {};
    return { key: prefix ? `${prefix}.${key}` : key, label: `${prefix ? `${prefix} ` : ""}${key}`, e2e_ms: band.e2e_ms, requests: band.requests, segments: band.segments };
  });
}

function budgetSection(budget) {
  const entries = budgetEntries(budget);
  const names = new Set(entries.flatMap((entry) => budgetParts(entry.segments).map((part) => part.segment)));
  const section = el("section", { class: "budget-section" }, el("h2", { text: "Where the time goes: p50 vs p99" }));
  section.append(budgetBars(entries, { width: 860 }), segmentLegend(names));
  const p50 = budget?.p50?.e2e_ms;
  const p99 = budget?.p99?.e2e_ms;
  if (isNumber(p50) && isNumber(p99) && p50 > 0) {
    section.appendChild(el("p", { class: "muted", text: `p99 band E2E is ${formatChange(p99 / p50 - 1)} vs the p50 band` }));
  }
  return section;
}

function requestsSection(title, testid, items, context, emptyText) {
  const section = el("section", {}, el("h2", { text: title }));
  if (items.length === 0) {
    section.appendChild(el("p", { class: "muted", text: emptyText }));
    return section;
  }
  const showNetwork = items.some((item) => item.network_ms !== null && item.network_ms !== undefined);
  const head = el(
    "tr",
    {},
    ["start", "service", "model", "operation", "prompt"].map((label) => el("th", { text: label })),
    ["E2E", "TTFT", "TPOT", "queue", "prefill", "decode", ...(showNetwork ? ["network"] : []), "tokens in/out"].map((label) =>
      el("th", { class: "num", text: label }),
    ),
    el("th", { text: "SLO" }),
    el("th", { text: "verdict" }),
  );
  const body = el("tbody");
  for (const item of items) body.appendChild(requestRow(item, context, testid, { showNetwork }));
  section.appendChild(el("div", { class: "table-scroll" }, el("table", { class: "data requests", "data-testid": `${testid.replace(/-row$/, "")}-table` }, el("thead", {}, head), body)));
  return section;
}
