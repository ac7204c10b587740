"""validate: run the payload checks the rule names (JSON Schema, SQL, MCP), in order."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.call import Call


async def validate(call: Call, gw: Gateway) -> None:
    assert call.match is not None and call.upstream is not None
    checks = call.match.rule.checks
    if not checks:
        return
    await call.read_body(call.upstream.max_request_body)
    for check in checks:
        check.check(call)
