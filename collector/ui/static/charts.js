// SVG charts: scales and axes, stacked budget bars, histograms. Geometry only through attributes
// holding numbers computed here; colours through CSS classes.

import { el, svg, tooltip } from "./dom.js";
import { SEGMENTS, formatAxisMs, formatMs, formatPercent, humanise, isNumber, segmentClass } from "./format.js";

/** A linear scale from [lo, hi] (ms) onto [x0, x1] (px). */
export function linearScale(lo, hi, x0, x1) {
  const span = hi > lo ? hi - lo : 1;
  const scale = (value) => x0 + ((value - lo) / span) * (x1 - x0);
  scale.domain = [lo, hi];
  scale.range = [x0, x1];
  return scale;
}

/** Round tick values (1, 2, 5 x 10^k) covering [lo, hi], about `count` of them. */
export function niceTicks(lo, hi, count = 8) {
  const span = hi - lo;
  if (!(span > 0) || !Number.isFinite(span)) return [lo];
  const raw = span / Math.max(1, count);
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((candidate) => candidate >= raw) ?? 10 * power;
  const ticks = [];
  const first = Math.ceil(lo / step) * step;
  for (let value = first; value <= hi + step * 1e-9 && ticks.length < 100; value += step) {
    ticks.push(Math.abs(value) < step * 1e-9 ? 0 : value);
  }
  return ticks;
}

/** Round pixel values so lines land on whole pixels and attributes stay short. */
export function px(value) {
  return Math.round(value * 10) / 10;
}

/** Vertical grid lines and labels of a time axis across [top, bottom]. */
export function timeAxis(scale, { top, bottom, labelY, ticks = 8 }) {
  const group = svg("g", { class: "axis", "data-testid": "time-axis" });
  const [left, right] = scale.range;
  for (const value of niceTicks(scale.domain[0], scale.domain[1], ticks)) {
    const x = px(scale(value));
    // Labels at the edges are anchored inwards so they are not cut off.
    const anchor = x > right - 40 ? "end" : x < left + 12 ? "start" : "middle";
    group.append(
      svg("line", { class: "grid", x1: x, x2: x, y1: top, y2: bottom }),
      svg("text", { class: "axis-label", x, y: labelY, "text-anchor": anchor, text: formatAxisMs(value) }),
    );
  }
  return group;
}

/** The segments of a budget with a duration, in the canonical order, unknown names last. */
export function budgetParts(segments) {
  if (!segments || typeof segments !== "object") return [];
  const names = [...SEGMENTS, ...Object.keys(segments).filter((name) => !SEGMENTS.includes(name))];
  return names
    .filter((name) => isNumber(segments[name]) && segments[name] > 0)
    .map((name) => ({ segment: name, ms: segments[name] }));
}

/**
 * Stacked horizontal bars (one per entry: {label, e2e_ms, requests, segments}) on one ms scale,
 * so a p99 bar is as much longer than the p50 bar as it took. Returns an <svg>.
 */
export function budgetBars(entries, { width = 720, testid = "budget-bar" } = {}) {
  const labelWidth = 120;
  const valueWidth = 150;
  const rowHeight = 26;
  const gap = 10;
  const height = entries.length * (rowHeight + gap) + 24;
  const maxMs = Math.max(1e-9, ...entries.map((entry) => (isNumber(entry.e2e_ms) ? entry.e2e_ms : 0)));
  const scale = linearScale(0, maxMs, labelWidth, width - valueWidth);
  const chart = svg("svg", {
    class: "chart budget-bars",
    width,
    height,
    viewBox: `0 0 ${width} ${height}`,
    role: "img",
    "aria-label": "latency budget",
  });
  entries.forEach((entry, index) => {
    const y = index * (rowHeight + gap) + 4;
    const row = svg("g", { "data-testid": testid, "data-percentile": entry.key ?? entry.label });
    row.appendChild(svg("text", { class: "row-label", x: 0, y: y + rowHeight / 2 + 4, text: entry.label }));
    if (!isNumber(entry.e2e_ms) || !entry.requests) {
      row.appendChild(svg("text", { class: "muted", x: labelWidth, y: y + rowHeight / 2 + 4, text: "no requests" }));
      chart.appendChild(row);
      return;
    }
    const parts = budgetParts(entry.segments);
    const total = parts.reduce((sum, part) => sum + part.ms, 0) || 1;
    // The bar's length is the band's mean E2E; its segments split it by their shares.
    let x = scale(0);
    const barEnd = scale(entry.e2e_ms);
    for (const part of parts) {
      const w = ((barEnd - scale(0)) * part.ms) / total;
      const rect = svg("rect", {
        class: ["seg", segmentClass(part.segment)],
        x: px(x),
        y,
        width: px(Math.max(w, 0.5)),
        height: rowHeight,
        "data-segment": part.segment,
        "data-ms": part.ms,
      });
      rect.appendChild(tooltip(`${humanise(part.segment)}: ${formatMs(part.ms)} (${formatPercent(part.ms / total)})`));
      row.appendChild(rect);
      if (w > 54) {
        row.appendChild(
          svg("text", {
            class: "seg-label",
            x: px(x + w / 2),
            y: y + rowHeight / 2 + 4,
            "text-anchor": "middle",
            text: `${humanise(part.segment)} ${formatPercent(part.ms / total, 0)}`,
          }),
        );
      }
      x += w;
    }
    row.appendChild(
      svg("text", {
        class: "row-value",
        x: px(barEnd + 6),
        y: y + rowHeight / 2 + 4,
        text: `${formatMs(entry.e2e_ms)} · ${entry.requests} req`,
      }),
    );
    chart.appendChild(row);
  });
  chart.appendChild(
    svg("text", { class: "axis-label", x: labelWidth, y: height - 4, text: "mean budget of the requests around each percentile" }),
  );
  return chart;
}

const MARKER_REACH_DECADES = 0.6;

/** log10 values of round tick positions (1, 2, 5 x 10^k) between lo and hi (log10 ms). */
function logTicks(lo, hi) {
  const decades = hi - lo;
  const multipliers = decades < 1.2 ? [1, 2, 5] : decades < 2.5 ? [1, 3] : [1];
  const ticks = [];
  for (let power = Math.floor(lo); power <= Math.ceil(hi); power += 1) {
    for (const multiplier of multipliers) {
      const value = power + Math.log10(multiplier);
      if (value >= lo && value <= hi) ticks.push(value);
    }
  }
  return ticks;
}

/** A legend of the budget segments present in `names`. */
export function segmentLegend(names) {
  const present = SEGMENTS.filter((name) => names.has(name));
  return el(
    "ul",
    { class: "legend" },
    present.map((name) => el("li", {}, el("span", { class: ["swatch", segmentClass(name)], "aria-hidden": "true" }), humanise(name))),
  );
}

/**
 * A histogram with log-spaced buckets ({bounds_ms, counts, count}) on a log x axis, with
 * optional vertical markers ({label, ms, cls}). Returns an <svg>.
 */
export function histogram(data, { metric, width = 340, height = 170, markers = [] } = {}) {
  const chart = svg("svg", {
    class: "chart histogram",
    width,
    height,
    viewBox: `0 0 ${width} ${height}`,
    role: "img",
    "aria-label": `${metric} distribution`,
    "data-testid": "histogram",
    "data-metric": metric,
  });
  const bounds = Array.isArray(data?.bounds_ms) ? data.bounds_ms.filter(isNumber) : [];
  const counts = Array.isArray(data?.counts) ? data.counts : [];
  const left = 8;
  const right = width - 8;
  const top = 20; // room above the bars for the target labels
  const bottom = height - 24;
  if (bounds.length < 2 || counts.length === 0 || !data.count) {
    chart.appendChild(svg("text", { class: "muted", x: width / 2, y: height / 2, "text-anchor": "middle", text: "no data in this window" }));
    return chart;
  }
  const positive = bounds.map((bound) => Math.max(bound, 1e-6));
  const lo = Math.log10(positive[0]);
  const dataHi = Math.log10(positive[positive.length - 1]);
  // Target lines within a few times the data's range widen the axis to show the headroom; a
  // target far beyond it is drawn at the edge with its value in the label.
  const reach = markers.filter((m) => isNumber(m.ms) && m.ms > 0).map((m) => Math.log10(m.ms));
  const hi = Math.max(dataHi, ...reach.filter((value) => value <= dataHi + MARKER_REACH_DECADES));
  const scale = linearScale(lo, hi > lo ? hi + (hi - lo) * 0.03 : lo + 1, left, right);
  const x = (ms) => scale(Math.log10(Math.max(ms, 1e-6)));
  const maxCount = Math.max(1, ...counts.filter(isNumber));
  chart.setAttribute("data-count", String(data.count));
  for (let index = 0; index < counts.length && index + 1 < positive.length; index += 1) {
    const count = counts[index];
    if (!isNumber(count) || count <= 0) continue;
    const x0 = x(positive[index]);
    const x1 = x(positive[index + 1]);
    const h = ((bottom - top) * count) / maxCount;
    const bar = svg("rect", {
      class: "hist-bar",
      x: px(x0),
      y: px(bottom - h),
      width: px(Math.max(1, x1 - x0 - 0.5)),
      height: px(Math.max(h, 1)),
      "data-count": count,
    });
    bar.appendChild(tooltip(`${formatMs(bounds[index])} – ${formatMs(bounds[index + 1])}: ${count}`));
    chart.appendChild(bar);
  }
  chart.append(
    svg("line", { class: "baseline", x1: left, x2: right, y1: bottom, y2: bottom }),
    svg("text", { class: "axis-label", x: left, y: top + 9, text: `${maxCount}` }),
  );
  for (const value of logTicks(scale.domain[0], scale.domain[1])) {
    const xx = px(scale(value));
    chart.append(
      svg("line", { class: "grid", x1: xx, x2: xx, y1: top, y2: bottom }),
      svg("text", {
        class: "axis-label",
        x: xx,
        y: height - 8,
        "text-anchor": xx > right - 20 ? "end" : xx < left + 20 ? "start" : "middle",
        text: formatAxisMs(10 ** value),
      }),
    );
  }
  for (const marker of markers) {
    if (!isNumber(marker.ms) || marker.ms <= 0) continue;
    const beyond = x(marker.ms) > right;
    const xx = px(Math.min(right, Math.max(left, x(marker.ms))));
    const line = svg("line", { class: ["marker", marker.cls ?? ""], x1: xx, x2: xx, y1: top - 5, y2: bottom });
    line.appendChild(tooltip(`${marker.label}: ${formatMs(marker.ms)}`));
    const text = beyond ? `${marker.label} ${formatMs(marker.ms)} →` : marker.label;
    chart.append(
      line,
      svg("text", { class: ["marker-label", marker.cls ?? ""], x: xx, y: top - 8, "text-anchor": "end", text }),
    );
  }
  return chart;
}
