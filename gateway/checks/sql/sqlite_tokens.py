"""SQLite's tokens, read by the rules SQLite's own tokenizer follows (``tokenize.c``).

Used for what SQLite's authorizer does not report, each only to refuse more:

- where the statement's last token ends, so an appended ``LIMIT`` lands after it, outside any
  comment or string, and the trailing ``LIMIT`` clause of the outermost query (at bracket
  depth 0, at the end), both confirmed by SQLite itself (``sqlite3_complete``, through
  ``sqlite3.complete_statement``) before they decide anything;
- the joins, ``NATURAL`` and ``USING`` (an over-count refuses more), and a first word that
  SQLite would run as something else than what ``EXPLAIN <text>`` compiles.

The check reads them from ``outline`` (one pass that makes no token of the ones it has no use
for), ``first_keyword`` and, after a LIMIT, ``code_tokens``; each is tested against the
per-character reference (``slow_tokens``, ``outline_of``). Everything else about a SQLite
statement (its tables, columns, functions, actions) comes from SQLite's compiler through the
authorizer (``sqlite``), never from these tokens.
"""

from __future__ import annotations

import re
import sqlite3
import string
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class Kind(Enum):
    SPACE = "space"  # whitespace and comments
    STRING = "string"  # '...' and x'...'
    NAME = "name"  # keywords, identifiers (bare, "...", `...`, [...])
    NUMBER = "number"
    VARIABLE = "variable"  # ?, ?NNN, :name, @name, $name (TCL: $a::b(...)), #name
    PUNCT = "punct"
    ILLEGAL = "illegal"


class Token(NamedTuple):
    kind: Kind
    start: int
    end: int  # exclusive
    text: str
    quoted: bool = False


_SPACES = " \t\n\f\r"


def _id_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "_$") or not c.isascii()


def _id_start(c: str) -> bool:
    return (c.isascii() and (c.isalpha() or c == "_")) or not c.isascii()


def _quoted_end(text: str, i: int, quote: str) -> int:
    """End (exclusive) of a quoted token starting at ``i``; -1 when unterminated."""
    j = i + 1
    n = len(text)
    while j < n:
        if text[j] == quote:
            if quote != "]" and j + 1 < n and text[j + 1] == quote:
                j += 2
                continue
            return j + 1
        j += 1
    return -1


def _variable_end(text: str, i: int) -> tuple[int, bool]:
    """The end of a variable token at ``i`` and whether it is legal (tokenize.c, CC_VARALPHA)."""
    n = len(text)
    j = i + 1
    count = 0
    while j < n:
        c = text[j]
        if _id_char(c):
            count += 1
            j += 1
        elif c == "(" and count > 0:
            j += 1
            while j < n and text[j] not in _SPACES and text[j] != ")":
                j += 1
            if j < n and text[j] == ")":
                return j + 1, True
            return j, False
        elif c == ":" and j + 1 < n and text[j + 1] == ":":
            j += 2
        else:
            break
    return j, count > 0


def _number_end(text: str, i: int) -> int:
    n = len(text)
    j = i
    if text.startswith(("0x", "0X"), i) and i + 2 < n and text[i + 2] in "0123456789abcdefABCDEF":
        j = i + 2
        while j < n and (text[j] in "0123456789abcdefABCDEF_"):
            j += 1
        return j
    while j < n and (text[j].isascii() and text[j].isdigit() or text[j] == "_"):
        j += 1
    if j < n and text[j] == ".":
        j += 1
        while j < n and text[j].isascii() and text[j].isdigit():
            j += 1
    if j < n and text[j] in "eE":
        k = j + 1
        if k < n and text[k] in "+-":
            k += 1
        if k < n and text[k].isascii() and text[k].isdigit():
            j = k
            while j < n and text[j].isascii() and text[j].isdigit():
                j += 1
    while j < n and _id_char(text[j]):  # 12abc: one illegal token in SQLite
        j += 1
    return j


_TWO_CHAR = ("||", "<=", ">=", "!=", "<>", "==", "<<", ">>", "->")


def _space_at(text: str, i: int) -> Token | None:
    """Whitespace or a comment starting at ``i``."""
    n = len(text)
    if text[i] in _SPACES:
        j = i
        while j < n and text[j] in _SPACES:
            j += 1
        return Token(Kind.SPACE, i, j, text[i:j])
    if text.startswith("--", i):
        j = text.find("\n", i)
        j = n if j < 0 else j + 1
        return Token(Kind.SPACE, i, j, text[i:j])
    if text.startswith("/*", i) and i + 2 < n:  # at the very end: '/' then '*' (tokenize.c)
        j = text.find("*/", i + 2)
        j = n if j < 0 else j + 2
        return Token(Kind.SPACE, i, j, text[i:j])
    return None


def _quoted_at(text: str, i: int) -> Token | None:
    """A string, blob or quoted identifier starting at ``i``."""
    n = len(text)
    c = text[i]
    if c in "'\"`[":
        j = _quoted_end(text, i, "]" if c == "[" else c)
        if j < 0:
            return Token(Kind.ILLEGAL, i, n, text[i:])
        kind = Kind.STRING if c == "'" else Kind.NAME
        return Token(kind, i, j, text[i:j], quoted=c != "'")
    if c in "xX" and i + 1 < n and text[i + 1] == "'":
        j = _quoted_end(text, i + 1, "'")
        if j < 0:
            return Token(Kind.ILLEGAL, i, n, text[i:])
        return Token(Kind.STRING, i, j, text[i:j])
    return None


def _token_at(text: str, i: int) -> Token:
    """The one token starting at ``i`` (never empty)."""
    found = _space_at(text, i) or _quoted_at(text, i)
    if found is not None:
        return found
    n = len(text)
    c = text[i]
    if c == "?":
        j = i + 1
        while j < n and text[j].isascii() and text[j].isdigit():
            j += 1
        return Token(Kind.VARIABLE, i, j, text[i:j])
    if c in "$@:#":
        j, legal = _variable_end(text, i)
        return Token(Kind.VARIABLE if legal else Kind.ILLEGAL, i, j, text[i:j])
    if c.isascii() and c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
        j = _number_end(text, i)
        return Token(Kind.NUMBER, i, j, text[i:j])
    if _id_start(c):
        j = i + 1
        while j < n and _id_char(text[j]):
            j += 1
        return Token(Kind.NAME, i, j, text[i:j])
    if text.startswith("->>", i):
        return Token(Kind.PUNCT, i, i + 3, "->>")
    if text[i : i + 2] in _TWO_CHAR:
        return Token(Kind.PUNCT, i, i + 2, text[i : i + 2])
    return Token(Kind.PUNCT, i, i + 1, c)


# The common tokens, read by one regular expression after the whitespace before them (the
# per-character rules above cost ~5 µs a token in Python). Each branch stops where the full
# rules might read on (a non-ASCII character, a digit after '.', an exponent, x'...', '/'
# before '*', '--', '!'), and a token no branch reads (the last branch, one character) is read
# by ``_token_at``: the two readings are the same by construction and by test
# (tests/checks/test_sql_sqlite_tokens.py).
_FAST = re.compile(
    r"[ \t\n\f\r]*(?:"
    r"(?P<name>(?![xX]')[A-Za-z_][A-Za-z0-9_$]*)(?![A-Za-z0-9_$]|[^\x00-\x7f])"
    r"|(?P<number>[0-9]+)(?![0-9A-Za-z_$.]|[^\x00-\x7f])"
    r"|(?P<string>'(?:[^']|'')*')(?!')"
    r"|(?P<quoted>\"(?:[^\"]|\"\")*\")(?!\")"
    r"|(?P<punct>[(),;*+%&~]|==|=|\.(?![0-9]|[^\x00-\x7f])|->>|->|-(?!-)"
    r"|<[=>]|<<|<|>=|>>|>|!=|\|\||\||/(?!\*))"
    r"|(?P<other>.))",
    re.DOTALL,
)
# By group number (``Match.lastindex``): 1 name, 2 number, 3 string, 4 quoted, 5 punct,
# 6 other (a token the expression does not read).
_FAST_KIND = (None, Kind.NAME, Kind.NUMBER, Kind.STRING, Kind.NAME, Kind.PUNCT)
_NAME = 1
_NUMBER = 2
_QUOTED = 4
_OTHER = 6
assert _FAST.groupindex == {
    "name": 1, "number": 2, "string": 3, "quoted": 4, "punct": 5, "other": 6
}  # fmt: skip


def iter_code_tokens(text: str, start: int = 0) -> Iterator[Token]:
    """The tokens SQLite compiles (no whitespace, no comments), from the token at ``start``."""
    new = tuple.__new__
    kinds = _FAST_KIND
    n = len(text)
    i = start
    while i < n:
        for m in _FAST.finditer(text, i):
            group = m.lastindex
            if group == _OTHER:  # a token the expression does not read: the full rules do
                token = _token_at(text, m.start(group))
                if token.kind is not Kind.SPACE:
                    yield token
                i = token.end
                break
            assert group is not None
            begin, end = m.span(group)
            yield new(Token, (kinds[group], begin, end, text[begin:end], group == _QUOTED))
        else:
            break


def code_tokens(text: str, start: int = 0) -> list[Token]:
    """The tokens SQLite compiles (no whitespace, no comments), from the token at ``start``."""
    return list(iter_code_tokens(text, start))


def tokens_to_end(text: str, start: int, end: int) -> list[Token]:
    """The code tokens from the token at ``start`` on, but the ';' tokens after ``end`` (where
    the statement's code ends: ``Outline.end``; only ';' tokens follow it)."""
    m = _FAST.match(text, start)
    if m is not None and m.lastindex == _NUMBER and m.end(_NUMBER) == end:  # the common clause
        begin = m.start(_NUMBER)
        return [Token(Kind.NUMBER, begin, end, text[begin:end])]
    tokens = code_tokens(text, start)
    while tokens and tokens[-1].text == ";":
        tokens.pop()
    return tokens


def slow_tokens(text: str) -> list[Token]:
    """Every token of ``text`` (whitespace and comments as ``Kind.SPACE``) by the
    per-character rules alone: the reference ``code_tokens`` is tested against."""
    out: list[Token] = []
    i = 0
    n = len(text)
    while i < n:
        token = _token_at(text, i)
        out.append(token)
        i = token.end
    return out


# --- the outline: what the SQLite check reads from the tokens, in one pass ----------------------

# The words that end a FROM clause's items at their depth (the outline's joins count each ','
# between them). Each is reserved in SQLite: never a table's alias (a test asks SQLite). Not
# ON or USING: a ',' after a join's condition adds another item (``FROM a JOIN b ON 1, c``);
# not WINDOW: SQLite takes ``window`` as an alias (``FROM a window, b``). What they leave
# counted past the items (a WINDOW clause's ',') is an over-count: it only refuses more.
CLAUSE_ENDS = frozenset(
    {"WHERE", "GROUP", "HAVING", "ORDER", "LIMIT", "UNION", "EXCEPT", "INTERSECT"}
    | {"SELECT", "VALUES", "RETURNING", "SET"}
)
_OUTLINE_WORDS = CLAUSE_ENDS | {"FROM", "JOIN", "NATURAL", "USING"}


@dataclass(slots=True)
class Outline:
    """What a statement's tokens say that SQLite's authorizer does not report, and where its
    code ends. The ';' tokens at the end are not part of the statement."""

    end: int = -1  # end of the last token (not a ';' at the end); -1: no token (no statement)
    joins: int = 0  # each JOIN, and each ',' between FROM items (at the FROM's depth)
    limit_start: int = -1  # the last LIMIT at bracket depth 0 (the outermost query's); -1: none
    limit_end: int = -1
    natural: bool = False  # a NATURAL keyword
    using: bool = False  # a USING keyword


def outline_of(tokens: list[Token]) -> Outline:
    """The outline of a text's code tokens, token by token: the reference ``outline`` is
    tested against (tests/checks/test_sql_sqlite_tokens.py). Unquoted ASCII names are read as
    keywords whatever SQLite makes of them; an over-count only refuses more."""
    found = Outline()
    last = len(tokens)
    while last and tokens[last - 1].text == ";":
        last -= 1
    if last:
        found.end = tokens[last - 1].end
    from_depths: set[int] = set()
    depth = 0
    for token in tokens[:last]:
        if token.kind is Kind.PUNCT:
            if token.text == "(":
                depth += 1
            elif token.text == ")":
                from_depths.discard(depth)
                depth -= 1
            elif token.text == "," and depth in from_depths:
                found.joins += 1
        elif token.kind is Kind.NAME and not token.quoted:
            _word(found, from_depths, depth, token.text, token.start, token.end)
    return found


def _word(
    found: Outline, from_depths: set[int], depth: int, name: str, start: int, end: int
) -> None:
    """An unquoted name (``name``, from ``start`` to ``end``) in the outline. SQLite's
    keywords are ASCII: a name with any other letter (``ſelect``, ``LıMIT``, which Python
    upper-cases to a keyword) is a name to SQLite, and to the outline."""
    if not name.isascii():
        return
    word = name.upper()
    if word == "FROM":
        from_depths.add(depth)
    elif word == "JOIN":
        found.joins += 1
    elif word == "NATURAL":
        found.natural = True
    elif word == "USING":
        found.using = True
    elif word in CLAUSE_ENDS:
        from_depths.discard(depth)
        if word == "LIMIT" and depth == 0:
            found.limit_start, found.limit_end = start, end


# ``outline`` reads a text by one regular expression that passes over every token the outline
# has no use for (the tokens ``_FAST`` reads, but for '(', ')', ',', ';' and the outline's
# words), in runs, and stops at the next token it does use; a token ``_FAST`` does not read is
# read by ``_token_at``, as in ``code_tokens``. The two outlines are the same by test.
_WS = r"[ \t\n\f\r]*"
_NAME_ENDS = r"(?![A-Za-z0-9_$\x80-\U0010ffff])"  # no name character follows
assert all(w.isascii() and w.isalpha() and w.isupper() and w[0] != "X" for w in _OUTLINE_WORDS)


def _either_case(word: str) -> str:
    return "".join(f"[{c}{c.lower()}]" for c in word)  # ASCII letters only


def _rests_by_first_letter() -> dict[str, str]:
    """The outline's words by their first letter: the rests, either case, as alternatives."""
    rests: dict[str, list[str]] = {}
    for word in sorted(_OUTLINE_WORDS, key=lambda w: (-len(w), w)):
        rests.setdefault(word[0], []).append(_either_case(word[1:]))
    return {first: "|".join(rest) for first, rest in sorted(rests.items())}


_RESTS = _rests_by_first_letter()
# One of the outline's words, either case.
_WORDS = "|".join(f"[{first}{first.lower()}](?:{rest})" for first, rest in _RESTS.items())
# A name that is none of the outline's words and not the x of x'...'. Each branch starts with
# one letter, which the expression engine tests before it enters the branch; any other token
# is turned away before the branches by one test of its first character.
_OTHER_FIRSTS = "".join(c for c in string.ascii_uppercase if c not in _RESTS and c != "X")
_PASSED_NAME = (
    "(?=[A-Za-z_])(?:"
    + "".join(
        f"{c}(?!(?:{rest}){_NAME_ENDS})|"
        for first, rest in _RESTS.items()
        for c in (first, first.lower())
    )
    + f"[xX](?!')|[{_OTHER_FIRSTS}{_OTHER_FIRSTS.lower()}_])[A-Za-z0-9_$]*{_NAME_ENDS}"
)
_PASSED = (
    _PASSED_NAME + r"|\.(?![0-9\x80-\U0010ffff])|==|=|[*+%&~]|->>|->|-(?!-)"
    r"|<[=>]|<<|<|>=|>>|>|!=|\|\||\||/(?!\*)"
    r"|[0-9]+(?![0-9A-Za-z_$.\x80-\U0010ffff])"
    r"|'[^']*(?:''[^']*)*'(?!')"
    r"|\"[^\"]*(?:\"\"[^\"]*)*\"(?!\")"
)
_OUTLINE = re.compile(
    rf"(?P<passed>(?:{_WS}(?:{_PASSED}))*+){_WS}(?:"
    rf"(?P<word>{_WORDS}){_NAME_ENDS}"
    r"|(?P<open>\()|(?P<close>\))|(?P<comma>,)|(?P<semi>;)"
    r"|(?P<other>.)"
    r"|\Z)",
    re.DOTALL,
)
# By group number (``Match.lastindex``; 1 also when the text ends after the run passed over).
_PASSED_RUN, _WORD, _OPEN, _CLOSE, _COMMA, _SEMI, _UNREAD = 1, 2, 3, 4, 5, 6, 7
_SPACE, _CODE = 8, 9  # a token ``_token_at`` read: whitespace or a comment; any other token
assert _OUTLINE.groupindex == {
    "passed": 1, "word": 2, "open": 3, "close": 4, "comma": 5, "semi": 6, "other": 7
}  # fmt: skip
_PUNCT_GROUPS = {"(": _OPEN, ")": _CLOSE, ",": _COMMA, ";": _SEMI}
# What may not be a token in code (a ';', a token the expression does not read, the end of the
# text); after any other token, the end of the code is that token's (past what was passed over).
_NO_END = frozenset({_SEMI, _UNREAD, _PASSED_RUN})


def _group_of(token: Token) -> int:
    """A token read by ``_token_at``, as the group ``_OUTLINE`` would have read it in."""
    if token.kind is Kind.SPACE:
        return _SPACE
    if token.kind is Kind.NAME and not token.quoted:
        return _WORD
    if token.kind is Kind.PUNCT:
        return _PUNCT_GROUPS.get(token.text, _CODE)
    return _CODE


def outline(text: str) -> Outline:
    """The outline of ``text`` (``outline_of`` its code tokens), in one pass that makes no
    token of the ones it has no use for."""
    found = Outline()
    from_depths: set[int] = set()
    depth = 0
    n = len(text)
    i = 0
    while i < n:
        for m in _OUTLINE.finditer(text, i):
            group = m.lastindex
            if group in _NO_END:  # what was passed over before it may be the last in code
                start, passed = m.span(_PASSED_RUN)
                if passed > start:
                    found.end = passed
            if group == _UNREAD:  # a token the expression does not read: the full rules do
                token = _token_at(text, m.start(group))
                group, start, i = _group_of(token), token.start, token.end
            elif group == _PASSED_RUN:  # the end of the text
                i = n
                break
            elif group == _WORD:
                start, i = m.span(group)
            else:
                i = m.end()
            if group == _WORD:
                _word(found, from_depths, depth, text[start:i], start, i)
            elif group == _OPEN:
                depth += 1
            elif group == _CLOSE:
                from_depths.discard(depth)
                depth -= 1
            elif group == _COMMA and depth in from_depths:
                found.joins += 1
            if group != _SEMI and group != _SPACE:
                found.end = i
            if m.lastindex == _UNREAD:
                break  # on from the end of the token read
        else:
            break
    return found


def outside_comments_and_strings(text: str, offset: int) -> bool:
    """SQLite's own word (``sqlite3_complete``) that ``offset`` is in code, not inside a
    comment, a string or a quoted identifier: a ';' put there ends the statement."""
    return sqlite3.complete_statement(text[:offset] + ";")


def first_keyword(text: str) -> str | None:
    """``keyword`` of the text's first code token (None: none, or not an unquoted name)."""
    m = _FAST.match(text)
    if m is not None and m.lastindex == _NAME:  # the first token (the expression reads it whole)
        return m.group(_NAME).upper()
    head = next(iter_code_tokens(text), None)
    return None if head is None else keyword(head)


def keyword(token: Token) -> str | None:
    """The upper-case word of an unquoted name token, else None."""
    if token.kind is Kind.NAME and not token.quoted:
        return token.text.upper()
    return None
