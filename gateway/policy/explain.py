"""``capgate policy explain``: the decision the gateway would make, without sending anything.

It runs the same stages as the gateway (``receive``, ``match_policy``, ``validate``) on a
call built from the command line, with claims made from ``--role``/``--agent``/``--cap``
instead of a verified token. Nothing is sent upstream and no state store is touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

from gateway.call import Call
from gateway.checks.mcp import McpGate
from gateway.errors import GatewayError, InternalError
from gateway.policy.model import Policy
from gateway.stages.match_policy import match_policy
from gateway.stages.receive import receive
from gateway.stages.validate import validate
from gateway.tokens import Claims

_ABSOLUTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")


def raw_target_of(url: str) -> str:
    """``http://127.0.0.1:8787/metrics/cpu?x=1`` -> ``/metrics/cpu?x=1``, byte for byte."""
    m = _ABSOLUTE.match(url)
    if m:
        rest = url[m.end() :]
        return rest if rest else "/"
    return url


@dataclass
class _ExplainGateway:
    """The parts of ``Gateway`` the policy stages read."""

    policy: Policy
    mcp: Any = None


async def explain(
    policy: Policy,
    *,
    roles: list[str],
    agent: str,
    method: str,
    url: str,
    caps: list[str] | None = None,
    run: str | None = None,
    headers: list[tuple[str, str]] | None = None,
    body: bytes | None = None,
) -> dict[str, Any]:
    claims = Claims(
        agent=agent,
        jti="explain",
        roles=tuple(roles),
        caps=frozenset(caps) if caps is not None else None,
        run=run,
        issuer="explain",
        audience=("explain",),
        issued_at=0,
        not_before=0,
        expires_at=0,
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
    gw = _ExplainGateway(policy=policy)
    gw.mcp = McpGate(gw)
    try:
        await receive(call, gw)  # type: ignore[arg-type]
        await match_policy(call, gw)  # type: ignore[arg-type]
        await validate(call, gw)  # type: ignore[arg-type]
    except GatewayError as exc:
        call.error = exc
    except Exception as exc:  # the same fail-closed rule as the gateway
        call.error = InternalError.wrap(exc)
    return decision_of(call)


def decision_of(call: Call) -> dict[str, Any]:
    facts = {k: v for k, v in call.facts.items() if k not in ("json", "mcp")}
    if "mcp" in call.facts:
        facts["mcp"] = [
            {"id": m.id, "method": m.method, "tool": m.tool} for m in call.facts["mcp"]["messages"]
        ]
    out: dict[str, Any] = {
        "decision": "deny" if call.error else "allow",
        "reason": call.error.reason.value if call.error else "allowed",
        "rule": call.rule_id,
        "method": call.method,
        "target": call.raw_target,
        "upstream": call.target.upstream if call.target else None,
    }
    if call.tool is not None:
        out["tool"] = call.tool
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
        if call.body is not None and call.facts.get("sql", {}).get("rewritten"):
            out["forwarded_body"] = call.body.decode("utf-8", "replace")
    if facts:
        out["facts"] = facts
    return out
