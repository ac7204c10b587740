"""The PostgreSQL check remembers an allowed reading by the parse tree's shape (its JSON without
locations and literal values, but a LIMIT's), so texts that differ only in their literals are
walked once. These tests hold the shape to what makes that sound:

- a shape is JSON, and cutting it again gives exactly the cut of the parser's tree, so two
  texts with one shape have the same tree but for locations and literal values (the walk reads
  neither), however a literal or an identifier is spelled (quotes, backslashes, JSON look-alikes);
- what the walk does read (names, aliases, operators, parameters, the LIMIT) keeps shapes apart;
- a policy that remembers shapes gives every text the verdict a fresh policy gives it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pglast import parser as pg_parser

from gateway.checks.sql import SqlPolicy
from gateway.checks.sql import policy as sql_policy
from gateway.checks.sql import postgres as pg_check
from gateway.checks.sql.limits import SHAPE_CACHE_CHARS
from gateway.checks.sql.postgres import shape
from gateway.errors import SqlDenied
from tests.checks.sql_corpus import pg_policy


@pytest.fixture(autouse=True, scope="module")
def _no_wall_clock() -> Iterator[None]:
    """These tests compare verdicts; the wall-clock backstop (its own tests are in
    test_sql_advisories and below) would make a stall of a loaded machine a verdict."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sql_policy, "CHECK_BACKSTOP_SECONDS", 60.0)
        yield


_VALUE_KINDS = frozenset({"ival", "fval", "sval", "bsval", "boolval"})
_PLACES = frozenset({"location", "stmt_location", "stmt_len"})


def cut(node: Any, key: str = "") -> Any:
    """The reference: the decoded tree without locations and literal values (a LIMIT's stay)."""
    if isinstance(node, list):
        return [cut(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for name, value in node.items():
        if name in _PLACES:
            continue
        if name == "A_Const" and key != "limitCount" and isinstance(value, dict):
            out[name] = {
                k: ({} if k in _VALUE_KINDS and isinstance(v, dict) else v)
                for k, v in value.items()
                if k not in _PLACES
            }
            continue
        out[name] = cut(value, name)
    return out


def _tree(text: str) -> str | None:
    try:
        return str(pg_parser.parse_sql_json(text))
    except pg_parser.ParseError:
        return None


def policy(**kwargs: Any) -> SqlPolicy:
    return pg_policy(functions=["lower", "sum", "count"], **kwargs)


# -- literals and identifiers, spelled every way PostgreSQL reads them --------------------------

_CHARS = st.characters(codec="utf-8", exclude_characters="\x00")
_JSONISH = st.sampled_from(
    ['"', "\\", '\\"', '","location":1', '"},{"A_Const":{"sval":{"sval":"', '"limitCount":']
    + ['{"ival":{"ival":5}}', ',"stmt_len":3', "}", "{", ":", "'", "$", "\n", "\u2028", "é"]
)
_CONTENT = st.lists(st.one_of(st.text(_CHARS, max_size=6), _JSONISH), max_size=6).map("".join)


def _string(content: str) -> str:
    return "'" + content.replace("'", "''") + "'"


def _dollar(content: str) -> str:
    tag = "$q$"
    return tag + content.replace("$", "") + tag


def _escaped(content: str) -> str:
    return "E'" + content.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _unicode(content: str) -> str:
    return "U&'" + content.replace("\\", "\\\\").replace("'", "''") + "'"


STRINGS = st.builds(lambda f, c: f(c), st.sampled_from([_string, _dollar, _escaped]), _CONTENT)
NUMBERS = st.one_of(
    st.integers(0, 2**31 - 1).map(str),
    st.integers(2**31, 10**30).map(str),  # past int4: a numeric (fval)
    st.decimals(allow_nan=False, allow_infinity=False, places=3).map(lambda d: str(abs(d))),
)
LITERALS = st.one_of(
    STRINGS,
    NUMBERS,
    st.sampled_from(["true", "false", "NULL", "B'0101'", "X'ff'", "interval '1 day'"]),
    _CONTENT.map(_unicode),
)
IDENTIFIERS = _CONTENT.filter(lambda c: 0 < len(c.encode()) < 60).map(
    lambda c: '"' + c.replace('"', '""') + '"'
)


def statement(a: str, b: str, ident: str, limit: str) -> str:
    return (
        f"SELECT {a} AS {ident}, o.id FROM orders o "
        f"WHERE o.status = {b} AND o.id > 7 ORDER BY 1 LIMIT {limit}"
    )


@settings(max_examples=400, deadline=None)
@given(LITERALS, LITERALS, IDENTIFIERS, st.sampled_from(["5", "1000", "ALL", "$1", "5 + 1"]))
def test_a_shape_is_json_whose_cut_is_the_trees_cut(a: str, b: str, ident: str, lim: str) -> None:
    tree = _tree(statement(a, b, ident, lim))
    if tree is None:
        return
    assert cut(orjson.loads(shape(tree))) == cut(orjson.loads(tree))


@settings(max_examples=300, deadline=None)
@given(_CONTENT, _CONTENT, st.sampled_from([_string, _dollar, _escaped]))
def test_strings_of_any_content_share_one_shape(one: str, two: str, spell: Any) -> None:
    trees = [_tree(statement(spell(c), "'paid'", '"x"', "5")) for c in (one, two)]
    if None in trees:
        return
    assert shape(str(trees[0])) == shape(str(trees[1]))


@settings(max_examples=200, deadline=None)
@given(st.lists(NUMBERS, min_size=2, max_size=2))
def test_numbers_of_one_kind_share_one_shape(numbers: list[str]) -> None:
    trees = [str(_tree(statement(n, "'paid'", '"x"', "5"))) for n in numbers]
    kinds = [orjson.loads(t)["stmts"][0]["stmt"]["SelectStmt"]["targetList"][0] for t in trees]
    if list(kinds[0]["ResTarget"]["val"]["A_Const"]) != list(
        kinds[1]["ResTarget"]["val"]["A_Const"]
    ):
        return  # an int and a numeric are two shapes (sound, only less shared)
    assert shape(trees[0]) == shape(trees[1])


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ("SELECT id FROM orders LIMIT 5", "SELECT id FROM orders LIMIT 6"),
        ("SELECT id FROM orders LIMIT 5", "SELECT id FROM orders LIMIT $1"),
        ("SELECT 1 FROM orders WHERE id = $1 LIMIT 5", "SELECT 1 FROM orders WHERE id = 1 LIMIT 5"),
        ("SELECT 'a' AS x FROM orders LIMIT 5", "SELECT 'a' AS y FROM orders LIMIT 5"),
        ("SELECT 'a' FROM orders o LIMIT 5", "SELECT 'a' FROM orders p LIMIT 5"),
        ("SELECT id FROM orders WHERE id < 1 LIMIT 5", "SELECT id FROM orders WHERE id > 1"),
        ("SELECT id FROM orders WHERE id < 1", "SELECT id FROM orders WHERE id > 1"),
        ("SELECT 1 FROM orders LIMIT 5", "SELECT '1' FROM orders LIMIT 5"),
        ("SELECT 1 FROM orders LIMIT 5", "SELECT 1::text FROM orders LIMIT 5"),
        ("SELECT lower('a') FROM orders LIMIT 5", "SELECT \"LOWER\"('a') FROM orders LIMIT 5"),
        ("SELECT id FROM orders LIMIT 5", "SELECT id FROM public.orders LIMIT 5"),
        ("SELECT id FROM orders LIMIT 5", "SELECT id FROM orders LIMIT 5; SELECT 1"),
    ],
)
def test_what_the_walk_reads_keeps_shapes_apart(one: str, two: str) -> None:
    assert shape(str(_tree(one))) != shape(str(_tree(two)))


def test_texts_that_differ_only_in_literals_are_walked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    walks: list[str] = []
    root = pg_check._Reader.root

    def counted(self: Any, node: Any) -> None:
        walks.append(self.text)
        root(self, node)

    monkeypatch.setattr(pg_check._Reader, "root", counted)
    checker = policy()
    template = "SELECT o.id, o.status FROM orders o WHERE o.id > {n} AND o.status = '{s}' LIMIT 10"
    for n in range(20):
        verdict = checker.check(template.format(n=n, s="x" * n))
        assert verdict.sql == template.format(n=n, s="x" * n)
        assert verdict.tables == ("orders",)
        assert verdict.columns == ("orders.id", "orders.status")
    assert len(walks) == 1
    assert checker._shapes.info()["hits"] == 19


def test_a_remembered_limit_is_its_own_shape() -> None:
    checker = policy()
    checker.check("SELECT id FROM orders LIMIT 5")
    with pytest.raises(SqlDenied) as denied:
        checker.check("SELECT id FROM orders LIMIT 5000")
    assert (denied.value.errors or [{}])[0].get("kind") == "limit"
    assert "LIMIT 5000 is above the rule's maximum of 1000" in str(denied.value)


def test_a_refused_text_is_never_remembered_and_each_refusal_places_its_own_text() -> None:
    checker = policy()
    for pad, line, col in (("", 1, 8), ("   ", 1, 11), ("\n\n  ", 3, 3)):
        text = f"SELECT {pad}c.ssn FROM customers c WHERE c.id = {len(pad)} LIMIT 5"
        with pytest.raises(SqlDenied) as denied:
            checker.check(text)
        errors = denied.value.errors or [{}]
        assert (errors[0].get("line"), errors[0].get("col")) == (line, col)
    assert checker._shapes.info()["size"] == 0


def test_an_appended_limit_lands_at_each_texts_own_end() -> None:
    checker = policy(add_limit=True)
    first = checker.check("SELECT id FROM orders WHERE id > 1")
    second = checker.check("SELECT id FROM orders WHERE id > 22 -- a comment the tree never saw")
    assert first.sql == "SELECT id FROM orders WHERE id > 1 LIMIT 1000"
    assert second.sql == "SELECT id FROM orders WHERE id > 22 LIMIT 1000"
    assert checker._shapes.info()["hits"] >= 1


def _verdict(checker: SqlPolicy, text: str) -> Any:
    try:
        v = checker.check(text)
    except SqlDenied as denied:
        return ("denied", denied.reason, str(denied))
    return (v.sql, v.kinds, v.tables, v.columns, v.rewritten)


SKELETONS = [
    "SELECT o.id FROM orders o WHERE o.status = {a} AND o.total_cents > {b} LIMIT 5",
    "SELECT c.name FROM customers c WHERE c.name = {a} OR c.id = {b} LIMIT 5",
    "SELECT c.ssn FROM customers c WHERE c.name = {a} AND c.id = {b} LIMIT 5",
    "SELECT lower({a}), count(*) FROM orders WHERE status IN ({a}, {b}) GROUP BY 1 LIMIT 5",
    "SELECT {a} AS ssn, id FROM orders WHERE id = {b}",
    "SELECT id FROM orders WHERE id = {b} LIMIT {b}",
    "WITH x AS (SELECT id, {a} AS v FROM orders) SELECT v FROM x WHERE id > {b} LIMIT 5",
    "SELECT * FROM (SELECT {a} AS ssn) t, orders o WHERE o.id = {b} LIMIT 5",
    "SELECT id FROM orders WHERE status = {a} FETCH FIRST {b} ROWS ONLY",
]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(SKELETONS),
    st.lists(st.tuples(LITERALS, NUMBERS), min_size=2, max_size=4),
    st.booleans(),
)
def test_a_remembered_shape_gives_the_verdict_a_fresh_check_gives(
    skeleton: str, literals: list[tuple[str, str]], add_limit: bool
) -> None:
    shared = policy(add_limit=add_limit)
    for a, b in literals:
        text = skeleton.format(a=a, b=b)
        assert _verdict(shared, text) == _verdict(policy(add_limit=add_limit), text), text


def test_what_shapes_remember_is_bounded_by_their_texts() -> None:
    """A reading's names come from its text: each shape weighs its text's length, and the
    rule's shapes weigh at most ``SHAPE_CACHE_CHARS`` (an agent cannot grow them without
    bound with long, distinct, allowed statements)."""
    checker = policy()
    text = "SELECT o.id, o.status FROM orders o WHERE o.id > 1 LIMIT 10"
    checker.check(text)
    assert checker._shapes.info()["size"] == 1
    assert checker._shapes._weight == len(text)
    assert checker._shapes.max_weight == SHAPE_CACHE_CHARS


def test_a_check_past_the_backstop_remembers_no_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wall-clock backstop's refusal is never remembered, and neither is the shape of
    what that check read: the next text of the shape is walked again."""
    checker = policy()
    text = "SELECT o.id FROM orders o WHERE o.id > {n} LIMIT 10"
    monkeypatch.setattr(sql_policy, "CHECK_BACKSTOP_SECONDS", -1.0)
    with pytest.raises(SqlDenied, match="longer than"):
        checker.check(text.format(n=1))
    assert checker._shapes.info()["size"] == 0
    monkeypatch.setattr(sql_policy, "CHECK_BACKSTOP_SECONDS", 60.0)
    checker.check(text.format(n=2))
    assert checker._shapes.info() == {"hits": 0, "misses": 2, "size": 1}
    checker.check(text.format(n=3))
    assert checker._shapes.info()["hits"] == 1
