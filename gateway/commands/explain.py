"""``capgate policy explain``: the decision the gateway would make, without sending anything.

It runs the gateway's own stages (``Receive``, ``MatchPolicy``, ``Validate``, with the
protocols the gateway uses) on a call built from the command line, with claims made from
``--role``/``--agent``/``--cap`` instead of a verified token (with ``--agent``, the agent must
be declared and may hold the roles, as in the gateway). Nothing is sent upstream and no
state store is touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

from gateway.call import Call
from gateway.errors import GatewayError, InternalError
from gateway.policy.model import Policy
from gateway.protocols import PROTOCOLS
from gateway.stages.authenticate import admit_agent
from gateway.stages.match_policy import MatchPolicy
from gateway.stages.receive import Receive
from gateway.stages.route import Route
from gateway.stages.validate import Validate
from gateway.tokens import Claims

_ABSOLUTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")


def raw_target_of(url: str) -> str:
    """``http://127.0.0.1:8787/metrics/cpu?x=1`` -> ``/metrics/cpu?x=1``, byte for byte."""
    m = _ABSOLUTE.match(url)
    if m:
        rest = url[m.end() :]
        return rest if rest else "/"
    return url


@dataclass(frozen=True)
class _Fixed:
    """One policy, for the one call explained."""

    policy: Policy


async def explain(
    policy: Policy,
    *,
    roles: list[str],
    agent: str | None,
    method: str,
    url: str,
    caps: list[str] | None = None,
    run: str | None = None,
    headers: list[tuple[str, str]] | None = None,
    body: bytes | None = None,
) -> dict[str, Any]:
    claims = Claims.assumed(
        agent or "explain-agent", roles, caps=caps, run=run, jti="explain", issuer="explain"
    )
    hdrs: CIMultiDict[str] = CIMultiDict(headers or [])
    if body is not None and "Content-Type" not in hdrs:
        hdrs["Content-Type"] = "application/json"
    call = Call(
        method=method.upper(),
        raw_target=raw_target_of(url),
        headers=hdrs,
        request_id="explain",
        body=body if body is not None else b"",
    )
    call.claims = claims
    # With --agent, the policy's word on that agent too (declared, may hold these roles).
    admit = (admit_agent,) if agent is not None else ()
    stages = (Receive(), Route(_Fixed(policy), PROTOCOLS), *admit, MatchPolicy(), Validate())
    try:
        for stage in stages:
            pending = stage(call)
            if pending is not None:
                await pending
    except GatewayError as exc:
        call.error = exc
    except Exception as exc:  # the same fail-closed rule as the gateway
        call.error = InternalError.wrap(exc)
    return decision_of(call)


def decision_of(call: Call) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    findings = call.findings
    if findings.sql_kinds or findings.sql_tables:
        facts["sql"] = {
            "kinds": sorted(findings.sql_kinds),
            "tables": sorted(findings.sql_tables),
            "rewritten": findings.rewritten,
        }
    if call.upstream is not None and call.upstream.kind != "http" and call.operations:
        facts["operations"] = [
            {
                "kind": op.kind,
                "tool": op.tool,
                "rule": op.match.rule.id if op.match is not None else None,
            }
            for op in call.operations
        ]
    out: dict[str, Any] = {
        "decision": "deny" if call.error else "allow",
        "reason": call.error.reason.value if call.error else "allowed",
        "rule": call.rule_id,
        "method": call.method,
        "target": call.raw_target,
        "upstream": call.target.upstream if call.target else None,
    }
    if call.tools:
        out["tool"] = call.tools[0]
    if call.error is not None:
        out["status"] = call.error.status
        out["detail"] = call.error.detail
        if call.error.errors:
            out["errors"] = call.error.errors
    else:
        assert call.match is not None
        rule = call.match.rule
        out["matched"] = rule.describe()
        out["params"] = dict(call.match.params)
        out["approval"] = "required" if rule.approval else "none"
        if call.body is not None and call.findings.rewritten:
            out["forwarded_body"] = call.body.decode("utf-8", "replace")
    if facts:
        out["facts"] = facts
    return out
