"""audit: one line per call, allowed or denied, written after the response."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.call import Call

MAX_PATH_IN_AUDIT = 512


_second: list[Any] = [None, ""]  # (whole second, its formatted text): one strftime a second


def _timestamp(t: float) -> str:
    whole = int(t)
    if _second[0] != whole:
        _second[0] = whole
        _second[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{_second[1]}.{int((t - whole) * 1000):03d}Z"


def audit_record(call: Call) -> dict[str, Any]:
    """The audit line's fields: who, what, which rule, the decision and why. No secrets."""
    claims = call.claims
    target = call.target
    err = call.error
    path = target.upstream and ("/" + target.upstream + target.rest) if target else None
    if path is None:
        path = call.raw_target.partition("?")[0]
    record: dict[str, Any] = {
        "time": _timestamp(call.wall_started),
        "request_id": call.request_id,
        "agent": claims.agent if claims else None,
        "jti": claims.jti if claims else None,
        "run": claims.run if claims else None,
        "upstream": target.upstream if target else None,
        "method": call.method,
        "path": path[:MAX_PATH_IN_AUDIT],
        "rule": call.rule_id,
        "decision": "deny" if err is not None and call.response is None else "allow",
        "reason": err.reason.value if err is not None else "allowed",
        "status": call.status,
        "duration_ms": round((time.monotonic() - call.started) * 1000, 3),
    }
    if call.tool is not None:
        record["tool"] = call.tool
    if call.facts:
        record["facts"] = call.facts
    return record


def audit(call: Call, gw: Gateway) -> None:
    record = audit_record(call)
    gw.telemetry.record(call, record)  # before append: the trail adds its hash chain field
    gw.audit.append(record)
