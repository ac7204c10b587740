// Loaded into the conformance suite's Node process (`node --import`) by `python -m
// mocks.conformance`. The suite's CLI (0.1.9) has no option for extra headers or a token, and
// both its MCP client (the SDK's Streamable HTTP transport) and its raw requests use the global
// fetch, so this wraps that one function:
//
// - CAPGATE_CONFORMANCE_TOKEN and CAPGATE_CONFORMANCE_ORIGIN set: every request to that origin
//   (capgate) gets `Authorization: Bearer <token>`; other requests are left as they are.
// - CAPGATE_CONFORMANCE_LOG set: one JSON line per exchange is appended to that file: the
//   scenario it belongs to, the HTTP method, the JSON-RPC methods in the body (tools/call with
//   its tool's name), the status, the content type, capgate's X-Capgate-Reason header, and for
//   JSON answers each JSON-RPC error's code, data.reason and message, or a problem+json's
//   reason. The scenario is the one
//   the suite last announced with its `=== Running scenario: NAME ===` line (or
//   CAPGATE_CONFORMANCE_SCENARIO before that).
//
// Nothing else is changed: bodies, the other headers and the streams pass as they are.
import { appendFileSync } from "node:fs";

const token = process.env.CAPGATE_CONFORMANCE_TOKEN;
const origin = process.env.CAPGATE_CONFORMANCE_ORIGIN;
const logFile = process.env.CAPGATE_CONFORMANCE_LOG;
const originalFetch = globalThis.fetch;
let scenario = process.env.CAPGATE_CONFORMANCE_SCENARIO ?? null;

if (logFile) {
  const originalLog = console.log;
  console.log = (...args) => {
    const announced = typeof args[0] === "string" && /=== Running scenario: (\S+) ===/.exec(args[0]);
    if (announced) scenario = announced[1];
    originalLog(...args);
  };
}

function rpcMethods(body) {
  if (typeof body !== "string") return [];
  try {
    const value = JSON.parse(body);
    const items = Array.isArray(value) ? value : [value];
    return items.map((m) => {
      if (!m || typeof m.method !== "string") return "(answer)";
      const tool = m.method === "tools/call" ? m.params?.name : undefined;
      return typeof tool === "string" ? `${m.method} ${tool}` : m.method;
    });
  } catch {
    return [];
  }
}

function parseJson(text) {
  try {
    return JSON.parse(text);
  } catch {
    return undefined;
  }
}

function rpcErrors(value) {
  const items = Array.isArray(value) ? value : [value];
  return items
    .filter((m) => m && typeof m === "object" && m.error)
    .map((m) => ({
      id: m.id ?? null,
      code: m.error.code ?? null,
      reason: m.error.data?.reason ?? null,
      message: typeof m.error.message === "string" ? m.error.message : null,
    }));
}

async function record(entry, response) {
  if (response) {
    entry.status = response.status;
    entry.contentType = response.headers.get("content-type");
    entry.capgateReason = response.headers.get("x-capgate-reason");
    if ((entry.contentType ?? "").includes("json")) {
      const value = parseJson(await response.clone().text());
      entry.errors = rpcErrors(value);
      // An HTTP error as problem+json (RFC 9457): capgate puts its reason code beside it.
      if (value && !Array.isArray(value) && !value.jsonrpc && typeof value.reason === "string") {
        entry.problemReason = value.reason;
      }
    }
  }
  appendFileSync(logFile, JSON.stringify(entry) + "\n");
}

globalThis.fetch = async function capgateFetch(input, init = {}) {
  const url = new URL(input instanceof Request ? input.url : String(input));
  let options = init;
  if (token && origin && url.origin === origin) {
    const headers = new Headers(input instanceof Request ? input.headers : undefined);
    new Headers(init.headers ?? {}).forEach((value, name) => headers.set(name, value));
    headers.set("authorization", `Bearer ${token}`);
    options = { ...init, headers };
  }
  if (!logFile) return originalFetch(input, options);
  const entry = {
    scenario,
    time: new Date().toISOString(),
    httpMethod: options.method ?? (input instanceof Request ? input.method : "GET"),
    url: url.pathname,
    rpc: rpcMethods(options.body),
  };
  let response;
  try {
    response = await originalFetch(input, options);
  } catch (err) {
    entry.fetchError = String(err);
    await record(entry, undefined);
    throw err;
  }
  await record(entry, response);
  return response;
};
