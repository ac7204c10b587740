"""The SQLite token reader's fast path (one regular expression) reads every text exactly as
the per-character rules do: the corpus, and hypothesis texts made of the characters where
the two could part (quotes, digits, dots, '=', 'x', non-ASCII letters and digits)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.checks.sql.sqlite_tokens import Kind, code_tokens, slow_tokens
from tests.checks import sql_corpus

ALPHABET = "ab xX_$019.eE=<>!-/*|+%&~'\"`[]();,?:@#\t\nü٣²"


def test_the_corpus_reads_the_same() -> None:
    texts = sql_corpus.read_fixture("sqlite", "allowed.sql")
    texts += sql_corpus.read_fixture("sqlite", "denied.sql")
    texts += sql_corpus.mutations("sqlite", seed=3, budget=2000)
    for text in texts:
        assert code_tokens(text) == [t for t in slow_tokens(text) if t.kind is not Kind.SPACE]


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40))
def test_any_text_reads_the_same(text: str) -> None:
    assert code_tokens(text) == [t for t in slow_tokens(text) if t.kind is not Kind.SPACE]


def test_the_cases_where_the_fast_path_must_stop() -> None:
    cases = ["abü", "12abc", "1.5e3", "x'ab'", "a==b", ".5", "'a''", '"a""', "'it''s'"]
    cases += ["a--b\nc", "a /*x*/b", "a/*", "/*", "a/", "a->>b->c-d", "a!b!=c", "a<<=b<>c"]
    cases += ["a||b|c"]
    cases += ["", "  ", "a  ", " \t-- only a comment", "a -", "1.", "?1 :a @b $c::d(e) #f"]
    for text in cases:
        assert code_tokens(text) == [t for t in slow_tokens(text) if t.kind is not Kind.SPACE], text
