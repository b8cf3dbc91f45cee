// One request on one time axis: the waterfall of its phases, its token ticks (outlier gaps
// highlighted), the engine steps it shared, and GPU lanes, all drawn with the same x scale
// (ms after the request's timeline origin).

import { svg, tooltip } from "./dom.js";
import { linearScale, px, timeAxis } from "./charts.js";
import { formatBytes, formatMs, formatPercent, isNumber, segmentClass } from "./format.js";

export const MAX_TICKS_DRAWN = 3000;
export const MAX_STEPS_DRAWN = 2000;

const LABEL_WIDTH = 190;
const RIGHT_PAD = 16;
const AXIS_HEIGHT = 24;
const ROW_HEIGHT = 24;
const BAR_HEIGHT = 16;
const TOKEN_ROW_HEIGHT = 40;
const STEP_LANE_HEIGHT = 52;
const GPU_LANE_HEIGHT = 40;
const SECTION_GAP = 22;

/** Every time the document places on the axis, to size the shared scale. */
function axisDomain(data) {
  const values = [0];
  for (const row of data.waterfall ?? []) {
    for (const interval of row.intervals_ms ?? []) values.push(...interval);
  }
  const ticks = data.tokens?.ticks_ms ?? [];
  if (ticks.length) values.push(ticks[0], ticks[ticks.length - 1]);
  for (const step of data.engine_steps ?? []) values.push(step.start_ms, step.end_ms);
  for (const phase of data.gpu ?? []) values.push(phase.start_ms, phase.end_ms);
  const boundaries = data.request?.timeline?.boundaries_ms ?? {};
  values.push(...Object.values(boundaries));
  const finite = values.filter(isNumber);
  let lo = Math.min(...finite);
  let hi = Math.max(...finite);
  if (!(hi > lo)) hi = lo + 1;
  // A little air on the right so the last tick is not on the edge.
  hi += (hi - lo) * 0.01;
  return [lo, hi];
}

function sectionLabel(y, text) {
  return svg("text", { class: "section-label", x: 0, y, text });
}

/** Which token ticks to draw: all of them up to the cap, else a thinned set plus every outlier. */
function ticksToDraw(ticks, outlierIndexes) {
  if (ticks.length <= MAX_TICKS_DRAWN) return ticks.map((_, index) => index);
  const stride = Math.ceil(ticks.length / MAX_TICKS_DRAWN);
  const kept = [];
  for (let index = 0; index < ticks.length; index += 1) {
    if (index % stride === 0 || outlierIndexes.has(index)) kept.push(index);
  }
  return kept;
}

/**
 * The request's timeline as one <svg> of `width` px. `onStep(spanId)` is called when an engine
 * step is clicked (the page highlights its row in the table).
 */
export function drawTimeline(data, { width, onStep } = {}) {
  const [lo, hi] = axisDomain(data);
  const x0 = LABEL_WIDTH;
  const x1 = Math.max(x0 + 200, width - RIGHT_PAD);
  const scale = linearScale(lo, hi, x0, x1);
  const parts = [];
  let y = AXIS_HEIGHT;

  // --- waterfall ---------------------------------------------------------------------------
  const waterfall = data.waterfall ?? [];
  const waterfallGroup = svg("g", { "data-testid": "waterfall" });
  for (const row of waterfall) {
    const intervals = (row.intervals_ms ?? []).filter((pair) => Array.isArray(pair) && isNumber(pair[0]) && isNumber(pair[1]));
    const duration = intervals.reduce((sum, [start, end]) => sum + Math.max(0, end - start), 0);
    // The API marks the phase holding the dominant segment of the verdict shown.
    const group = svg("g", {
      class: ["wf-row", row.dominant ? "dominant" : ""],
      "data-testid": "waterfall-row",
      "data-segment": String(row.segment ?? ""),
      "data-dominant": row.dominant ? "true" : undefined,
      "data-label": String(row.label ?? ""),
      "data-duration-ms": duration,
    });
    group.append(
      svg("text", { class: "row-label", x: 0, y: y + 15, text: String(row.label ?? row.segment ?? "") }),
      svg("text", { class: "row-value", x: LABEL_WIDTH - 10, y: y + 15, "text-anchor": "end", text: formatMs(duration) }),
    );
    for (const [start, end] of intervals) {
      const left = scale(start);
      const rect = svg("rect", {
        class: ["seg", segmentClass(row.segment)],
        x: px(left),
        y: y + (ROW_HEIGHT - BAR_HEIGHT) / 2,
        width: px(Math.max(1.5, scale(end) - left)),
        height: BAR_HEIGHT,
        rx: 2,
      });
      rect.appendChild(tooltip(`${row.label}: ${formatMs(start)} → ${formatMs(end)} (${formatMs(end - start)})`));
      group.appendChild(rect);
    }
    waterfallGroup.appendChild(group);
    y += ROW_HEIGHT;
  }
  if (waterfall.length === 0) {
    waterfallGroup.appendChild(svg("text", { class: "muted", x: x0, y: y + 15, text: "no phase timestamps recorded" }));
    y += ROW_HEIGHT;
  }
  parts.push(waterfallGroup);

  // --- tokens --------------------------------------------------------------------------------
  y += SECTION_GAP;
  parts.push(sectionLabel(y - 6, "tokens"));
  const tokens = data.tokens ?? {};
  const ticks = (tokens.ticks_ms ?? []).filter(isNumber);
  const outlierGaps = (tokens.gaps ?? []).filter((gap) => gap && gap.outlier && isNumber(gap.at_ms) && isNumber(gap.gap_ms));
  const outlierIndexes = new Set(outlierGaps.map((gap) => gap.index));
  const drawn = ticksToDraw(ticks, outlierIndexes);
  const tokenGroup = svg("g", {
    class: "token-row",
    "data-testid": "token-row",
    "data-total": ticks.length,
    "data-drawn": drawn.length,
  });
  tokenGroup.append(
    svg("text", { class: "row-label", x: 0, y: y + 24, text: `${ticks.length} tokens` }),
    svg("text", {
      class: "row-value",
      x: LABEL_WIDTH - 10,
      y: y + 24,
      "text-anchor": "end",
      text: outlierGaps.length ? `${outlierGaps.length} outlier gap${outlierGaps.length === 1 ? "" : "s"}` : "",
    }),
  );
  for (const gap of outlierGaps) {
    const left = scale(gap.at_ms - gap.gap_ms);
    const rect = svg("rect", {
      class: "outlier-gap",
      "data-testid": "outlier-gap",
      x: px(left),
      y: y + 2,
      width: px(Math.max(2, scale(gap.at_ms) - left)),
      height: TOKEN_ROW_HEIGHT - 4,
    });
    rect.appendChild(tooltip(`gap before token ${gap.index}: ${formatMs(gap.gap_ms)}`));
    tokenGroup.appendChild(rect);
  }
  for (const index of drawn) {
    const xx = px(scale(ticks[index]));
    const outlier = outlierIndexes.has(index);
    const line = svg("line", {
      class: outlier ? "tick outlier" : "tick",
      "data-testid": "token-tick",
      "data-outlier": outlier ? "true" : undefined,
      x1: xx,
      x2: xx,
      y1: y + (outlier ? 4 : 10),
      y2: y + TOKEN_ROW_HEIGHT - (outlier ? 4 : 10),
    });
    if (outlier) line.appendChild(tooltip(`token ${index} at ${formatMs(ticks[index])}`));
    tokenGroup.appendChild(line);
  }
  if (ticks.length === 0) {
    tokenGroup.appendChild(svg("text", { class: "muted", x: x0, y: y + 24, text: "no token times recorded" }));
  }
  parts.push(tokenGroup);
  y += TOKEN_ROW_HEIGHT;

  // --- engine steps ------------------------------------------------------------------------
  y += SECTION_GAP;
  parts.push(sectionLabel(y - 6, "engine steps"));
  const steps = (data.engine_steps ?? []).filter((step) => isNumber(step.start_ms) && isNumber(step.end_ms));
  const stepGroup = svg("g", { class: "step-lane", "data-testid": "engine-lane", "data-total": steps.length });
  const maxBatch = Math.max(1, ...steps.map((step) => (isNumber(step.batch_size) ? step.batch_size : 0)));
  const ordered = [...steps.filter((step) => !step.outlier), ...steps.filter((step) => step.outlier)].slice(-MAX_STEPS_DRAWN);
  stepGroup.append(
    svg("text", { class: "row-label", x: 0, y: y + 20, text: `${steps.length} steps` }),
    svg("text", { class: "row-value", x: 0, y: y + 38, text: `height: batch size (max ${maxBatch})` }),
  );
  for (const step of ordered) {
    const batch = isNumber(step.batch_size) ? step.batch_size : 0;
    const h = Math.max(3, ((STEP_LANE_HEIGHT - 6) * batch) / maxBatch);
    const left = scale(step.start_ms);
    const rect = svg("rect", {
      class: ["step", step.outlier ? "outlier" : "", step.prefill_tokens > 0 ? "with-prefill" : ""],
      "data-testid": "engine-step",
      "data-span-id": typeof step.span_id === "string" ? step.span_id : "",
      "data-outlier": step.outlier ? "true" : undefined,
      x: px(left),
      y: px(y + STEP_LANE_HEIGHT - h),
      width: px(Math.max(1, scale(step.end_ms) - left - 0.5)),
      height: px(h),
    });
    rect.appendChild(tooltip(stepSummary(step)));
    if (onStep) rect.addEventListener("click", () => onStep(step.span_id));
    stepGroup.appendChild(rect);
  }
  if (steps.length === 0) {
    stepGroup.appendChild(svg("text", { class: "muted", x: x0, y: y + 30, text: "no engine steps recorded for this request" }));
  }
  parts.push(stepGroup);
  y += STEP_LANE_HEIGHT;

  // --- GPU lanes -----------------------------------------------------------------------------
  y += SECTION_GAP;
  parts.push(sectionLabel(y - 6, "GPU"));
  const samples = gpuIntervals(data);
  for (const lane of [
    { metric: "utilization", label: "utilisation", value: (g) => g.utilization_mean },
    { metric: "bandwidth", label: "bandwidth % of peak", value: (g) => g.bandwidth_peak_ratio },
  ]) {
    const group = svg("g", { class: ["gpu-lane", `gpu-${lane.metric}`], "data-testid": "gpu-lane", "data-metric": lane.metric });
    group.append(
      svg("text", { class: "row-label", x: 0, y: y + 24, text: lane.label }),
      svg("rect", { class: "lane-bg", x: x0, y, width: px(x1 - x0), height: GPU_LANE_HEIGHT - 6 }),
    );
    let drawnBars = 0;
    for (const sample of samples) {
      const value = lane.value(sample);
      if (!isNumber(value)) continue;
      const fraction = Math.min(1, Math.max(0, value));
      const h = Math.max(1, (GPU_LANE_HEIGHT - 6) * fraction);
      const left = scale(sample.start_ms);
      const bar = svg("rect", {
        class: "gpu-bar",
        "data-testid": "gpu-bar",
        "data-value": value,
        x: px(left),
        y: px(y + GPU_LANE_HEIGHT - 6 - h),
        width: px(Math.max(1, scale(sample.end_ms) - left)),
        height: px(h),
      });
      bar.appendChild(tooltip(`${sample.phase ?? "step"}: ${lane.label} ${formatPercent(value)}${gpuDetail(sample)}`));
      group.appendChild(bar);
      drawnBars += 1;
    }
    group.setAttribute("data-bars", String(drawnBars));
    if (drawnBars === 0) {
      group.appendChild(svg("text", { class: "muted", x: x0 + 8, y: y + 22, text: "no GPU samples for this request" }));
    }
    parts.push(group);
    y += GPU_LANE_HEIGHT;
  }

  const height = y + 8;
  const chart = svg("svg", {
    class: "chart timeline",
    "data-testid": "timeline",
    width,
    height,
    viewBox: `0 0 ${width} ${height}`,
    role: "img",
    "aria-label": "request timeline",
  });
  chart.appendChild(timeAxis(scale, { top: AXIS_HEIGHT - 4, bottom: height - 4, labelY: 14, ticks: Math.max(3, Math.floor((x1 - x0) / 90)) }));
  chart.append(...parts);
  return chart;
}

/** The finest GPU aggregates available: per engine step when the node agent attached them,
 * else per phase (prefill/decode), else the whole request. */
function gpuIntervals(data) {
  const perStep = (data.engine_steps ?? [])
    .filter((step) => step.gpu && isNumber(step.start_ms) && isNumber(step.end_ms))
    .map((step) => ({ ...step.gpu, start_ms: step.start_ms, end_ms: step.end_ms, phase: "step" }));
  if (perStep.length) return perStep;
  const phases = (data.gpu ?? []).filter((g) => isNumber(g.start_ms) && isNumber(g.end_ms));
  const finer = phases.filter((g) => g.phase !== "request");
  return finer.length ? finer : phases;
}

function gpuDetail(sample) {
  const parts = [];
  if (isNumber(sample.bandwidth_gbps)) parts.push(`${sample.bandwidth_gbps.toFixed(0)} GB/s`);
  if (isNumber(sample.bandwidth_peak_gbps)) parts.push(`peak ${sample.bandwidth_peak_gbps.toFixed(0)} GB/s`);
  if (isNumber(sample.memory_used_bytes)) parts.push(`memory ${formatBytes(sample.memory_used_bytes)}`);
  if (isNumber(sample.power_w)) parts.push(`${sample.power_w.toFixed(0)} W`);
  if (isNumber(sample.samples)) parts.push(`${sample.samples} samples`);
  return parts.length ? ` · ${parts.join(" · ")}` : "";
}

export function stepSummary(step) {
  const parts = [
    `step ${formatMs(step.start_ms)} → ${formatMs(step.end_ms)} (${formatMs(step.end_ms - step.start_ms)})`,
    `batch ${step.batch_size ?? "-"}`,
    `prefill ${step.prefill_requests ?? "-"} req / ${step.prefill_tokens ?? "-"} tok`,
    `decode ${step.decode_requests ?? "-"} req`,
  ];
  if (isNumber(step.kv_cache_usage)) parts.push(`KV ${formatPercent(step.kv_cache_usage)}`);
  if (step.outlier) parts.push("overlaps an outlier gap");
  return parts.join(" · ");
}
