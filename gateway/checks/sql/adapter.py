"""``SqlBodyCheck``: where a rule's SQL is in a payload, and what a verdict does to it.

The SQL is a JSON body field, the whole (UTF-8) body, or an MCP ``tools/call`` argument. The
verdict's statement kinds and tables are noted in the payload's ``findings`` (for the audit
record); when a LIMIT was appended, the payload carries the rewritten SQL, which is exactly
the text that was checked, and the call forwards it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.checks.sql.policy import SqlPolicy
from gateway.errors import BodyInvalid, GatewayError, SqlDenied, ToolDenied
from gateway.payload import BodyPayload, Payload, ToolCallPayload


@dataclass(frozen=True, slots=True)
class SqlBodyCheck:
    """Where a rule's SQL is (a JSON field, the raw body, or an MCP tool argument) + its policy."""

    kind = "sql"
    policy: SqlPolicy
    rule_id: str | None
    field: tuple[str, ...] | None = None  # JSON body field path, e.g. ("query", "text")
    raw: bool = False  # the whole body is the SQL
    argument: str | None = None  # MCP: the tools/call argument holding the SQL

    def check(self, payload: Payload) -> None:
        if isinstance(payload, ToolCallPayload):
            self._check_tool_call(payload)
        elif isinstance(payload, BodyPayload) and self.argument is None:
            if self.raw:
                self._check_raw(payload)
            else:
                self._check_field(payload)
        else:
            raise SqlDenied("the SQL could not be found where the rule says", rule=self.rule_id)

    def costly(self, payload: Payload) -> bool:
        """Whether this payload's SQL is long and unseen (``SqlPolicy.costly``), so its check
        belongs in a worker thread. False when the SQL is not where the rule says: ``check``
        then refuses it at once."""
        try:
            text = self._find(payload)
        except GatewayError:
            return False
        return text is not None and self.policy.costly(text)

    def _find(self, payload: Payload) -> str | None:
        """The SQL text where the rule says it is, without checking it (None: not there)."""
        if isinstance(payload, ToolCallPayload):
            text = payload.arguments.get(self.argument) if self.argument is not None else None
        elif isinstance(payload, BodyPayload) and self.argument is None:
            if self.raw:
                return payload.text()
            assert self.field is not None
            text = payload.json()
            for part in self.field:
                text = text.get(part) if isinstance(text, dict) else None
        else:
            return None
        return text if isinstance(text, str) else None

    def _check_raw(self, payload: BodyPayload) -> None:
        try:
            text = payload.text()
        except BodyInvalid:
            raise BodyInvalid("the SQL body is not UTF-8 text", rule=self.rule_id) from None
        verdict = self.policy.check(text)
        payload.findings.note_sql(verdict.kinds, verdict.tables)
        if verdict.rewritten:
            payload.replace_raw(verdict.sql.encode("utf-8"))

    def _check_field(self, payload: BodyPayload) -> None:
        assert self.field is not None
        value = payload.json()
        container = value
        for part in self.field[:-1]:
            container = container.get(part) if isinstance(container, dict) else None
        key = self.field[-1]
        text = container.get(key) if isinstance(container, dict) else None
        pointer = "/" + "/".join(self.field)
        if not isinstance(text, str):
            raise BodyInvalid(
                f"the JSON body needs the SQL as a string at {pointer}",
                rule=self.rule_id,
                errors=[{"pointer": pointer, "keyword": "sql", "message": "a string is required"}],
            )
        verdict = self.policy.check(text)
        payload.findings.note_sql(verdict.kinds, verdict.tables)
        if verdict.rewritten:
            assert isinstance(container, dict)
            container[key] = verdict.sql
            payload.replace_json(value)

    def _check_tool_call(self, payload: ToolCallPayload) -> None:
        if self.argument is None:
            raise SqlDenied("the rule's SQL is not in a tool argument", rule=self.rule_id)
        text = payload.arguments.get(self.argument)
        if not isinstance(text, str):
            raise ToolDenied(
                f"tool {payload.tool!r} needs the SQL as a string in argument {self.argument!r}",
                rule=self.rule_id,
            )
        verdict = self.policy.check(text)
        payload.findings.note_sql(verdict.kinds, verdict.tables)
        if verdict.rewritten:
            payload.replace_argument(self.argument, verdict.sql)
