"""audit: one closed record per ended call, told to every observer; one failing observer
neither changes the answer nor keeps the others from being told."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.audit_record import AuditRecord, BodyMac
from gateway.call import Call
from gateway.errors import ClientClosed, GatewayError, UpstreamTimeout, UpstreamUnavailable
from gateway.policy.model import Policy
from gateway.stages.audit import Audit, audit_record, audit_records
from gateway.stages.validate import Validate
from gateway.testing import CollectingObserver, make_call, matching, run_stages

SECRET = "hunter2-do-not-write"


async def checked(policy: Policy, call: Call) -> Call:
    try:
        await run_stages(call, *matching(policy), Validate())
    except GatewayError as exc:
        call.error = exc
    return call


class Broken:
    def call_ended(self, call: Call, records: Sequence[AuditRecord]) -> None:
        raise OSError("disk full")


async def test_every_observer_is_told_even_after_one_fails(
    policy: Policy, caplog: pytest.LogCaptureFixture
) -> None:
    call = await checked(
        policy,
        make_call(
            "POST",
            "/db/query",
            headers={"X-Leak": SECRET},
            body=json.dumps({"sql": f"SELECT id FROM orders WHERE status = '{SECRET}'"}).encode(),
            roles=["analyst"],
        ),
    )
    first, last = CollectingObserver(), CollectingObserver()
    Audit(BodyMac(b"k" * 32), [first, Broken(), last])(call)
    assert len(first.records) == len(last.records) == 1
    assert "Broken failed" in caplog.text
    [record] = last.records
    assert record is first.records[0]
    text = json.dumps(record)
    assert SECRET not in text and "SELECT" not in text
    assert record["sql"] == {"kinds": ["select"], "tables": ["orders"]}
    assert record["request_body"]["size"] > 0


async def test_the_record_is_a_closed_set_of_fields(policy: Policy) -> None:
    call = await checked(policy, make_call("GET", f"/svc/status?verbose={SECRET}", roles=["ops"]))
    record = audit_record(call, BodyMac(None))
    assert record["query"] == ["verbose"] and SECRET not in json.dumps(record)
    # Every key the record may have is declared; none other can be built (mypy) or written.
    assert set(record) <= set(AuditRecord.__annotations__)
    assert set(AuditRecord.__annotations__) == {
        "v", "time", "request_id", "agent", "jti", "run", "upstream", "method", "path", "rule",
        "decision", "reason", "status", "duration_ms", "query", "request_body", "response_body",
        "sql", "mcp", "approval", "operator", "state_error_allowed", "fault",
    }  # fmt: skip
    assert (record["rule"], record["decision"], record["reason"]) == (
        "status",
        "deny",
        "query_invalid",
    )


def test_agent_controlled_names_are_kept_only_when_plain() -> None:
    mac = BodyMac(b"k" * 32)
    assert mac.label("get_order") == "get_order"
    odd = mac.label("name with spaces and a 's3cret'")
    assert odd.startswith("~") and "s3cret" not in odd and len(odd) == 17
    assert mac.label("x" * 500).startswith("~")
    # Keyed: without the key, the digest of a guessed name cannot be recomputed.
    assert BodyMac(b"j" * 32).label("a b") != mac.label("a b")


# --- the ended call's record, completed from its decision's ----------------------------------


class _Decisions:
    def __init__(self) -> None:
        self.records: list[AuditRecord] = []

    def call_decided(self, call: Call, records: Sequence[AuditRecord]) -> None:
        self.records.extend(records)
        call.audit_decided = True


_ENDINGS = st.fixed_dictionaries(
    {
        "error": st.sampled_from(
            [None, UpstreamTimeout("slow"), UpstreamUnavailable("gone"), ClientClosed("bye")]
        ),
        "answered": st.booleans(),
        "status": st.sampled_from([None, 200, 404, 502, 504]),
        "digest": st.booleans(),
        "operator": st.sampled_from([None, "alice", "bob@example.org"]),
        "fault": st.sampled_from([None, "latency 10s", "status 503"]),
    }
)
_ALLOWED = [
    ("GET", "/svc/status?verbose=1", None, ["ops"]),
    ("POST", "/svc/restart", b'{"service": "web"}', ["ops"]),
    ("POST", "/db/query", b'{"sql": "SELECT id FROM orders"}', ["analyst"]),
]


@settings(max_examples=200, deadline=None)
@given(which=st.sampled_from(_ALLOWED), end=_ENDINGS)
async def test_an_ended_record_completed_from_the_decision_equals_one_built_afresh(
    policy: Policy, which: tuple[str, str, bytes | None, list[str]], end: dict[str, Any]
) -> None:
    # The end of a call rebuilds nothing it read at the decision: whatever happens after
    # (an upstream error, the agent hanging up, a person's stop, an injected fault), the line
    # written equals the record the whole call would give if built from scratch.
    method, target, body, roles = which
    headers = {"X-Env": "prod"} if target == "/svc/restart" else None
    call = await checked(policy, make_call(method, target, body=body, roles=roles, headers=headers))
    assert call.error is None
    mac = BodyMac(b"k" * 32)
    decisions = _Decisions()
    audit = Audit(mac, [CollectingObserver()], decisions)
    assert audit.decided(call) is None and call.decided_records is not None
    call.error = end["error"]
    call.response = object() if end["answered"] else None  # type: ignore[assignment]
    call.status = end["status"]
    call.response_digest = mac.of(b"answer") if end["digest"] else None
    call.operator = end["operator"]
    call.fault = end["fault"]
    [completed] = audit_records(call, mac)
    call.decided_records = None
    afresh = audit_record(call, mac)
    completed.pop("duration_ms")
    afresh.pop("duration_ms")
    assert completed == afresh
    assert decisions.records[0] is not completed  # the decision line's record is untouched
