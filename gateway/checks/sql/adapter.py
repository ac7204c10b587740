"""``SqlBodyCheck``: where a rule's SQL is in a call, and what happens to the call.

The SQL is a JSON body field, the whole (UTF-8) body, or an MCP ``tools/call`` argument. The
verdict's facts are recorded on ``call.facts["sql"]``; when a LIMIT was appended, the call
carries the rewritten SQL, which is exactly the text that was checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.checks.body import call_json, parse_json
from gateway.checks.sql.policy import SqlPolicy, SqlVerdict
from gateway.errors import BodyInvalid, SqlDenied, ToolDenied

if TYPE_CHECKING:
    from gateway.call import Call


@dataclass(frozen=True, slots=True)
class SqlBodyCheck:
    """Where a rule's SQL is (a JSON field, the raw body, or an MCP tool argument) + its policy."""

    kind = "sql"
    policy: SqlPolicy
    rule_id: str | None
    field: tuple[str, ...] | None = None  # JSON body field path, e.g. ("query", "text")
    raw: bool = False  # the whole body is the SQL
    argument: str | None = None  # MCP: the tools/call argument holding the SQL
    tool: str | None = None  # MCP: the tool of the rule

    def check(self, call: Call) -> None:
        if self.argument is not None:
            self._check_tool_call(call)
        elif self.raw:
            self._check_raw(call)
        else:
            self._check_field(call)

    def _record(self, call: Call, verdict: SqlVerdict) -> None:
        facts = call.facts.setdefault("sql", {"kinds": [], "tables": [], "rewritten": False})
        facts["kinds"] = sorted(set(facts["kinds"]) | set(verdict.kinds))
        facts["tables"] = sorted(set(facts["tables"]) | set(verdict.tables))
        facts["rewritten"] = bool(facts["rewritten"] or verdict.rewritten)

    def _check_raw(self, call: Call) -> None:
        try:
            text = (call.body or b"").decode("utf-8")
        except UnicodeDecodeError:
            raise BodyInvalid("the SQL body is not UTF-8 text", rule=self.rule_id) from None
        verdict = self.policy.check(text)
        self._record(call, verdict)
        if verdict.rewritten:
            call.body = verdict.sql.encode("utf-8")

    def _check_field(self, call: Call) -> None:
        assert self.field is not None
        value = call_json(call)
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
        self._record(call, verdict)
        if verdict.rewritten:
            assert isinstance(container, dict)
            container[key] = verdict.sql
            call.facts["json"] = value
            call.body = _dump_json(value)

    def _check_tool_call(self, call: Call) -> None:
        assert self.argument is not None
        info = call.facts.get("mcp")
        messages = list(info["messages"]) if isinstance(info, dict) else []
        picked = [
            (i, m)
            for i, m in enumerate(messages)
            if getattr(m, "tool", None) is not None and (self.tool is None or m.tool == self.tool)
        ]
        if not picked:
            raise SqlDenied(
                "no MCP tools/call for this rule's tool was found to check its SQL",
                rule=self.rule_id,
            )
        rewrites: dict[int, str] = {}
        for index, message in picked:
            arguments = message.arguments or {}
            text = arguments.get(self.argument)
            if not isinstance(text, str):
                raise ToolDenied(
                    f"tool {message.tool!r} needs the SQL as a string in argument "
                    f"{self.argument!r}",
                    rule=self.rule_id,
                )
            verdict = self.policy.check(text)
            self._record(call, verdict)
            if verdict.rewritten:
                arguments[self.argument] = verdict.sql
                rewrites[index] = verdict.sql
        if rewrites:
            value = parse_json(call.body or b"")
            items = value if isinstance(value, list) else [value]
            for index, sql in rewrites.items():
                items[index]["params"]["arguments"][self.argument] = sql
            call.body = _dump_json(value)


def _dump_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
        "utf-8"
    )
