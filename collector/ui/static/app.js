// tokentrace web UI: a one-page app with hash routes over the drill-down API (docs/api.md).
//   #/requests?...filters        the request list
//   #/request/<trace_id>[/<span_id>]   one request: verdict, waterfall, tokens, engine steps, GPU
//   #/fleet?last=1h              percentiles, SLOs, distributions, budgets of a window
//   #/compare?a_since=..&...     two windows side by side
// Plain ES modules, no framework, no build step, nothing loaded from outside this server.

import { AuthRequired, apiGet, currentToken, forgetToken, saveToken, validToken } from "./api.js";
import { clear, el } from "./dom.js";
import { renderCompare } from "./compare.js";
import { renderFleet } from "./fleet.js";
import { renderList } from "./list.js";
import { renderRequest } from "./request.js";

const VIEWS = {
  requests: { title: "Requests", render: renderList },
  request: { title: "Request", render: renderRequest },
  fleet: { title: "Fleet", render: renderFleet },
  compare: { title: "Compare", render: renderCompare },
};

const main = document.getElementById("app");
const status = document.getElementById("status");
let generation = 0;
let tokenRefused = false;
let metaShown = false;

/** The route in the address bar's fragment: path parts and query parameters. */
export function currentRoute() {
  const fragment = window.location.hash.replace(/^#/, "");
  const mark = fragment.indexOf("?");
  const path = mark < 0 ? fragment : fragment.slice(0, mark);
  const query = mark < 0 ? "" : fragment.slice(mark + 1);
  const parts = path.split("/").filter(Boolean).map(safeDecode);
  return { parts, params: new URLSearchParams(query) };
}

function safeDecode(part) {
  try {
    return decodeURIComponent(part);
  } catch {
    return part;
  }
}

/** Go to a hash route (`#/...`); re-renders even when it is the current one. */
export function navigate(hash) {
  if (window.location.hash === hash) {
    route();
  } else {
    window.location.hash = hash;
  }
}

/** `#/<view>?<params>` with empty values left out. */
export function routeHash(view, params) {
  const query = new URLSearchParams();
  for (const [name, value] of params instanceof URLSearchParams ? params.entries() : Object.entries(params)) {
    if (value === undefined || value === null || value === "") continue;
    query.set(name, String(value));
  }
  const text = query.toString();
  return text ? `#/${view}?${text}` : `#/${view}`;
}

/** `#token=...` (or a `token` parameter in the route) is accepted once, then removed. */
function takeTokenFromFragment() {
  const fragment = window.location.hash;
  let token = null;
  let rest = fragment;
  if (fragment.startsWith("#token=")) {
    token = safeDecode(fragment.slice("#token=".length));
    rest = "#/requests";
  } else {
    const { parts, params } = currentRoute();
    if (params.has("token")) {
      token = params.get("token");
      params.delete("token");
      rest = routeHash(parts.join("/") || "requests", params);
    }
  }
  if (token === null) return;
  saveToken(token.trim());
  window.history.replaceState(null, "", `${window.location.pathname}${window.location.search}${rest}`);
}

async function route() {
  const current = ++generation;
  const { parts, params } = currentRoute();
  const name = parts[0] || "requests";
  const view = Object.hasOwn(VIEWS, name) ? VIEWS[name] : null;
  for (const navLink of document.querySelectorAll("[data-nav]")) {
    navLink.classList.toggle("active", navLink.getAttribute("data-nav") === (name === "request" ? "requests" : name));
  }
  updateTokenButton();
  if (!view) {
    show(current, el("section", { class: "message error", "data-testid": "error", text: `There is no page "${name}".` }));
    return;
  }
  document.title = `${view.title} · tokentrace`;
  main.setAttribute("aria-busy", "true");
  status.textContent = "loading…";
  const context = {
    parts,
    params,
    navigate,
    routeHash,
    isCurrent: () => current === generation,
  };
  try {
    const node = await view.render(context);
    tokenRefused = false;
    show(current, node);
    if (!metaShown) showMeta();
  } catch (error) {
    if (current !== generation) return;
    if (error instanceof AuthRequired) {
      show(current, tokenPrompt(tokenRefused || currentToken() !== null));
      return;
    }
    console.warn("tokentrace:", error);
    show(
      current,
      el(
        "section",
        { class: "message error", "data-testid": "error" },
        el("strong", { text: "Cannot show this page. " }),
        el("span", { text: error && error.message ? error.message : String(error) }),
      ),
    );
  }
}

function show(current, node) {
  if (current !== generation) return; // a newer navigation won
  clear(main).appendChild(node);
  main.removeAttribute("aria-busy");
  main.setAttribute("data-route", currentRoute().parts[0] || "requests");
  status.textContent = "";
}

function tokenPrompt(refused) {
  const input = el("input", {
    type: "password",
    name: "token",
    autocomplete: "off",
    required: true,
    "data-testid": "token-input",
    "aria-label": "bearer token",
  });
  const problem = el("p", { class: "form-error", "data-testid": "token-error", role: "alert" });
  if (refused) problem.textContent = "The server refused that token.";
  const form = el(
    "form",
    { class: "token-form", "data-testid": "token-form" },
    el("h2", { text: "This tokentrace server needs a token" }),
    el("p", {
      text: "Paste the bearer token configured for the API. It is kept in this tab's session storage only.",
    }),
    el("label", {}, "Token ", input),
    el("button", { type: "submit", text: "Open", "data-testid": "token-submit" }),
    problem,
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const token = input.value.trim();
    if (!validToken(token)) {
      problem.textContent = "A token is printable ASCII without spaces.";
      return;
    }
    saveToken(token);
    tokenRefused = true; // cleared by the next page that loads
    route();
  });
  queueMicrotask(() => input.focus());
  return el("section", { class: "message" }, form);
}

function updateTokenButton() {
  const button = document.getElementById("forget-token");
  if (button) button.hidden = currentToken() === null;
}

async function showMeta() {
  try {
    const meta = await apiGet("meta");
    const parts = [`tokentrace ${meta.version ?? ""}`.trim()];
    if (typeof meta.requests === "number") parts.push(`${meta.requests.toLocaleString("en-US")} requests stored`);
    document.getElementById("meta").textContent = parts.join(" · ");
    metaShown = true;
  } catch {
    // the footer is optional; the page shows its own errors
  }
}

function start() {
  takeTokenFromFragment();
  const forget = document.getElementById("forget-token");
  forget.addEventListener("click", () => {
    forgetToken();
    tokenRefused = false;
    route();
  });
  window.addEventListener("hashchange", () => {
    takeTokenFromFragment();
    route();
  });
  if (!window.location.hash || window.location.hash === "#" || window.location.hash === "#/") {
    window.history.replaceState(null, "", `${window.location.pathname}${window.location.search}#/requests`);
  }
  route();
}

start();
