"""The names of a policy's ``sql:`` settings are read without sqlglot for PostgreSQL and SQLite
when sqlglot's reading of them is plain (``names._hand_parts``): this proves the hand reading
equal to sqlglot's, accepted names and refusals alike, for every name hypothesis makes."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlglot.dialects.dialect import Dialect

from gateway.checks.sql import names
from gateway.policy_file import PolicyError
from gateway.testing import policy_from_text

DIALECTS = ("postgres", "sqlite")


def _installed_words() -> set[str]:
    """The leading word of every keyword, comment and string prefix of the installed sqlglot's
    PostgreSQL and SQLite tokenizers: what its tokenizer may read as other than a name."""
    words: set[str] = set()
    for dialect in DIALECTS:
        tokenizer: Any = Dialect.get_or_raise(dialect).tokenizer_class
        keys = (*tokenizer.KEYWORDS, *tokenizer._COMMENTS, *tokenizer._QUOTES)
        for key in (*keys, *tokenizer._FORMAT_STRINGS):
            match = re.match(r"[A-Z0-9_]+", key.upper())
            if match:
                words.add(match.group())
    return words


def test_the_word_list_covers_the_installed_sqlglot() -> None:
    missing = _installed_words() - set(names._SQLGLOT_WORDS.split())
    assert not missing, f"add to names._SQLGLOT_WORDS: {sorted(missing)}"


def outcome(read: Callable[[str, str], Any], text: str, dialect: str) -> Any:
    try:
        return read(text, dialect)
    except ValueError as exc:
        return ("refused", str(exc))


WORDS = sorted(names._SQLGLOT_WORDS.split())
# Letters whose upper case is ASCII (long s, dotless i, ligatures, sharp s), and others.
ODD_LETTERS = "ſıﬁﬂﬀﬃﬄﬅﬆßKÅéÉΣİǅª²_$"


@st.composite
def bare_word(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 4))
    if kind == 0:  # a keyword, a prefix of one, or one with a tail
        word = draw(st.sampled_from(WORDS))
        word = word[: draw(st.integers(1, len(word)))] + draw(st.sampled_from(["", "", "s", "$"]))
    elif kind == 1:
        word = draw(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True))
    elif kind == 2:
        word = draw(st.from_regex(r"[A-Za-z_][A-Za-z0-9_$]{0,6}", fullmatch=True))
    elif kind == 3:  # keyword look-alikes through Unicode upper case
        word = draw(st.sampled_from(WORDS)).lower()
        i = draw(st.integers(0, len(word)))
        word = word[:i] + draw(st.sampled_from(ODD_LETTERS)) + word[i:]
    else:
        word = draw(
            st.text(st.characters(categories=["L", "N", "Pc", "Mn"]), min_size=1, max_size=5)
        )
    mixed = "".join(c.upper() if draw(st.booleans()) else c for c in word)
    return draw(st.sampled_from([word, mixed]))


@st.composite
def quoted(draw: st.DrawFn) -> str:
    quote = draw(st.sampled_from(['"', "`"]))
    alphabet = st.one_of(
        st.sampled_from(['"', "`", ".", " ", "\\", "'", "\n", "$", "[", "]", "A", "a"]),
        st.characters(codec="utf-8"),
    )
    body = draw(st.text(alphabet, min_size=1, max_size=8))
    inner = draw(st.sampled_from(WORDS)) if draw(st.booleans()) else body
    return quote + inner.replace(quote, quote * 2) + quote


part = st.one_of(bare_word(), quoted())


@st.composite
def name(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 9)) == 0:  # anything at all: the shape check refuses most
        return draw(st.text(st.sampled_from('ab."`$. Sé1'), max_size=10))
    return ".".join(draw(st.lists(part, min_size=1, max_size=4)))


FAST = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


READERS: dict[str, tuple[Callable[[str, str], Any], Callable[[str, str], Any], re.Pattern[str]]] = {
    "table": (names.parse_table_name, names.sqlglot_table_name, names._TABLE_TEXT),
    "column": (names.parse_column_name, names.sqlglot_column_name, names._COLUMN_TEXT),
    "identifier": (names.parse_identifier, names.sqlglot_identifier, re.compile(names._IDENT_PART)),
}


def assert_agree(kind: str, text: str, dialect: str) -> None:
    """The reading of ``text`` is sqlglot's: the same name, or the same refusal; a text not of
    the shape of a name is refused before either reads it."""
    read, by_sqlglot, shape = READERS[kind]
    got = outcome(read, text, dialect)
    if shape.fullmatch(text):
        assert got == outcome(by_sqlglot, text, dialect), (kind, text, dialect)
    else:
        assert got[0] == "refused", (kind, text, dialect)


@FAST
@given(text=name(), dialect=st.sampled_from(DIALECTS))
@example(text="select", dialect="postgres")
@example(text="orders.ssn", dialect="sqlite")
@example(text='"Orders"."SSN"', dialect="postgres")
@example(text="aſ", dialect="sqlite")
@example(text="`a``b`", dialect="postgres")
def test_table_names_read_as_sqlglot_reads_them(text: str, dialect: str) -> None:
    assert_agree("table", text, dialect)


@FAST
@given(text=name(), dialect=st.sampled_from(DIALECTS))
@example(text="t.select", dialect="postgres")
@example(text="null.c", dialect="sqlite")
@example(text='public."Orders".Id', dialect="postgres")
def test_column_names_read_as_sqlglot_reads_them(text: str, dialect: str) -> None:
    assert_agree("column", text, dialect)


@FAST
@given(text=part, dialect=st.sampled_from(DIALECTS))
@example(text="SELECT", dialect="postgres")
@example(text="`Abc`", dialect="postgres")
@example(text='"Abc"', dialect="sqlite")
@example(text="a$B", dialect="postgres")
@example(text="`;`", dialect="postgres")  # sqlglot raised TypeError (a traceback at load)
def test_identifiers_read_as_sqlglot_reads_them(text: str, dialect: str) -> None:
    assert_agree("identifier", text, dialect)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_word_in_every_place(dialect: str) -> None:
    """Each word of the list (and its lower case) alone, first, in the middle and last."""
    for word in WORDS:
        for w in (word, word.lower()):
            assert_agree("identifier", w, dialect)
            for text in (w, f"{w}.b", f"a.{w}", f"a.{w}.c", f"a.b.{w}", f"{w}.b.c"):
                assert_agree("table", text, dialect)
            for text in (f"t.{w}", f"{w}.c", f"a.{w}.c", f"a.b.c.{w}", f"{w}.a.b.c"):
                assert_agree("column", text, dialect)


def test_plain_names_load_no_sqlglot() -> None:
    """What the example policy names is read without sqlglot (run in a fresh interpreter)."""
    import subprocess

    code = (
        "import sys\n"
        "from gateway.checks.sql.names import parse_table_name, parse_column_name, "
        "parse_identifier\n"
        "for d in ('postgres', 'sqlite'):\n"
        "    parse_table_name('orders', d); parse_table_name('public.Customers', d)\n"
        "    parse_column_name('customers.ssn', d); parse_identifier('created_at', d)\n"
        "    parse_identifier('\"Mixed Case\"', d)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sqlglot', 'pglast')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("text", ["`;`", "`;;`", "`; `"])
def test_a_name_sqlglot_cannot_read_is_a_line_numbered_error_not_a_crash(text: str) -> None:
    # sqlglot raises TypeError (not its own error) on some quoted texts: the policy check
    # printed a traceback; the name is refused with the file's line and column.
    policy = POLICY_WITH_COLUMN.replace("COLUMN", text)
    with pytest.raises(PolicyError) as info:
        policy_from_text(policy, "p.yaml")
    assert "is not an identifier for postgres" in str(info.value)
    assert "p.yaml:11:" in str(info.value)


POLICY_WITH_COLUMN = """version: 1
agents: {"*": [analyst]}
upstreams:
  db: {url: "http://127.0.0.1:9"}
roles:
  analyst:
    rules:
      - id: query
        upstream: db
        allow: POST /query
        sql: {field: sql, dialect: postgres, tables: [orders], schema: {orders: [id, "COLUMN"]}}
"""
