"""Policy regression on real traffic: recorded calls through a new policy, nothing sent.

``policy_test(policy, dir)`` takes every recorded call, allowed or denied, and asks the new
policy for its decision with ``gateway.commands.explain.explain``: the same stages the gateway
runs (target, rule match, payload checks), with the roles, caps, agent and run recorded from
the call's token. It reports every decision that changes:

=====================  ====================================================================
``allowed->denied``    a regression: the new policy refuses a call agents made and got
``denied->allowed``    a loosening: the new policy lets through a call that was refused
``rule changed``       still allowed, by another rule
``reason changed``     still denied, for another reason (e.g. ``no_rule`` -> ``sql_denied``)
=====================  ====================================================================

Calls decided by something other than the policy rules cannot be re-decided from a
recording and are listed as skipped: token failures, rate limits and quotas, approvals, the
state store, internal errors. Recorded bodies are redacted, so a check that looks at a
password field sees ``[redacted:key]``; such calls are rare and show up as changes to look at.

``RegressionReport.exit_code(allow_regressions)`` is 1 when an allowed call becomes denied
(unless allowed) or when no call could be checked (a recording imported from HAR without
``--agent/--role`` has no roles: every call is skipped), else 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.commands.explain import explain
from gateway.recording.model import Entry
from gateway.recording.reader import load_recording
from gateway.recording.redact import HeaderValue

if TYPE_CHECKING:
    from gateway.policy.model import Policy

NOT_POLICY_REASONS = frozenset(
    {
        "token_missing",
        "token_invalid",
        "token_expired",
        "token_revoked",
        "rate_limited",
        "quota_exhausted",
        "attempts_limited",
        "concurrency_limited",
        "approval_denied",
        "approval_timeout",
        "state_unavailable",
        "internal_error",
        "replay_miss",
    }
)
"""Denials a policy file does not decide alone; not comparable from a recording."""


def _text(value: HeaderValue) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class Change:
    kind: str  # allowed->denied | denied->allowed | rule changed | reason changed
    recording: str
    call: str
    agent: str | None
    roles: tuple[str, ...]
    before: dict[str, Any]
    after: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "recording": self.recording,
            "call": self.call,
            "agent": self.agent,
            "roles": list(self.roles),
            "before": self.before,
            "after": self.after,
        }

    def describe(self) -> str:
        def side(d: dict[str, Any]) -> str:
            rule = f" by rule {d['rule']!r}" if d.get("rule") else ""
            return f"{d['decision']} ({d['reason']}){rule}"

        change = f"{side(self.before)} -> {side(self.after)}"
        text = f"{self.kind:16} {self.recording} {self.call}: {change}"
        if self.after.get("detail") and self.after["decision"] == "deny":
            text += f"\n{'':17}{self.after['detail']}"
        return text


@dataclass(slots=True)
class RegressionReport:
    policy: str
    recording: str
    checked: int = 0
    unchanged: int = 0
    changes: list[Change] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[Change]:
        return [c for c in self.changes if c.kind == kind]

    @property
    def regressions(self) -> list[Change]:
        return self.of_kind("allowed->denied")

    def exit_code(self, allow_regressions: bool = False) -> int:
        """1 when an allowed call became denied (unless allowed), or when no call was
        checked at all (a test that compared nothing must not pass); else 0."""
        if self.checked == 0:
            return 1
        return 1 if self.regressions and not allow_regressions else 0

    def skip_summary(self) -> str:
        """Why calls were skipped, most common first: ``no roles recorded (8)``."""
        counts: dict[str, int] = {}
        for s in self.skipped:
            counts[s["why"]] = counts.get(s["why"], 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return ", ".join(f"{why} ({n})" for why, n in ranked) or "none recorded"

    def as_dict(self) -> dict[str, Any]:
        counts = {
            k: len(self.of_kind(k))
            for k in ("allowed->denied", "denied->allowed", "rule changed", "reason changed")
        }
        return {
            "policy": self.policy,
            "recording": self.recording,
            "checked": self.checked,
            "unchanged": self.unchanged,
            "changed": counts,
            "changes": [c.as_json() for c in self.changes],
            "skipped": self.skipped,
        }

    def text(self) -> str:
        counts = self.as_dict()["changed"]
        lines = [
            f"policy test of {self.policy} on {self.recording}: {self.checked} call(s) checked, "
            f"{self.unchanged} unchanged, {counts['allowed->denied']} allowed->denied, "
            f"{counts['denied->allowed']} denied->allowed, {counts['rule changed']} rule "
            f"changed, {counts['reason changed']} reason changed, {len(self.skipped)} skipped"
        ]
        order = ("allowed->denied", "denied->allowed", "rule changed", "reason changed")
        for kind in order:
            lines.extend("  " + c.describe() for c in self.of_kind(kind))
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


def _before(e: Entry) -> dict[str, Any]:
    return {
        "decision": "allow" if e.decision.allowed else "deny",
        "reason": e.decision.reason,
        "rule": e.decision.rule,
    }


async def policy_test(policy: Policy, directory: str | Path) -> RegressionReport:
    """Every recorded call re-decided by ``policy``; the decisions that change."""
    rec = load_recording(directory)
    report = RegressionReport(policy=policy.source, recording=str(directory))
    for e in rec.entries():
        before = _before(e)
        if not e.decision.allowed and e.decision.reason in NOT_POLICY_REASONS:
            report.skipped.append(
                {
                    "recording": e.ref,
                    "call": e.describe(),
                    "why": f"decided by {e.decision.reason}, not by the rules",
                }
            )
            continue
        if not e.roles:
            report.skipped.append(
                {"recording": e.ref, "call": e.describe(), "why": "no roles recorded for this call"}
            )
            continue
        url = f"/{e.upstream}{e.target}" if e.upstream else e.target
        headers = [(k, t) for k, v in e.request_headers if (t := _text(v)) is not None]
        after = await explain(
            policy,
            roles=list(e.roles),
            agent=e.agent,  # as the gateway would now: declared, holding these roles
            method=e.method,
            url=url,
            caps=list(e.caps) if e.caps is not None else None,
            run=e.run,
            headers=headers,
            body=e.request_bytes(),
        )
        report.checked += 1
        was_allowed = e.decision.allowed
        now_allowed = after["decision"] == "allow"
        kind: str | None = None
        if was_allowed and not now_allowed:
            kind = "allowed->denied"
        elif not was_allowed and now_allowed:
            kind = "denied->allowed"
        elif was_allowed and after.get("rule") != e.decision.rule:
            kind = "rule changed"
        elif not was_allowed and after["reason"] != e.decision.reason:
            kind = "reason changed"
        if kind is None:
            report.unchanged += 1
            continue
        report.changes.append(
            Change(
                kind=kind,
                recording=e.ref,
                call=e.describe(),
                agent=e.agent,
                roles=e.roles,
                before=before,
                after={k: after.get(k) for k in ("decision", "reason", "rule", "detail")},
            )
        )
    return report
