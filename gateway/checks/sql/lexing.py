"""(MySQL) The text and its tokens: measured, and refused where MySQL would lex it otherwise.

sqlglot reads the dialects whose own parser capgate does not embed (MySQL/MariaDB), so what
it cannot be trusted to lex like the server is refused before parsing, under a strict
lexical allow-list:

- ASCII only outside string literals (identifiers, quoted or not, comments and spaces
  included): sqlglot splits words on every Unicode space, MySQL follows its character set;
- no control characters outside strings; no NUL anywhere;
- parameters only in the forms the rule lists (``parameters: ["?"]``);
- executable comments ``/*! */`` and ``/*M!`` (MySQL runs them, sqlglot skips them) and
  sqlglot's own comment directives (``/* sqlglot.meta case_sensitive */``);
- what depends on the server's ``sql_mode`` unless the rule states it (``sql_mode:``, as
  ``SELECT @@GLOBAL.sql_mode`` prints it): a backslash (``NO_BACKSLASH_ESCAPES`` decides
  whether it escapes the next character or is one), a double-quoted string (``ANSI_QUOTES``
  makes it an identifier) and ``||`` (``PIPES_AS_CONCAT`` makes it a concatenation). With
  the mode stated, the text is lexed as that mode does; a backslash outside a string is
  refused in every mode.

Nothing is parsed before the token stream is measured: deep nesting makes sqlglot raise
``RecursionError`` (or, compiled, crash the process) and chained subscripts parse in
super-linear time, so length, tokens, nesting and subscripts are capped here.
"""

from __future__ import annotations

import re
from typing import Any

from sqlglot.dialects.dialect import Dialect
from sqlglot.dialects.mysql import MySQL
from sqlglot.errors import TokenError
from sqlglot.tokenizer_core import Token, TokenType

from gateway.checks.sql.limits import MAX_NESTING, MAX_SUBSCRIPTS, MAX_TOKENS
from gateway.checks.sql.reading import refuse_blank
from gateway.checks.sql.violations import Denial, Refusal, at, position

SQLGLOT_READS = ("mysql",)
"""Dialects whose text sqlglot reads (PostgreSQL's parser and SQLite's compiler read theirs)."""

LEXING_MODES = ("ANSI_QUOTES", "NO_BACKSLASH_ESCAPES")
"""The sql_mode flags that change how MySQL splits a text into tokens."""


class _AnsiQuotes(MySQL):
    class Tokenizer(MySQL.Tokenizer):
        QUOTES = ["'"]
        IDENTIFIERS = ["`", '"']


class _NoBackslashEscapes(MySQL):
    class Tokenizer(MySQL.Tokenizer):
        STRING_ESCAPES = ["'", '"']


class _AnsiQuotesNoBackslashEscapes(MySQL):
    class Tokenizer(MySQL.Tokenizer):
        QUOTES = ["'"]
        IDENTIFIERS = ["`", '"']
        STRING_ESCAPES = ["'"]


def lexer_key(dialect: str, sql_mode: frozenset[str] | None) -> str:
    """The name of the reader for ``dialect`` under ``sql_mode`` (None: not stated), e.g.
    ``mysql`` (mode unknown), ``mysql:`` (stated, no lexing flag), ``mysql:ANSI_QUOTES``."""
    if sql_mode is None:
        return dialect
    return dialect + ":" + ",".join(m for m in LEXING_MODES if m in sql_mode)


DIALECT_OBJECTS: dict[str, Dialect] = {
    "mysql": Dialect.get_or_raise("mysql"),
    "mysql:": Dialect.get_or_raise("mysql"),
    "mysql:ANSI_QUOTES": _AnsiQuotes(),
    "mysql:NO_BACKSLASH_ESCAPES": _NoBackslashEscapes(),
    "mysql:ANSI_QUOTES,NO_BACKSLASH_ESCAPES": _AnsiQuotesNoBackslashEscapes(),
}
"""sqlglot's reader per lexer key (``lexer_key``)."""

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
    refuse_blank(text)
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


def tokenize(lexer: str, text: str, parameters: frozenset[str] = frozenset()) -> list[Token]:
    """The tokens of ``text`` read by ``lexer`` (a ``lexer_key``), measured and checked
    against the lexical allow-list; raise ``Refusal``."""
    d = DIALECT_OBJECTS[lexer]
    stated = ":" in lexer
    if not stated and "\\" in text:
        raise Refusal.of(
            Denial.PARSE,
            "the SQL contains a backslash: MySQL lexes it differently depending on sql_mode "
            "(NO_BACKSLASH_ESCAPES), which the rule does not state (sql_mode:)",
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
    _measure(text, tokens)
    _outside_strings(text, tokens)
    _mode_dependent(text, tokens, stated)
    _parameters(text, tokens, parameters)
    return tokens


def _where_token(text: str, token: Token) -> dict[str, Any]:
    return position(text, token.start)


def _measure(text: str, tokens: list[Token]) -> None:
    """Refuse token streams that are too big or too deep."""
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


def _mode_dependent(text: str, tokens: list[Token], stated: bool) -> None:
    """What reads otherwise under another sql_mode: refused unless the mode is stated; a
    backslash outside a string in every mode."""
    for token in tokens:
        kind = token.token_type
        if not stated and kind is TokenType.STRING and text[token.start] == '"':
            raise Refusal.of(
                Denial.PARSE,
                "a double-quoted string: with sql_mode ANSI_QUOTES MySQL reads it as an "
                "identifier; use single quotes, or state the server's sql_mode in the rule",
                '"',
                **_where_token(text, token),
            )
        if not stated and kind is TokenType.DPIPE:
            raise Refusal.of(
                Denial.PARSE,
                "'||' is OR, or with sql_mode PIPES_AS_CONCAT a concatenation; use OR or "
                "concat(), or state the server's sql_mode in the rule",
                "||",
                **_where_token(text, token),
            )
    if "\\" not in text:
        return
    spans = _string_spans(tokens)
    for match in re.finditer(r"\\\\", text):
        offset = match.start()
        if not any(s <= offset <= e for s, e in spans):
            raise Refusal.of(
                Denial.PARSE,
                "a backslash outside a string literal (MySQL reads \\N as NULL)",
                "\\",
                **position(text, offset),
            )


# Tokens sqlglot reads in MySQL text that MySQL has no use for there: ':name' (a parameter to
# sqlglot) and '::' (a PostgreSQL cast to sqlglot) are syntax errors to MySQL.
_FOREIGN = {TokenType.COLON: "':'", TokenType.DCOLON: "'::'"}


def _parameters(text: str, tokens: list[Token], allowed: frozenset[str]) -> None:
    for token in tokens:
        foreign = _FOREIGN.get(token.token_type)
        if foreign is not None:
            raise Refusal.of(
                Denial.PARSE,
                f"{foreign} is not MySQL syntax here (sqlglot would read a parameter or a cast)",
                token.text,
                **_where_token(text, token),
            )
        if token.token_type is TokenType.PLACEHOLDER and token.text not in allowed:
            raise Refusal.of(
                Denial.PARSE,
                f"a parameter {token.text!r}: the rule lists the parameter forms it allows "
                f"(parameters: {sorted(allowed)})",
                token.text,
                **_where_token(text, token),
            )


# Outside string literals only printable ASCII, tab and line breaks: sqlglot splits tokens on
# every str.isspace() character, MySQL reads by its character set.
_NOT_PLAIN = re.compile(r"[^\t\n\r\x20-\x7e]")
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


def _string_spans(tokens: list[Token]) -> list[tuple[int, int]]:
    return [(t.start, t.end) for t in tokens if t.token_type in _STRING_TOKENS]


def _outside_strings(text: str, tokens: list[Token]) -> None:
    if _NOT_PLAIN.search(text) is None:
        return
    spans = _string_spans(tokens)
    for match in _NOT_PLAIN.finditer(text):
        offset = match.start()
        if not any(start <= offset <= end for start, end in spans):
            raise Refusal.of(
                Denial.PARSE,
                f"the SQL contains the character U+{ord(match.group()):04X} outside a string "
                "literal; only ASCII is read there (names, comments and spaces included)",
                f"U+{ord(match.group()):04X}",
                **position(text, offset),
            )
