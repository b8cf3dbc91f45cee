// Two windows side by side (before / after a change) against the SLO targets.

import { apiGet } from "./api.js";
import { el } from "./dom.js";
import { budgetBars, budgetParts, segmentLegend } from "./charts.js";
import { formatChange, formatCount, formatMs, formatPercent, formatSignedMs, formatUnixS, isNumber } from "./format.js";
import { budgetEntries, sloStatus } from "./fleet.js";

const WINDOW_FIELDS = ["a_since", "a_until", "b_since", "b_until"];
const DIMENSIONS = ["service", "model", "operation", "prompt_bucket"];
const MAIN_METRICS = new Set(["ttft", "tpot", "itl", "e2e"]);
const METRIC_ORDER = ["ttft", "tpot", "itl", "e2e", "queue", "prefill", "decode", "network"];
// A change smaller than this is noise in a sketch with ~1% relative error.
const CHANGE_NOISE = 0.02;

function nowS() {
  return Math.floor(Date.now() / 1000);
}

/** The last hour against the hour before it: the usual "did my change help" question. */
function defaultWindows() {
  const now = nowS();
  return { a_since: now - 7200, a_until: now - 3600, b_since: now - 3600, b_until: now };
}

function picked(params) {
  const values = {};
  for (const name of [...WINDOW_FIELDS, ...DIMENSIONS]) {
    const value = params.get(name);
    if (value !== null && value !== "") values[name] = value;
  }
  return values;
}

export async function renderCompare(context) {
  const values = picked(context.params);
  const complete = WINDOW_FIELDS.every((name) => values[name] !== undefined);
  const view = el("div", { class: "view compare-view", "data-testid": "compare-view" });
  view.appendChild(el("h1", { text: "Compare two windows" }));
  const form = windowsForm(complete ? values : { ...defaultWindows(), ...values }, context);
  view.appendChild(form);
  if (!complete) {
    view.appendChild(el("p", { class: "muted", "data-testid": "compare-hint", text: "Pick the window before the change (A) and after it (B), then compare." }));
    return view;
  }
  const data = await apiGet("compare", values);
  if (!context.isCurrent()) return el("div");
  view.append(
    windowsSummary(data),
    sloSection(data.slo ?? []),
    metricsSection(data.metrics ?? []),
    budgetSection(data.budget ?? {}),
  );
  return view;
}

function toUtcInput(seconds) {
  const value = Number(seconds);
  if (!Number.isFinite(value)) return "";
  return new Date(value * 1000).toISOString().slice(0, 19);
}

function fromUtcInput(text) {
  const millis = Date.parse(`${text}Z`);
  return Number.isFinite(millis) ? String(millis / 1000) : "";
}

function windowsForm(values, context) {
  const inputs = {};
  for (const name of WINDOW_FIELDS) {
    inputs[name] = el("input", { type: "datetime-local", step: "1", name, required: true, "data-filter": name });
    inputs[name].value = toUtcInput(values[name]);
  }
  for (const name of DIMENSIONS) {
    inputs[name] = el("input", { type: "text", name, "data-filter": name });
    inputs[name].value = values[name] ?? "";
  }
  const label = (text, input) => el("label", { class: "field" }, el("span", { text }), input);
  const preset = (text, seconds) =>
    el("button", {
      type: "button",
      class: "link-button",
      text,
      onclick: () => {
        const now = nowS();
        context.navigate(
          context.routeHash("compare", { ...dimensionValues(inputs), a_since: now - 2 * seconds, a_until: now - seconds, b_since: now - seconds, b_until: now }),
        );
      },
    });
  const form = el(
    "form",
    { class: "filters compare-form", "data-testid": "compare-form" },
    el("fieldset", {}, el("legend", { text: "A: before (UTC)" }), label("from", inputs.a_since), label("to", inputs.a_until)),
    el("fieldset", {}, el("legend", { text: "B: after (UTC)" }), label("from", inputs.b_since), label("to", inputs.b_until)),
    el(
      "fieldset",
      {},
      el("legend", { text: "only" }),
      label("Service", inputs.service),
      label("Model", inputs.model),
      label("Operation", inputs.operation),
      label("Prompt bucket", inputs.prompt_bucket),
    ),
    el(
      "div",
      { class: "actions" },
      el("button", { type: "submit", text: "Compare", "data-testid": "compare-submit" }),
      preset("previous vs last 15 min", 900),
      preset("previous vs last hour", 3600),
      preset("yesterday vs today", 86400),
    ),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const next = dimensionValues(inputs);
    for (const name of WINDOW_FIELDS) next[name] = fromUtcInput(inputs[name].value);
    context.navigate(context.routeHash("compare", next));
  });
  return form;
}

function dimensionValues(inputs) {
  const values = {};
  for (const name of DIMENSIONS) values[name] = inputs[name].value.trim();
  return values;
}

function windowsSummary(data) {
  const line = (name, report) =>
    el(
      "div",
      { class: `window-card window-${name.toLowerCase()}`, "data-testid": `window-${name.toLowerCase()}` },
      el("strong", { text: name }),
      ` ${formatUnixS(report?.since_s)} → ${formatUnixS(report?.until_s)} · `,
      el("span", { "data-cell": "requests", text: formatCount(report?.requests ?? 0) }),
      " requests",
    );
  return el("div", { class: "window-cards" }, line("A", data.a), line("B", data.b));
}

function sloSection(entries) {
  const section = el("section", {}, el("h2", { text: "SLO targets" }));
  if (entries.length === 0) {
    section.appendChild(el("p", { class: "muted", text: "No SLO targets are configured." }));
    return section;
  }
  const head = el(
    "tr",
    {},
    el("th", { text: "target" }),
    el("th", { text: "objective" }),
    el("th", { class: "num", text: "A value" }),
    el("th", { text: "A" }),
    el("th", { class: "num", text: "A compliance" }),
    el("th", { class: "num", text: "B value" }),
    el("th", { text: "B" }),
    el("th", { class: "num", text: "B compliance" }),
    el("th", { class: "num", text: "change" }),
  );
  const body = el("tbody");
  for (const entry of entries) {
    const a = entry.a ?? null;
    const b = entry.b ?? null;
    const any = a ?? b ?? {};
    const statusA = sloStatus(a);
    const statusB = sloStatus(b);
    const change = isNumber(a?.value_ms) && isNumber(b?.value_ms) && a.value_ms > 0 ? b.value_ms / a.value_ms - 1 : null;
    body.appendChild(
      el(
        "tr",
        { "data-testid": "compare-slo-row", "data-target": String(entry.target ?? "") },
        el("td", { text: String(entry.target ?? "") }),
        el("td", { text: `${any.metric ?? "?"} p${any.percentile ?? "?"} < ${formatMs(any.threshold_ms)}` }),
        el("td", { class: "num", "data-cell": "a.value", text: formatMs(a?.value_ms) }),
        el("td", { class: statusA.cls, "data-cell": "a.status", text: statusA.text }),
        el("td", { class: "num", text: formatPercent(a?.compliance, 2) }),
        el("td", { class: "num", "data-cell": "b.value", text: formatMs(b?.value_ms) }),
        el("td", { class: statusB.cls, "data-cell": "b.status", text: statusB.text }),
        el("td", { class: "num", text: formatPercent(b?.compliance, 2) }),
        el("td", { class: ["num", changeClass(change)], text: formatChange(change) }),
      ),
    );
  }
  section.appendChild(el("table", { class: "data", "data-testid": "compare-slo" }, el("thead", {}, head), body));
  return section;
}

/** Latency: lower is better. */
function changeClass(change) {
  if (!isNumber(change) || Math.abs(change) < CHANGE_NOISE) return "";
  return change < 0 ? "good" : "bad";
}

function metricsSection(metrics) {
  const section = el("section", {}, el("h2", { text: "Percentiles: A → B" }));
  const showAll = false;
  const toggle = el("input", { type: "checkbox", "data-testid": "compare-all-metrics" });
  toggle.addEventListener("change", () => {
    for (const row of section.querySelectorAll("tr[data-secondary]")) row.hidden = !toggle.checked;
  });
  section.appendChild(el("label", { class: "toggle" }, toggle, " also queue, prefill, decode and network"));
  if (metrics.length === 0) {
    section.appendChild(el("p", { class: "muted", "data-testid": "compare-empty", text: "Neither window has requests." }));
    return section;
  }
  const sorted = [...metrics].sort((x, y) => {
    const keyX = `${x.service}\u0000${x.model}\u0000${x.operation}\u0000${x.prompt_bucket}`;
    const keyY = `${y.service}\u0000${y.model}\u0000${y.operation}\u0000${y.prompt_bucket}`;
    if (keyX !== keyY) return keyX < keyY ? -1 : 1;
    return METRIC_ORDER.indexOf(x.metric) - METRIC_ORDER.indexOf(y.metric);
  });
  const head = el(
    "tr",
    {},
    ["service", "model", "operation", "prompt", "metric"].map((label) => el("th", { text: label })),
    ["A p50", "A p95", "A p99", "A n", "B p50", "B p95", "B p99", "B n", "Δ p50", "Δ p95", "Δ p99", "p99 change"].map((label) => el("th", { class: "num", text: label })),
  );
  const body = el("tbody");
  let previousKey = null;
  for (const row of sorted) {
    // Rows of one key are grouped: its name is shown on the first of them only.
    const key = JSON.stringify([row.service, row.model, row.operation, row.prompt_bucket]);
    const sameKey = key === previousKey;
    previousKey = key;
    const a = row.a ?? {};
    const b = row.b ?? {};
    const delta = row.delta ?? {};
    const change = row.change ?? {};
    body.appendChild(
      el(
        "tr",
        {
          "data-testid": "compare-row",
          "data-metric": String(row.metric ?? ""),
          "data-service": String(row.service ?? ""),
          "data-model": String(row.model ?? ""),
          "data-operation": String(row.operation ?? ""),
          "data-prompt-bucket": String(row.prompt_bucket ?? ""),
          class: sameKey ? "same-key" : "new-key",
          hidden: !MAIN_METRICS.has(row.metric) && !showAll,
          "data-secondary": MAIN_METRICS.has(row.metric) ? undefined : "true",
        },
        ["service", "model", "operation", "prompt_bucket"].map((name) =>
          el("td", { class: "key-cell", text: sameKey ? "" : String(row[name] ?? "") }),
        ),
        el("td", { class: "metric-name", text: String(row.metric ?? "").toUpperCase() }),
        ["p50", "p95", "p99"].map((q) => el("td", { class: "num", "data-cell": `a.${q}`, text: formatMs(a[q], { unit: false }) })),
        el("td", { class: "num muted", "data-cell": "a.count", text: formatCount(a.count) }),
        ["p50", "p95", "p99"].map((q) => el("td", { class: "num", "data-cell": `b.${q}`, text: formatMs(b[q], { unit: false }) })),
        el("td", { class: "num muted", "data-cell": "b.count", text: formatCount(b.count) }),
        ["p50", "p95", "p99"].map((q) => el("td", { class: ["num", changeClass(change[q])], "data-cell": `delta.${q}`, text: formatSignedMs(delta[q]) })),
        el("td", { class: ["num", changeClass(change.p99)], "data-cell": "change.p99", text: formatChange(change.p99) }),
      ),
    );
  }
  section.appendChild(el("div", { class: "table-scroll" }, el("table", { class: "data", "data-testid": "compare-table" }, el("thead", {}, head), body)));
  return section;
}

function budgetSection(budget) {
  const entries = [...budgetEntries(budget.a, "A"), ...budgetEntries(budget.b, "B")];
  // A p50, B p50, A p99, B p99: each percentile's two windows next to each other.
  const ordered = [entries[0], entries[2], entries[1], entries[3]];
  const names = new Set(ordered.flatMap((entry) => budgetParts(entry.segments).map((part) => part.segment)));
  return el(
    "section",
    { class: "budget-section" },
    el("h2", { text: "Where the time goes, A vs B" }),
    budgetBars(ordered, { width: 860, testid: "compare-budget-bar" }),
    segmentLegend(names),
  );
}
