"""``capgate policy test``: YAML test cases decided by the gateway's stages, a table, exit
status; and the recording mode, which fails when it checked nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.commands.policy_tests import case_files_beside
from tests.helpers_core import REPO

EXAMPLE = REPO / "policies" / "example.yaml"
EXAMPLE_TESTS = REPO / "policies" / "example.tests.yaml"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv), {})
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_the_example_tests_pass_and_cover_every_rule(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "policy", "test", "--policy", str(EXAMPLE), "--json")
    assert (code, err) == (0, "")
    result = json.loads(out)
    assert result["ok"] is True
    [report] = result["tests"]
    assert report["failed"] == 0 and report["passed"] == len(report["cases"]) >= 30
    # Every rule of the example has a passing case it allows and one it refuses.
    assert report["uncovered"] == {"allow": [], "deny": []}
    rewritten = [c for c in report["cases"] if "forwarded_body" in c["got"]]
    assert {c["got"]["forwarded_body"] for c in rewritten} >= {
        '{"sql":"SELECT id, total_cents FROM orders WHERE status = \'paid\' LIMIT 1000"}'
    }


def test_the_table_and_the_policy_named_by_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "policy", "test", str(EXAMPLE_TESTS))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["CASE", "EXPECTED", "GOT", "RESULT"]
    assert any(
        line.startswith("query-orders never reads the SSN")
        and line.split()[-4:] == ["deny", "sql_denied", "query-orders", "PASS"]
        for line in lines
    )
    assert lines[-1].endswith("passed, 0 failed")


POLICY = """
version: 1
upstreams:
  api: {url: "http://127.0.0.1:9"}
agents:
  bot: [ops]
roles:
  ops:
    rules:
      - id: list-items
        upstream: api
        allow: GET /items
      - id: delete-item
        upstream: api
        allow: DELETE /items/{id}
        params: {id: {integer: true}}
        approval: required
"""


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    path = tmp_path / "ops.yaml"
    path.write_text(POLICY)
    return path


def test_a_failing_case_exits_1_with_its_line(
    policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tests = policy.with_name("ops.tests.yaml")
    tests.write_text(
        "cases:\n"
        "  - name: list\n"
        "    agent: bot\n"
        "    target: /api/items\n"
        "    expect: {decision: allow, rule: list-items}\n"
        "  - name: delete needs a person\n"
        "    agent: bot\n"
        "    method: DELETE\n"
        "    target: /api/items/4\n"
        "    expect: {decision: approval, rule: delete-item}\n"
        "  - name: wrongly expected\n"
        "    agent: bot\n"
        "    method: DELETE\n"
        "    target: /api/items/x\n"
        "    expect: {decision: allow}\n"
    )
    code, out, _ = run(capsys, "policy", "test", "--policy", str(policy))
    assert code == 1
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert rows["list"].endswith("PASS")
    assert rows["delete needs a person"].split()[-3:] == ["approval", "delete-item", "PASS"]
    assert rows["wrongly expected"].endswith("FAIL")
    assert f"{tests}:11: wrongly expected: FAIL" in out
    assert "expected allow, got deny (no_rule)" in out
    assert "1 failed" in out.splitlines()[-1]


def test_the_expected_body_is_compared(policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (policy.parent / "ops.tests").mkdir()
    (policy.parent / "ops.tests" / "body.yaml").write_text(
        "cases:\n"
        "  - name: a body on a rule without one\n"
        "    roles: [ops]\n"
        "    method: GET\n"
        "    target: /api/items\n"
        "    body: hello\n"
        "    expect: {decision: deny, reason: body_invalid, rule: list-items}\n"
        "  - name: wrong forwarded body\n"
        "    roles: [ops]\n"
        "    target: /api/items\n"
        "    expect: {decision: allow, body: something}\n"
    )
    assert case_files_beside(policy) == [policy.parent / "ops.tests" / "body.yaml"]
    code, out, _ = run(capsys, "policy", "test", "--policy", str(policy))
    assert code == 1
    assert "expected the forwarded body 'something', got ''" in out


def test_a_malformed_test_file_is_reported_at_its_lines(
    policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tests = policy.with_name("bad.tests.yaml")
    tests.write_text(
        "cases:\n"
        "  - name: typo\n"
        "    agent: bot\n"
        "    target: /api/items\n"
        "    expect: {decision: allowed, rule: list-item}\n"
        "  - name: unknown key\n"
        "    agnet: bot\n"
        "    target: /api/items\n"
        "    expect: {decision: deny, reason: no_such_reason}\n"
    )
    code, out, err = run(capsys, "policy", "test", "--policy", str(policy), str(tests))
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert f"{tests}:5:24: cases[0].expect.decision: expected one of" in lines[0]
    assert lines[1] == f"{tests}:5:39: cases[0].expect.rule: the policy has no rule 'list-item'"
    assert lines[2].startswith(f"{tests}:6:5: cases[1]: a case needs roles")
    assert lines[3].startswith(f"{tests}:7:5: unknown key 'agnet' in cases[1]")
    assert lines[4] == (
        f"{tests}:9:38: cases[1].expect.reason: unknown reason code 'no_such_reason'"
    )


def test_a_yaml_error_in_a_test_file(policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tests = policy.with_name("ops.tests.yaml")
    tests.write_text("cases:\n  - name: x\n   target: /api/items\n")
    code, _, err = run(capsys, "policy", "test", "--policy", str(policy))
    assert code == 2
    assert err.startswith(f"{tests}:3:")


def test_no_test_files_is_a_failure(policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "policy", "test", "--policy", str(policy))
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert err.startswith("capgate: error: policy test: no test files for ")
    assert "checked nothing" in err
    code, _, err = run(capsys, "policy", "test", str(policy.with_name("none.yaml")))
    assert code == 2 and "no such test file" in err


def test_a_recording_that_checks_nothing_fails(
    policy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.recording.helpers import exchange, write

    directory = write(
        tmp_path / "rec",
        *(exchange(i, "/items", b"[]", upstream="api", roles=()) for i in range(1, 4)),
    )
    code, out, err = run(capsys, "policy", "test", "--policy", str(policy), str(directory))
    assert code == 1
    assert "0 call(s) checked" in out
    [line] = err.splitlines()
    assert line == (
        f"capgate: error: policy test: {directory}: 0 calls checked (3 skipped: no roles "
        "recorded for this call (3)); nothing was compared"
    )
    code, out, _ = run(capsys, "policy", "test", "--policy", str(policy), str(directory), "--json")
    assert code == 1
    result = json.loads(out)
    assert result["ok"] is False and result["recordings"][0]["checked"] == 0


def test_the_command_runs_as_a_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "policy", "test", "policies/example.tests.yaml"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].endswith(" 0 failed")


def test_the_test_file_schema_is_published_and_fits_the_reader(tmp_path: Path) -> None:
    from jsonschema import Draft202012Validator
    from ruamel.yaml import YAML

    from gateway.commands.policy_tests import (
        CASE,
        TESTS_SCHEMA_FILE,
        case_file_schema,
        tests_schema_text,
    )

    assert (REPO / TESTS_SCHEMA_FILE).read_text() == tests_schema_text(), (
        "regenerate: capgate policy schema --tests -o docs/policy-tests.schema.json"
    )
    schema = case_file_schema()
    Draft202012Validator.check_schema(schema)
    validator = Draft202012Validator(schema)
    text = EXAMPLE_TESTS.read_text()
    assert text.splitlines()[0] == (
        "# yaml-language-server: $schema=../docs/policy-tests.schema.json"
    )
    assert list(validator.iter_errors(YAML(typ="safe").load(text))) == []
    # A typo the reader refuses, the schema refuses too.
    bad = {
        "cases": [{"name": "x", "agnet": "bot", "target": "/a", "expect": {"decision": "allow"}}]
    }
    assert list(validator.iter_errors(bad))
    assert set(schema["properties"]["cases"]["items"]["properties"]) == set(
        CASE.required + CASE.optional
    )
