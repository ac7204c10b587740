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
roles:
  r:
    rules:
      - {id: a, upstream: svc, allow: GET /x}
"""


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
        text += 'agents: {"*": [r]}\n'
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
