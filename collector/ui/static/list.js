// The request list: filters, sorting, cursor pagination (next / back).

import { apiGet } from "./api.js";
import { add, el, link, requestRoute } from "./dom.js";
import { SEGMENTS, formatIsoShort, formatMs, segmentClass } from "./format.js";

/** The query parameters the list endpoint understands (anything else in the hash is ignored). */
const LIST_PARAMS = [
  "since",
  "until",
  "last",
  "service",
  "model",
  "operation",
  "prompt_bucket",
  "slo_breached",
  "cause",
  "segment",
  "min_ttft_ms",
  "min_e2e_ms",
  "q",
  "sort",
  "order",
  "limit",
  "cursor",
];

const SORTABLE = [
  ["start", "Start"],
  ["e2e", "E2E"],
  ["ttft", "TTFT"],
  ["tpot", "TPOT"],
  ["queue", "Queue"],
  ["prefill", "Prefill"],
  ["decode", "Decode"],
  ["network", "Network"],
];

const LAST_CHOICES = [
  ["", "all time"],
  ["5m", "last 5 min"],
  ["15m", "last 15 min"],
  ["1h", "last hour"],
  ["6h", "last 6 hours"],
  ["24h", "last 24 hours"],
  ["7d", "last 7 days"],
];

const CAUSES = [
  "queueing",
  "cold_start",
  "long_prompt",
  "prefix_cache_miss",
  "prefill",
  "bandwidth_bound_decode",
  "batching_interference",
  "long_decode",
  "kv_cache_pressure",
  "network",
  "http",
  "postprocess",
  "unattributed",
  "error",
];

// The cursor of the page before each page reached with "next", per filter set: the API's cursors
// only go forward. Browser back/forward keep working (they change the hash); after a reload,
// "back" returns to the first page.
const previousCursor = new Map();
const MAX_REMEMBERED_PAGES = 1000;

function listParams(params) {
  const picked = {};
  for (const name of LIST_PARAMS) {
    const value = params.get(name);
    if (value !== null && value !== "") picked[name] = value;
  }
  return picked;
}

function filterKey(picked) {
  const { cursor, ...filters } = picked;
  return JSON.stringify(Object.entries(filters).sort());
}

export async function renderList(context) {
  const picked = listParams(context.params);
  const page = await apiGet("requests", picked);
  if (!context.isCurrent()) return el("div");
  const key = filterKey(picked);
  const view = el("div", { class: "view list-view", "data-testid": "list-view" });
  view.append(
    el("h1", { text: "Requests" }),
    filterForm(picked, context),
    summaryLine(page),
    requestTable(page.items ?? [], picked, context),
    pager(page, picked, key, context),
  );
  return view;
}

function summaryLine(page) {
  const total = typeof page.total === "number" ? page.total : 0;
  const exact = page.total_exact !== false;
  const shown = Array.isArray(page.items) ? page.items.length : 0;
  return el(
    "p",
    { class: "summary", "data-testid": "list-summary" },
    `${exact ? "" : "more than "}${total.toLocaleString("en-US")} matching request${total === 1 ? "" : "s"}`,
    ` · ${shown} on this page`,
  );
}

function field(label, input) {
  return el("label", { class: "field" }, el("span", { text: label }), input);
}

function textInput(name, value, attrs = {}) {
  const input = el("input", { type: "text", name, "data-filter": name, ...attrs });
  input.value = value ?? "";
  return input;
}

function select(name, value, choices) {
  const node = el("select", { name, "data-filter": name });
  for (const [choice, label] of choices) {
    const option = el("option", { value: choice, text: label });
    if (choice === (value ?? "")) option.selected = true;
    node.appendChild(option);
  }
  return node;
}

/** unix seconds -> the value of a UTC datetime-local input. */
function toUtcInput(seconds) {
  const value = Number(seconds);
  if (!Number.isFinite(value)) return "";
  return new Date(value * 1000).toISOString().slice(0, 19);
}

function fromUtcInput(text) {
  if (!text) return "";
  const millis = Date.parse(`${text}Z`);
  return Number.isFinite(millis) ? String(millis / 1000) : "";
}

function filterForm(picked, context) {
  const since = el("input", { type: "datetime-local", step: "1", name: "since", "data-filter": "since" });
  since.value = toUtcInput(picked.since);
  const until = el("input", { type: "datetime-local", step: "1", name: "until", "data-filter": "until" });
  until.value = toUtcInput(picked.until);
  const last = select("last", picked.last, LAST_CHOICES);
  const inputs = {
    service: textInput("service", picked.service),
    model: textInput("model", picked.model),
    operation: textInput("operation", picked.operation, { list: "operations" }),
    prompt_bucket: textInput("prompt_bucket", picked.prompt_bucket, { placeholder: "e.g. 128-511" }),
    slo_breached: select("slo_breached", picked.slo_breached, [
      ["", "any"],
      ["true", "breached"],
      ["false", "met"],
    ]),
    cause: select("cause", picked.cause, [["", "any"], ...CAUSES.map((cause) => [cause, cause])]),
    segment: select("segment", picked.segment, [["", "any"], ...SEGMENTS.map((s) => [s, s])]),
    min_ttft_ms: textInput("min_ttft_ms", picked.min_ttft_ms, { inputmode: "decimal", placeholder: "ms" }),
    min_e2e_ms: textInput("min_e2e_ms", picked.min_e2e_ms, { inputmode: "decimal", placeholder: "ms" }),
    q: textInput("q", picked.q, { placeholder: "request id or trace id", "data-testid": "search" }),
  };
  const operations = el(
    "datalist",
    { id: "operations" },
    ["chat", "text_completion", "embeddings", "generate_content"].map((op) => el("option", { value: op })),
  );
  const form = el(
    "form",
    { class: "filters", "data-testid": "filters" },
    field("Time", last),
    field("From (UTC)", since),
    field("To (UTC)", until),
    field("Service", inputs.service),
    field("Model", inputs.model),
    field("Operation", inputs.operation),
    field("Prompt bucket", inputs.prompt_bucket),
    field("SLO", inputs.slo_breached),
    field("Cause", inputs.cause),
    field("Dominant", inputs.segment),
    field("Min TTFT", inputs.min_ttft_ms),
    field("Min E2E", inputs.min_e2e_ms),
    field("Search", inputs.q),
    operations,
    el(
      "div",
      { class: "actions" },
      el("button", { type: "submit", text: "Apply", "data-testid": "apply-filters" }),
      el("button", {
        type: "button",
        class: "link-button",
        text: "Clear",
        onclick: () => context.navigate(context.routeHash("requests", {})),
      }),
    ),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const next = { sort: picked.sort, order: picked.order, limit: picked.limit };
    for (const [name, input] of Object.entries(inputs)) next[name] = input.value.trim();
    next.since = fromUtcInput(since.value);
    next.until = fromUtcInput(until.value);
    // An explicit range wins over "last".
    next.last = next.since || next.until ? "" : last.value;
    context.navigate(context.routeHash("requests", next));
  });
  return form;
}

function sortHeader(sort, label, picked, context) {
  const active = (picked.sort ?? "start") === sort;
  const order = picked.order ?? "desc";
  const nextOrder = active && order === "desc" ? "asc" : "desc";
  const arrow = active ? (order === "desc" ? " ▼" : " ▲") : "";
  const button = el("button", {
    type: "button",
    class: ["sort", active ? "active" : ""],
    "data-sort": sort,
    "data-testid": `sort-${sort}`,
    text: `${label}${arrow}`,
    "aria-sort": active ? (order === "desc" ? "descending" : "ascending") : undefined,
    onclick: () => {
      const { cursor, ...rest } = picked;
      context.navigate(context.routeHash("requests", { ...rest, sort, order: nextOrder }));
    },
  });
  return el("th", { class: sort === "start" ? "" : "num" }, button);
}

function requestTable(items, picked, context) {
  if (items.length === 0) {
    return el("p", { class: "message", "data-testid": "list-empty", text: "No request matches these filters." });
  }
  // Network time needs a client span; most deployments have none, so its column is left out
  // unless a request on this page has it (or the list is sorted by it).
  const showNetwork = picked.sort === "network" || items.some((item) => item.network_ms !== null && item.network_ms !== undefined);
  const sortCells = Object.fromEntries(SORTABLE.map(([sort, label]) => [sort, sortHeader(sort, label, picked, context)]));
  const head = el(
    "tr",
    {},
    sortCells.start,
    el("th", { text: "Service" }),
    el("th", { text: "Model" }),
    el("th", { text: "Operation" }),
    el("th", { text: "Prompt" }),
    sortCells.e2e,
    sortCells.ttft,
    sortCells.tpot,
    sortCells.queue,
    sortCells.prefill,
    sortCells.decode,
    showNetwork ? sortCells.network : null,
    el("th", { class: "num", text: "Tokens in/out" }),
    el("th", { text: "SLO" }),
    el("th", { text: "Verdict" }),
  );
  const body = el("tbody");
  for (const item of items) body.appendChild(requestRow(item, context, "request-row", { showNetwork }));
  return el("div", { class: "table-scroll" }, el("table", { class: "data requests", "data-testid": "request-table" }, el("thead", {}, head), body));
}

function msCell(value, metric) {
  return el("td", { class: "num", "data-metric": metric, text: formatMs(value, { unit: false }) });
}

export function requestRow(item, context, testid = "request-row", { showNetwork = true } = {}) {
  const route = requestRoute(item.trace_id, item.span_id);
  const row = el("tr", {
    "data-testid": testid,
    "data-trace-id": typeof item.trace_id === "string" ? item.trace_id : "",
    class: ["clickable", item.slo_breached ? "breached" : ""],
  });
  if (route) {
    row.addEventListener("click", (event) => {
      if (event.target instanceof Element && event.target.closest("a")) return; // the link itself
      context.navigate(route);
    });
  }
  const tokens = `${item.input_tokens ?? "-"} / ${item.output_tokens ?? "-"}`;
  const verdictCell = el("td", { class: "verdict-cell", "data-field": "verdict" });
  if (item.segment) verdictCell.appendChild(el("span", { class: ["seg-dot", segmentClass(item.segment)], "aria-hidden": "true" }));
  verdictCell.appendChild(el("span", { class: "verdict-text", text: item.verdict ?? item.cause ?? "-" }));
  if (typeof item.verdict === "string") verdictCell.setAttribute("title", item.verdict);
  add(
    row,
    el(
      "td",
      { class: "nowrap", title: typeof item.start_iso === "string" ? item.start_iso : undefined },
      link(route, { "data-testid": "request-link", text: formatIsoShort(item.start_iso) }),
    ),
    el("td", { "data-field": "service", text: item.service ?? "" }),
    el("td", { "data-field": "model", text: item.model ?? "" }),
    el("td", { "data-field": "operation", text: item.operation ?? "" }),
    el("td", { "data-field": "prompt_bucket", text: item.prompt_bucket ?? "" }),
    msCell(item.e2e_ms, "e2e"),
    msCell(item.ttft_ms, "ttft"),
    msCell(item.tpot_ms, "tpot"),
    msCell(item.queue_ms, "queue"),
    msCell(item.prefill_ms, "prefill"),
    msCell(item.decode_ms, "decode"),
    showNetwork ? msCell(item.network_ms, "network") : null,
    el("td", { class: "num nowrap", text: tokens }),
    el("td", {
      class: item.slo_breached ? "bad" : "good",
      "data-field": "slo",
      text: item.slo_breached ? "breached" : "met",
    }),
    verdictCell,
  );
  return row;
}

function pager(page, picked, key, context) {
  const { cursor, ...filters } = picked;
  const back = el("button", {
    type: "button",
    text: "← Back",
    "data-testid": "prev-page",
    disabled: !cursor,
    onclick: () => {
      const previous = previousCursor.get(`${key}\n${cursor}`);
      context.navigate(context.routeHash("requests", previous ? { ...filters, cursor: previous } : filters));
    },
  });
  const next = el("button", {
    type: "button",
    text: "Next →",
    "data-testid": "next-page",
    disabled: !page.next_cursor,
    onclick: () => {
      if (previousCursor.size >= MAX_REMEMBERED_PAGES) previousCursor.clear();
      previousCursor.set(`${key}\n${page.next_cursor}`, cursor ?? "");
      context.navigate(context.routeHash("requests", { ...filters, cursor: page.next_cursor }));
    },
  });
  return el("nav", { class: "pager", "aria-label": "pages" }, back, next);
}
