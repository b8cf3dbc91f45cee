// The drill-down API client (docs/api.md): JSON over same-origin fetch, optional bearer token.

const TOKEN_KEY = "tokentrace.token";
// A bearer token is sent in a header: visible ASCII only (anything else is a typo or an attack).
const TOKEN_PATTERN = /^[\x21-\x7e]{1,4096}$/;

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

/** The API answered 401: the UI asks for a token and tries again. */
export class AuthRequired extends ApiError {}

export function validToken(text) {
  return typeof text === "string" && TOKEN_PATTERN.test(text);
}

export function storedToken() {
  try {
    const token = window.sessionStorage.getItem(TOKEN_KEY);
    return validToken(token) ? token : null;
  } catch {
    return null; // storage disabled: the token lives only as long as the page
  }
}

let pageToken = null;

export function currentToken() {
  return storedToken() ?? pageToken;
}

export function saveToken(token) {
  if (!validToken(token)) return false;
  pageToken = token;
  try {
    window.sessionStorage.setItem(TOKEN_KEY, token);
  } catch {
    // keep it in memory only
  }
  return true;
}

export function forgetToken() {
  pageToken = null;
  try {
    window.sessionStorage.removeItem(TOKEN_KEY);
  } catch {
    // nothing stored
  }
}

/**
 * GET `api/v1/<path>` with query parameters (entries whose value is empty are left out).
 * Resolves to the parsed JSON; rejects with ApiError (AuthRequired on 401).
 */
export async function apiGet(path, params = {}) {
  // Relative to the page, so the UI also works behind a reverse proxy under a path prefix.
  const url = new URL(`api/v1/${path}`, document.baseURI);
  const entries = params instanceof URLSearchParams ? params.entries() : Object.entries(params);
  for (const [name, value] of entries) {
    if (value === undefined || value === null || value === "") continue;
    url.searchParams.set(name, String(value));
  }
  const headers = { Accept: "application/json" };
  const token = currentToken();
  if (token) headers.Authorization = `Bearer ${token}`;
  let response;
  try {
    response = await fetch(url, { headers, cache: "no-store", credentials: "same-origin" });
  } catch (error) {
    throw new ApiError(0, `the tokentrace server cannot be reached (${error.message})`);
  }
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (response.status === 401) {
    throw new AuthRequired(401, errorMessage(body, "this server needs a bearer token"));
  }
  if (!response.ok) {
    throw new ApiError(response.status, errorMessage(body, `HTTP ${response.status}`));
  }
  if (body === null || typeof body !== "object") {
    throw new ApiError(response.status, "the server's answer is not a JSON document");
  }
  return body;
}

function errorMessage(body, fallback) {
  return body && typeof body.error === "string" && body.error ? body.error : fallback;
}
