"""Promises of README.md and docs/*.md that had no test of their own (docs/promises.md lists
every promise and the test that guards it; tests/test_promises_index.py keeps that list true).

Each test runs the real parts: the gateway's agents' listener on loopback, the mock upstreams
(the MCP one is the ``mcp`` package's own server), a real redis-server where the promise is
about the shared store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from gateway.app import build_gateway
from gateway.config import Settings
from mocks.demo import Workspace
from tests.conftest import ROOT, Mocks

PROBLEM = "application/problem+json"
MCP_ACCEPT = "application/json, text/event-stream"


def bearer(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


def _rpc(msg_id: int, method: str, **params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}


async def _open_session(client: Any, tok: str) -> str:
    """``initialize`` through the gateway; the MCP server's session id."""
    init = _rpc(
        1,
        "initialize",
        protocolVersion="2025-06-18",
        capabilities={},
        clientInfo={"name": "promises", "version": "0"},
    )
    resp = await client.post("/tools/mcp", json=init, headers={**bearer(tok), "Accept": MCP_ACCEPT})
    assert resp.status == 200, await resp.text()
    await resp.read()
    session = resp.headers.get("Mcp-Session-Id")
    assert session, "the MCP server opened no session"
    return session


# --- README "MCP servers": sessions belong to their agent ------------------------------------


async def test_an_mcp_session_is_its_agents_and_an_unknown_one_is_404(
    client: Any, token: Any, mocks: Mocks
) -> None:
    """README: "A session (``Mcp-Session-Id``) belongs to the agent that opened it through
    this gateway; another agent's is refused, an unknown one gets 404"."""
    owner = token("mcp-owner", ["mcp-agent"])
    session = await _open_session(client, owner)
    headers = {"Accept": MCP_ACCEPT, "Mcp-Session-Id": session}
    own = await client.post(
        "/tools/mcp", json=_rpc(2, "tools/list"), headers={**bearer(owner), **headers}
    )
    assert own.status == 200
    await own.read()
    mocks.clear()
    intruder = token("mcp-intruder", ["mcp-agent"])
    resp = await client.post(
        "/tools/mcp", json=_rpc(3, "tools/list"), headers={**bearer(intruder), **headers}
    )
    assert resp.status == 403
    body = await resp.json(content_type=PROBLEM)
    assert body["reason"] == "mcp_denied" and "another agent" in body["detail"]
    unknown = await client.post(
        "/tools/mcp",
        json=_rpc(4, "tools/list"),
        headers={**bearer(owner), "Accept": MCP_ACCEPT, "Mcp-Session-Id": "never-opened-0001"},
    )
    assert unknown.status == 404
    assert (await unknown.json(content_type=PROBLEM))["reason"] == "mcp_session_unknown"
    assert mocks.requests("mcp") == [], "a refused session reached the MCP server"


# --- README "MCP servers": routing headers -----------------------------------------------------


async def test_mcp_routing_headers_must_agree_and_mcp_param_headers_stay_behind(
    client: Any, token: Any, mocks: Mocks
) -> None:
    """README: "``Mcp-Method`` and ``Mcp-Name`` pass (must agree with the body ...);
    ``Mcp-Param-*`` headers are not forwarded"."""
    tok = token("mcp-routing", ["mcp-agent"])
    session = await _open_session(client, tok)
    headers = {**bearer(tok), "Accept": MCP_ACCEPT, "Mcp-Session-Id": session}
    call = _rpc(5, "tools/call", name="get_order", arguments={"order_id": 1})
    mocks.clear()
    wrong_name = await client.post(
        "/tools/mcp",
        json=call,
        headers={**headers, "Mcp-Method": "tools/call", "Mcp-Name": "search_orders"},
    )
    assert (await wrong_name.json())["error"]["data"]["reason"] == "body_invalid"
    twice = await client.post(
        "/tools/mcp",
        json=call,
        headers=[*headers.items(), ("Mcp-Method", "tools/call"), ("Mcp-Method", "tools/call")],
    )
    assert (await twice.json())["error"]["data"]["reason"] == "body_invalid"
    assert mocks.requests("mcp") == [], "a call whose headers disagree reached the server"
    agreeing = await client.post(
        "/tools/mcp",
        json=call,
        headers={
            **headers,
            "Mcp-Method": "tools/call",
            "Mcp-Name": "get_order",
            "Mcp-Param-Order-Id": "1",
        },
    )
    assert agreeing.status == 200
    await agreeing.read()
    [sent] = [r for r in mocks.requests("mcp") if r["method"] == "POST"]
    names = {k.lower(): v for k, v in sent["headers"].items()}
    assert names.get("mcp-method") == "tools/call" and names.get("mcp-name") == "get_order"
    assert not [k for k in names if k.startswith("mcp-param-")], names


# --- README "Pause and stop": the refusal names what is paused, never who or why -------------


async def test_a_pause_refusal_names_what_is_paused_never_who_or_why(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    mocks: Mocks,
    tmp_path: Path,
    token: Any,
) -> None:
    """README: "The refusal names what is paused, never who paused it or why"."""
    s = dataclasses.replace(settings, audit=tmp_path / "audit.jsonl", pause_hold=0.2)
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    await gw.pause("run", "run-secretive", until=None, by="ops-carol-7731", reason="fraud-4412")
    resp = await client.get("/echo/echo/x", headers=bearer(token("tester", run="run-secretive")))
    assert resp.status == 503
    text = await resp.text()
    assert json.loads(text)["reason"] == "agent_paused"
    assert "run-secretive" in json.loads(text)["detail"]
    shown = text + json.dumps(dict(resp.headers))
    assert "ops-carol-7731" not in shown and "fraud-4412" not in shown
    assert mocks.requests("echo") == []


# --- README "Errors": the table of reasons is the code's --------------------------------------


def _readme_reasons() -> dict[str, set[str]]:
    """The README's table of reason codes: reason -> the statuses it gives."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for line in section.splitlines():
        m = re.match(r"\| `([a-z_]+)` \| ([^|]+) \|", line)
        if m:
            table.setdefault(m.group(1), set()).update(re.findall(r"\d{3}", m.group(2)))
    return table


def test_the_readme_table_of_reasons_is_the_codes_and_statuses_of_the_code() -> None:
    """README: "``reason`` is a stable code (added to, never renamed)", and the table that
    lists them with their status: every code the gateway answers with is in the table with
    its status, and the table names no code the gateway does not have."""
    from gateway.errors import GatewayError, Reason

    table = _readme_reasons()
    assert len(table) >= 30, table
    codes = {r.value for r in Reason}
    assert set(table) - codes == set(), "the README names codes the gateway does not have"
    missing = codes - set(table) - {"allowed"}
    assert missing == set(), f"codes the README's table does not list: {sorted(missing)}"

    def classes(cls: type[GatewayError]) -> list[type[GatewayError]]:
        return [cls, *(c for sub in cls.__subclasses__() for c in classes(sub))]

    for cls in classes(GatewayError):
        reason = getattr(cls, "reason", None)
        status = getattr(cls, "status", None)
        if not isinstance(reason, Reason) or not isinstance(status, int):
            continue
        if reason.value in table and reason.value != "client_closed":
            assert str(status) in table[reason.value], (cls.__name__, status, table[reason.value])


# --- README "Observability": at most 2000 call series ----------------------------------------


async def test_call_series_past_the_cap_are_counted_under_other(
    serve_gateway: Any, gateway: Any, workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: "At most 2000 call series are kept; further combinations are counted under
    ``(other)``" (the cap lowered to 3 here, so that three rules fill it)."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from gateway import telemetry as telemetry_module
    from gateway.telemetry import OTHER, Plan, Telemetry

    monkeypatch.setattr(telemetry_module, "MAX_SERIES", 3)
    reader = InMemoryMetricReader()
    telemetry = Telemetry(Plan(), metric_readers=[reader])
    observers = tuple(o for o in gateway.observers if not isinstance(o, Telemetry))
    gw = dataclasses.replace(gateway, telemetry=telemetry, observers=(*observers, telemetry))
    client = await serve_gateway(gw)
    tester = bearer(workspace.token("tester", ["tester"]))
    sre = bearer(workspace.token("sre-bot", ["sre-diagnostics"]))
    calls = [
        ("/echo/echo/x", tester),
        ("/metrics/metrics/cpu?window=5m", sre),
        ("/metrics/metrics/cpu?window=7m", sre),
        ("/logs/logs/application?level=info", sre),
        ("/logs/logs/application?level=loud", sre),
        ("/metrics/metrics/cpu?zone=1", tester),
    ]
    for path, auth in calls:
        await (await client.get(path, headers=auth)).read()
    data = reader.get_metrics_data()
    assert data is not None
    points = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "capgate.calls"
        for p in m.data.data_points
    ]
    named = [p for p in points if p.attributes.get("rule") != OTHER]
    other = [p for p in points if p.attributes.get("rule") == OTHER]
    assert len(named) == 3, [p.attributes for p in named]
    assert sum(p.value for p in points) == len(calls)
    assert sum(p.value for p in other) == len(calls) - 3
    assert all(p.attributes["upstream"] == OTHER and p.attributes["reason"] == OTHER for p in other)
    assert len(other) <= 2  # one per decision: the agent cannot add series past the cap


# --- README "Untrusted content": a store that cannot be read counts as tainted ---------------


async def test_a_taint_store_that_cannot_be_read_counts_as_tainted(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    mocks: Mocks,
    redis_server: Any,
) -> None:
    """README: "A store that cannot be read counts as tainted (fail closed)": with Redis
    gone, a sensitive call of a run that never read anything untrusted is refused as tainted,
    even on a rule that lets the call through a state error (``on_state_error: allow``)."""
    text = policy_file.read_text()
    rule = "      - id: restart-service\n"
    assert rule in text
    text = text.replace("  logs:\n", "  logs:\n    trust: untrusted\n", 1).replace(
        rule, rule + "        sensitive: true\n        when_tainted: deny\n"
        "        on_state_error: allow\n", 1
    )  # fmt: skip
    path = policy_file.with_name("tainting-fail-closed.yaml")
    path.write_text(text)
    s = dataclasses.replace(settings, policy=path, state=redis_server.url)
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    mocks.clear()

    async def restart(run: str) -> Any:
        auth = bearer(workspace.token("sre-bot", ["sre-diagnostics"], run=run))
        resp = await client.post(
            "/services/services/restart", json={"service": "web"}, headers=auth
        )
        await resp.read()
        return resp

    assert (await restart("run-clean-1")).status == 200  # the store answers: not tainted
    redis_server.close()
    await asyncio.sleep(0.3)
    resp = await restart("run-clean-2")
    assert resp.status == 403, await resp.text()
    body = await resp.json(content_type=PROBLEM)
    assert body["reason"] == "run_tainted"
    assert "could not be read" in body["detail"]
    assert len(mocks.requests("services")) == 1, "a sensitive call went out unchecked"


# --- docs/audit.md "Keeping the trail": the mirror --------------------------------------------


def test_a_new_audit_file_continues_the_mirrors_chain_and_a_foreign_mirror_is_moved_aside(
    tmp_path: Path,
) -> None:
    """docs/audit.md: "A new sandbox whose audit file is empty continues the mirror's chain; a
    mirror holding another chain is moved aside (``PATH.<time>``) and a new one started"."""
    from gateway.audit_sign import CheckpointSigner, load_verify_keys
    from gateway.audit_trail import AuditTrail, TrailOptions
    from gateway.audit_verify import verify_trail

    signer = CheckpointSigner.load_or_create(tmp_path / "k.pem")
    signer.publish(tmp_path / "jwks.json")
    keys = load_verify_keys(tmp_path / "jwks.json")
    mirror = tmp_path / "keep" / "audit.jsonl"

    def run(primary: Path, ids: list[str]) -> None:
        trail = AuditTrail(primary, TrailOptions(mirror=mirror), signer=signer)
        trail.open()
        for request_id in ids:
            trail.append({"v": 2, "type": "decision", "request_id": request_id})
        trail.close()
        assert trail.error is None

    run(tmp_path / "sandbox-1" / "audit.jsonl", ["1", "2"])
    run(tmp_path / "sandbox-2" / "audit.jsonl", ["3"])  # a new sandbox: its file is empty
    whole = verify_trail([mirror], keys)
    assert whole.ok, whole.problem
    ids = [json.loads(x).get("request_id") for x in mirror.read_text().splitlines()]
    assert [i for i in ids if i] == ["1", "2", "3"]
    assert verify_trail([tmp_path / "sandbox-2" / "audit.jsonl"], keys).ok  # continues it
    kept = mirror.read_bytes()
    # A primary with a chain of its own, then opened with this mirror: the mirror is kept
    # aside, whole, and a fresh mirror follows the primary's chain.
    other = tmp_path / "sandbox-3" / "audit.jsonl"
    trail = AuditTrail(other, TrailOptions(), signer=signer)
    trail.open()
    trail.append({"v": 2, "type": "decision", "request_id": "other"})
    trail.close()
    run(other, ["4"])
    [aside] = [p for p in mirror.parent.iterdir() if p.name.startswith("audit.jsonl.")]
    assert re.fullmatch(r"audit\.jsonl\.\d{8}T\d{6}Z(\.\d+)?", aside.name), aside.name
    assert aside.read_bytes() == kept
    assert verify_trail([aside], keys).ok
    fresh = [json.loads(x).get("request_id") for x in mirror.read_text().splitlines()]
    assert [i for i in fresh if i] == ["4"]
    assert verify_trail([mirror], keys).ok  # a fresh start, chained to the primary


# --- docs/audit.md "What anchors the tail": a slow anchor never holds a call -----------------


async def test_a_slow_anchor_never_holds_a_call(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    mocks: Mocks,
    tmp_path: Path,
    token: Any,
) -> None:
    """docs/audit.md: "Publication runs in its own thread and keeps only the latest pending
    checkpoint: a slow or down anchor never holds a call (health shows
    ``audit.anchor.error``)". Here the anchor command takes 3 s per checkpoint and every
    second line is a checkpoint."""
    from gateway.audit_anchor import AnchorSpec

    s = dataclasses.replace(
        settings,
        audit=tmp_path / "audit.jsonl",
        audit_anchor=AnchorSpec.parse("exec:sleep 3"),
        audit_checkpoint_lines=2,
    )
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    auth = bearer(token("tester"))
    loop = asyncio.get_running_loop()
    began = loop.time()
    for _ in range(8):
        resp = await client.get("/echo/echo/x", headers=auth)
        assert resp.status == 200
        await resp.read()
    # Waiting for the anchor would take 3 s per checkpoint, 4 checkpoints at least (12 s);
    # the bound leaves room for a loaded machine.
    assert loop.time() - began < 6.0, "calls waited for the anchor"
    health = await (await client.get("/_capgate/health")).json()
    assert health["audit"]["anchor"]["target"].startswith("exec:")


# --- README "Operators": the operators file is read again when it changes ----------------------


async def _status_within(admin: Any, token: str, want: int, seconds: float = 5.0) -> int:
    status = 0
    for _ in range(int(seconds / 0.05)):
        resp = await admin.get("/whoami", headers=bearer(token))
        status = resp.status
        await resp.read()
        if status == want:
            break
        await asyncio.sleep(0.05)
    return status


async def test_a_running_gateway_reads_the_operators_file_again_when_it_changes(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    tmp_path: Path,
) -> None:
    """README: "The operators file holds SHA-256 digests of their tokens, never the tokens;
    it is read again when it changes" (by the gateway's own background loop: nothing here
    calls ``reload``), and a file that no longer reads keeps the operators in force."""
    from gateway.admin import create_admin_app
    from gateway.operators import add_operator, remove_operator

    file = tmp_path / "operators.yaml"
    vera = add_operator(file, "vera", "viewer")
    s = dataclasses.replace(settings, admin_port=0, operators_file=file)
    gw = build_gateway(s, workspace.environ())
    await serve_gateway(gw)  # runs the background loop (every reload_interval, 0.2 s)
    assert gw.operators is not None
    admin = await aiohttp_client(create_admin_app(gw, gw.operators))
    assert await _status_within(admin, vera, 200) == 200
    nora = add_operator(file, "nora", "admin")
    assert nora not in file.read_text()
    assert await _status_within(admin, nora, 200) == 200
    who = await (await admin.get("/whoami", headers=bearer(nora))).json()
    assert (who["name"], who["role"]) == ("nora", "admin")
    remove_operator(file, "vera")
    assert await _status_within(admin, vera, 401) == 401
    file.write_text("operators: [this is not a mapping\n")
    await asyncio.sleep(0.6)
    assert await _status_within(admin, nora, 200, seconds=0.2) == 200  # still in force


# --- README "In scripts and CI": --json on every command a script reads -----------------------


def _example_trail(tmp_path: Path) -> Path:
    from gateway.audit_sign import CheckpointSigner
    from gateway.audit_trail import AuditTrail, TrailOptions

    audit = tmp_path / "audit.jsonl"
    signer = CheckpointSigner.load_or_create(tmp_path / "audit.jsonl.signing.pem")
    signer.publish(tmp_path / "audit.jsonl.jwks.json")
    trail = AuditTrail(audit, TrailOptions(), signer=signer)
    trail.open()
    trail.append({"v": 2, "type": "decision", "request_id": "r1", "agent": "a"})
    trail.close()
    return audit


@pytest.mark.parametrize(
    "argv",
    [
        ["policy", "check", "policies/example.yaml"],
        ["policy", "test", "--policy", "policies/example.yaml"],
        ["policy", "lint", "policies/example.yaml"],
        ["recording", "lint", "recordings/example"],
        ["audit", "verify", "{audit}"],
        ["audit", "query", "{audit}"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_every_command_a_script_reads_prints_one_json_object_with_json(
    argv: list[str], tmp_path: Path
) -> None:
    """README: "Every command a script reads has ``--json`` (one JSON object on stdout):
    ``policy check``, ``policy test``, ``policy lint``, ``recording lint``, ``audit verify``
    ... and ``audit query``", with exit status 0 for a good input. Run as ``capgate`` runs:
    ``python -m gateway`` in a process of its own."""
    import os
    import subprocess
    import sys

    audit = _example_trail(tmp_path)
    args = [a.replace("{audit}", str(audit)) for a in argv]
    done = subprocess.run(
        [sys.executable, "-m", "gateway", *args, "--json"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert isinstance(json.loads(done.stdout), dict), done.stdout


# --- the documented defaults -------------------------------------------------------------------


def test_the_defaults_the_docs_state_are_the_ones_in_force() -> None:
    """The defaults README.md and docs/policy-reference.md state, read through the real
    loaders (settings as ``capgate serve`` reads them, a policy as the gateway loads it):
    ``--max-connections`` 1024, ``--head-timeout`` 10 s, ``--idle-timeout`` 60 s,
    ``--approvals-per-agent`` 10, ``--approval-timeout`` 5 minutes, ``--pause-hold`` 5
    minutes, ``--shutdown-grace`` 10 s, ``--audit-fsync 1s``, a checkpoint every 1000 lines
    and every 10 s, telemetry off; per upstream ``timeouts`` 5 s / 30 s / 60 s, ``limits``
    1 MiB / 16 MiB / 64 in flight / a quarter per agent; per rule ``on_state_error: deny``,
    ``when_tainted: approve``, ``max_length`` 1024; MCP patience 25 s and keepalive 15 s."""
    from gateway.config import load_settings
    from gateway.policy.load import load_policy

    s = load_settings({"policy": "p.yaml", "jwks": "j.json"}, {})
    assert (s.max_connections, s.head_timeout, s.idle_timeout) == (1024, 10.0, 60.0)
    assert (s.approvals_per_agent, s.approval_timeout, s.pause_hold) == (10, 300.0, 300.0)
    assert s.shutdown_grace == 10.0
    assert (s.audit_fsync.always, s.audit_fsync.interval) == (False, 1.0)
    assert (s.audit_checkpoint_lines, s.audit_checkpoint_interval) == (1000, 10.0)
    assert s.traces is None and s.traces_exporter is None and s.metrics_exporter is None
    assert s.otlp_endpoint is None and s.admin_port is None
    policy = load_policy(
        "p.yaml",
        """version: 1
upstreams:
  web: {url: "http://127.0.0.1:9"}
  small: {url: "http://127.0.0.1:9", limits: {concurrency: 8}}
  tools: {url: "http://127.0.0.1:9", kind: mcp}
roles:
  r:
    rules:
      - {id: a, upstream: web, allow: GET /x, query: {q: {regex: "[a-z]+"}}}
agents:
  "*": [r]
""",
    )
    web = policy.upstreams["web"]
    assert (web.connect_timeout, web.read_timeout, web.total_timeout) == (5.0, 30.0, 60.0)
    assert (web.max_request_body, web.max_response_body) == (1024**2, 16 * 1024**2)
    assert (web.concurrency, web.per_agent) == (64, 16)
    assert policy.upstreams["small"].per_agent == 2  # a quarter of its concurrency
    assert web.kind == "http" and web.mcp_batches is False
    tools = policy.upstreams["tools"]
    assert (tools.mcp_approval_patience, tools.mcp_approval_keepalive) == (25.0, 15.0)
    assert tools.mcp_tool_refusals == "error"
    rule = policy.rules_by_id["a"]
    assert (rule.on_state_error, rule.when_tainted) == ("deny", "approve")
    assert [c.max_length for c in rule.query.values()] == [1024]


# --- docs/audit.md "Keys": keys read from beside the trail prove nothing, and verify says so --


def test_verify_says_keys_read_from_beside_the_trail_prove_nothing(tmp_path: Path) -> None:
    """docs/audit.md: "pass that copy to ``verify --jwks``: keys read from beside the trail
    prove nothing against whoever could write both (verify says so)"."""
    import os
    import shutil
    import subprocess
    import sys

    audit = _example_trail(tmp_path)
    trusted = tmp_path / "trusted" / "audit.jwks.json"
    trusted.parent.mkdir()
    shutil.copy(tmp_path / "audit.jsonl.jwks.json", trusted)

    def verify(*extra: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "audit", "verify", str(audit), "--json", *extra],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        answer: dict[str, Any] = json.loads(done.stdout)
        return answer

    beside = json.dumps(verify())
    assert "prove nothing" in beside and "--jwks" in beside
    assert "prove nothing" not in json.dumps(verify("--jwks", str(trusted)))


async def test_mcp_routing_headers_on_a_batch_are_refused(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    mocks: Mocks,
    token: Any,
) -> None:
    """README: "``Mcp-Method``/``Mcp-Name`` must agree with the body, and are refused on
    batches" (a batch has no one method for them to name), on an upstream that takes
    batches, where the same batch without them is forwarded."""
    text = policy_file.read_text()
    tools = "  tools:\n    url: "
    assert tools in text
    path = policy_file.with_name("batches.yaml")
    path.write_text(text.replace("    kind: mcp\n", "    kind: mcp\n    mcp: {batches: true}\n", 1))
    gw = build_gateway(dataclasses.replace(settings, policy=path), workspace.environ())
    assert gw.policy.upstreams["tools"].mcp_batches
    client = await serve_gateway(gw)
    tok = token("mcp-batcher", ["mcp-agent"])
    session = await _open_session(client, tok)
    headers = {**bearer(tok), "Accept": MCP_ACCEPT, "Mcp-Session-Id": session}
    batch = [
        _rpc(7, "tools/call", name="get_order", arguments={"order_id": 1}),
        _rpc(8, "tools/call", name="get_order", arguments={"order_id": 2}),
    ]
    mocks.clear()
    for named in ({"Mcp-Method": "tools/call"}, {"Mcp-Name": "get_order"}):
        resp = await client.post("/tools/mcp", json=batch, headers={**headers, **named})
        answers = await resp.json()
        assert [a["id"] for a in answers] == [7, 8], answers
        assert {a["error"]["data"]["reason"] for a in answers} == {"body_invalid"}, answers
    assert mocks.requests("mcp") == [], "a batch with routing headers reached the server"
    # The same batch without them is forwarded (this SDK server itself takes no batches and
    # answers 400: what matters is that the gateway let it through).
    plain = await client.post("/tools/mcp", json=batch, headers=headers)
    await plain.read()
    assert len([r for r in mocks.requests("mcp") if r["method"] == "POST"]) == 1


# --- README "Untrusted content": one taint event, when the run is first tainted ----------------


async def test_the_event_stream_announces_a_taint_once_when_the_run_is_first_tainted(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    mocks: Mocks,
) -> None:
    """README: "the event stream has a ``taint`` event when a run is first tainted": three
    untrusted reads of one run give one event, and another run's first read its own."""
    from gateway.admin import create_admin_app
    from tests.test_taint import LOGS, make, sre

    gw, client = await make(serve_gateway, settings, workspace, policy_file)
    admin = await aiohttp_client(create_admin_app(gw, gw.operators))
    auth = {"Authorization": "Bearer admin-token-0123456789abcdef"}
    events = await admin.get("/events?type=taint", headers=auth)
    await events.content.readuntil(b"\n\n")  # the stream's opening frame
    for run in ("run-once", "run-once", "run-once", "run-other"):
        resp = await client.get(LOGS, headers=sre(workspace, run))
        assert resp.status == 200
        await resp.read()
    frames = []
    while not frames or b"run-other" not in frames[-1]:
        frames.append(await asyncio.wait_for(events.content.readuntil(b"\n\n"), 2))
    events.close()
    taints = [f for f in frames if b"event: taint" in f]
    assert [b"run-once" in f for f in taints] == [True, False], frames


# --- README "Shared state": the audit anchor ``redis`` needs a single server --------------------


@pytest.mark.parametrize("state", ["redis+cluster://127.0.0.1:7000", "rediss+cluster://h:7000"])
def test_the_redis_audit_anchor_is_refused_with_a_cluster(state: str) -> None:
    """README: "The audit anchor ``redis`` needs a single server (use ``file:`` or ``exec:``
    in a cluster)": refused at start, naming the setting; a single server is taken."""
    from gateway.config import load_settings
    from gateway.errors import ConfigError

    base = {"policy": "p.yaml", "jwks": "j.json", "audit_anchor": "redis"}
    with pytest.raises(ConfigError, match="--audit-anchor"):
        load_settings({**base, "state": state}, {})
    single = load_settings({**base, "state": "redis://127.0.0.1:6379/0"}, {})
    assert single.audit_anchor is not None and single.audit_anchor.kind == "redis"


# --- README "Calling through capgate": redirects are passed back, never followed ---------------


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
async def test_a_redirect_with_a_location_is_passed_back_never_followed(
    aiohttp_server: Any, serve_gateway: Any, workspace: Workspace, tmp_path: Path, code: int
) -> None:
    """README: "Redirects are passed back, never followed". The older test's mock answered
    302 without a ``Location``, which no client follows; here the upstream sends one, to a
    path of its own that counts its visitors, and to another origin."""
    from aiohttp import web

    from gateway.config import load_settings

    visits: list[str] = []

    async def moved(request: web.Request) -> web.Response:
        visits.append(request.path)
        target = request.query.get("to", "/landing")
        return web.Response(status=code, headers={"Location": target}, text="moved")

    async def landing(request: web.Request) -> web.Response:
        visits.append(request.path)
        return web.Response(text="followed")

    app = web.Application()
    app.router.add_route("*", "/moved", moved)
    app.router.add_route("*", "/landing", landing)
    server = await aiohttp_server(app)
    policy = tmp_path / "redirects.yaml"
    policy.write_text(
        "version: 1\nupstreams:\n"
        f'  up: {{url: "http://127.0.0.1:{server.port}"}}\n'
        'agents: {"*": [r]}\nroles:\n  r:\n    rules:\n'
        "      - {id: get, upstream: up, allow: 'GET /moved', query: {to: {max_length: 200}}}\n"
        "      - {id: post, upstream: up, allow: 'POST /moved', body: {max_size: 1KiB}}\n"
    )
    settings = load_settings(
        {"policy": str(policy), "jwks": str(workspace.jwks), "audit": str(tmp_path / "a.jsonl")},
        {},
    )
    client = await serve_gateway(build_gateway(settings, workspace.environ()))
    auth = bearer(workspace.token("a1", ["r"]))
    elsewhere = f"http://127.0.0.1:{server.port}/landing"
    for method, target, data in (
        ("GET", "/up/moved", None),
        ("GET", "/up/moved?to=" + elsewhere.replace(":", "%3A").replace("/", "%2F"), None),
        ("POST", "/up/moved", b"x"),
    ):
        visits.clear()
        resp = await client.request(method, target, headers=auth, data=data, allow_redirects=False)
        assert resp.status == code, await resp.text()
        assert resp.headers["Location"] in ("/landing", elsewhere)
        assert await resp.text() == "moved"
        assert visits == ["/moved"], f"{method} {target}: the gateway followed to {visits}"


# --- README "Calling through capgate": compressed answers from an upstream with credentials ---

UP_SECRET = "up-secret-4b1d0c7e9a"


def _containers(secret: bytes) -> dict[str, bytes]:
    """The secret inside each compressed container the README names. zstd and 7z have no
    encoder in the standard library: their frames start with the real magic numbers."""
    import bz2
    import io
    import lzma
    import zipfile
    import zlib

    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w", zipfile.ZIP_DEFLATED) as archive:
        # A fixed entry time: a zip stamps its entries with the clock (the control below
        # compares two builds of these bytes, which straddled a second under load).
        entry = zipfile.ZipInfo("creds.txt", date_time=(2024, 1, 1, 0, 0, 0))
        archive.writestr(entry, secret, compress_type=zipfile.ZIP_DEFLATED)
    return {
        "gzip": __import__("gzip").compress(secret, mtime=0),  # (no clock in the bytes)
        **{f"zlib-{level}": zlib.compress(secret, level) for level in (1, 6, 9)},
        "bzip2": bz2.compress(secret),
        "xz": lzma.compress(secret, format=lzma.FORMAT_XZ),
        "zstd": b"\x28\xb5\x2f\xfd\x04\x00" + secret,
        "zip": zipped.getvalue(),
        "7z": b"7z\xbc\xaf\x27\x1c\x00\x04" + secret,
    }


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_compressed_answers_from_an_upstream_with_credentials_are_refused(
    aiohttp_server: Any,
    serve_gateway: Any,
    workspace: Workspace,
    tmp_path: Path,
    streamed: bool,
) -> None:
    """README: "A compressed answer from an upstream with credentials (capgate asks for
    ``identity``; a ``Content-Encoding`` other than identity, or gzip, zlib, bzip2, xz, zstd,
    zip or 7z bytes without one) is refused (502 ``upstream_unavailable``) rather than passed
    on unmasked". Every container, unlabelled, whole and streamed in small chunks (the magic
    split across them); every other coding, labelled; and, as the control, the same bytes from
    an upstream that holds no credential pass byte for byte."""
    from aiohttp import web

    from gateway.config import load_settings

    asked: list[str] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        asked.append(request.headers.get("Accept-Encoding", ""))
        key = request.headers.get("X-Api-Key", "no-key").encode()
        kind = request.match_info["kind"]
        containers = _containers(b'{"token": "' + key + b'"}')
        headers = {"Content-Type": "application/octet-stream"}
        if kind in containers:
            body = containers[kind]
        else:  # a coding named in the header: the bytes need not be of that coding
            body, headers["Content-Encoding"] = key, kind
        if not streamed:
            return web.Response(body=body, headers=headers)
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        for i in range(0, len(body), 3):
            await resp.write(body[i : i + 3])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/{kind}", answer)
    server = await aiohttp_server(app)
    url = f"http://127.0.0.1:{server.port}"
    policy = tmp_path / "coded.yaml"
    policy.write_text(
        "version: 1\nupstreams:\n"
        f'  keyed: {{url: "{url}", credentials: {{type: header, header: X-Api-Key,'
        ' secret: "env:UP_SECRET"}}\n'
        f'  open: {{url: "{url}"}}\n'
        'agents: {"*": [r]}\nroles:\n  r:\n    rules:\n'
        "      - {id: keyed, upstream: keyed, allow: 'GET /{kind}'}\n"
        "      - {id: open, upstream: open, allow: 'GET /{kind}'}\n"
    )
    settings = load_settings(
        {"policy": str(policy), "jwks": str(workspace.jwks), "audit": str(tmp_path / "a.jsonl")},
        {},
    )
    gw = build_gateway(settings, {**workspace.environ(), "UP_SECRET": UP_SECRET})
    client = await serve_gateway(gw)
    auth = bearer(workspace.token("a1", ["r"]))
    kinds = [*_containers(b"x"), "br", "deflate", "compress", "x-custom", "identity, gzip"]
    for kind in kinds:
        resp = await client.get(f"/keyed/{kind}", headers=auth)
        raw = await resp.read()
        assert resp.status == 502, (kind, resp.status, raw[:80])
        assert json.loads(raw)["reason"] == "upstream_unavailable", kind
        assert UP_SECRET.encode() not in raw
    assert asked and set(asked) == {"identity"}, asked
    for kind in _containers(b"x"):
        resp = await client.get(f"/open/{kind}", headers=auth)
        assert resp.status == 200, kind
        assert await resp.read() == _containers(b'{"token": "no-key"}')[kind], kind
