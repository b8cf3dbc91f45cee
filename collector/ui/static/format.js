// Number formatting shared by every view (the same precision rules as `tokentrace explain`).

// Budget segments in time order (semconv.SEGMENTS), with decode's parts in the TPOT/ITL budgets
// (interference, stall) after it.
export const SEGMENTS = [
  "client",
  "connect",
  "network",
  "http",
  "cold_start",
  "queue",
  "prefill",
  "preempted",
  "decode",
  "interference",
  "stall",
  "postprocess",
  "unattributed",
];

/** The metrics a verdict can answer about, in the order views list them (diagnosis.VERDICT_METRICS). */
export const VERDICT_METRICS = ["ttft", "tpot", "itl", "e2e"];

const SEGMENT_CLASSES = new Set(SEGMENTS);

/** The CSS class of a budget segment (only known names become classes). */
export function segmentClass(segment) {
  return SEGMENT_CLASSES.has(segment) ? `seg-${segment}` : "seg-unattributed";
}

export function isNumber(value) {
  return typeof value === "number" && Number.isFinite(value);
}

/** Whose clock measured a figure, as every view says it: "client-seen" or "server-seen". */
export function clockText(clock) {
  return clock === "client" || clock === "server" ? `${clock}-seen` : "";
}

/** A duration in ms with as many decimals as are useful; "-" when missing. */
export function formatMs(value, { unit = true } = {}) {
  if (!isNumber(value)) return "-";
  const magnitude = Math.abs(value);
  let text;
  if (magnitude < 10) text = value.toFixed(3);
  else if (magnitude < 100) text = value.toFixed(2);
  else if (magnitude < 1000) text = value.toFixed(1);
  else text = value.toFixed(0);
  return unit ? `${text} ms` : text;
}

/** A duration for axis labels: short (12 ms, 1.5 s). */
export function formatAxisMs(value) {
  if (!isNumber(value)) return "";
  const magnitude = Math.abs(value);
  if (magnitude >= 1000) return `${trimZeros((value / 1000).toFixed(magnitude >= 10000 ? 0 : 2))} s`;
  if (magnitude >= 1 || magnitude === 0) return `${trimZeros(value.toFixed(magnitude >= 100 ? 0 : 1))} ms`;
  return `${trimZeros((value * 1000).toFixed(0))} µs`;
}

function trimZeros(text) {
  return text.includes(".") ? text.replace(/\.?0+$/, "") : text;
}

/** A fraction 0..1 as a percentage. */
export function formatPercent(fraction, digits = 1) {
  if (!isNumber(fraction)) return "-";
  return `${(fraction * 100).toFixed(digits)}%`;
}

export function formatCount(value) {
  if (!isNumber(value)) return "-";
  return Number.isInteger(value) ? value.toLocaleString("en-US") : value.toFixed(2);
}

/** A signed relative change (0.12 -> "+12.0%"). */
export function formatChange(ratio) {
  if (!isNumber(ratio)) return "-";
  const percent = ratio * 100;
  return `${percent > 0 ? "+" : ""}${percent.toFixed(1)}%`;
}

export function formatSignedMs(value) {
  if (!isNumber(value)) return "-";
  return `${value > 0 ? "+" : ""}${formatMs(value)}`;
}

export function formatBytes(value) {
  if (!isNumber(value)) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let scaled = value;
  let index = 0;
  while (Math.abs(scaled) >= 1024 && index < units.length - 1) {
    scaled /= 1024;
    index += 1;
  }
  return `${scaled.toFixed(index === 0 ? 0 : 1)} ${units[index]}`;
}

/** A unix-seconds value as "YYYY-MM-DD HH:MM:SS" UTC. */
export function formatUnixS(seconds) {
  if (!isNumber(seconds)) return "-";
  return new Date(seconds * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

/** The API's ISO timestamp shortened for tables (date + time to the ms, UTC). */
export function formatIso(iso) {
  if (typeof iso !== "string") return "-";
  const match = /^(\d{4}-\d{2}-\d{2})T(\d{2}:\d{2}:\d{2})(\.\d{1,3})?\d*Z$/.exec(iso);
  return match ? `${match[1]} ${match[2]}${match[3] || ""}Z` : iso;
}

/** The API's ISO timestamp without the year, for dense tables ("11-21 10:00:00.123"). */
export function formatIsoShort(iso) {
  if (typeof iso !== "string") return "-";
  const match = /^\d{4}-(\d{2}-\d{2})T(\d{2}:\d{2}:\d{2})(\.\d{1,3})?\d*Z$/.exec(iso);
  return match ? `${match[1]} ${match[2]}${match[3] || ""}` : iso;
}

/** A verdict number for display: ms keys as durations, shares as percentages, ratios as "x". */
export function formatVerdictNumber(key, value) {
  if (typeof value === "string") return value;
  if (!isNumber(value)) return String(value);
  if (key.endsWith("_ms")) return formatMs(value);
  if (key === "share" || key.endsWith("_share") || key.endsWith("_fraction")) return formatPercent(value);
  if (key.endsWith("_ratio") || key.endsWith("ratio")) return `${value.toFixed(2)}x`;
  if (key.endsWith("_bytes")) return formatBytes(value);
  return formatCount(value);
}

/** "itl_p99_ms" -> "itl p99 ms" (labels for keys the API documents as free-form). */
export function humanise(key) {
  return String(key).replace(/_/g, " ");
}
