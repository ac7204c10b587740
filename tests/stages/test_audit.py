"""audit: one closed record per ended call, told to every observer; one failing observer
neither changes the answer nor keeps the others from being told."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from gateway.audit_record import AuditRecord, BodyMac
from gateway.call import Call
from gateway.errors import GatewayError
from gateway.policy.model import Policy
from gateway.stages.audit import Audit, audit_record
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
