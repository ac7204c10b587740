// capgate console: reads the admin API and its event stream, acts through the admin API.
//
// Everything shown here is agent-controlled text (paths, names, bodies): it is put into the
// page with textContent and createElement only, never parsed as HTML. The operator's token
// is sent once, to /console/login, and kept nowhere: the session is an HttpOnly cookie, and
// the CSRF token the login answers is held in memory and sent as X-CSRF-Token.
"use strict";

(() => {
  const ROLES = ["viewer", "approver", "admin"];
  const MAX_ROWS = 500;
  const REFRESH_MS = 5000;
  const ATTRS = new Set(["id", "type", "title", "value", "maxlength", "autocomplete",
    "aria-label", "aria-describedby", "aria-live", "for", "scope", "datetime"]);

  const state = {
    who: null,
    csrf: null,
    source: null,
    rows: new Map(), // seq -> <tr> of the recent calls table
    subjects: new Map(), // "agent:NAME" | "run:NAME" -> facts
    approvals: new Map(), // id -> {card, deadline, countdown}
    offered: { agent: new Set(), run: new Set() }, // actions the admin API has, per kind
    reads: new Set(), // GET paths the admin API documents (/pauses, /stops, /taint, ...)
    refreshTimer: null,
    tick: null,
    poll: null,
  };

  const $ = (id) => document.getElementById(id);

  // A DOM element; `attrs` keys are a fixed list of attribute names, `children` are nodes or
  // strings (which become text nodes).
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = String(value);
      else if (ATTRS.has(key)) node.setAttribute(key, String(value));
      else throw new Error(`el: attribute ${key} is not allowed`);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const text = (value) => (value === null || value === undefined || value === "" ? "—" : String(value));
  const may = (role) => state.who !== null && ROLES.indexOf(state.who.role) >= ROLES.indexOf(role);

  function notice(message, kind) {
    const box = $("notice");
    box.textContent = message;
    box.className = `notice ${kind || ""}`;
  }

  // --- the admin API --------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, reason, detail) {
      super(detail || `HTTP ${status}`);
      this.status = status;
      this.reason = reason || "";
    }
  }

  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    const init = { method, headers, credentials: "same-origin", cache: "no-store", redirect: "error" };
    if (method !== "GET") {
      headers["Content-Type"] = "application/json";
      if (state.csrf) headers["X-CSRF-Token"] = state.csrf;
      init.body = JSON.stringify(body || {});
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (err) {
      throw new ApiError(0, "unreachable", "the admin API cannot be reached");
    }
    let data = null;
    try {
      data = await resp.json();
    } catch (err) {
      data = null;
    }
    if (!resp.ok) {
      const error = new ApiError(resp.status, data && data.reason, data && data.detail);
      if (resp.status === 401 && state.who !== null && path !== "/console/login") {
        sessionEnded("Your session has ended; log in again.");
      }
      throw error;
    }
    return data;
  }

  function describeError(err) {
    if (!(err instanceof ApiError)) return String(err);
    if (err.status === 403 && err.reason === "operator_forbidden") {
      return `Not allowed: ${err.message}`;
    }
    if (err.status === 404 && err.reason === "admin_not_found") {
      return "This gateway does not offer that action.";
    }
    return err.reason ? `${err.message} (${err.reason})` : err.message;
  }

  // --- logging in and out ---------------------------------------------------------------

  function showLogin(message) {
    $("app").hidden = true;
    $("who").hidden = true;
    $("login").hidden = false;
    const error = $("login-error");
    error.textContent = message || "";
    error.hidden = !message;
    $("token").focus();
  }

  function sessionEnded(message) {
    teardown();
    state.who = null;
    state.csrf = null;
    showLogin(message);
  }

  async function login(event) {
    event.preventDefault();
    const input = $("token");
    const token = input.value.trim();
    input.value = "";
    if (!token) {
      showLogin("Paste an operator token.");
      return;
    }
    try {
      await enter(await api("POST", "/console/login", { token }));
    } catch (err) {
      showLogin(err.status === 401
        ? "That token is not an operator token of this gateway. Check it and try again."
        : `Cannot log in: ${describeError(err)}`);
    }
  }

  async function logout() {
    try {
      await api("POST", "/console/logout", {});
    } catch (err) {
      // The session may have ended already; the page forgets it either way.
    }
    sessionEnded("You are logged out.");
  }

  // Which of pause, resume and stop this gateway offers, per kind, as its OpenAPI document
  // says: a button is shown only for an action the admin API has.
  async function loadActions() {
    const offered = { agent: new Set(), run: new Set() };
    state.reads = new Set();
    try {
      const doc = await api("GET", "/openapi.json");
      for (const [path, ops] of Object.entries(doc.paths || {})) {
        if (ops && ops.get) state.reads.add(path);
        if (!ops || !ops.post) continue;
        for (const kind of ["agent", "run"]) {
          const match = new RegExp(`^/${kind}s/\\{[^}/]+\\}/(.+)$`).exec(path);
          if (!match) continue;
          const last = match[1];
          const verbs = last.startsWith("{") ? JSON.stringify(ops.post.parameters || []) : `"${last}"`;
          for (const verb of ["pause", "resume", "stop"]) {
            if (verbs.includes(`"${verb}"`)) offered[kind].add(verb);
          }
        }
      }
    } catch (err) {
      for (const kind of ["agent", "run"]) ["pause", "resume", "stop"].forEach((v) => offered[kind].add(v));
      ["/pauses", "/stops", "/taint"].forEach((p) => state.reads.add(p));
    }
    state.offered = offered;
  }

  async function enter(session) {
    state.who = { name: session.name, role: session.role };
    state.csrf = session.csrf;
    document.body.dataset.role = session.role;
    $("login").hidden = true;
    $("login-error").hidden = true;
    $("app").hidden = false;
    $("who").hidden = false;
    $("who-name").textContent = session.name;
    $("who-role").textContent = session.role;
    $("actions-head").hidden = !may("admin");
    $("admin-hint").textContent = may("admin") ? "" : "Pausing and stopping need the admin role.";
    notice("");
    await loadActions();
    if (state.who === null) return; // logged out meanwhile
    if (may("admin")) {
      const verbs = [...new Set([...state.offered.agent, ...state.offered.run])];
      $("admin-hint").textContent = verbs.length
        ? `Actions (${verbs.join(", ")}) apply on every gateway sharing the state store.`
        : "This gateway's admin API offers no pause, resume or stop.";
    }
    $("taint-note").textContent = state.reads.has("/taint")
      ? "Taint: once a run has read untrusted content (an upstream or rule marked untrusted), its sensitive calls need a person; the cause is shown."
      : "Taint: this gateway's admin API does not report a run's taint, so none is shown (no guess is made).";
    openStream();
    loadCalls();
    refresh();
    state.tick = setInterval(tick, 1000);
    state.poll = setInterval(refresh, REFRESH_MS);
  }

  function teardown() {
    if (state.source) state.source.close();
    state.source = null;
    clearInterval(state.tick);
    clearInterval(state.poll);
    clearTimeout(state.refreshTimer);
    state.refreshTimer = null;
    for (const [id, entry] of state.approvals) {
      entry.card.remove();
      state.approvals.delete(id);
    }
    for (const row of state.rows.values()) row.remove();
    state.rows.clear();
    state.subjects.clear();
    $("subjects").replaceChildren();
    $("inflight").replaceChildren();
    $("reasons").replaceChildren();
  }

  // --- the event stream -----------------------------------------------------------------

  function setLive(live, label) {
    const badge = $("live");
    badge.textContent = label || (live ? "live" : "reconnecting");
    badge.className = live ? "live on" : "live";
  }

  function parse(data) {
    try {
      return JSON.parse(data);
    } catch (err) {
      return null;
    }
  }

  function openStream() {
    if (state.source) state.source.close();
    const source = new EventSource("/events"); // the session cookie goes with it
    state.source = source;
    source.addEventListener("open", () => {
      setLive(true);
      loadCalls(); // catch up on what happened while the stream was down
      refreshSoon();
    });
    source.addEventListener("call", (message) => {
      const event = parse(message.data);
      if (event) addCall(event, true);
      refreshSoon();
    });
    source.addEventListener("approval", () => refreshSoon());
    source.addEventListener("taint", (message) => {
      const event = parse(message.data);
      if (!event || typeof event.key !== "string" || event.key.startsWith("jti:")) return;
      const subject = subjectOf("run", event.key);
      subject.taint = { source: event.source, time: event.time };
      renderSubject(subject);
    });
    source.addEventListener("operator", (message) => {
      const event = parse(message.data);
      if (event) operatorActed(event);
      refreshSoon();
    });
    source.addEventListener("error", async () => {
      if (state.source !== source) return;
      setLive(false);
      if (source.readyState !== EventSource.CLOSED) return; // the browser reconnects
      try {
        await api("GET", "/console/session");
        setTimeout(() => { if (state.source === source) openStream(); }, 3000);
      } catch (err) {
        if (err.status !== 401) setTimeout(() => { if (state.source === source) openStream(); }, 3000);
      }
    });
  }

  // --- recent calls ---------------------------------------------------------------------

  function clock(iso) {
    if (typeof iso !== "string") return "—";
    const match = /T(\d\d:\d\d:\d\d)/.exec(iso);
    return match ? match[1] : iso;
  }

  function callCell(method, path, mcp) {
    const cell = el("td", { class: "call" }, el("span", { class: "method", text: method }), " ",
      el("code", { text: path }));
    if (mcp && typeof mcp.method === "string") {
      cell.append(el("div", { class: "muted small" }, `${mcp.method} `, el("code", { text: mcp.name || "" })));
    }
    return cell;
  }

  function decisionBadge(decision) {
    return el("span", { class: `badge ${decision === "allow" ? "allow" : "deny"}`, text: decision });
  }

  async function loadCalls() {
    try {
      const data = await api("GET", "/calls?limit=200");
      for (const call of data.calls) addCall(call, false);
    } catch (err) {
      if (err.status !== 401) notice(`Recent calls cannot be read: ${describeError(err)}`, "error");
    }
  }

  function addCall(call, live) {
    if (typeof call.seq !== "number" || state.rows.has(call.seq)) return;
    const reason = el("td", {}, el("span", { text: text(call.reason) }));
    if (call.operator) reason.append(el("span", { class: "muted small", text: ` approved by ${call.operator}` }));
    const row = el("tr", { class: live ? "fresh" : "" },
      el("td", { class: "time" }, el("time", { datetime: call.time, text: clock(call.time) })),
      el("td", { text: text(call.agent) }),
      el("td", { text: text(call.run) }),
      callCell(call.method, call.path, call.mcp),
      el("td", { text: text(call.rule) }),
      el("td", {}, decisionBadge(call.decision)),
      reason,
      el("td", { class: "num", text: text(call.status) }),
      el("td", { class: "num", text: typeof call.duration_ms === "number" ? call.duration_ms.toFixed(1) : "—" }),
    );
    row.dataset.seq = String(call.seq);
    row.dataset.search = [call.agent, call.run, call.path, call.rule, call.reason, call.method,
      call.mcp && call.mcp.name]
      .filter(Boolean).join(" ").toLowerCase();
    applyFilter(row);
    const body = $("calls");
    let before = null;
    for (const other of body.children) {
      if (Number(other.dataset.seq) < call.seq) { before = other; break; }
    }
    body.insertBefore(row, before);
    state.rows.set(call.seq, row);
    while (body.children.length > MAX_ROWS) {
      const last = body.lastElementChild;
      state.rows.delete(Number(last.dataset.seq));
      last.remove();
    }
    $("calls-empty").hidden = body.children.length > 0;
    seen(call);
  }

  function applyFilter(row) {
    const wanted = $("calls-filter").value.trim().toLowerCase();
    row.hidden = wanted !== "" && !row.dataset.search.includes(wanted);
  }

  // --- agents and runs ------------------------------------------------------------------

  function seen(call) {
    const denied = call.decision === "deny";
    if (call.agent) bump("agent", call.agent, call, denied);
    if (call.run) bump("run", call.run, call, denied);
  }

  // An agent or run the page has seen: in an ended call, a call in flight or a held call.
  function subjectOf(kind, name) {
    const key = `${kind}:${name}`;
    let subject = state.subjects.get(key);
    if (!subject) {
      subject = { kind, name, calls: 0, refused: 0, last: "", lastSeq: 0, status: "", row: null };
      state.subjects.set(key, subject);
      renderSubject(subject);
      if (kind === "run" && state.reads.has("/taint")) loadTaint(subject);
    }
    return subject;
  }

  function bump(kind, name, call, denied) {
    const subject = subjectOf(kind, name);
    subject.calls += 1;
    if (denied) subject.refused += 1;
    if (call.seq > subject.lastSeq) {
      subject.lastSeq = call.seq;
      subject.last = clock(call.time);
    }
    if (call.taint !== undefined && kind === "run") subject.taint = call.taint;
    renderSubject(subject);
  }

  function renderSubject(subject) {
    if (!subject.row) {
      subject.row = el("tr", {},
        el("td", { text: subject.kind }),
        el("td", {}, el("code", { text: subject.name }), el("span", { class: "badge status" })),
        el("td", { class: "num" }), el("td", { class: "num" }), el("td", {}), el("td", { class: "muted" }),
        el("td", { class: "actions" }, ...(may("admin") ? controls(subject) : [])));
      subject.row.cells[6].hidden = !may("admin");
      const body = $("subjects");
      const after = [...body.children].find((row) => row.dataset.key > `${subject.kind}:${subject.name}`);
      subject.row.dataset.key = `${subject.kind}:${subject.name}`;
      body.insertBefore(subject.row, after || null);
      $("subjects-empty").hidden = true;
    }
    const cells = subject.row.cells;
    const badge = cells[1].lastElementChild;
    badge.textContent = subject.status;
    badge.hidden = !subject.status;
    cells[2].textContent = String(subject.calls);
    cells[3].textContent = String(subject.refused);
    cells[4].textContent = subject.last || "—";
    cells[5].textContent = subject.kind === "run"
      ? (subject.taint === undefined ? "not reported" : describeTaint(subject.taint))
      : "—";
    cells[5].className = subject.taint && typeof subject.taint === "object" ? "tainted" : "muted";
  }

  // A run's taint as GET /taint and the "taint" event give it: null (clean) or its cause.
  function describeTaint(taint) {
    if (taint === "checking") return "checking";
    if (taint === null || taint === false) return "clean";
    if (typeof taint === "object") {
      const source = typeof taint.source === "string" ? taint.source : "untrusted content";
      return taint.time ? `tainted by ${source} at ${clock(taint.time)}` : `tainted by ${source}`;
    }
    return String(taint);
  }

  async function loadTaint(subject) {
    subject.taint = "checking";
    renderSubject(subject);
    try {
      const report = await api("GET", `/taint?run=${encodeURIComponent(subject.name)}`);
      if (subject.taint === "checking") subject.taint = report.tainted ? report.cause || {} : null;
    } catch (err) {
      if (subject.taint === "checking") subject.taint = undefined;
    }
    renderSubject(subject);
  }

  function controls(subject) {
    const label = `${subject.kind} ${subject.name}`;
    const make = (verb, title, cls) => {
      const button = el("button", { type: "button", class: cls, "aria-label": `${title} ${label}`, text: title });
      button.addEventListener("click", () => confirmAction(subject, verb, title));
      return button;
    };
    const offered = state.offered[subject.kind];
    const buttons = [["pause", "Pause", "quiet"], ["resume", "Resume", "quiet"], ["stop", "Stop", "danger"]]
      .filter(([verb]) => offered.has(verb)).map(([verb, title, cls]) => make(verb, title, cls));
    return buttons.length ? buttons : [el("span", { class: "muted", text: "none offered" })];
  }

  const EXPLAIN = {
    pause: "Its next calls wait until it is resumed.",
    resume: "Its paused calls go on, and its next calls are checked as usual.",
    stop: "Its calls in flight are cut and every next call is refused (token_revoked). This cannot be undone from the console.",
  };

  function confirmAction(subject, verb, title) {
    const dialog = $("confirm");
    $("confirm-title").textContent = `${title} ${subject.kind} ${subject.name}?`;
    $("confirm-text").textContent = EXPLAIN[verb];
    $("confirm-reason").value = "";
    const ok = $("confirm-ok");
    ok.textContent = `${title} ${subject.kind}`;
    ok.className = verb === "stop" ? "danger" : "primary";
    dialog.onclose = null;
    dialog.addEventListener("close", async () => {
      if (dialog.returnValue !== "ok") return;
      const reason = $("confirm-reason").value;
      const path = `/${subject.kind}s/${encodeURIComponent(subject.name)}/${verb}`;
      try {
        await api("POST", path, { reason });
        subject.status = { pause: "paused", resume: "", stop: "stopped" }[verb];
        renderSubject(subject);
        notice(`${title}: ${subject.kind} ${subject.name}.`, "ok");
      } catch (err) {
        notice(`${title} ${subject.kind} ${subject.name} failed: ${describeError(err)}`, "error");
      }
    }, { once: true });
    dialog.returnValue = "";
    dialog.showModal();
    $("confirm-reason").focus();
  }

  function operatorActed(event) {
    const kind = event.kind === "agent" || event.kind === "run" ? event.kind : null;
    if (!kind || typeof event.value !== "string") return;
    const subject = subjectOf(kind, event.value);
    subject.status = { pause: "paused", resume: "", stop: "stopped" }[event.action] || subject.status;
    renderSubject(subject);
  }

  // --- calls in flight, approvals, counts -----------------------------------------------

  function refreshSoon() {
    if (state.refreshTimer !== null) return;
    state.refreshTimer = setTimeout(() => {
      state.refreshTimer = null;
      refresh();
    }, 150);
  }

  async function refresh() {
    if (state.who === null) return;
    try {
      const [inflight, approvals, stats] = await Promise.all([
        api("GET", "/calls/inflight"), api("GET", "/approvals"), api("GET", "/stats"),
      ]);
      renderInflight(inflight.calls);
      renderApprovals(approvals.pending);
      renderStats(stats);
      await refreshStates();
    } catch (err) {
      if (err.status !== 401) notice(`The console cannot read the gateway: ${describeError(err)}`, "error");
    }
  }

  // Paused and stopped agents and runs, as the state store has them (when the API says).
  async function refreshStates() {
    if (!state.reads.has("/pauses") || !state.reads.has("/stops")) return;
    const [pauses, stops] = await Promise.all([api("GET", "/pauses"), api("GET", "/stops")]);
    const status = new Map();
    for (const p of pauses.pauses || []) status.set(`${p.kind}:${p.value}`, "paused");
    for (const r of stops.stops || []) status.set(`${r.kind}:${r.value}`, "stopped");
    for (const key of status.keys()) {
      const [kind, ...rest] = key.split(":");
      if (kind === "agent" || kind === "run") subjectOf(kind, rest.join(":"));
    }
    for (const [key, subject] of state.subjects) {
      const now = status.get(key) || "";
      if (subject.status !== now) {
        subject.status = now;
        renderSubject(subject);
      }
    }
  }

  function renderInflight(calls) {
    for (const call of calls) {
      if (call.agent) subjectOf("agent", call.agent);
      if (call.run) subjectOf("run", call.run);
    }
    const rows = calls.map((call) => el("tr", {},
      el("td", { text: text(call.agent) }),
      el("td", { text: text(call.run) }),
      callCell(call.method, call.path),
      el("td", { text: text(call.rule) }),
      el("td", {}, el("span", { class: `badge ${call.state === "forwarded" ? "allow" : "held"}`, text: call.state })),
      el("td", { class: "num", text: `${Number(call.seconds).toFixed(1)} s` }),
    ));
    $("inflight").replaceChildren(...rows);
    $("inflight-empty").hidden = rows.length > 0;
    $("inflight-count").textContent = String(rows.length);
  }

  function renderStats(stats) {
    $("stat-total").textContent = String(stats.total);
    $("stat-allow").textContent = String(stats.by_decision.allow);
    $("stat-deny").textContent = String(stats.by_decision.deny);
    $("stat-since").textContent = `since ${stats.since}`;
    const rows = stats.by_reason.map((item) => el("tr", {},
      el("td", {}, el("code", { text: item.reason })),
      el("td", {}, decisionBadge(item.decision)),
      el("td", { class: "num", text: String(item.count) }),
    ));
    $("reasons").replaceChildren(...rows);
    $("reasons-empty").hidden = rows.length > 0;
  }

  // Cards are kept while their call is pending, so a reason being typed is never lost.
  function renderApprovals(pending) {
    const ids = new Set(pending.map((p) => p.id));
    for (const [id, entry] of state.approvals) {
      if (!ids.has(id)) {
        entry.card.remove();
        state.approvals.delete(id);
      }
    }
    for (const item of pending) {
      if (!state.approvals.has(item.id)) {
        const entry = approvalCard(item);
        state.approvals.set(item.id, entry);
        $("approvals").append(entry.card);
      }
    }
    $("approvals-empty").hidden = pending.length > 0;
    $("approvals-count").textContent = String(pending.length);
    tick();
  }

  function approvalCard(item) {
    const countdown = el("span", { class: "countdown" });
    const facts = el("dl", { class: "facts" },
      el("dt", { text: "Agent" }), el("dd", {}, el("code", { text: item.agent })),
      el("dt", { text: "Run" }), el("dd", {}, el("code", { text: text(item.run) })),
      el("dt", { text: "Rule" }), el("dd", {}, el("code", { text: item.rule })),
      el("dt", { text: "Approval" }), el("dd", {}, el("code", { text: item.id })),
    );
    const why = typeof item.why === "string" && item.why
      ? el("p", { class: "why" }, "Why approval is asked: ", el("strong", { text: item.why }))
      : el("p", { class: "why" }, "Why: the rule ", el("code", { text: item.rule }),
        " requires a person's approval before this call goes on to the upstream.");
    if (Array.isArray(item.tools) && item.tools.length) {
      facts.append(el("dt", { text: "Tools" }), el("dd", {}, el("code", { text: item.tools.join(", ") })));
    }
    let body;
    if (item.body === null || item.body === undefined) {
      body = el("p", { class: "muted", text: "The call has no body." });
    } else {
      const truncated = item.body_truncated === true || (item.body_truncated === undefined && item.body.length >= 4096);
      const size = typeof item.body_size === "number" ? ` of ${item.body_size} bytes` : "";
      const shown = truncated ? ` (the beginning${size})` : "";
      body = el("details", { class: "body" },
        el("summary", { text: `Body${shown}, secret-looking values masked: ${item.body.length} characters` }),
        el("pre", { text: item.body }));
      body.open = true;
    }
    const card = el("li", { class: "approval", "aria-label": `Held call ${item.method} ${item.target}` },
      el("h3", {}, el("span", { class: "method", text: item.method }), " ", el("code", { text: item.target })),
      facts, why, body, el("p", { class: "muted small" }, countdown));
    if (may("approver")) {
      card.append(decisionForm(item));
    } else {
      card.append(el("p", { class: "muted", text: "Deciding needs the approver role." }));
    }
    return { card, countdown, deadline: Date.now() + item.expires_in_s * 1000 };
  }

  function decisionForm(item) {
    const inputId = `reason-${item.id}`;
    const input = el("input", { id: inputId, type: "text", maxlength: 500, autocomplete: "off" });
    const approve = el("button", { type: "button", class: "primary", text: "Approve" });
    const deny = el("button", { type: "button", class: "danger", text: "Deny" });
    const result = el("p", { class: "result", "aria-live": "polite" });
    const decide = async (verb) => {
      approve.disabled = true;
      deny.disabled = true;
      try {
        const decision = { reason: input.value };
        // The decision names the body the approver saw: a different one is not decided (409).
        if (typeof item.body_sha256 === "string") decision.body_sha256 = item.body_sha256;
        const answer = await api("POST", `/approvals/${item.id}/${verb}`, decision);
        result.textContent = `${answer.decision === "approved" ? "Approved" : "Denied"} by ${answer.by}.`;
        notice(`${answer.decision === "approved" ? "Approved" : "Denied"}: ${item.method} ${item.target} (${item.agent}).`, "ok");
        refreshSoon();
      } catch (err) {
        result.textContent = err.status === 404
          ? "This call is no longer waiting (decided by someone else, expired or stopped)."
          : err.status === 409
            ? "The held call's body is not the one shown here; nothing was decided. Reload the list."
            : `Failed: ${describeError(err)}`;
        approve.disabled = false;
        deny.disabled = false;
        refreshSoon();
      }
    };
    approve.addEventListener("click", () => decide("approve"));
    deny.addEventListener("click", () => decide("deny"));
    return el("div", { class: "decide" },
      el("label", { for: inputId, text: "Reason (goes with your decision; the agent sees a denial's reason)" }), input,
      el("div", { class: "actions" }, approve, deny), result);
  }

  function tick() {
    const now = Date.now();
    for (const entry of state.approvals.values()) {
      const left = Math.max(0, Math.round((entry.deadline - now) / 1000));
      entry.countdown.textContent = `Refused as approval_timeout in ${left} s unless someone decides.`;
    }
  }

  // --- start ----------------------------------------------------------------------------

  async function start() {
    $("login-form").addEventListener("submit", login);
    $("logout").addEventListener("click", logout);
    $("calls-filter").addEventListener("input", () => {
      for (const row of state.rows.values()) applyFilter(row);
    });
    try {
      await enter(await api("GET", "/console/session"));
    } catch (err) {
      showLogin(err.status === 401 ? "" : `The admin API cannot be reached: ${describeError(err)}`);
    }
  }

  document.addEventListener("DOMContentLoaded", start);
})();
