// One request: the verdict with its numbers on top, about one metric at a time (a switch picks
// TTFT, TPOT, ITL or E2E; `?metric=` in the route), then the shared-axis timeline (waterfall,
// token ticks, engine steps, GPU lanes), that metric's budget, the outlier engine steps, GPU
// phases and the request's spans.

import { apiGet } from "./api.js";
import { add, clear, el, isHexId, link, requestRoute } from "./dom.js";
import { budgetParts, segmentLegend } from "./charts.js";
import {
  VERDICT_METRICS,
  clockText,
  formatBytes,
  formatCount,
  formatIso,
  formatMs,
  formatPercent,
  formatVerdictNumber,
  humanise,
  isNumber,
  segmentClass,
} from "./format.js";
import { MAX_TICKS_DRAWN, drawTimeline, stepSummary } from "./timeline.js";

const MAX_STEP_ROWS = 200;
const MAX_SPAN_ROWS = 500;
const MIN_TIMELINE_WIDTH = 640;
const CLOCKS = ["client", "server"];
// What one unit of a per-token metric's budget is (TTFT and E2E are one span of time).
const BUDGET_UNITS = { tpot: "per output token", itl: "the slow inter-token gaps together (all gaps when none is slow)" };

// The metric whose switch button was pressed: its button gets the focus back once the page
// is drawn again for it (the switch is a route change, so the keyboard user stays in place).
let switchedTo = null;

export async function renderRequest(context) {
  const traceId = (context.parts[1] ?? "").toLowerCase();
  const spanId = (context.parts[2] ?? "").toLowerCase();
  if (!isHexId(traceId, { min: 8, max: 32 })) {
    return el("section", { class: "message error", "data-testid": "error", text: "A request is opened by its trace id (hex, at least 8 digits)." });
  }
  const params = isHexId(spanId, { min: 16, max: 16 }) ? { span_id: spanId } : {};
  const metric = context.params.get("metric");
  if (VERDICT_METRICS.includes(metric)) params.metric = metric;
  const data = await apiGet(`requests/${encodeURIComponent(traceId)}`, params);
  if (!context.isCurrent()) return el("div");
  const doc = data.request ?? {};
  const view = el("div", { class: "view request-view", "data-testid": "request-view" });
  const switcher = metricSwitch(doc, data, context);
  view.append(
    header(doc, data),
    verdictPanel(doc, data, switcher),
    metricsStrip(doc),
    notes(doc, data),
    timelineSection(data),
    el("div", { class: "columns" }, budgetSection(doc, data), tokenSection(data)),
    stepsSection(data),
    gpuSection(data),
    spansSection(data),
  );
  const focusMetric = switchedTo;
  switchedTo = null;
  const pressed = focusMetric && switcher?.querySelector(`button[data-metric="${CSS.escape(focusMetric)}"]`);
  // After the router has put the view in the page (it does so once this function returns).
  if (pressed) window.setTimeout(() => pressed.focus(), 0);
  return view;
}

function header(doc, data) {
  const title = el("div", { class: "request-title" });
  title.append(
    el("h1", {}, "Request ", el("code", { "data-testid": "trace-id", text: doc.trace_id ?? "" })),
    el(
      "p",
      { class: "subtitle" },
      el("span", { "data-field": "service", text: doc.service ?? "" }),
      " · ",
      el("span", { "data-field": "model", text: doc.model ?? "" }),
      " · ",
      el("span", { "data-field": "operation", text: doc.operation ?? "" }),
      " · prompt ",
      el("span", { "data-field": "prompt_bucket", text: doc.prompt_bucket ?? "" }),
      " · ",
      el("span", { text: formatIso(doc.start?.iso) }),
    ),
  );
  const ids = el(
    "p",
    { class: "ids" },
    "span ",
    el("code", { text: doc.span_id ?? "" }),
    doc.request_id ? [" · request id ", el("code", { "data-field": "request_id", text: doc.request_id })] : null,
  );
  title.appendChild(ids);
  const traceLink = data.links?.trace;
  if (typeof traceLink === "string" && traceLink) {
    // Only an absolute http(s) URL becomes a link; anything else is shown as text.
    title.appendChild(el("p", { class: "trace-link" }, "trace in the tracing backend: ", link(traceLink, { "data-testid": "trace-link", text: traceLink })));
  }
  return title;
}

/** One button per metric the request has a verdict about; the default verdict's is marked. */
function metricSwitch(doc, data, context) {
  const verdicts = doc.verdicts && typeof doc.verdicts === "object" ? doc.verdicts : {};
  const metrics = VERDICT_METRICS.filter((metric) => verdicts[metric]);
  if (metrics.length === 0) return null;
  const defaultMetric = doc.verdict?.metric ?? null;
  const base = requestRoute(doc.trace_id, doc.span_id);
  const group = el("div", { class: "metric-switch", role: "group", "aria-label": "verdict about", "data-testid": "metric-switch" }, el("span", { class: "switch-label", text: "Verdict about" }));
  for (const metric of metrics) {
    const isDefault = metric === defaultMetric;
    group.appendChild(
      el(
        "button",
        {
          type: "button",
          "data-metric": metric,
          "data-default": isDefault ? "true" : undefined,
          "aria-pressed": metric === data.verdict_metric ? "true" : "false",
          title: isDefault && doc.verdict?.why ? `the default: ${doc.verdict.why}` : undefined,
          onclick: () => {
            if (base === null) return;
            switchedTo = metric;
            context.navigate(isDefault ? base : `${base}?metric=${metric}`);
          },
        },
        metric.toUpperCase(),
        isDefault ? el("span", { class: "default-mark", text: " · default" }) : null,
      ),
    );
  }
  return group;
}

/** The keys of a verdict's numbers that are figures of its metric's budget (on its clock). */
function budgetKeys(doc, verdict) {
  const segments = Object.keys(doc.budgets?.[verdict.metric]?.[verdict.clock]?.segments ?? {});
  return new Set(["value_ms", ...segments.flatMap((segment) => [`${segment}_ms`, `without_${segment}_ms`])]);
}

function clockTag(clock) {
  const text = clockText(clock);
  return text ? el("span", { class: "clock", "data-testid": "clock-label", "data-clock": clock, text }) : null;
}

function verdictPanel(doc, data, switcher) {
  const verdict = data.verdict ?? null;
  const metric = data.verdict_metric ?? null;
  const panel = el("section", {
    class: ["verdict-panel", verdict?.segment ? segmentClass(verdict.segment) : "no-verdict"],
    "data-testid": "verdict-panel",
    "data-metric": metric ?? undefined,
    "data-clock": verdict?.clock ?? undefined,
    "data-segment": verdict?.segment ?? undefined,
    "data-cause": verdict?.cause ?? undefined,
  });
  if (switcher) panel.appendChild(switcher);
  if (data.verdict_heading) panel.appendChild(el("p", { class: "verdict-heading", "data-testid": "verdict-heading", text: data.verdict_heading }));
  const defaultVerdict = doc.verdict ?? null;
  if (defaultVerdict?.why && defaultVerdict.metric !== metric) {
    panel.appendChild(el("p", { class: "muted", "data-testid": "default-why", text: `The default is ${String(defaultVerdict.metric).toUpperCase()}: ${defaultVerdict.why}` }));
  }
  panel.appendChild(el("p", { class: "verdict", "data-testid": "verdict", text: data.verdict_text ?? "no diagnosis for this request" }));
  if (verdict) {
    const numbers = verdict.numbers && typeof verdict.numbers === "object" ? verdict.numbers : {};
    const facts = el("p", { class: "verdict-facts" });
    if (metric) {
      add(facts, String(metric).toUpperCase(), " ", isNumber(numbers.value_ms) ? [el("strong", { "data-field": "value", text: formatMs(numbers.value_ms) }), " "] : null, clockTag(verdict.clock));
    }
    if (verdict.segment) add(facts, " · dominant ", el("strong", { "data-field": "segment", text: String(verdict.segment) }));
    if (verdict.cause) add(facts, " · cause ", el("strong", { "data-field": "cause", text: String(verdict.cause) }));
    panel.appendChild(facts);
    if (verdict.advice) panel.appendChild(el("p", { class: "advice", "data-testid": "advice", text: verdict.advice }));
    // The metric and clock are said above; the budget's figures carry whose clock they are on.
    const shown = Object.entries(numbers).filter(([key]) => key !== "metric" && key !== "clock");
    if (shown.length) {
      const onClock = budgetKeys(doc, verdict);
      const list = el("dl", { class: "numbers", "data-testid": "verdict-numbers" });
      for (const [key, value] of shown) {
        list.appendChild(
          el(
            "div",
            { class: "number", "data-key": key },
            el("dt", { text: humanise(key.replace(/_ms$/, "")) }),
            el("dd", {}, formatVerdictNumber(key, value), onClock.has(key) ? [" ", clockTag(verdict.clock)] : null),
          ),
        );
      }
      panel.appendChild(list);
    }
  }
  return panel;
}

/** "server 202.7 ms · client 245.5 ms": a metric on each clock that measured it. */
function clockFigures(doc, metric, serverValue) {
  const figures = [el("span", { "data-clock": "server", text: `server ${serverValue}` })];
  const client = doc.budgets?.[metric]?.client;
  if (client) figures.push(" · ", el("span", { "data-clock": "client", text: `client ${formatMs(client.value_ms)}` }));
  return figures;
}

function metricsStrip(doc) {
  const metrics = doc.metrics_ms ?? {};
  const itl = metrics.itl ?? {};
  const tokens = doc.tokens ?? {};
  const items = [
    ["E2E", clockFigures(doc, "e2e", formatMs(metrics.e2e)), "e2e"],
    ["TTFT", clockFigures(doc, "ttft", formatMs(metrics.ttft)), "ttft"],
    ["TPOT", clockFigures(doc, "tpot", formatMs(metrics.tpot)), "tpot"],
    ["ITL p50 / p99 / max", itl.count ? clockFigures(doc, "itl", `${formatMs(itl.p50)} / ${formatMs(itl.p99)} / ${formatMs(itl.max)}`) : "-", "itl"],
    ["tokens in / out", `${tokens.input ?? "-"}${tokens.cached ? ` (${tokens.cached} cached)` : ""} / ${tokens.output ?? "-"}`, "tokens"],
    ["finish", doc.finish_reason ?? "-", "finish"],
  ];
  const strip = el("dl", { class: "metrics-strip", "data-testid": "metrics" });
  for (const [label, value, key] of items) {
    strip.appendChild(el("div", { class: "metric", "data-metric": key }, el("dt", { text: label }), el("dd", {}, value)));
  }
  const slo = doc.slo && typeof doc.slo === "object" ? Object.entries(doc.slo) : [];
  if (slo.length) {
    const marks = el("dd", { class: "slo-marks" });
    for (const [name, met] of slo.sort(([a], [b]) => a.localeCompare(b))) {
      marks.appendChild(
        el("span", { class: ["slo-mark", met ? "good" : "bad"], "data-testid": "slo-mark", "data-met": met ? "true" : "false", text: `${met ? "✓" : "✗"} ${name}` }),
      );
    }
    strip.appendChild(el("div", { class: "metric slo" }, el("dt", { text: "SLO" }), marks));
  }
  return strip;
}

function notes(doc, data) {
  const list = el("ul", { class: "notes", "data-testid": "notes" });
  if (doc.status_error) list.appendChild(el("li", { class: "bad", text: `error: ${doc.status_error}` }));
  if (doc.skew_clamped) list.appendChild(el("li", { text: "out-of-order timestamps (clock skew) were clamped" }));
  const dropped = data.tokens?.dropped ?? doc.token_offsets_dropped;
  if (dropped) list.appendChild(el("li", { text: `${dropped} token times were not recorded (the agent's cap)` }));
  const others = (data.other_span_ids ?? doc.other_span_ids ?? []).filter((id) => isHexId(id, { min: 16, max: 16 }));
  if (others.length) {
    const item = el("li", {}, `${others.length} more request(s) in this trace: `);
    others.forEach((id, index) => {
      if (index) item.append(", ");
      item.appendChild(link(requestRoute(doc.trace_id, id), { text: id }));
    });
    list.appendChild(item);
  }
  return list.childElementCount ? list : el("div");
}

function timelineWidth() {
  const main = document.getElementById("app");
  // main and the section around the chart have padding and borders: about 80 px in all.
  const available = main ? main.clientWidth - 80 : 1000;
  return Math.max(MIN_TIMELINE_WIDTH, Math.floor(available));
}

function timelineSection(data) {
  const section = el("section", { class: "timeline-section" }, el("h2", { text: "Timeline" }));
  const holder = el("div", { class: "timeline-holder" });
  const highlightStep = (spanId) => {
    if (typeof spanId !== "string") return;
    for (const row of document.querySelectorAll("[data-testid=engine-step-row].selected")) row.classList.remove("selected");
    const row = document.querySelector(`[data-testid=engine-step-row][data-span-id="${CSS.escape(spanId)}"]`);
    if (row) {
      row.classList.add("selected");
      row.scrollIntoView({ block: "nearest", behavior: "smooth" });
    }
  };
  const draw = () => clear(holder).appendChild(drawTimeline(data, { width: timelineWidth(), onStep: highlightStep }));
  draw();
  // Redraw at the new width while this page is shown; forget the listener once it is gone.
  let pending = 0;
  const onResize = () => {
    if (!holder.isConnected) {
      window.removeEventListener("resize", onResize);
      return;
    }
    window.clearTimeout(pending);
    pending = window.setTimeout(draw, 150);
  };
  window.addEventListener("resize", onResize);
  const segments = new Set((data.waterfall ?? []).map((row) => row.segment));
  section.append(holder, segmentLegend(segments));
  const ticks = data.tokens?.ticks_ms?.length ?? 0;
  if (ticks > MAX_TICKS_DRAWN) {
    section.appendChild(el("p", { class: "muted", text: `${ticks} tokens: every outlier and an evenly thinned set of the others are drawn.` }));
  }
  return section;
}

/** The budget of the verdict's metric on one clock, with a client/server toggle where the
 * request has both; the verdict's dominant segment highlighted. */
function budgetSection(doc, data) {
  const metric = data.verdict_metric ?? "e2e";
  const name = metric.toUpperCase();
  const onClocks = doc.budgets?.[metric] ?? {};
  const clocks = CLOCKS.filter((clock) => onClocks[clock]);
  const section = el("section", { class: "budget-section", "data-testid": "budget-section", "data-metric": metric }, el("h2", { text: `Budget of ${name}` }));
  if (clocks.length === 0) {
    section.appendChild(el("p", { class: "muted", "data-testid": "budget-empty", text: `No ${name} budget for this request.` }));
    return section;
  }
  const verdictClock = data.verdict?.clock;
  let shown = clocks.includes(verdictClock) ? verdictClock : clocks[0];
  const holder = el("div");
  const draw = () => clear(holder).appendChild(budgetTable(metric, shown, onClocks[shown], data.verdict?.segment));
  if (clocks.length > 1) {
    const toggle = el("div", { class: "clock-toggle", role: "group", "aria-label": "whose clock", "data-testid": "clock-toggle" });
    for (const clock of clocks) {
      toggle.appendChild(
        el("button", {
          type: "button",
          "data-clock": clock,
          "aria-pressed": clock === shown ? "true" : "false",
          text: clockText(clock),
          onclick: () => {
            shown = clock;
            for (const button of toggle.querySelectorAll("button")) button.setAttribute("aria-pressed", button.dataset.clock === clock ? "true" : "false");
            draw();
          },
        }),
      );
    }
    section.appendChild(toggle);
  }
  draw();
  section.appendChild(holder);
  if (BUDGET_UNITS[metric]) section.appendChild(el("p", { class: "muted", text: `${name}: ${BUDGET_UNITS[metric]}.` }));
  return section;
}

function budgetTable(metric, clock, budget, dominant) {
  const name = metric.toUpperCase();
  const total = budget?.value_ms;
  const body = el("tbody");
  for (const { segment, ms } of budgetParts(budget?.segments)) {
    const isDominant = segment === dominant;
    body.appendChild(
      el(
        "tr",
        { "data-segment": segment, "data-dominant": isDominant ? "true" : undefined, class: isDominant ? "dominant" : "" },
        el("td", {}, el("span", { class: ["swatch", segmentClass(segment)], "aria-hidden": "true" }), humanise(segment)),
        el("td", { class: "num", text: formatMs(ms, { unit: false }) }),
        el("td", { class: "num", text: isNumber(total) && total > 0 ? formatPercent(ms / total) : "-" }),
      ),
    );
  }
  body.appendChild(
    el("tr", { class: "total" }, el("td", {}, `${name} `, clockTag(clock)), el("td", { class: "num", "data-field": "value", text: formatMs(total, { unit: false }) }), el("td", { class: "num", text: "100.0%" })),
  );
  const head = el("tr", {}, el("th", { text: "segment" }), el("th", { class: "num", text: "ms" }), el("th", { class: "num", text: `% of ${name}` }));
  return el("table", { class: "data compact", "data-testid": "budget-table", "data-clock": clock }, el("thead", {}, head), body);
}

function tokenSection(data) {
  const tokens = data.tokens ?? {};
  const gaps = tokens.gaps ?? [];
  const outliers = gaps.filter((gap) => gap && gap.outlier);
  const list = el(
    "dl",
    { class: "facts", "data-testid": "token-facts" },
    el("dt", { text: "tokens" }),
    el("dd", { text: formatCount((tokens.ticks_ms ?? []).length) }),
    el("dt", { text: "median gap" }),
    el("dd", { text: formatMs(tokens.median_gap_ms) }),
    el("dt", { text: "outlier threshold" }),
    el("dd", { text: formatMs(tokens.outlier_threshold_ms) }),
    el("dt", { text: "outlier gaps" }),
    el("dd", { text: formatCount(outliers.length) }),
  );
  const section = el("section", { class: "token-section" }, el("h2", { text: "Inter-token gaps" }), list);
  if (outliers.length) {
    const body = el("tbody");
    for (const gap of outliers.slice(0, 50)) {
      body.appendChild(
        el(
          "tr",
          { "data-testid": "outlier-gap-row" },
          el("td", { class: "num", text: String(gap.index) }),
          el("td", { class: "num", text: formatMs(gap.at_ms, { unit: false }) }),
          el("td", { class: "num bad", text: formatMs(gap.gap_ms, { unit: false }) }),
          el("td", { class: "num", text: isNumber(tokens.median_gap_ms) && tokens.median_gap_ms > 0 ? `${(gap.gap_ms / tokens.median_gap_ms).toFixed(1)}x` : "-" }),
        ),
      );
    }
    const head = el("tr", {}, el("th", { class: "num", text: "token" }), el("th", { class: "num", text: "at ms" }), el("th", { class: "num", text: "gap ms" }), el("th", { class: "num", text: "x median" }));
    section.appendChild(el("table", { class: "data compact" }, el("thead", {}, head), body));
  }
  return section;
}

function stepsSection(data) {
  const steps = data.engine_steps ?? [];
  const outliers = steps.filter((step) => step.outlier);
  const shown = (outliers.length ? outliers : steps).slice(0, MAX_STEP_ROWS);
  const title = outliers.length
    ? `Engine steps during the outlier gaps (${outliers.length} of ${steps.length})`
    : `Engine steps (${steps.length})`;
  const section = el("section", { class: "steps-section" }, el("h2", { text: title }));
  if (steps.length === 0) {
    section.appendChild(el("p", { class: "muted", text: "The agent exported no engine steps that overlap this request." }));
    return section;
  }
  const head = el(
    "tr",
    {},
    ["start ms", "duration ms", "batch", "prefill req", "prefill tokens", "decode req", "decode tokens", "KV cache", "waiting", "running", "GPU util", "BW % peak"].map(
      (label) => el("th", { class: "num", text: label }),
    ),
    el("th", { text: "requests in the batch" }),
  );
  const body = el("tbody");
  for (const step of shown) {
    const ids = Array.isArray(step.request_ids) ? step.request_ids.map(String) : [];
    const row = el(
      "tr",
      {
        "data-testid": "engine-step-row",
        "data-span-id": typeof step.span_id === "string" ? step.span_id : "",
        "data-outlier": step.outlier ? "true" : "false",
        class: step.outlier ? "outlier" : "",
        title: stepSummary(step),
      },
      el("td", { class: "num", text: formatMs(step.start_ms, { unit: false }) }),
      el("td", { class: "num", text: isNumber(step.end_ms) && isNumber(step.start_ms) ? formatMs(step.end_ms - step.start_ms, { unit: false }) : "-" }),
      el("td", { class: "num", "data-field": "batch_size", text: formatCount(step.batch_size) }),
      el("td", { class: "num", text: formatCount(step.prefill_requests) }),
      el("td", { class: ["num", step.prefill_tokens > 0 ? "warn" : ""], "data-field": "prefill_tokens", text: formatCount(step.prefill_tokens) }),
      el("td", { class: "num", text: formatCount(step.decode_requests) }),
      el("td", { class: "num", text: formatCount(step.decode_tokens) }),
      el("td", { class: "num", text: formatPercent(step.kv_cache_usage) }),
      el("td", { class: "num", text: formatCount(step.waiting) }),
      el("td", { class: "num", text: formatCount(step.running) }),
      el("td", { class: "num", text: formatPercent(step.gpu?.utilization_mean) }),
      el("td", { class: "num", text: formatPercent(step.gpu?.bandwidth_peak_ratio) }),
      el(
        "td",
        { class: "ids-cell" },
        ids.length ? el("details", {}, el("summary", { text: `${ids.length} request${ids.length === 1 ? "" : "s"}` }), el("div", { text: ids.join(", ") })) : "-",
      ),
    );
    body.appendChild(row);
  }
  section.appendChild(el("div", { class: "table-scroll" }, el("table", { class: "data compact", "data-testid": "engine-steps" }, el("thead", {}, head), body)));
  if (shown.length < (outliers.length || steps.length)) {
    section.appendChild(el("p", { class: "muted", text: `first ${shown.length} shown` }));
  }
  return section;
}

function gpuSection(data) {
  const phases = data.gpu ?? [];
  const section = el("section", { class: "gpu-section" }, el("h2", { text: "GPU during the request" }));
  if (phases.length === 0) {
    section.appendChild(el("p", { class: "muted", "data-testid": "gpu-empty", text: "No GPU samples: the node agent did not enrich this request (no GPU, or no node agent on its path)." }));
    return section;
  }
  const head = el(
    "tr",
    {},
    el("th", { text: "phase" }),
    ["util mean", "util max", "mem ctrl", "bandwidth", "% of peak", "memory", "power", "SM clock", "mem clock", "samples"].map((label) => el("th", { class: "num", text: label })),
  );
  const body = el("tbody");
  for (const phase of phases) {
    body.appendChild(
      el(
        "tr",
        { "data-testid": "gpu-phase-row", "data-phase": String(phase.phase ?? "") },
        el("td", { text: String(phase.phase ?? "") }),
        el("td", { class: "num", text: formatPercent(phase.utilization_mean) }),
        el("td", { class: "num", text: formatPercent(phase.utilization_max) }),
        el("td", { class: "num", text: formatPercent(phase.memory_controller_utilization_mean) }),
        el("td", { class: "num", text: isNumber(phase.bandwidth_gbps) ? `${phase.bandwidth_gbps.toFixed(0)} GB/s` : "-" }),
        el("td", { class: "num", text: formatPercent(phase.bandwidth_peak_ratio) }),
        el("td", { class: "num", text: formatBytes(phase.memory_used_bytes) }),
        el("td", { class: "num", text: isNumber(phase.power_w) ? `${phase.power_w.toFixed(0)} W` : "-" }),
        el("td", { class: "num", text: isNumber(phase.sm_clock_mhz) ? `${phase.sm_clock_mhz.toFixed(0)} MHz` : "-" }),
        el("td", { class: "num", text: isNumber(phase.memory_clock_mhz) ? `${phase.memory_clock_mhz.toFixed(0)} MHz` : "-" }),
        el("td", { class: "num", text: formatCount(phase.samples) }),
      ),
    );
  }
  section.appendChild(el("div", { class: "table-scroll" }, el("table", { class: "data compact", "data-testid": "gpu-table" }, el("thead", {}, head), body)));
  return section;
}

function attributeText(value) {
  if (typeof value === "string") return value;
  try {
    return JSON.stringify(value);
  } catch {
    return String(value);
  }
}

function spansSection(data) {
  const spans = (data.spans ?? []).slice(0, MAX_SPAN_ROWS);
  const details = el("details", { class: "spans-section", "data-testid": "spans" });
  details.appendChild(el("summary", {}, el("h2", { text: `Spans (${spans.length})` })));
  if (spans.length === 0) {
    details.appendChild(el("p", { class: "muted", text: "The stored trace holds no spans of this request." }));
    return details;
  }
  // Depth from the parent links, for indentation (spans arrive in any order).
  const parents = new Map(spans.map((span) => [span.span_id, span.parent_span_id]));
  const depthOf = (span) => {
    let depth = 0;
    let parent = span.parent_span_id;
    while (parent && parents.has(parent) && depth < 32) {
      depth += 1;
      parent = parents.get(parent);
    }
    return depth;
  };
  const body = el("tbody");
  for (const span of [...spans].sort((a, b) => (a.start_ms ?? 0) - (b.start_ms ?? 0))) {
    const attributes = span.attributes && typeof span.attributes === "object" ? Object.entries(span.attributes) : [];
    const attrList = el("dl", { class: "attributes" });
    for (const [key, value] of attributes) {
      attrList.append(el("dt", { text: key }), el("dd", { text: attributeText(value) }));
    }
    const depth = Math.min(depthOf(span), 8);
    body.appendChild(
      el(
        "tr",
        { "data-testid": "span-row", "data-span-id": typeof span.span_id === "string" ? span.span_id : "", class: span.status === "error" ? "bad" : "" },
        el("td", { class: `depth-${depth}`, text: String(span.name ?? "") }),
        el("td", { class: "num", text: formatMs(span.start_ms, { unit: false }) }),
        el("td", { class: "num", text: isNumber(span.end_ms) && isNumber(span.start_ms) ? formatMs(span.end_ms - span.start_ms, { unit: false }) : "-" }),
        el("td", { text: String(span.status ?? "") }),
        el("td", {}, attributes.length ? el("details", {}, el("summary", { text: `${attributes.length} attributes` }), attrList) : "-"),
      ),
    );
  }
  const head = el("tr", {}, el("th", { text: "span" }), el("th", { class: "num", text: "start ms" }), el("th", { class: "num", text: "duration ms" }), el("th", { text: "status" }), el("th", { text: "attributes" }));
  details.appendChild(el("div", { class: "table-scroll" }, el("table", { class: "data compact" }, el("thead", {}, head), body)));
  return details;
}
