"""The policy file's vocabulary as data (``policy/spec.py``) and the JSON Schema made from it:
the schema accepts what the loader accepts, and refuses the mistakes the loader refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from ruamel.yaml import YAML

from gateway.policy.load import load_policy
from gateway.policy.spec import RULE, policy_schema
from gateway.policy_file import PolicyError

ROOT = Path(__file__).resolve().parent.parent
POLICIES = [ROOT / "policies" / "example.yaml", ROOT / "tests" / "policies" / "gateway.yaml"]


def plain(text: str) -> Any:
    return YAML(typ="safe").load(text)


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schema = policy_schema()
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.name)
def test_the_policies_the_loader_accepts_are_valid(
    validator: Draft202012Validator, path: Path
) -> None:
    load_policy(path)
    assert list(validator.iter_errors(plain(path.read_text()))) == []


BASE = """
version: 1
upstreams:
  svc: {url: "http://127.0.0.1:9"}
agents:
  bot: [r]
roles:
  r:
    rules:
      - {id: a, upstream: svc, allow: GET /x}
"""


def test_the_base_is_valid(validator: Draft202012Validator) -> None:
    # Else every mistake below would be "found" for the base's own fault.
    load_policy("policy.yaml", text=BASE)
    assert list(validator.iter_errors(plain(BASE))) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("{id: a, upstream: svc, allow: GET /x}", "{id: a, upstream: svc, allow: GET /x, alow: 1}"),
        ("{id: a, upstream: svc, allow: GET /x}", "{upstream: svc, allow: GET /x}"),
        ("{id: a, upstream: svc, allow: GET /x}", "{id: a, upstream: svc, allow: FETCH /x}"),
        (
            "{id: a, upstream: svc, allow: GET /x}",
            "{id: a, upstream: svc, allow: GET /x, rate: fast}",
        ),
        ('{url: "http://127.0.0.1:9"}', '{url: "http://127.0.0.1:9", kind: grpc}'),
        ('{url: "http://127.0.0.1:9"}', '{url: "http://x", credentials: {type: token}}'),
        ("version: 1", "version: 2"),
        (
            '{url: "http://127.0.0.1:9"}',
            '{url: "http://127.0.0.1:9", kind: mcp, mcp: {approval_keepalive: off}}',
        ),
        (
            "{id: a, upstream: svc, allow: GET /x}",
            "{id: a, upstream: svc, allow: POST /x, sql: {dialect: oracle, tables: [t], field: q}}",
        ),
    ],
)
def test_the_schema_and_the_loader_refuse_the_same_mistakes(
    validator: Draft202012Validator, old: str, new: str
) -> None:
    text = BASE.replace(old, new)
    assert text != BASE
    assert list(validator.iter_errors(plain(text))), text
    with pytest.raises(PolicyError):
        load_policy("policy.yaml", text=text)


def test_approval_keepalive_none_is_valid(validator: Draft202012Validator) -> None:
    for value in ("none", "15s", "200ms", "2"):
        text = BASE.replace(
            '{url: "http://127.0.0.1:9"}',
            f'{{url: "http://127.0.0.1:9", kind: mcp, mcp: {{approval_keepalive: {value}}}}}',
        )
        assert list(validator.iter_errors(plain(text))) == [], value
        load_policy("policy.yaml", text=text)


def test_every_key_is_described() -> None:
    schema = policy_schema()
    rule = schema["properties"]["roles"]["additionalProperties"]["properties"]["rules"]["items"]
    assert set(rule["properties"]) == set(RULE.required + RULE.optional) | {
        "body",
        "arguments",
        "sql",
    }
    assert all(prop.get("description") for prop in rule["properties"].values())


def test_capgate_policy_schema_prints_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "policy", "schema"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert json.loads(out) == json.loads(json.dumps(policy_schema()))


# --- the published schema and reference, and the fixtures --------------------------------------

FIXTURES = ROOT / "tests" / "fixtures" / "policies"
# Mistakes only the loader can see: references between sections, path patterns, regular
# expressions, reserved header names. The schema accepts these files; the loader does not.
LOADER_ONLY = {
    "allow_bad_segments",
    "allow_duplicate_param",
    "bad_regex",
    "duplicate_rule_id",
    "reserved_headers",
    "unknown_upstream",
}
NOT_YAML = {"duplicate_yaml_key", "yaml_indent", "yaml_indent_deeper", "yaml_syntax", "yaml_tab"}


def _policy_files() -> list[Path]:
    """Every policy under policies/ (test files, NAME.tests.yaml, are not policies)."""
    return sorted(p for p in (ROOT / "policies").rglob("*.yaml") if ".tests" not in p.name)


def test_the_committed_schema_and_reference_are_generated() -> None:
    from gateway.policy.reference import (
        REFERENCE_FILE,
        SCHEMA_FILE,
        reference_markdown,
        schema_text,
    )

    assert (ROOT / SCHEMA_FILE).read_text() == schema_text(), (
        "regenerate: capgate policy schema -o docs/policy.schema.json"
    )
    assert (ROOT / REFERENCE_FILE).read_text() == reference_markdown(), (
        "regenerate: capgate policy schema --markdown -o docs/policy-reference.md"
    )
    reference = reference_markdown()
    # every key of every section is in the reference, SQL's and the body's included
    for key in (*RULE.required, *RULE.optional, "deny_columns", "max_limit", "add_limit"):
        assert f"| `{key}` |" in reference, key


@pytest.mark.parametrize(
    "path",
    _policy_files() + sorted((FIXTURES / "good").glob("*.yaml")),
    ids=lambda p: p.name,
)
def test_every_policy_and_good_fixture_is_valid(
    validator: Draft202012Validator, path: Path
) -> None:
    load_policy(path)
    assert list(validator.iter_errors(plain(path.read_text()))) == []


@pytest.mark.parametrize("path", sorted((FIXTURES / "bad").glob("*.yaml")), ids=lambda p: p.stem)
def test_the_bad_fixtures_fail_the_schema(validator: Draft202012Validator, path: Path) -> None:
    if path.stem in NOT_YAML:
        with pytest.raises(Exception):  # noqa: B017 (any YAML error: not a document at all)
            YAML(typ="safe").load(path.read_text())
        return
    errors = list(validator.iter_errors(plain(path.read_text())))
    if path.stem in LOADER_ONLY:
        assert errors == [], "the schema now catches this one: move it out of LOADER_ONLY"
    else:
        assert errors, f"{path.name} passes the schema"


def test_the_modeline_points_editors_at_the_schema() -> None:
    first = (ROOT / "policies" / "example.yaml").read_text().splitlines()[0]
    assert first == "# yaml-language-server: $schema=../docs/policy.schema.json"
    assert (
        ROOT / "policies" / first.split("=", 1)[1]
    ).resolve() == ROOT / "docs" / "policy.schema.json"


def test_capgate_policy_schema_markdown_and_out(tmp_path: Path) -> None:
    from gateway.cli import main
    from gateway.policy.reference import reference_markdown

    out = tmp_path / "ref.md"
    assert main(["policy", "schema", "--markdown", "-o", str(out)], {}) == 0
    assert out.read_text() == reference_markdown()


def test_the_loader_reads_the_keys_the_schema_declares() -> None:
    from gateway.checks.body import BODY_KEY_SCHEMA
    from gateway.checks.sql.config import SQL_KEY_SCHEMA, SQL_KEYS, SQL_REQUIRED

    assert SQL_KEYS == tuple(SQL_KEY_SCHEMA["properties"])
    assert SQL_REQUIRED == tuple(SQL_KEY_SCHEMA["required"])
    # a key the schema declares is one the loader takes: no "unknown key" for any of them
    text = BASE.replace(
        "{id: a, upstream: svc, allow: GET /x}",
        "{id: a, upstream: svc, allow: POST /x, body: {max_size: 1KiB, schema: {type: object}}}",
    )
    load_policy("p.yaml", text=text)
    assert set(BODY_KEY_SCHEMA["properties"]) == {"schema", "max_size"}
