"""The SQLite token reader's fast paths read every text exactly as the per-character rules do:
the token list (``code_tokens``, one regular expression) and the outline the SQLite check reads
(``outline``, one regular expression passing over the tokens it has no use for), each against
the reference (``slow_tokens``; ``outline_of`` those tokens). The corpus, and hypothesis texts
made of the characters where the readings could part (quotes, digits, dots, '=', 'x', non-ASCII
letters and digits) and of the outline's words in any case, whole or cut, and look-alikes."""

from __future__ import annotations

import re
import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.checks.sql import sqlite_tokens as tok
from gateway.checks.sql.sqlite_tokens import Kind, code_tokens, outline, outline_of, slow_tokens
from tests.checks import sql_corpus

ALPHABET = "ab xX_$019.eE=<>!-/*|+%&~'\"`[]();,?:@#\t\nü٣²"
# The outline's words, in other cases and cut short or run on, the leading commands, and
# non-ASCII letters whose upper case is ASCII (ſ: S, ı: I) or whose lower case is (K: k).
WORDS = sorted(tok._OUTLINE_WORDS) + ["limit", "Join", "oN", "usinG", "natural", "FRO", "ON_"]
WORDS += ["LIMIT1", "OFFSET", "ſelect", "LıMIT", "uſing", "Kelvin", "PRAGMA", "END", "x'ab'"]
PIECES = st.one_of(st.sampled_from(ALPHABET), st.sampled_from(WORDS), st.just(" "))


def reference(text: str) -> list[tok.Token]:
    return [t for t in slow_tokens(text) if t.kind is not Kind.SPACE]


def reference_first_keyword(text: str) -> str | None:
    tokens = reference(text)
    return tok.keyword(tokens[0]) if tokens else None


def corpus() -> list[str]:
    texts = sql_corpus.read_fixture("sqlite", "allowed.sql")
    texts += sql_corpus.read_fixture("sqlite", "denied.sql")
    texts += sql_corpus.mutations("sqlite", seed=3, budget=2000)
    return texts


def test_the_corpus_reads_the_same() -> None:
    for text in corpus():
        assert code_tokens(text) == reference(text)


def test_the_corpus_outlines_the_same() -> None:
    for text in corpus():
        assert outline(text) == outline_of(reference(text)), text
        assert tok.first_keyword(text) == reference_first_keyword(text), text


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40))
def test_any_text_reads_the_same(text: str) -> None:
    assert code_tokens(text) == reference(text)


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40))
def test_any_text_outlines_the_same(text: str) -> None:
    assert outline(text) == outline_of(reference(text))
    assert tok.first_keyword(text) == reference_first_keyword(text)


@settings(max_examples=3000, deadline=None)
@given(st.lists(PIECES, max_size=30).map("".join))
def test_any_text_of_words_outlines_the_same(text: str) -> None:
    assert outline(text) == outline_of(reference(text))
    assert code_tokens(text) == reference(text)
    assert tok.first_keyword(text) == reference_first_keyword(text)


@settings(max_examples=1000, deadline=None)
@given(st.lists(PIECES, max_size=20).map("".join))
def test_the_tokens_after_a_token_read_the_same(text: str) -> None:
    tokens = slow_tokens(text)
    for token in tokens:
        after = [t for t in tokens if t.start >= token.end and t.kind is not Kind.SPACE]
        assert code_tokens(text, token.end) == after


PASSED = re.compile(tok._PASSED, re.DOTALL)
WORD = re.compile(f"(?:{tok._WORDS}){tok._NAME_ENDS}", re.DOTALL)


def check_the_outline_reads_whole_tokens(text: str) -> None:
    """Where a token starts, what ``_OUTLINE`` passes over is that whole token and one the
    outline has no use for, and a word it stops at is that whole token and one of its words."""
    for token in slow_tokens(text):
        passed = PASSED.match(text, token.start)
        if passed is not None:
            assert passed.end() == token.end, (text, token)
            assert token.kind is not Kind.SPACE and token.text not in ("(", ")", ",", ";")
            assert tok.keyword(token) not in tok._OUTLINE_WORDS, (text, token)
        word = WORD.match(text, token.start)
        if word is not None:
            assert word.end() == token.end, (text, token)
            assert tok.keyword(token) in tok._OUTLINE_WORDS, (text, token)


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40))
def test_the_outline_passes_over_whole_tokens(text: str) -> None:
    check_the_outline_reads_whole_tokens(text)


@settings(max_examples=3000, deadline=None)
@given(st.lists(PIECES, max_size=30).map("".join))
def test_the_outline_passes_over_whole_tokens_of_words(text: str) -> None:
    check_the_outline_reads_whole_tokens(text)


def check_the_tokens_after_limit(text: str) -> None:
    found = outline(text)
    if found.limit_start >= 0:
        after = [t for t in reference(text) if t.start >= found.limit_end]
        while after and after[-1].text == ";":
            after.pop()
        assert tok.tokens_to_end(text, found.limit_end, found.end) == after, text


@settings(max_examples=2000, deadline=None)
@given(st.lists(PIECES, max_size=30).map(lambda pieces: "LIMIT " + "".join(pieces)))
def test_the_tokens_after_limit_read_the_same(text: str) -> None:
    check_the_tokens_after_limit(text)


def test_the_cases_where_the_fast_path_must_stop() -> None:
    cases = ["abü", "12abc", "1.5e3", "x'ab'", "a==b", ".5", "'a''", '"a""', "'it''s'"]
    cases += ["a--b\nc", "a /*x*/b", "a/*", "/*", "a/", "a->>b->c-d", "a!b!=c", "a<<=b<>c"]
    cases += ["a||b|c"]
    cases += ["", "  ", "a  ", " \t-- only a comment", "a -", "1.", "?1 :a @b $c::d(e) #f"]
    for text in cases:
        assert code_tokens(text) == reference(text), text
        assert outline(text) == outline_of(reference(text)), text


def test_the_outline_of_a_query() -> None:
    text = "SELECT a FROM t, u NATURAL JOIN v USING (w) WHERE x IN (SELECT 1 LIMIT 2) LIMIT 5 ;;"
    found = outline(text)
    assert found == outline_of(reference(text))
    assert (found.joins, found.natural, found.using) == (2, True, True)
    assert text[found.limit_start : found.limit_end] == "LIMIT"
    assert text[found.limit_start : found.end] == "LIMIT 5"


def test_the_outline_reads_names_as_the_reference_does() -> None:
    cases = ["SELECT a FROM b LıMIT 5", "SELECT a FROM b ſelect c", "a JOINü b", '"LIMIT" 5']
    cases += ["a [LIMIT] 5", "a `JOIN` b", "a 'FROM' b, c", "FROM a, b -- LIMIT 5", "FROM a /*,*/"]
    cases += ["a; LIMIT 5; ;", "; ;", "LIMIT", "x'LIMIT'", "$LIMIT", ":JOIN", "a.LIMIT 5"]
    cases += ["FROM a , (b, c) , d", "FROM (a, b", "a) , b FROM c", "LIMIT\x00 5", "LIMIT\u00a05"]
    cases += ["FROM a, 1ſelect, b", "SELECT 1LıMIT 5", "FROM a, b1ſelect, c", "x'a'ſelect"]
    cases += ["FROM a, 'b'ſelect, c", 'FROM a, "b"ſelect, c', "FROM a, 1.ſelect, c", "a=ſelect"]
    cases += [
        "LIMIT 5",
        "LIMIT 5;",
        "LIMIT 5 ; ;",
        "LIMIT 5;x",
        "LIMIT 5x",
        "LIMIT 5ü",
        "LIMIT 5.0",
    ]
    cases += [
        "LIMIT 5 -- c",
        "LIMIT 5 /* c",
        "LIMIT 0x10",
        "LIMIT 5, 6",
        "LIMIT 5 OFFSET 6",
        "LIMIT",
    ]
    cases += ["LIMIT ;5", "LIMIT 1_000", "LIMIT 5e2", "LIMIT ٣", "LIMIT 5 LIMIT 6", "LIMIT (5)"]
    cases += [" pragma x", "/* c */ PRAGMA x", "-- c\nEXPLAIN x", "[PRAGMA]", "PRAGMAü", "x'1'"]
    for text in cases:
        assert outline(text) == outline_of(reference(text)), text
        assert tok.first_keyword(text) == reference_first_keyword(text), text
        check_the_outline_reads_whole_tokens(text)
        check_the_tokens_after_limit(text)


# --- joins: never fewer than SQLite's own plan has (CG-2026-40) -------------------------------

_PLAN_DB = sqlite3.connect(":memory:")
for _table in ("t", "u", "v"):
    _PLAN_DB.execute(f"CREATE TABLE {_table} (a, b)")

# Aliases a FROM item may have: SQLite's non-reserved keywords among them (window, natural
# after AS), names Python upper-cases to a keyword (ſelect, LıMIT), quoted keywords.
_ALIASES = ["", "x", "window", "AS window", "AS natural", "ſelect", "LıMIT", '"where"', "[on]"]
_CONDITIONS = ["1", "t.a = 1", "x.a IN (1, 2)", "f(1, 2)", "1 OR 2", "a BETWEEN 1 AND 2"]


def _plan_loops(sql: str) -> int | None:
    """How many tables SQLite's own plan loops over (None: SQLite refuses the text)."""
    try:
        rows = _PLAN_DB.execute("EXPLAIN QUERY PLAN " + sql).fetchall()
    except sqlite3.Error:
        return None
    return sum(1 for row in rows if str(row[3]).startswith(("SCAN ", "SEARCH ")))


@settings(max_examples=400, deadline=None)
@given(
    items=st.lists(
        st.tuples(
            st.sampled_from(["t", "u", "v"]),
            st.sampled_from(_ALIASES),
            st.sampled_from([",", "JOIN", "CROSS JOIN", "LEFT JOIN"]),
            st.sampled_from(_CONDITIONS),
        ),
        min_size=1,
        max_size=5,
    ),
    tail=st.sampled_from(["", " WHERE 1", " LIMIT 5", " ORDER BY 1", " GROUP BY 1"]),
)
def test_the_outline_never_counts_fewer_joins_than_sqlites_plan(
    items: list[tuple[str, str, str, str]], tail: str
) -> None:
    """The oracle is SQLite itself: for a FROM list with any aliases, joins and conditions
    that SQLite compiles, the outline counts at least the joins SQLite's plan loops over (the
    join limit is a cost bound; an under-count was a bypass)."""
    parts = []
    for n, (table, alias, join, condition) in enumerate(items):
        item = f"{table} {alias}".strip()
        if n == 0:
            parts.append(item)
        elif join == ",":
            parts.append(f", {item}")
        else:
            parts.append(f" {join} {item} ON {condition}")
    sql = "SELECT 1 FROM " + "".join(parts) + tail
    loops = _plan_loops(sql)
    if loops is None:
        return
    assert tok.outline(sql).joins >= loops - 1, sql
    assert outline_of(slow_tokens(sql)).joins >= loops - 1, sql


@pytest.mark.parametrize("word", sorted(tok.CLAUSE_ENDS))
def test_every_word_that_ends_the_from_items_is_never_an_alias_to_sqlite(word: str) -> None:
    for sql in (
        f"SELECT 1 FROM t {word}",
        f"SELECT 1 FROM t AS {word}",
        f"SELECT 1 FROM t {word}, u",
    ):
        with pytest.raises(sqlite3.Error):
            _PLAN_DB.execute("EXPLAIN " + sql)
