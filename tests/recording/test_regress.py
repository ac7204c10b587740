"""Policy regression: the example recording through changed policies."""

from __future__ import annotations

from pathlib import Path

from gateway.commands.regression import policy_test
from gateway.policy.load import load_policy
from gateway.recording.model import Decision, ErrorInfo
from tests.recording.helpers import exchange, write

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "recordings" / "example"
POLICY = (ROOT / "policies" / "example.yaml").read_text()


def changed(tmp_path: Path, text: str) -> object:
    path = tmp_path / "new.yaml"
    path.write_text(text)
    return load_policy(path)


async def test_the_same_policy_changes_nothing(tmp_path: Path) -> None:
    report = await policy_test(changed(tmp_path, POLICY), EXAMPLE)  # type: ignore[arg-type]
    assert report.checked == 4 and report.unchanged == 4 and report.changes == []
    assert report.exit_code() == 0


async def test_allowed_to_denied_and_denied_to_allowed(tmp_path: Path) -> None:
    text = POLICY.replace(
        'window: {enum: ["1m", "5m", "15m"], required: true}',
        'window: {enum: ["1m", "15m"], required: true}',
    )
    # A new rule for the SRE role, right after its last rule.
    anchor = "        rate: 3/hour\n"
    assert anchor in text
    text = text.replace(
        anchor,
        anchor
        + """      - id: delete-service
        upstream: services
        allow: DELETE /services/{name}
""",
        1,
    )
    report = await policy_test(changed(tmp_path, text), EXAMPLE)  # type: ignore[arg-type]
    kinds = {c.recording: c.kind for c in report.changes}
    assert kinds == {
        "runs/example.jsonl#1": "allowed->denied",
        "runs/example.jsonl#4": "denied->allowed",
    }
    [regression] = report.regressions
    assert regression.before == {"decision": "allow", "reason": "allowed", "rule": "read-cpu"}
    assert regression.after["decision"] == "deny" and regression.after["reason"] == "query_invalid"
    assert regression.after["rule"] == "read-cpu"
    [loosened] = report.of_kind("denied->allowed")
    assert loosened.after["rule"] == "delete-service" and loosened.roles == ("sre-diagnostics",)
    assert report.exit_code() == 1 and report.exit_code(allow_regressions=True) == 0
    text_report = report.text()
    assert "1 allowed->denied, 1 denied->allowed" in text_report
    assert (
        "runs/example.jsonl#1 GET metrics /metrics/cpu?window=5m: "
        "allow (allowed) by rule 'read-cpu' -> deny (query_invalid)" in text_report
    )
    assert report.as_dict()["changed"]["allowed->denied"] == 1


async def test_rule_changes_and_skipped_calls(tmp_path: Path) -> None:
    text = POLICY.replace("id: read-app-logs", "id: read-logs-v2")
    report = await policy_test(changed(tmp_path, text), EXAMPLE)  # type: ignore[arg-type]
    [change] = report.changes
    assert change.kind == "rule changed" and change.after["rule"] == "read-logs-v2"
    assert report.exit_code() == 0
    limited = exchange(1, "/metrics/cpu?window=5m", b"", upstream="metrics", kind="denial")
    limited.decision = Decision(False, "rate_limited", "read-cpu", 429)
    anonymous = exchange(2, "/metrics/cpu?window=5m", b"{}", upstream="metrics", roles=())
    anonymous.error = ErrorInfo("upstream_timeout", 504, "slow")
    directory = write(tmp_path / "rec", limited, anonymous)
    report = await policy_test(changed(tmp_path, POLICY), directory)  # type: ignore[arg-type]
    assert report.exit_code() == 1  # it checked nothing: that is no pass
    assert report.checked == 0 and [s["why"] for s in report.skipped] == [
        "decided by rate_limited, not by the rules",
        "no roles recorded for this call",
    ]
