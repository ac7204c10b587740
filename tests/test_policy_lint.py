"""``capgate policy lint``: one test per warning (FILE:LINE:COL, stable code), silencing with
``# capgate: allow CGnnn``, ``--json`` and the exit status (0 clean, 1 warnings, 2 errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.policy.lint import CODES, lint_file
from tests.helpers_core import REPO

HEAD = """\
version: 1
upstreams:
  api: {url: "http://127.0.0.1:9"}
agents:
  bot: [ops]
roles:
  ops:
    rules:
"""


def lint(tmp_path: Path, rules: str, head: str = HEAD) -> list[str]:
    path = tmp_path / "p.yaml"
    path.write_text(head + rules)
    return [str(w).replace(f"{path}:", "", 1) for w in lint_file(path) if not w.silenced]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv), {})
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_the_example_policy_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "policy", "lint", str(REPO / "policies" / "example.yaml"))
    assert (code, out) == (0, "0 warning(s) in 1 file(s)\n")


def test_cg101_a_regex_that_accepts_anything(tmp_path: Path) -> None:
    assert lint(
        tmp_path,
        "      - id: a\n"
        "        upstream: api\n"
        "        allow: GET /items/{name}\n"
        "        params: {name: {regex: '.*'}}\n"
        "        query: {q: {regex: '[a-z]+'}, r: {regex: '(?s).*'}}\n",
    ) == [
        "12:32: CG101: rule 'a': params 'name': regex '.*' accepts anything ('../', quotes, "
        "NUL): say what the value looks like, e.g. '[a-z0-9-]{1,64}'",
        "13:50: CG101: rule 'a': query 'r': regex '(?s).*' accepts anything ('../', quotes, "
        "NUL): say what the value looks like, e.g. '[a-z0-9-]{1,64}'",
    ]


def test_cg101_an_agent_pattern_that_takes_every_name(tmp_path: Path) -> None:
    head = HEAD.replace("  bot: [ops]", '  "*": [ops]')
    [warning] = lint(tmp_path, "      - {id: a, upstream: api, allow: GET /items}\n", head)
    assert warning.startswith("5:3: CG101: agent '*' declares every agent name")


def test_cg102_an_unconstrained_path_parameter(tmp_path: Path) -> None:
    warnings = lint(
        tmp_path,
        "      - {id: a, upstream: api, allow: 'GET /items/{id}'}\n"
        "      - {id: b, upstream: api, allow: 'GET /users/{id}', params: {id: {integer: true}}}\n"
        "      - {id: c, upstream: api, allow: 'GET /docs/{id}', params: {id: {max_length: 9}}}\n",
    )
    assert warnings == [
        "9:39: CG102: rule 'a': path parameter {id} is unconstrained: any segment passes; "
        "add 'params: {id: {regex: ..., enum: [...] or integer: true}}'",
        "11:70: CG102: rule 'c': path parameter {id} is unconstrained: any segment passes; "
        "add 'params: {id: {regex: ..., enum: [...] or integer: true}}'",
    ]


def test_cg103_a_write_without_a_body_check(tmp_path: Path) -> None:
    warnings = lint(
        tmp_path,
        "      - {id: a, upstream: api, allow: POST /items}\n"
        "      - {id: b, upstream: api, allow: PUT /items, body: {max_size: 1KiB}}\n"
        "      - {id: c, upstream: api, allow: PATCH /items, body: {schema: true}}\n"
        "      - {id: d, upstream: api, allow: POST /x, body: {schema: {type: object}}}\n"
        "      - {id: e, upstream: api, allow: DELETE /items}\n",
    )
    assert [w.split(": ", 2)[:2] for w in warnings] == [
        ["9:39", "CG103"],
        ["10:39", "CG103"],
        ["11:39", "CG103"],
    ]
    assert warnings[0].endswith(
        "rule 'a': POST without a check of the body: add 'body: {schema: ...}' (a JSON "
        "Schema) or 'sql:'"
    )


def test_cg103_an_mcp_tool_without_arguments(tmp_path: Path) -> None:
    head = HEAD.replace('{url: "http://127.0.0.1:9"}', '{url: "http://127.0.0.1:9", kind: mcp}')
    warnings = lint(
        tmp_path,
        "      - {id: a, upstream: api, allow: POST /mcp, tool: anything}\n"
        "      - {id: b, upstream: api, allow: POST /mcp, tool: x, arguments: {type: object}}\n"
        "      - {id: c, upstream: api, allow: POST /mcp}\n",
        head,
    )
    assert warnings == [
        "9:39: CG103: rule 'a': POST without a check of the tool's arguments: add "
        "'arguments:' (a JSON Schema of the tool's input)"
    ]


def test_cg104_a_rule_shadowed_by_an_earlier_one(tmp_path: Path) -> None:
    warnings = lint(
        tmp_path,
        "      - {id: any-item, upstream: api, allow: 'GET /items/{id}',\n"
        "         params: {id: {regex: '[0-9]+'}}}\n"
        "      - {id: item-7, upstream: api, allow: GET /items/7, query: {full: [yes]}}\n"
        "      - {id: item-x, upstream: api, allow: GET /items/x}\n"
        "      - {id: item-8, upstream: api, allow: GET /items/8}\n"
        "      - {id: same, upstream: api, allow: 'GET /items/{id}',\n"
        "         params: {id: {regex: '[0-9]+'}}, headers: {X-Trace: {regex: '[a-f]+'}}}\n",
    )
    # item-7 takes a query any-item refuses, so a call with it falls through: not shadowed;
    # item-x is not a number; item-8 is.
    assert warnings == [
        "13:44: CG104: rule 'item-8' is shadowed by rule 'any-item' (line 9), which matches "
        "every call it does and is tried first: its checks never run; put it first, or "
        "narrow 'any-item'",
        "14:42: CG104: rule 'same' is shadowed by rule 'any-item' (line 9), which matches "
        "every call it does and is tried first: its checks never run; put it first, or "
        "narrow 'any-item'",
    ]


def test_cg105_and_cg106_unused_upstreams_and_roles(tmp_path: Path) -> None:
    head = HEAD.replace(
        '  api: {url: "http://127.0.0.1:9"}\n',
        '  api: {url: "http://127.0.0.1:9"}\n  old: {url: "http://127.0.0.1:10"}\n',
    )
    warnings = lint(
        tmp_path,
        "      - {id: a, upstream: api, allow: GET /items}\n"
        "  spare:\n"
        "    rules:\n"
        "      - {id: b, upstream: api, allow: GET /other}\n",
        head,
    )
    assert warnings == [
        "4:3: CG105: upstream 'old' is not used by any rule: remove it, or add the rules",
        "11:3: CG106: role 'spare' is not held by any agent: no token can use it",
    ]


def test_a_comment_silences_one_code_on_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        HEAD + "      - {id: a, upstream: api, allow: 'GET /items/{id}'}  # capgate: allow CG102\n"
        "      # capgate: allow CG103, CG102\n"
        "      - {id: b, upstream: api, allow: 'POST /items/{id}'}\n"
        "      - {id: c, upstream: api, allow: POST /x}  # capgate: allow CG102\n"
    )
    code, out, _ = run(capsys, "policy", "lint", str(path))
    assert code == 1
    assert out.splitlines() == [
        f"{path}:12:39: CG103: rule 'c': POST without a check of the body: add 'body: "
        "{schema: ...}' (a JSON Schema) or 'sql:'",
        "1 warning(s), 3 silenced with '# capgate: allow' in 1 file(s)",
    ]
    code, out, _ = run(capsys, "policy", "lint", str(path), "--json", "--show-silenced")
    assert code == 1
    result = json.loads(out)
    assert result["ok"] is False and result["silenced"] == 3
    assert [(w["line"], w["code"], w["silenced"]) for w in result["warnings"]] == [
        (9, "CG102", True),
        (11, "CG102", True),
        (11, "CG103", True),
        (12, "CG103", False),
    ]
    assert {w["code"] for w in result["warnings"]} == {"CG102", "CG103"}
    assert all(w["title"] == CODES[w["code"]] for w in result["warnings"])


def test_a_policy_with_errors_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(HEAD + "      - {id: a, upstream: nowhere, allow: GET /x}\n")
    code, out, _ = run(capsys, "policy", "lint", str(path))
    assert code == 2
    assert out.startswith(f"{path}:9:27: unknown upstream 'nowhere'")
    code, out, _ = run(capsys, "policy", "lint", "--json", str(path))
    assert code == 2 and json.loads(out)["errors"][0].startswith(f"{path}:9:27:")


def test_a_comment_above_a_rule_silences_its_warnings(tmp_path: Path) -> None:
    warnings = lint(
        tmp_path,
        "      # capgate: allow CG102 (ids are opaque; the service checks them)\n"
        "      - id: a\n"
        "        upstream: api\n"
        "        allow: GET /items/{id}\n"
        "      - id: b  # capgate: allow CG103\n"
        "        upstream: api\n"
        "        allow: POST /items/{id}\n",
    )
    # a's CG102 and b's CG103 are silenced; b's CG102 is not.
    assert [w.split(": ")[1] for w in warnings] == ["CG102"]
    assert warnings[0].startswith("15:16: CG102: rule 'b'")
