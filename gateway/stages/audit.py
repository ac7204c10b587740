"""audit: the call's closed ``AuditRecord``, handed to the audit trail and the trace span."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateway.audit_record import MAX_PATH, AuditRecord, BodyMac, names, timestamp

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.call import Call


def audit_record(call: Call, mac: BodyMac) -> AuditRecord:
    """The facts of an ended call that may be written down: ids, names, decisions, digests."""
    claims = call.claims
    target = call.target
    err = call.error
    if target is not None:
        path = "/" + target.upstream + target.rest
        query = names(mac, (name for name, _ in target.query_pairs))
    else:
        path = call.raw_target.partition("?")[0]
        query = ()
    request_body = call.request_digest
    if request_body is None and call.body is not None:
        request_body = mac.of(call.body)
    sql = call.facts.get("sql") if call.error is None else None
    mcp = call.facts.get("mcp")
    tools = (
        names(mac, (m.tool for m in mcp["messages"] if m.tool is not None))
        if isinstance(mcp, dict)
        else ()
    )
    return AuditRecord(
        time=timestamp(call.wall_started),
        request_id=call.request_id,
        agent=claims.agent if claims else None,
        jti=claims.jti if claims else None,
        run=claims.run if claims else None,
        upstream=target.upstream if target else None,
        method=mac.label(call.method),
        path=path[:MAX_PATH],
        query=query,
        rule=call.rule_id,
        decision="deny" if err is not None and call.response is None else "allow",
        reason=err.reason.value if err is not None else "allowed",
        status=call.status,
        duration_ms=round((time.monotonic() - call.started) * 1000, 3),
        request_body=request_body,
        response_body=call.response_digest,
        sql_kinds=names(mac, sql["kinds"]) if sql else (),
        sql_tables=names(mac, sql["tables"]) if sql else (),
        tools=tools,
        approval=call.approval,
        state_error_allowed=call.state_error_allowed,
    )


def audit(call: Call, gw: Gateway) -> None:
    record = audit_record(call, gw.mac)
    gw.telemetry.record(call, record)
    gw.audit.append(record.as_json())
