// DOM building for the tokentrace UI. Every value that came from the API is data: it reaches the
// page only as a text node (textContent) or as an attribute value this module sets; nothing is
// ever parsed as markup. Colours and layout come from CSS classes (the CSP forbids inline
// styles), geometry from SVG attributes holding numbers.

const SVG_NS = "http://www.w3.org/2000/svg";

/** Attributes an element builder accepts; `class`, `text`, `on*` handlers and plain attributes. */
function apply(node, attrs) {
  if (!attrs) return node;
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "text") {
      node.textContent = String(value);
    } else if (name === "class") {
      const classes = Array.isArray(value) ? value.filter(Boolean) : [value];
      for (const cls of classes) node.classList.add(...String(cls).split(/\s+/).filter(Boolean));
    } else if (name.startsWith("on") && typeof value === "function") {
      node.addEventListener(name.slice(2), value);
    } else if (name === "href" || name === "src" || name === "style" || name.startsWith("on")) {
      // Links go through link() (scheme checked), styles through classes (the CSP), and
      // handlers are functions: no string ever becomes a URL, a style or code here.
      throw new Error(`attribute ${name} cannot be set from a string`);
    } else {
      node.setAttribute(name, value === true ? "" : String(value));
    }
  }
  return node;
}

function append(node, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) {
      append(node, child);
    } else if (child instanceof Node) {
      node.appendChild(child);
    } else {
      node.appendChild(document.createTextNode(String(child)));
    }
  }
  return node;
}

/** An HTML element: el("td", {class: "num", text: "1.0"}) or el("tr", {}, td1, td2). */
export function el(tag, attrs, ...children) {
  return append(apply(document.createElement(tag), attrs), children);
}

/** Append children to a node, skipping null/undefined/false and flattening arrays (the DOM's own
 * append would write "null" for a missing optional cell). */
export function add(node, ...children) {
  return append(node, children);
}

/** An SVG element; numbers for geometry are written as attribute values. */
export function svg(tag, attrs, ...children) {
  return append(apply(document.createElementNS(SVG_NS, tag), attrs), children);
}

/** An SVG <title> (the native tooltip), from text. */
export function tooltip(text) {
  const title = document.createElementNS(SVG_NS, "title");
  title.textContent = String(text);
  return title;
}

/** Remove every child of a node. */
export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

/**
 * The URL when `text` is an absolute http(s) URL, else null: a trace link template from the
 * configuration or any other data-provided address never becomes a javascript:, data: or
 * relative link.
 */
export function safeHttpUrl(text) {
  if (typeof text !== "string" || text.length === 0 || text.length > 4096) return null;
  let url;
  try {
    url = new URL(text);
  } catch {
    return null;
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") return null;
  return url.href;
}

/**
 * A link into the app (a hash route built by the caller from checked parts) or to an http(s)
 * URL outside it; for anything else a plain <span> with the same text.
 */
export function link(target, attrs, ...children) {
  let href = null;
  if (typeof target === "string" && target.startsWith("#/")) {
    href = target;
  } else {
    href = safeHttpUrl(target);
  }
  if (href === null) return el("span", attrs, ...children);
  const anchor = el("a", attrs, ...children);
  anchor.href = href;
  if (!href.startsWith("#")) {
    anchor.setAttribute("rel", "noopener noreferrer");
    anchor.setAttribute("target", "_blank");
  }
  return anchor;
}

const HEX_ID = /^[0-9a-f]{8,32}$/;
const SPAN_ID = /^[0-9a-f]{16}$/;

/** The hash route of one request, or null when the ids are not the hex the API returns. */
export function requestRoute(traceId, spanId) {
  const trace = typeof traceId === "string" ? traceId.toLowerCase() : "";
  if (!HEX_ID.test(trace)) return null;
  const span = typeof spanId === "string" ? spanId.toLowerCase() : "";
  return SPAN_ID.test(span) ? `#/request/${trace}/${span}` : `#/request/${trace}`;
}

export function isHexId(text, { min = 8, max = 32 } = {}) {
  return typeof text === "string" && text.length >= min && text.length <= max && /^[0-9a-f]+$/i.test(text);
}
