"""The text and its tokens: measured, and refused where the database would lex it otherwise.

Nothing is parsed before the token stream is measured: deep nesting makes sqlglot raise
``RecursionError`` (or, compiled, crash the process) and chained subscripts parse in
super-linear time, so length, tokens, nesting and subscripts are capped here.

Refused because sqlglot and the database read them differently: MySQL/MariaDB executable
comments ``/*! */``, sqlglot's own comment directives (``/* sqlglot.meta case_sensitive */``
switches identifier normalisation off for a node), PostgreSQL ``U&"..."`` identifiers (sqlglot
reads ``U & "\\0073sn"``, PostgreSQL reads ``ssn``), identifiers PostgreSQL would truncate,
control characters and Unicode spaces outside strings, and on MySQL backslashes and
double-quoted strings (their meaning depends on ``sql_mode``).
"""

from __future__ import annotations

import re
from typing import Any

from sqlglot.dialects.dialect import Dialect
from sqlglot.errors import TokenError
from sqlglot.tokenizer_core import Token, TokenType

from gateway.checks.sql.limits import (
    MAX_NESTING,
    MAX_SUBSCRIPTS,
    MAX_TOKENS,
    PG_MAX_IDENTIFIER_BYTES,
)
from gateway.checks.sql.options import DIALECTS
from gateway.checks.sql.violations import Denial, Refusal, at, position

SQLGLOT_READS = ("mysql",)
"""Dialects whose text sqlglot reads (PostgreSQL's parser and SQLite's compiler read theirs)."""

DIALECT_OBJECTS: dict[str, Dialect] = {name: Dialect.get_or_raise(name) for name in DIALECTS}

# Lexical markers refused in the raw text, for every dialect (case-insensitive).
_RAW_MARKERS = (
    ("/*!", "a MySQL executable comment '/*!' (MySQL runs what sqlglot reads as a comment)"),
    ("/*m!", "a MariaDB executable comment '/*M!' (MariaDB runs what sqlglot reads as a comment)"),
    ("sqlglot.", "a sqlglot comment directive ('sqlglot.meta', 'sqlglot.anonymous')"),
)

_OPEN = {TokenType.L_PAREN, TokenType.L_BRACKET, TokenType.L_BRACE}
_CLOSE = {TokenType.R_PAREN, TokenType.R_BRACKET, TokenType.R_BRACE}


def raw_text_problems(text: str, dialect: str) -> None:
    """Refuse a NUL, a text of nothing but whitespace, and, where sqlglot reads the text, the
    raw markers, before any lexing. (The database's own reader needs no markers: a comment is a
    comment to PostgreSQL and SQLite.)"""
    if "\x00" in text:
        raise Refusal.of(Denial.PARSE, "the SQL contains a NUL character", "\\x00")
    if not text.strip():
        raise Refusal.of(Denial.EMPTY, "the SQL is empty")
    if dialect not in SQLGLOT_READS:
        return
    lowered = text.lower()
    for marker, what in _RAW_MARKERS:
        offset = lowered.find(marker)
        if offset >= 0:
            where = position(text, offset)
            raise Refusal.of(
                Denial.COMMENT,
                f"the SQL contains {what}{at(where)}",
                text[offset : offset + len(marker)],
                **where,
            )


def tokenize(dialect: str, text: str) -> list[Token]:
    """The tokens of ``text``, measured and checked; raise ``Refusal``."""
    d = DIALECT_OBJECTS[dialect]
    if dialect == "mysql" and "\\" in text:
        raise Refusal.of(
            Denial.PARSE,
            "the SQL contains a backslash: MySQL lexes it differently depending on sql_mode "
            "(NO_BACKSLASH_ESCAPES), so the gateway cannot know what the server would run",
            "\\",
            **position(text, text.index("\\")),
        )
    try:
        tokens = d.tokenize(text)
    except TokenError:
        raise Refusal.of(
            Denial.PARSE,
            "the SQL could not be tokenized: an unterminated string, quoted identifier or comment?",
            "token",
        ) from None
    if not tokens or all(t.token_type is TokenType.SEMICOLON for t in tokens):
        raise Refusal.of(Denial.EMPTY, "the SQL has no statement (only comments or ';')")
    _lexical_problems(dialect, text, tokens)
    return tokens


def _where_token(text: str, token: Token) -> dict[str, Any]:
    return position(text, token.start)


def _lexical_problems(dialect: str, text: str, tokens: list[Token]) -> None:
    """Refuse token streams that are too big, too deep, or that the database lexes otherwise."""
    if len(tokens) > MAX_TOKENS:
        raise Refusal.of(Denial.SIZE, f"the SQL has more than {MAX_TOKENS} tokens")
    depth = 0
    subscripts = 0
    for token in tokens:
        kind = token.token_type
        if kind in _OPEN:
            depth += 1
            if depth > MAX_NESTING:
                raise Refusal.of(
                    Denial.DEPTH,
                    f"the SQL nests brackets more than {MAX_NESTING} levels deep",
                    "nesting",
                    **_where_token(text, token),
                )
            if kind is TokenType.L_BRACKET:
                subscripts += 1
                if subscripts > MAX_SUBSCRIPTS:
                    raise Refusal.of(
                        Denial.SIZE,
                        f"the SQL has more than {MAX_SUBSCRIPTS} '[' subscripts",
                        "[",
                        **_where_token(text, token),
                    )
        elif kind in _CLOSE:
            depth -= 1
    if _ODD_CHARACTER.search(text) is not None:
        _odd_characters(text, tokens)
    if dialect == "postgres":
        _postgres_lexing(text, tokens)
    elif dialect == "mysql" and '"' in text:
        for token in tokens:
            if token.token_type is TokenType.STRING and text[token.start] == '"':
                raise Refusal.of(
                    Denial.PARSE,
                    "a double-quoted string: with sql_mode ANSI_QUOTES MySQL reads it as an "
                    "identifier; use single quotes",
                    '"',
                    **_where_token(text, token),
                )


# Control characters and Unicode spaces: sqlglot splits tokens on every str.isspace()
# character, PostgreSQL and SQLite read U+00A0, U+3000, U+2028 ... as identifier characters,
# MySQL follows its character set. Refused outside string literals.
_ODD_CHARACTER = re.compile(
    "[\x01-\x08\x0b\x0c\x0e-\x1f\x7f\x85\xa0\u1680\u2000-\u200f\u2028\u2029\u202f"
    "\u205f\u3000\ufeff]"
)
_STRING_TOKENS = frozenset(
    t
    for t in (
        getattr(TokenType, name, None)
        for name in (
            "STRING", "NATIONAL_STRING", "RAW_STRING", "HEREDOC_STRING", "BYTE_STRING",
            "UNICODE_STRING", "HEX_STRING", "BIT_STRING", "NATIONAL_RAW_STRING",
        )
    )
    if t is not None
)  # fmt: skip


def _odd_characters(text: str, tokens: list[Token]) -> None:
    spans = [(t.start, t.end) for t in tokens if t.token_type in _STRING_TOKENS]
    for match in _ODD_CHARACTER.finditer(text):
        offset = match.start()
        if not any(start <= offset <= end for start, end in spans):
            raise Refusal.of(
                Denial.PARSE,
                f"the SQL contains the character U+{ord(match.group()):04X} outside a string "
                "literal; databases disagree on whether it separates words",
                f"U+{ord(match.group()):04X}",
                **position(text, offset),
            )


# A prefilter: more than 63 UTF-8 bytes take at least 16 characters (4 bytes each at most).
_LONG_WORD = re.compile(r'[^\s"()\[\],;.]{16,}|"(?:[^"]|""){16,}')


def _postgres_lexing(text: str, tokens: list[Token]) -> None:
    """U&"..." identifiers (sqlglot: 'U & "..."') and identifiers PostgreSQL truncates."""
    if "&" in text:
        for previous, token in zip(tokens, tokens[1:], strict=False):
            if (
                token.token_type is TokenType.IDENTIFIER
                and previous.token_type is TokenType.AMP
                and previous.start > 0
                and text[previous.start - 1] in "uU"
                and previous.end + 1 == token.start
            ):
                raise Refusal.of(
                    Denial.PARSE,
                    'a Unicode-escaped identifier U&"...": sqlglot reads it as \'U & "..."\', '
                    "PostgreSQL decodes it",
                    'U&"',
                    **_where_token(text, token),
                )
    if _LONG_WORD.search(text) is None:
        return  # no run of characters long enough to make a 64-byte identifier
    for token in tokens:
        if (
            token.token_type in (TokenType.IDENTIFIER, TokenType.VAR)
            and len(token.text.encode("utf-8")) > PG_MAX_IDENTIFIER_BYTES
        ):
            raise Refusal.of(
                Denial.PARSE,
                f"an identifier is longer than {PG_MAX_IDENTIFIER_BYTES} bytes, which "
                "PostgreSQL would truncate",
                token.text[:80],
                **_where_token(text, token),
            )
