"""``capgate policy test``: policy unit tests written in YAML, decided by the gateway's stages.

A test file holds cases; each case is one call (agent, roles, method, target, headers, body)
and the decision the policy must give it (``allow``, ``deny`` or ``approval``), with the
reason code, the rule id and, where the policy rewrites the body (SQL with a LIMIT added),
the body forwarded upstream. Every case is decided by ``gateway.commands.explain.explain``,
the same stages ``capgate policy explain`` and the gateway run; there is no second evaluator.

Where test files are found, for a policy ``DIR/NAME.yaml``: ``DIR/NAME.tests.yaml`` and every
``*.yaml`` under ``DIR/NAME.tests/``; or the files named on the command line. A file may name
its policy (``policy: NAME.yaml``, relative to the file); ``--policy`` wins over it.

    policy: example.yaml
    defaults: {agent: sre-bot}
    cases:
      - name: CPU over five minutes
        method: GET
        target: /metrics/metrics/cpu?window=5m
        expect: {decision: allow, rule: read-cpu}
      - name: SQL without LIMIT gets one
        agent: analyst-bot
        method: POST
        target: /db/query
        json: {sql: "select id from orders"}
        expect:
          decision: allow
          rule: query-orders
          json: {sql: "select id from orders LIMIT 1000"}

A malformed file is reported as ``FILE:LINE:COL: message`` lines, all of them, before any
case runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.commands.explain import explain
from gateway.errors import Reason
from gateway.policy.model import Policy
from gateway.policy.spec import METHODS, Key, Section
from gateway.policy_file import Node, PolicyError, read_document

DECISIONS = ("allow", "deny", "approval")
_TEXT: dict[str, Any] = {"type": "string"}
_LIST: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
_HEADERS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {"anyOf": [{"type": ["string", "number"]}, _LIST]},
}
# The test file's vocabulary, declared once: the reader takes these keys, and
# ``case_file_schema()`` (docs/policy-tests.schema.json) is made from them.
EXPECT = Section(
    "expect",
    "The decision the policy must give the call.",
    (
        Key(
            "decision",
            "allow, deny, or approval (allowed once a person approves)",
            {"enum": list(DECISIONS)},
            required=True,
        ),
        Key(
            "reason",
            "the reason code (allowed for an allowed call)",
            {"enum": sorted({r.value for r in Reason} | {"allowed"})},
        ),
        Key("rule", "the id of the rule that decides (must be a rule of the policy)", _TEXT),
        Key("detail", "text the decision's detail contains", _TEXT),
        Key("body", "the body forwarded upstream, exactly (after rewriting, e.g. LIMIT)", _TEXT),
        Key("json", "the body forwarded upstream, compared as JSON data", {}),
    ),
)
_WHO = (
    Key("agent", "the agent (declared in the policy); roles default to the agent's", _TEXT),
    Key("roles", "the token's roles", _LIST),
    Key("caps", "the token's caps (rule ids it is narrowed to)", _LIST),
    Key("run", "the token's run id", _TEXT),
    Key("headers", "request headers, name: value (or a list of values)", _HEADERS),
)
CASE = Section(
    "case",
    "One call and the decision it must get.",
    (
        Key("name", "unique in the file; shown in the table", _TEXT, required=True),
        Key("description", "for people", _TEXT),
        *_WHO,
        Key("method", "GET (default; POST with a body), POST, ...", {"enum": list(METHODS)}),
        Key(
            "target",
            "/<upstream>/<path>?<query>, as the agent calls it",
            {"type": "string", "pattern": "^/"},
        ),
        Key("body", "the request body, as text", _TEXT),
        Key("json", "the request body, as data sent as JSON", {}),
        Key("tool", "MCP: send a tools/call of this tool to target", _TEXT),
        Key("arguments", "MCP: the tool's arguments", {"type": "object"}),
        Key("expect", EXPECT.description, EXPECT.schema(), required=True),
    ),
)
DEFAULTS = Section("defaults", "Values every case takes unless it gives its own.", _WHO)
CASE_FILE = Section(
    "policy tests",
    "capgate policy test cases: calls, and the decision each must get from the policy.",
    (
        Key("policy", "the policy file, relative to this one (--policy overrides it)", _TEXT),
        Key("description", "for people", _TEXT),
        Key("defaults", DEFAULTS.description, DEFAULTS.schema()),
        Key(
            "cases",
            "the cases, run in order",
            {"type": "array", "minItems": 1, "items": CASE.schema()},
            required=True,
        ),
    ),
)


def case_file_schema() -> dict[str, Any]:
    """A JSON Schema (Draft 2020-12) of policy test files, for editors."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://capgate.dev/schemas/policy-tests-v1.json",
        "title": "capgate policy tests",
        **CASE_FILE.schema(),
    }


TESTS_SCHEMA_FILE = "docs/policy-tests.schema.json"


def tests_schema_text() -> str:
    """The schema of policy test files as the committed file (``capgate policy schema
    --tests``)."""
    return json.dumps(case_file_schema(), indent=2, ensure_ascii=False) + "\n"


_UNSET: Any = object()


def case_files_beside(policy: Path) -> list[Path]:
    """The test files that go with ``policy`` by name: ``NAME.tests.yaml`` beside it and the
    ``*.yaml`` files of a ``NAME.tests/`` directory beside it."""
    stem = policy.name.rsplit(".", 1)[0] if "." in policy.name else policy.name
    beside = (policy.with_name(f"{stem}.tests.yaml"), policy.with_name(f"{stem}.tests.yml"))
    out = [p for p in beside if p.is_file()]
    folder = policy.with_name(f"{stem}.tests")
    if folder.is_dir():
        out.extend(sorted(p for p in folder.rglob("*.y*ml") if p.is_file()))
    return out


@dataclass(frozen=True, slots=True)
class Expect:
    decision: str
    reason: str | None = None
    rule: str | None = None
    detail: str | None = None  # a substring of the decision's detail
    body: str | None = None  # the body forwarded upstream, exactly
    json: Any = _UNSET  # ... or as JSON, compared as data

    def text(self) -> str:
        parts = [self.decision]
        if self.reason and not (self.decision == "allow" and self.reason == "allowed"):
            parts.append(self.reason)
        if self.rule:
            parts.append(self.rule)
        if self.body is not None or self.json is not _UNSET:
            parts.append("+body")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Case:
    file: str
    line: int
    name: str
    agent: str | None
    roles: tuple[str, ...]
    caps: tuple[str, ...] | None
    run: str | None
    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes | None
    expect: Expect
    roles_given: bool = True


@dataclass(frozen=True, slots=True)
class CaseFile:
    path: str
    policy: Path | None
    cases: tuple[Case, ...]


@dataclass(slots=True)
class Outcome:
    case: Case
    got: dict[str, Any]
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def got_decision(self) -> str:
        if self.got["decision"] == "allow" and self.got.get("approval") == "required":
            return "approval"
        return str(self.got["decision"])

    def got_text(self) -> str:
        parts = [self.got_decision()]
        if self.got["decision"] == "deny":
            parts.append(str(self.got["reason"]))
        if self.got.get("rule"):
            parts.append(str(self.got["rule"]))
        return " ".join(parts)

    def as_json(self) -> dict[str, Any]:
        e = self.case.expect
        expected: dict[str, Any] = {"decision": e.decision}
        for key in ("reason", "rule", "detail", "body"):
            if getattr(e, key) is not None:
                expected[key] = getattr(e, key)
        if e.json is not _UNSET:
            expected["json"] = e.json
        got = {k: self.got.get(k) for k in ("reason", "rule", "detail", "status")}
        got["decision"] = self.got_decision()
        if "forwarded_body" in self.got:
            got["forwarded_body"] = self.got["forwarded_body"]
        return {
            "file": self.case.file,
            "line": self.case.line,
            "name": self.case.name,
            "expected": expected,
            "got": {k: v for k, v in got.items() if v is not None},
            "result": "pass" if self.passed else "fail",
            "problems": self.problems,
        }


# --- reading test files -----------------------------------------------------------------------


def policy_named_by(path: Path) -> Path | None:
    """The policy a test file names (``policy:``, relative to it), read before the rest of
    the file is checked against that policy's rule ids."""
    root = read_document(path)
    named = root.value.get("policy") if isinstance(root.value, dict) else None
    return path.parent / named if isinstance(named, str) else None


def read_case_file(path: Path, rule_ids: Iterable[str] | None = None) -> CaseFile:
    """Parse a test file; ``PolicyError`` with every ``FILE:LINE:COL`` problem found.

    With ``rule_ids``, an ``expect.rule`` naming no rule of the policy is an error too (a typo
    would make the case pass for the wrong reason or fail confusingly)."""
    root = read_document(path)
    doc = root.as_map(required=CASE_FILE.required, optional=CASE_FILE.optional)
    if doc is None:
        raise PolicyError(root.issues)
    policy = None
    if "policy" in doc:
        text = doc["policy"].as_str(what="the policy file, relative to this one")
        if text is not None:
            policy = path.parent / text
    defaults: dict[str, Node] = {}
    if "defaults" in doc:
        defaults = doc["defaults"].as_map(optional=DEFAULTS.optional) or {}
    known = frozenset(rule_ids) if rule_ids is not None else None
    cases: list[Case] = []
    names: dict[str, int] = {}
    items = (doc["cases"].as_list() or []) if "cases" in doc else []
    for item in items:
        case = _case(item, defaults, known)
        if case is None:
            continue
        if case.name in names:
            item.fail(
                f"{item.where}: case name {case.name!r} is used already (line {names[case.name]})"
            )
        names[case.name] = case.line
        cases.append(case)
    if "cases" in doc and isinstance(doc["cases"].value, list) and not doc["cases"].value:
        doc["cases"].fail("cases: the file has no cases")
    if root.issues:
        raise PolicyError(root.issues)
    return CaseFile(path=str(path), policy=policy, cases=tuple(cases))


def _case(node: Node, defaults: dict[str, Node], known: frozenset[str] | None) -> Case | None:
    m = node.as_map(required=CASE.required, optional=CASE.optional)
    if m is None:
        return None
    merged = {**defaults, **m}
    name = m["name"].as_str(what="the case's name") if "name" in m else None
    agent = merged["agent"].as_str(what="an agent name") if "agent" in merged else None
    roles = tuple(merged["roles"].as_str_list() or ()) if "roles" in merged else ()
    caps = tuple(merged["caps"].as_str_list() or ()) if "caps" in merged else None
    run = merged["run"].as_str(what="a run id") if "run" in merged else None
    headers = _headers(merged["headers"]) if "headers" in merged else ()
    method, target, body = _request(node, m)
    expect = _expect(m["expect"], known) if "expect" in m else None
    if "roles" not in merged and "agent" not in merged:
        node.fail(f"{node.where}: a case needs roles, or an agent declared in the policy")
    if name is None or expect is None or method is None or target is None:
        return None
    return Case(
        file=node.path,
        line=node.line,
        name=name,
        agent=agent,
        roles=roles,
        caps=caps,
        run=run,
        method=method,
        target=target,
        headers=headers,
        body=body,
        expect=expect,
        roles_given="roles" in merged,
    )


def _headers(node: Node) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for key, value in node.entries():
        if isinstance(value.value, list):
            out.extend((key.value, v) for v in value.as_str_list() or ())
            continue
        text = value.value if isinstance(value.value, int | float) else value.as_str()
        if text is not None and not isinstance(text, bool):
            out.append((key.value, str(text)))
    return tuple(out)


def _request(node: Node, m: dict[str, Node]) -> tuple[str | None, str | None, bytes | None]:
    """Method, target and body of a case: ``body`` (text) or ``json`` (data), or an MCP
    ``tool`` with its ``arguments`` (a ``tools/call`` request to ``target``)."""
    given = [k for k in ("body", "json", "tool") if k in m]
    for extra in given[1:]:
        m[extra].fail(
            f"{m[extra].where}: a case has one of body, json or tool ({given[0]!r} is given)"
        )
    body: bytes | None = None
    if "body" in m:
        text = m["body"].as_str(what="the request body as text (or use json:)")
        body = text.encode() if text is not None else None
    elif "json" in m:
        body = json.dumps(m["json"].plain(), separators=(",", ":")).encode()
    elif "tool" in m:
        tool = m["tool"].as_str(what="a tool name")
        arguments = m["arguments"].plain() if "arguments" in m else {}
        call = {"name": tool, "arguments": arguments}
        message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": call}
        body = json.dumps(message, separators=(",", ":")).encode()
    if "arguments" in m and "tool" not in m:
        m["arguments"].fail(f"{m['arguments'].where}: arguments go with tool")
    method: str | None = "POST" if body is not None else "GET"
    if "method" in m:
        method = m["method"].as_choice(METHODS)
    target = None
    if "target" in m:
        target = m["target"].as_str(what="a target such as /upstream/path?query")
        if target is not None and not target.startswith("/") and "://" not in target:
            m["target"].fail(f"{m['target'].where}: a target starts with /<upstream>/...")
            target = None
    else:
        node.fail(f"{node.where}: missing required key 'target' (/<upstream>/path?query)")
    return method, target, body


_REASONS = frozenset(r.value for r in Reason) | {"allowed"}


def _expect(node: Node, known: frozenset[str] | None) -> Expect | None:
    m = node.as_map(required=EXPECT.required, optional=EXPECT.optional)
    if m is None or "decision" not in m:
        return None
    decision = m["decision"].as_choice(DECISIONS)
    reason = m["reason"].as_str(what="a reason code") if "reason" in m else None
    if reason is not None and reason not in _REASONS:
        m["reason"].fail(f"{m['reason'].where}: unknown reason code {reason!r}")
    rule = m["rule"].as_str(what="a rule id") if "rule" in m else None
    if rule is not None and known is not None and rule not in known:
        m["rule"].fail(f"{m['rule'].where}: the policy has no rule {rule!r}")
    detail = (
        m["detail"].as_str(what="text the decision's detail contains") if "detail" in m else None
    )
    body = m["body"].as_str(what="the forwarded body as text") if "body" in m else None
    data = m["json"].plain() if "json" in m else _UNSET
    if "body" in m and "json" in m:
        m["json"].fail(f"{m['json'].where}: expect one of body or json")
    if decision is None:
        return None
    if decision != "deny" and decision != "approval" and reason not in (None, "allowed"):
        m["reason"].fail(f"{m['reason'].where}: an allowed call's reason is 'allowed'")
    return Expect(decision, reason, rule, detail, body, data)


# --- running -----------------------------------------------------------------------------------


async def run_case(policy: Policy, case: Case) -> Outcome:
    roles = list(case.roles)
    if not case.roles_given and case.agent is not None:
        entry = policy.agents.entry_for(case.agent)
        roles = sorted(entry.roles) if entry is not None else []
    got = await explain(
        policy,
        roles=roles,
        agent=case.agent,
        method=case.method,
        url=case.target,
        caps=list(case.caps) if case.caps is not None else None,
        run=case.run,
        headers=list(case.headers),
        body=case.body,
    )
    outcome = Outcome(case, got)
    outcome.problems.extend(_compare(case, outcome, got))
    return outcome


def _compare(case: Case, outcome: Outcome, got: dict[str, Any]) -> list[str]:
    e = case.expect
    problems: list[str] = []
    decision = outcome.got_decision()
    if decision != e.decision:
        problems.append(f"expected {e.decision}, got {decision} ({got['reason']})")
    if e.reason is not None and got["reason"] != e.reason:
        problems.append(f"expected reason {e.reason}, got {got['reason']}")
    if e.rule is not None and got.get("rule") != e.rule:
        problems.append(f"expected rule {e.rule}, got {got.get('rule') or 'none'}")
    detail = str(got.get("detail") or "")
    if e.detail is not None and e.detail not in detail:
        problems.append(f"expected the detail to contain {e.detail!r}")
    if e.body is not None or e.json is not _UNSET:
        problems.extend(_compare_body(case, got))
    if problems and got.get("detail"):
        problems.append(f"detail: {got['detail']}")
    return problems


def _compare_body(case: Case, got: dict[str, Any]) -> list[str]:
    e = case.expect
    if got["decision"] != "allow":
        return ["expected a forwarded body, but the call was denied"]
    sent = got.get("forwarded_body")
    if sent is None:
        sent = case.body.decode("utf-8", "replace") if case.body is not None else ""
    if e.body is not None and sent != e.body:
        return [f"expected the forwarded body {e.body!r}, got {sent!r}"]
    if e.json is not _UNSET:
        try:
            data = json.loads(sent)
        except ValueError:
            return [f"expected a JSON forwarded body, got {sent!r}"]
        if data != e.json:
            return [f"expected the forwarded body {json.dumps(e.json)}, got {sent}"]
    return []


@dataclass(slots=True)
class CaseReport:
    policy: str
    files: list[str]
    outcomes: list[Outcome]
    rules: list[str]  # every rule id of the policy, in file order

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.passed]

    def uncovered(self) -> dict[str, list[str]]:
        """Rules no passing case reached, allowed or denied: ``{"allow": [...], "deny": [...]}``."""
        allowed = {
            o.got.get("rule") for o in self.outcomes if o.passed and o.got["decision"] == "allow"
        }
        denied = {
            o.got.get("rule") for o in self.outcomes if o.passed and o.got["decision"] == "deny"
        }
        return {
            "allow": [r for r in self.rules if r not in allowed],
            "deny": [r for r in self.rules if r not in denied],
        }

    def exit_code(self) -> int:
        return 1 if self.failed or not self.outcomes else 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "files": self.files,
            "passed": len(self.outcomes) - len(self.failed),
            "failed": len(self.failed),
            "cases": [o.as_json() for o in self.outcomes],
            "uncovered": self.uncovered(),
        }

    def text(self) -> str:
        rows = [("CASE", "EXPECTED", "GOT", "RESULT")]
        for o in self.outcomes:
            name = o.case.name if len(o.case.name) <= 48 else o.case.name[:45] + "..."
            rows.append((name, o.case.expect.text(), o.got_text(), "PASS" if o.passed else "FAIL"))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [
            f"{r[0]:{widths[0]}}  {r[1]:{widths[1]}}  {r[2]:{widths[2]}}  {r[3]}".rstrip()
            for r in rows
        ]
        for o in self.failed:
            lines.append(f"{o.case.file}:{o.case.line}: {o.case.name}: FAIL")
            lines.extend(f"    {p}" for p in o.problems)
        uncovered = self.uncovered()
        for kind in ("allow", "deny"):
            if uncovered[kind]:
                lines.append(f"rules no passing case {kind}s: {', '.join(uncovered[kind])}")
        passed = len(self.outcomes) - len(self.failed)
        lines.append(
            f"policy test of {self.policy}: {len(self.outcomes)} case(s) in "
            f"{len(self.files)} file(s), {passed} passed, {len(self.failed)} failed"
        )
        return "\n".join(lines)


async def run_tests(policy: Policy, files: list[CaseFile]) -> CaseReport:
    outcomes = [await run_case(policy, case) for f in files for case in f.cases]
    rules = [rule.id for role in policy.roles.values() for rule in role.rules]
    return CaseReport(policy.source, [f.path for f in files], outcomes, rules)


# --- the command ------------------------------------------------------------------------------


class CaseFileError(Exception):
    """The command could not run (exit 2), or found nothing to check (exit 1); ``lines``
    are printed to stderr."""

    def __init__(self, lines: list[str], code: int = 2, *, positions: bool = False) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines
        self.code = code
        self.positions = positions  # FILE:LINE:COL lines, printed as they are


def collect(policy: Path | None, paths: list[Path]) -> dict[Path, list[Path]]:
    """Test files by the policy they run against (``--policy`` wins over a file's own
    ``policy:``); with no paths, the files found beside ``policy``."""
    files = paths
    if not files:
        if policy is None:
            raise CaseFileError(["give --policy FILE, or test files that name their policy"])
        files = case_files_beside(policy)
        if not files:
            stem = policy.name.rsplit(".", 1)[0]
            raise CaseFileError(
                [
                    f"no test files for {policy}: looked for "
                    f"{policy.with_name(stem + '.tests.yaml')} and "
                    f"{policy.with_name(stem + '.tests')}/*.yaml; checked nothing"
                ],
                code=1,
            )
    by_policy: dict[Path, list[Path]] = {}
    issues: list[str] = []
    for path in files:
        try:
            named = policy_named_by(path)
        except PolicyError as exc:
            issues.extend(str(i) for i in exc.issues)
            continue
        chosen = policy or named
        if chosen is None:
            issues.append(
                f"{path}:1:1: the file names no policy (policy: FILE) and no --policy was given"
            )
            continue
        by_policy.setdefault(chosen, []).append(path)
    if issues:
        raise CaseFileError(issues, positions=True)
    return by_policy


def run_case_files(policy_path: Path, paths: list[Path]) -> CaseReport:
    """Load the policy and the files (rule ids checked against it), run every case."""
    import asyncio

    from gateway.policy.load import load_policy

    try:
        policy = load_policy(policy_path)
    except PolicyError as exc:
        lines = [f"capgate: error: policy test: policy {policy_path} has errors:"]
        raise CaseFileError(lines + [str(i) for i in exc.issues], positions=True) from None
    ids = list(policy.rules_by_id)
    files: list[CaseFile] = []
    issues: list[str] = []
    for path in paths:
        try:
            files.append(read_case_file(path, ids))
        except PolicyError as exc:
            issues.extend(str(i) for i in exc.issues)
    if issues:
        raise CaseFileError(issues, positions=True)
    return asyncio.run(run_tests(policy, files))


def _fail(lines: list[str], code: int = 2, positions: bool = False) -> int:
    import sys

    if positions:
        for line in lines:
            print(line, file=sys.stderr)
    else:
        print(f"capgate: error: policy test: {' '.join(lines)}", file=sys.stderr)
    return code


def cmd_policy_test(
    policy: Path | None,
    paths: list[Path],
    *,
    allow_regressions: bool = False,
    as_json: bool = False,
) -> int:
    """``capgate policy test``: test files (named, or found beside the policy) and recording
    directories (regression mode, which needs ``--policy``). Exit 0 when every case passed and
    every recording checked at least one call without a regression; 1 when a case failed, a
    recording regressed or nothing was checked; 2 when a file or the policy is malformed."""
    from gateway.commands.recording import regression_report

    recordings = [p for p in paths if p.is_dir()]
    tests = [p for p in paths if not p.is_dir()]
    missing = [p for p in tests if not p.exists()]
    if missing:
        return _fail([f"{missing[0]}: no such test file or recording directory"])
    if recordings and policy is None:
        return _fail([f"{recordings[0]} is a recording: give the policy to test with --policy"])
    results: dict[str, list[Any]] = {"tests": [], "recordings": []}
    code = 0
    try:
        if tests or not recordings:
            for policy_path, files in collect(policy, tests).items():
                report = run_case_files(policy_path, files)
                code = max(code, report.exit_code())
                results["tests"].append(report.as_dict())
                if not as_json:
                    print(report.text())
        for directory in recordings:
            assert policy is not None
            status, data = regression_report(policy, directory, allow_regressions, as_json)
            code = max(code, status)
            if data is not None:
                results["recordings"].append(data)
    except CaseFileError as exc:
        return _fail(exc.lines, exc.code, exc.positions)
    if as_json:
        print(json.dumps({"ok": code == 0, **results}, indent=2, default=str))
    return code
