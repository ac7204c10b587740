"""audit: the ended call's closed ``AuditRecord``, handed to every observer.

The observers (the audit trail, trace spans, the recorder of denials, ...) are listed once,
in ``app.py``. Each is told of every call, allowed or denied; one observer's failure is
logged and never changes the answer or keeps the others from being told.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Sequence

from gateway.audit_record import (
    AUDIT_RECORD_VERSION,
    MAX_PATH,
    AuditRecord,
    BodyMac,
    McpSummary,
    milliseconds,
    names,
    timestamp,
)
from gateway.call import Call, CallObserver, DecisionLog
from gateway.errors import GatewayError
from gateway.policy.spec import METHODS

log = logging.getLogger("capgate")
# Methods written as they are; any other (agent-chosen) method token goes through the label.
STANDARD_METHODS = frozenset(METHODS) | {"CONNECT", "TRACE"}


def audit_record(call: Call, mac: BodyMac) -> AuditRecord:
    """The facts of an ended call that may be written down: ids, names, decisions, digests."""
    claims = call.claims
    target = call.target
    err = call.error
    method = call.method
    if target is not None:
        path = "/" + target.upstream + target.rest
    else:
        path = call.raw_target.partition("?")[0]
    record: AuditRecord = {
        "v": AUDIT_RECORD_VERSION,
        "time": timestamp(call.wall_started),
        "request_id": call.request_id,
        "agent": claims.agent if claims else None,
        "jti": claims.jti if claims else None,
        "run": claims.run if claims else None,
        "upstream": target.upstream if target else None,
        "method": method if method in STANDARD_METHODS else mac.label(method),
        "path": path[:MAX_PATH],
        "rule": call.rule_id,
        "decision": "deny" if err is not None and call.response is None else "allow",
        "reason": err.reason.value if err is not None else "allowed",
        "status": call.status,
        "duration_ms": milliseconds(time.monotonic() - call.started),
    }
    if target is not None and target.query_pairs:
        record["query"] = names(mac, [name for name, _ in target.query_pairs])
    if call.body is not None:
        digest = call.request_digest
        if digest is None:  # once per call: the decision line and the ended call share it
            digest = call.request_digest = mac.of(call.body)
        record["request_body"] = digest
    if call.response_digest is not None:
        record["response_body"] = call.response_digest
    findings = call.findings
    if findings.sql_kinds or findings.sql_tables:
        record["sql"] = {
            "kinds": names(mac, sorted(findings.sql_kinds)),
            "tables": names(mac, sorted(findings.sql_tables)),
        }
    if call.approval is not None:
        record["approval"] = call.approval
    if call.operator is not None:
        record["operator"] = call.operator
    if call.state_error_allowed:
        record["state_error_allowed"] = True
    if call.fault is not None:
        record["fault"] = call.fault
    return record


def _ended(decided: AuditRecord, call: Call) -> AuditRecord:
    """The record of an ended call from its decision's record: only what can change once a
    call has been decided is read again (how it ended, its answer, who or what cut it)."""
    err = call.error
    record = decided.copy()
    record["decision"] = "deny" if err is not None and call.response is None else "allow"
    record["reason"] = err.reason.value if err is not None else "allowed"
    record["status"] = call.status
    record["duration_ms"] = milliseconds(time.monotonic() - call.started)
    if call.response_digest is not None:
        record["response_body"] = call.response_digest
    if call.operator is not None:
        record["operator"] = call.operator
    if call.fault is not None:
        record["fault"] = call.fault
    return record


def audit_records(call: Call, mac: BodyMac) -> list[AuditRecord]:
    """One record per operation of an MCP call (the message's method, what it acts on, the
    rule that allowed it or none), sharing the request id; one record for any other call.

    An HTTP call whose decision was written is completed from that record, not rebuilt
    (``tests/stages/test_audit_stage.py`` proves both readings equal)."""
    decided = call.decided_records
    if decided is not None:
        return [_ended(decided[0], call)]
    base = audit_record(call, mac)
    ops = call.operations
    for op in ops:
        if op.rpc is not None:
            break
    else:  # no JSON-RPC message: one record
        return [base]
    out: list[AuditRecord] = []
    for op in ops:
        record = base.copy()
        if op.rpc is not None:
            summary: McpSummary = {"method": mac.label(op.rpc)}
            if op.subject is not None:
                summary["name"] = mac.label(op.subject[1])
            record["mcp"] = summary
        # A protocol message is allowed by the endpoint, not by a rule it used.
        used = op.match is not None and (op.governed or op.subject is not None)
        record["rule"] = op.match.rule.id if used and op.match is not None else None
        if call.error is not None and call.error.rule is not None and not used:
            record["rule"] = call.error.rule
        out.append(record)
    return out


class Audit:
    def __init__(
        self,
        mac: BodyMac,
        observers: Sequence[CallObserver],
        decisions: DecisionLog | None = None,
    ) -> None:
        self.mac = mac
        self.observers = tuple(observers)
        self.failures: dict[CallObserver, int] = {}  # calls each observer failed (metrics)
        self.decisions = decisions

    def decided(self, call: Call) -> Awaitable[None] | None:
        """Before an allowed call is forwarded: its decision is written (durably, when the
        trail says so), or the call is refused with ``audit_unavailable`` (fail closed)."""
        if self.decisions is None:
            return None
        # The response's digest is made under the key of this decision line, even when the
        # audit key changes while the call is forwarded (``BodyMac.under``).
        call.audit_key = self.mac.kid
        records = audit_records(call, self.mac)
        if len(records) == 1 and "mcp" not in records[0]:
            call.decided_records = records
        try:
            pending = self.decisions.call_decided(call, records)
        except GatewayError as exc:
            call.error = exc
            if not call.audit_decided:
                # No line written: the refusal's own line, later, digests under the key in
                # force then (the audit key may change in between).
                call.request_digest = call.audit_key = None
                call.decided_records = None
            return None
        return None if pending is None else _settled(call, pending)

    def __call__(self, call: Call) -> None:
        if not self.observers:
            return
        records = audit_records(call, self.mac)
        for observer in self.observers:
            try:
                observer.call_ended(call, records)
            except Exception:
                self.failures[observer] = self.failures.get(observer, 0) + 1
                log.exception("%s failed for request %s", type(observer).__name__, call.request_id)


async def _settled(call: Call, pending: Awaitable[None]) -> None:
    try:
        await pending
    except GatewayError as exc:
        call.error = exc
