"""JSON Schemas in a policy are read strictly: a typo is a policy error at its line and column,
``format`` is asserted, every ``$ref`` resolves inside the schema when the policy loads."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.checks.json_schema import KEYWORDS
from gateway.errors import BodyInvalid
from gateway.policy_file import PolicyError
from gateway.stages.validate import Validate
from gateway.testing import make_call, matching, policy_from_text, run_stages

HEAD = """\
version: 1
agents: {"*": [r]}
upstreams:
  svc: {url: "http://127.0.0.1:9"}
roles:
  r:
    rules:
      - id: post
        upstream: svc
        allow: POST /things
        body:
          schema:
"""


def policy_with(schema_yaml: str) -> Any:
    """The policy with ``schema_yaml`` (indented by 12) as the rule's body schema."""
    return policy_from_text(HEAD + schema_yaml)


def errors_of(schema_yaml: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        policy_with(schema_yaml)
    return [str(issue) for issue in info.value.issues]


async def check(policy: Any, body: Any) -> None:
    call = make_call("POST", "/svc/things", body=json.dumps(body).encode(), roles=["r"])
    await run_stages(call, *matching(policy), Validate())


def test_a_misspelt_keyword_is_a_policy_error_at_its_line_and_column() -> None:
    [error] = errors_of(
        "            type: object\n"
        "            properties: {name: {type: string}}\n"
        "            additionalProperty: false\n"
    )
    assert error.startswith("policy.yaml:15:13: ")
    assert "unknown JSON Schema keyword 'additionalProperty'" in error
    assert "did you mean 'additionalProperties'?" in error


@pytest.mark.parametrize(
    ("schema", "line", "col"),
    [
        ("            properties:\n              a: {type: string, maxLenght: 3}\n", 14, 33),
        ("            items: {minimum: 0, exclusiveMax: 3}\n", 13, 33),
        ("            allOf:\n              - {requried: [a]}\n", 14, 18),
        ("            $defs:\n              x: {typ: string}\n", 14, 19),
        ("            if: {const: 1}\n            then: {enumm: [1]}\n", 14, 20),
        ("            patternProperties:\n              '^a': {formt: email}\n", 14, 22),
    ],
)
def test_unknown_keywords_are_found_in_every_subschema(schema: str, line: int, col: int) -> None:
    [error] = errors_of(schema)
    assert error.startswith(f"policy.yaml:{line}:{col}: "), error
    assert "unknown JSON Schema keyword" in error


def test_keywords_of_older_drafts_and_of_other_documents_are_refused_with_a_hint() -> None:
    errors = errors_of(
        "            definitions: {a: {type: string}}\n"
        "            dependencies: {a: [b]}\n"
        "            $id: https://example.com/s\n"
    )
    assert len(errors) == 3
    assert any("use '$defs'" in e for e in errors)
    assert any("dependentRequired" in e for e in errors)
    assert any("self-contained" in e for e in errors)


def test_schema_must_be_draft_2020_12() -> None:
    [error] = errors_of("            $schema: http://json-schema.org/draft-04/schema#\n")
    assert "Draft 2020-12" in error


def test_refs_resolve_inside_the_schema_when_the_policy_loads() -> None:
    policy_with(
        "            $defs: {name: {type: string, maxLength: 3}}\n"
        "            properties: {a: {$ref: '#/$defs/name'}}\n"
    )
    [error] = errors_of("            properties: {a: {$ref: '#/$defs/missing'}}\n")
    assert "points to nothing" in error
    [error] = errors_of("            properties: {a: {$ref: 'https://example.com/s.json'}}\n")
    assert "must point inside the schema" in error


def test_an_unknown_format_is_a_policy_error() -> None:
    [error] = errors_of("            properties: {a: {type: string, format: e-mail}}\n")
    assert "format 'e-mail' cannot be checked" in error


def test_annotations_and_x_keywords_are_accepted() -> None:
    policy_with(
        "            title: a thing\n"
        "            description: the thing\n"
        "            x-owner: payments\n"
        "            $comment: reviewed\n"
        "            examples: [{}]\n"
        "            properties: {a: {type: string, default: x, deprecated: true}}\n"
    )


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        ("email", "a@example.com", "not-an-address"),
        ("date-time", "2026-12-01T10:00:00Z", "2026-13-01T10:00:00Z"),
        ("uri", "https://example.com/a", "not a uri"),
        ("ipv4", "10.0.0.1", "10.0.0.256"),
        ("uuid", "12345678-1234-5678-1234-567812345678", "1234"),
        ("hostname", "db.internal", "-bad-.host"),
        ("iri", "https://例え.jp/パス", "not an iri"),
        ("iri-reference", "/パス?q=1", "a b"),
    ],
)
async def test_format_is_asserted(fmt: str, good: str, bad: str) -> None:
    policy = policy_with(f"            properties: {{a: {{type: string, format: {fmt}}}}}\n")
    await check(policy, {"a": good})
    with pytest.raises(BodyInvalid) as info:
        await check(policy, {"a": bad})
    assert info.value.errors and info.value.errors[0]["keyword"] == "format"


async def test_pattern_searches_so_an_unanchored_pattern_matches_anywhere() -> None:
    """As the specification says and the README documents: anchor patterns."""
    loose = policy_with("            properties: {a: {type: string, pattern: '[a-z]+'}}\n")
    await check(loose, {"a": "; DROP TABLE x --"})
    anchored = policy_with("            properties: {a: {type: string, pattern: '^[a-z]+$'}}\n")
    with pytest.raises(BodyInvalid):
        await check(anchored, {"a": "; DROP TABLE x --"})


async def test_a_body_failing_everywhere_costs_a_bounded_number_of_errors() -> None:
    policy = policy_with("            items: {type: string}\n")
    with pytest.raises(BodyInvalid) as info:
        await check(policy, list(range(50_000)))
    assert len(info.value.errors) == 5


KEY = st.from_regex(re.compile(r"[a-zA-Z$][a-zA-Z0-9_]{0,20}"), fullmatch=True)


@given(KEY)
def test_any_keyword_outside_draft_2020_12_is_refused(keyword: str) -> None:
    text = f"            {json.dumps(keyword)}: 1\n"
    if keyword in KEYWORDS:
        return  # known: the meta-schema judges its value
    with pytest.raises(PolicyError) as info:
        policy_with(text)
    assert info.value.issues[0].line == 13


def test_the_iri_grammar_is_loaded_only_by_a_policy_that_uses_it() -> None:
    """Its import builds a grammar (~1.6 s, most of start-up): a gateway whose policy has no
    ``iri`` format never pays for it; one whose policy has one pays while the policy loads."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    probe = (
        "import sys, gateway.app\n"
        "from gateway.testing import policy_from_text\n"
        "stand_in = lambda: getattr(sys.modules['rfc3987_syntax'], '__capgate_stand_in__', 0)\n"
        "print(stand_in())\n"
        "policy_from_text(sys.stdin.read())\n"
        "print(stand_in())\n"
    )
    text = HEAD + "            properties: {a: {type: string, format: iri}}\n"
    done = subprocess.run(
        [sys.executable, "-c", probe], input=text, capture_output=True, text=True, cwd=ROOT
    )
    assert done.stdout.split() == ["True", "0"], done.stderr
