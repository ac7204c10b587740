"""Every MCP message governed by the policy: tools, prompts, resources, completions, methods,
the agent's answers to the server, sessions; refusals in the shapes clients use."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from gateway.call import Call
from gateway.errors import BodyInvalid, McpDenied, McpSessionUnknown, ToolDenied
from gateway.policy.model import Policy
from gateway.policy_file import PolicyError
from gateway.protocols import PROTOCOLS
from gateway.protocols.mcp import Allowed, Mcp, ResponseScan, jsonrpc_error_body
from gateway.stages.validate import Validate
from gateway.testing import make_call, matching, policy_from_text, run_stages

POLICY = """
version: 1
agents: {"*": [reader, other]}
upstreams:
  tools: {url: "http://127.0.0.1:9", kind: mcp}
  kind-tools: {url: "http://127.0.0.1:9", kind: mcp, mcp: {tool_refusals: result}}
  api: {url: "http://127.0.0.1:9"}
roles:
  reader:
    rules:
      - {id: t-echo, upstream: tools, allow: POST /mcp, tool: echo}
      - id: p-greet
        upstream: tools
        allow: POST /mcp
        prompt: greet
        arguments:
          type: object
          properties: {name: {type: string, maxLength: 20}}
          additionalProperties: false
      - {id: r-static, upstream: tools, allow: POST /mcp, resource: "test://static/resource"}
      - id: r-docs
        upstream: tools
        allow: POST /mcp
        resource:
          uri: "test://docs/{name}.md"
          params: {name: {regex: "[a-z]{1,10}"}}
      - {id: m-log, upstream: tools, allow: POST /mcp, method: logging/setLevel}
      - {id: m-roots, upstream: tools, allow: POST /mcp, method: roots/list}
      - {id: k-echo, upstream: kind-tools, allow: POST /mcp, tool: echo}
  other:
    rules:
      - {id: o-echo, upstream: tools, allow: POST /mcp, tool: echo}
"""


@pytest.fixture(scope="module")
def policy() -> Policy:
    return policy_from_text(POLICY)


@pytest.fixture
def mcp() -> Mcp:
    protocol = PROTOCOLS["mcp"]
    assert isinstance(protocol, Mcp)
    return protocol


def rpc(msg_id: int | None, method: str, **params: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
    if msg_id is not None:
        msg["id"] = msg_id
    return msg


def post(payload: Any, roles: tuple[str, ...] = ("reader",), **headers: str) -> Call:
    return make_call(
        "POST",
        "/tools/mcp",
        body=json.dumps(payload).encode(),
        roles=roles,
        headers=headers,
    )


async def decide(policy: Policy, call: Call) -> Call:
    return await run_stages(call, *matching(policy), Validate())


def rules(call: Call) -> list[str | None]:
    return [op.match.rule.id if op.match is not None else None for op in call.operations]


async def test_prompts_by_name_with_their_arguments_checked(policy: Policy) -> None:
    call = await decide(policy, post(rpc(1, "prompts/get", name="greet", arguments={"name": "x"})))
    assert rules(call) == ["p-greet"]
    with pytest.raises(McpDenied, match="arguments of prompt 'greet'"):
        await decide(policy, post(rpc(1, "prompts/get", name="greet", arguments={"other": 1})))
    with pytest.raises(McpDenied, match="the prompt 'secret'"):
        await decide(policy, post(rpc(1, "prompts/get", name="secret")))


@pytest.mark.parametrize(
    "method", ["resources/read", "resources/subscribe", "resources/unsubscribe"]
)
async def test_resources_by_uri_pattern(policy: Policy, method: str) -> None:
    call = await decide(policy, post(rpc(1, method, uri="test://static/resource")))
    assert rules(call) == ["r-static"]
    call = await decide(policy, post(rpc(1, method, uri="test://docs/intro.md")))
    assert rules(call) == ["r-docs"]


@pytest.mark.parametrize(
    "uri",
    [
        "test://static/resource/",  # a different resource
        "test://static/resourcex",
        "test://docs/INTRO.md",  # breaks the parameter's constraint
        "test://docs/../secrets.md",  # no dot segment or separator inside a parameter
        "test://docs/a%2F..%2Fb.md",  # no escape either
        "test://docs/.md",
        "test://docs/intro.md?x=1",
        "file:///etc/passwd",
    ],
)
async def test_resources_outside_the_patterns_are_refused(policy: Policy, uri: str) -> None:
    with pytest.raises(McpDenied):
        await decide(policy, post(rpc(1, "resources/read", uri=uri)))


async def test_completions_ride_on_the_prompt_or_resource_they_complete(policy: Policy) -> None:
    ok = rpc(1, "completion/complete", ref={"type": "ref/prompt", "name": "greet"},
             argument={"name": "name", "value": "a"})  # fmt: skip
    call = await decide(policy, post(ok))
    assert rules(call) == ["p-greet"] and not call.operations[0].governed
    template = rpc(
        1,
        "completion/complete",
        ref={"type": "ref/resource", "uri": "test://docs/{name}.md"},
        argument={"name": "name", "value": "i"},
    )
    assert rules(await decide(policy, post(template))) == ["r-docs"]
    other = rpc(1, "completion/complete", ref={"type": "ref/prompt", "name": "secret"},
                argument={"name": "n", "value": ""})  # fmt: skip
    with pytest.raises(McpDenied):
        await decide(policy, post(other))
    with pytest.raises(BodyInvalid):
        await decide(policy, post(rpc(1, "completion/complete", ref={"type": "ref/other"})))


async def test_methods_need_a_rule_naming_them(policy: Policy) -> None:
    assert rules(await decide(policy, post(rpc(1, "logging/setLevel", level="debug")))) == ["m-log"]
    with pytest.raises(McpDenied, match="logging/setLevel"):
        await decide(policy, post(rpc(1, "logging/setLevel", level="debug"), roles=("other",)))
    with pytest.raises(McpDenied, match="not one capgate can govern"):
        await decide(policy, post(rpc(1, "tasks/run")))


async def test_handshake_listings_and_notifications_are_allowed_by_the_endpoint(
    policy: Policy,
) -> None:
    for method in ("initialize", "ping", "tools/list", "prompts/list", "resources/list",
                   "resources/templates/list"):  # fmt: skip
        call = await decide(policy, post(rpc(1, method)))
        assert [op.kind for op in call.operations] == ["protocol"]
    call = await decide(policy, post(rpc(None, "notifications/initialized")))
    assert call.operations[0].kind == "protocol"


async def test_answers_only_to_requests_the_server_made(policy: Policy, mcp: Mcp) -> None:
    mcp.bind_session("s-answers", "test-agent")
    answer = {"jsonrpc": "2.0", "id": 99, "result": {"roots": []}}
    with pytest.raises(McpDenied, match="did not make"):
        await decide(policy, post(answer, **{"Mcp-Session-Id": "s-answers"}))
    # The server asked roots/list with id 99 on this session's stream:
    scan = ResponseScan({}, None, mcp._remember_server_request("s-answers"))
    scan.message({"jsonrpc": "2.0", "id": 99, "method": "roots/list"})
    call = await decide(policy, post(answer, **{"Mcp-Session-Id": "s-answers"}))
    assert rules(call) == ["m-roots"]
    # Another session's answer with the same id is not that answer.
    mcp.bind_session("s-other", "test-agent")
    with pytest.raises(McpDenied):
        await decide(policy, post(answer, **{"Mcp-Session-Id": "s-other"}))
    # An answer to sampling: the server may ask, but no rule lets this agent answer it.
    scan.message({"jsonrpc": "2.0", "id": 100, "method": "sampling/createMessage"})
    sampled = {"jsonrpc": "2.0", "id": 100, "result": {}}
    with pytest.raises(McpDenied, match="sampling/createMessage"):
        await decide(policy, post(sampled, **{"Mcp-Session-Id": "s-answers"}))


async def test_sessions_belong_to_the_agent_that_opened_them(policy: Policy, mcp: Mcp) -> None:
    mcp.bind_session("s-owned", "test-agent")
    await decide(policy, post(rpc(1, "ping"), **{"Mcp-Session-Id": "s-owned"}))
    foreign = make_call(
        "POST", "/tools/mcp", body=json.dumps(rpc(1, "ping")).encode(), roles=("reader",),
        agent="intruder", headers={"Mcp-Session-Id": "s-owned"},
    )  # fmt: skip
    with pytest.raises(McpDenied, match="another agent"):
        await decide(policy, foreign)
    with pytest.raises(McpSessionUnknown):
        await decide(policy, post(rpc(1, "ping"), **{"Mcp-Session-Id": "never-opened"}))
    with pytest.raises(McpDenied):
        mcp.bind_session("s-owned", "intruder")  # a server handing out another's session


async def test_batches_need_the_upstream_to_take_them(policy: Policy) -> None:
    with pytest.raises(McpDenied, match="batches"):
        await decide(policy, post([rpc(1, "ping"), rpc(2, "ping")]))


async def test_refused_tool_calls_as_tool_results_when_the_upstream_says_so(
    policy: Policy,
) -> None:
    msg = rpc(5, "tools/call", name="delete_all")
    call = make_call("POST", "/kind-tools/mcp", body=json.dumps(msg).encode(), roles=("reader",))
    with pytest.raises(ToolDenied) as info:
        await decide(policy, call)
    body = json.loads(jsonrpc_error_body(call, info.value) or b"")
    assert body["id"] == 5 and body["result"]["isError"] is True
    assert "tool_denied" in body["result"]["content"][0]["text"]
    # The default: a JSON-RPC error carrying the problem's fields.
    plain = post(msg)
    with pytest.raises(ToolDenied) as info:
        await decide(policy, plain)
    body = json.loads(jsonrpc_error_body(plain, info.value) or b"")
    assert body["error"]["data"]["reason"] == "tool_denied"


def test_listings_are_filtered_to_what_the_token_may_use(policy: Policy) -> None:
    call = make_call("POST", "/tools/mcp", roles=("reader",))
    call.policy = policy
    from gateway.target import parse_target

    call.target = parse_target("/tools/mcp")
    allowed = Allowed.of(call)
    assert allowed.lists("tools/list", "echo") and not allowed.lists("tools/list", "rm")
    assert allowed.lists("prompts/list", "greet") and not allowed.lists("prompts/list", "x")
    assert allowed.lists("resources/list", "test://docs/intro.md")
    assert not allowed.lists("resources/list", "test://docs/Intro.md")
    assert allowed.lists("resources/templates/list", "test://docs/{name}.md")
    assert not allowed.lists("resources/templates/list", "test://other/{x}")


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("{id: x, upstream: api, allow: GET /x, prompt: p}", "needs an upstream of kind mcp"),
        ("{id: x, upstream: tools, allow: POST /mcp, tool: a, prompt: b}", "names one of"),
        ("{id: x, upstream: tools, allow: POST /mcp, method: tools/call}", "expected one of"),
        (
            "{id: x, upstream: tools, allow: POST /mcp, method: elicitation/create}",
            "approval: required",
        ),
        ("{id: x, upstream: tools, allow: POST /mcp, resource: '{a}{b}'}", "literal text"),
        ("{id: x, upstream: tools, allow: POST /mcp, resource: 't://{a}/{a}'}", "appears twice"),
        (
            "{id: x, upstream: tools, allow: POST /mcp,"
            " resource: {uri: 't://{a}', params: {b: [x]}}}",
            "not a parameter",
        ),
        ("{id: x, upstream: tools, allow: POST /mcp, arguments: {type: object}}", "'prompt'"),
    ],
)
def test_policy_errors_for_mcp_rules(rule: str, message: str) -> None:
    text = f"""
version: 1
agents:
  "*": [r]
upstreams:
  tools: {{url: "http://127.0.0.1:9", kind: mcp}}
  api: {{url: "http://127.0.0.1:9", mcp: {{batches: true}}}}
roles:
  r:
    rules:
      - {rule}
"""
    with pytest.raises(PolicyError) as info:
        policy_from_text(text)
    issues = "\n".join(str(i) for i in info.value.issues)
    assert message in issues, issues
    assert "only for an upstream of kind mcp" in issues


def test_approval_patience_of_an_mcp_upstream() -> None:
    def upstreams(options: str) -> str:
        return f"""
version: 1
agents: {{"*": [r]}}
upstreams:
  tools: {{url: "http://127.0.0.1:9", kind: mcp{options}}}
roles:
  r:
    rules:
      - {{id: x, upstream: tools, allow: POST /mcp, tool: echo}}
"""

    assert policy_from_text(upstreams("")).upstreams["tools"].mcp_approval_patience == 25.0
    patient = policy_from_text(upstreams(", mcp: {approval_patience: 300ms}"))
    assert patient.upstreams["tools"].mcp_approval_patience == 0.3
    for bad, message in (("0s", "greater than zero"), ("soon", "approval_patience")):
        with pytest.raises(PolicyError) as info:
            policy_from_text(upstreams(f", mcp: {{approval_patience: {bad}}}"))
        issues = "\n".join(str(i) for i in info.value.issues)
        assert message in issues, issues


def test_approval_keepalive_of_an_mcp_upstream() -> None:
    def upstreams(options: str) -> str:
        return f"""
version: 1
agents: {{"*": [r]}}
upstreams:
  tools: {{url: "http://127.0.0.1:9", kind: mcp{options}}}
roles:
  r:
    rules:
      - {{id: x, upstream: tools, allow: POST /mcp, tool: echo}}
"""

    def keepalive(options: str) -> float | None:
        return policy_from_text(upstreams(options)).upstreams["tools"].mcp_approval_keepalive

    assert keepalive("") == 15.0
    assert keepalive(", mcp: {approval_patience: 1m}") == 15.0
    assert keepalive(", mcp: {approval_keepalive: 200ms}") == 0.2
    assert keepalive(", mcp: {approval_keepalive: 2}") == 2.0
    assert keepalive(", mcp: {approval_keepalive: none}") is None
    for bad, message in (
        ("0s", "at least 100ms"),
        ("50ms", "at least 100ms"),
        ("soon", "approval_keepalive"),
        ("off", "approval_keepalive"),
    ):
        with pytest.raises(PolicyError) as info:
            policy_from_text(upstreams(f", mcp: {{approval_keepalive: {bad}}}"))
        issues = "\n".join(str(i) for i in info.value.issues)
        assert message in issues, issues
        assert re.search(r":\d+:\d+", issues), issues  # FILE:LINE:COL
