"""The PostgreSQL walk calls ``_Reader.node`` only for the node types in ``_LOOKED_AT`` and
goes through every other one. A type ``node`` gained a rule for but ``_LOOKED_AT`` did not list
would be walked through unchecked: this reads ``node``'s source and keeps the two equal."""

from __future__ import annotations

import ast
import inspect
import textwrap

from gateway.checks.sql import SqlPolicy
from gateway.checks.sql.postgres import _LOOKED_AT, _Reader
from gateway.errors import SqlDenied


def _kinds_compared_in_node() -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(_Reader.node)))
    kinds: set[str] = set()
    for compare in ast.walk(tree):
        if not isinstance(compare, ast.Compare) or not isinstance(compare.left, ast.Name):
            continue
        if compare.left.id != "kind":
            continue
        for right in compare.comparators:
            for const in ast.walk(right):
                if isinstance(const, ast.Constant) and isinstance(const.value, str):
                    kinds.add(const.value)
    return kinds


def test_every_node_type_with_a_rule_is_looked_at() -> None:
    compared = _kinds_compared_in_node()
    assert compared, "no 'kind == ...' found in _Reader.node: this test no longer reads it"
    assert compared == set(_LOOKED_AT)


def test_node_types_below_plain_ones_are_still_checked() -> None:
    """A denied column or function deep inside node types the walk goes through."""
    policy = SqlPolicy.create(
        "postgres",
        tables=["customers"],
        deny_columns=["customers.ssn"],
        functions=["lower"],
        server_version=15,
    )
    for text in (
        "SELECT CASE WHEN (id + 1)::int > 0 THEN ssn END FROM customers",
        "SELECT COALESCE(NULLIF(lower(name), ''), (ARRAY[ssn])[1]) FROM customers",
        "SELECT id FROM customers WHERE id IN (1, 2) AND NOT (name IS NULL OR pg_sleep(1) IS NULL)",
    ):
        try:
            policy.check(text)
        except SqlDenied:
            continue
        raise AssertionError(f"allowed: {text}")
