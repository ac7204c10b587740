"""The canonical call: what makes two calls "the same call" for replay.

A call's key is ``(upstream, method, path, query, body)``:

- ``path`` and ``query`` come from the checked raw target relative to the upstream
  (``UpstreamRequest.target``), byte for byte: the gateway already refuses every
  non-canonical target, so there is nothing to normalise. Query pairs keep their order.
- ``body`` is the canonical body (``canonical_body``): a JSON body is re-serialised with
  sorted keys and no whitespace, and the SQL in the field a rule's SQL check names is
  normalised (keyword case and whitespace do not matter); other UTF-8 text is kept as is; a
  binary body (or one too large to hold) is represented by its SHA-256 (form ``digest``).
- Fields the rule declares **volatile** are left out of the key (not out of the recording):

  ===================  ===============================================================
  ``volatile`` entry   meaning
  ===================  ===============================================================
  ``/request_id``      a JSON pointer (RFC 6901) into the body; ``*`` matches any key or
                       index in one segment: ``/items/*/ts``
  ``query:nonce``      every ``nonce=`` query parameter
  ``body``             the whole body
  ===================  ===============================================================

Canonicalisation runs on the redacted body (``redact.py``), on both sides: the recorder
stores the canonical form of what it wrote, and replay redacts an incoming call the same way
before computing its key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.policy.model import Rule

Form = str  # "json" | "text" | "digest"

# --- bodies ----------------------------------------------------------------------------------


def _json_of(data: bytes) -> Any:
    if data.lstrip()[:1] not in (b"{", b"["):
        raise ValueError("not a JSON document")
    return json.loads(data)


def dumps(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class SqlField:
    """Where a rule's SQL check finds SQL in a body, and how to normalise it."""

    pointer: tuple[str, ...]  # () for a body that is SQL text itself
    dialect: str | None
    normalise: Callable[[str], str] | None = None  # the check's own normaliser, if it has one


def sql_fields(rule: Rule | None) -> tuple[SqlField, ...]:
    """The SQL fields of a rule's checks whose ``kind`` is ``"sql"``.

    The SQL check (``SqlBodyCheck`` in ``gateway/checks/sql/adapter.py``) is read by
    attribute, so this module does not depend on it: ``field`` (a path tuple, or a dotted
    path / JSON pointer string), ``raw`` (the whole body is SQL), ``argument`` (an MCP
    ``tools/call`` argument, at ``/params/arguments/<name>``), the dialect (``dialect`` or
    ``policy.dialect``), and an optional ``normalize(text) -> str``, used when present so
    replay normalises exactly as the check parses.
    """
    if rule is None:
        return ()
    out: list[SqlField] = []
    for check in rule.checks:
        if getattr(check, "kind", None) != "sql":
            continue
        field = getattr(check, "field", None)
        argument = getattr(check, "argument", None)
        pointer: tuple[str, ...]
        if getattr(check, "raw", False):
            pointer = ()
        elif isinstance(argument, str) and argument:
            pointer = ("params", "arguments", argument)
        elif isinstance(field, tuple | list):
            pointer = tuple(str(p) for p in field)
        else:
            pointer = _field_path(str(field if field is not None else "sql"))
        dialect = getattr(check, "dialect", None) or getattr(
            getattr(check, "policy", None), "dialect", None
        )
        normalise = getattr(check, "normalize", None)
        out.append(
            SqlField(
                pointer=pointer,
                dialect=str(dialect) if dialect else None,
                normalise=normalise if callable(normalise) else None,
            )
        )
    return tuple(out)


def _field_path(field: str) -> tuple[str, ...]:
    if field == "":
        return ()
    if field.startswith("/"):
        return tuple(_unescape(p) for p in field[1:].split("/"))
    return tuple(field.split("."))


def normalise_sql(text: str, dialect: str | None) -> str:
    """The SQL check's own normal form (imported here: only recordings of SQL need it, and
    a live gateway whose policy has no SQL never loads sqlglot)."""
    from gateway.checks.sql import normalise_sql as normalise

    return normalise(text, dialect)


def _normalise_sql_in(doc: Any, field: SqlField) -> Any:
    parent: Any = None
    key: Any = None
    node = doc
    for part in field.pointer:
        if isinstance(node, dict) and part in node:
            parent, key, node = node, part, node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            parent, key, node = node, int(part), node[int(part)]
        else:
            return doc
    if isinstance(node, str) and parent is not None:
        parent[key] = (
            field.normalise(node) if field.normalise else normalise_sql(node, field.dialect)
        )
    return doc


def body_form(data: bytes) -> tuple[Form, Any]:
    """("json", document) | ("text", str) | ("digest", None)."""
    try:
        return "json", _json_of(data)
    except (ValueError, RecursionError):
        pass
    try:
        return "text", data.decode("utf-8")
    except UnicodeDecodeError:
        return "digest", None


def canonical_body(data: bytes | None, rule: Rule | None = None) -> tuple[Form | None, str | None]:
    """(form, canonical text) of a (redacted) body; (None, None) when there is none."""
    if not data:
        return None, None
    form, value = body_form(data)
    fields = sql_fields(rule)
    if form == "json":
        for field in fields:
            if field.pointer:
                value = _normalise_sql_in(value, field)
        return form, dumps(value)
    if form == "text":
        for field in fields:
            if not field.pointer:
                value = (
                    field.normalise(value)
                    if field.normalise
                    else normalise_sql(value, field.dialect)
                )
        return form, value
    return "digest", "sha256:" + hashlib.sha256(data).hexdigest()


def recanonicalise(form: Form | None, canonical: str | None, rule: Rule | None) -> str | None:
    """A stored canonical body again under another rule (its SQL fields); idempotent."""
    if canonical is None or form not in ("json", "text") or not sql_fields(rule):
        return canonical
    return canonical_body(canonical.encode(), rule)[1]


# --- volatile fields -------------------------------------------------------------------------


def _unescape(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def _remove_pointer(doc: Any, parts: list[str]) -> None:
    if not parts:
        return
    head, rest = parts[0], parts[1:]
    if isinstance(doc, dict):
        keys = list(doc) if head == "*" else ([head] if head in doc else [])
        for k in keys:
            if rest:
                _remove_pointer(doc[k], rest)
            else:
                del doc[k]
    elif isinstance(doc, list):
        if head == "*":
            idx = list(range(len(doc)))
        elif head.isdigit() and int(head) < len(doc):
            idx = [int(head)]
        else:
            idx = []
        for i in reversed(idx):
            if rest:
                _remove_pointer(doc[i], rest)
            else:
                del doc[i]


def strip_volatile_body(
    form: Form | None, canonical: str | None, volatile: Iterable[str]
) -> str | None:
    pointers = [v for v in volatile if v.startswith("/")]
    if "body" in volatile:
        return None
    if form != "json" or canonical is None or not pointers:
        return canonical
    doc = json.loads(canonical)
    for pointer in pointers:
        _remove_pointer(doc, [_unescape(p) for p in pointer[1:].split("/")])
    return dumps(doc)


# --- targets and keys ------------------------------------------------------------------------


def split_target(target: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``/a/b?x=1&y=2`` -> ("/a/b", (("x", "1"), ("y", "2"))), raw (still %-encoded)."""
    path, sep, query = target.partition("?")
    pairs: list[tuple[str, str]] = []
    if sep and query:
        for item in query.split("&"):
            name, _, value = item.partition("=")
            pairs.append((name, value))
    return path, tuple(pairs)


@dataclass(frozen=True, slots=True)
class CallKey:
    upstream: str
    method: str
    path: str
    query: tuple[tuple[str, str], ...]
    body: str | None

    def describe(self) -> str:
        query = "&".join(f"{k}={v}" for k, v in self.query)
        return f"{self.method} {self.upstream} {self.path}{'?' + query if query else ''}"


def call_key(
    upstream: str,
    method: str,
    target: str,
    form: Form | None,
    canonical: str | None,
    volatile: Iterable[str] = (),
) -> CallKey:
    volatile = tuple(volatile)
    path, pairs = split_target(target)
    dropped = {v[len("query:") :] for v in volatile if v.startswith("query:")}
    if dropped:
        pairs = tuple((k, v) for k, v in pairs if k not in dropped)
    return CallKey(
        upstream=upstream,
        method=method.upper(),
        path=path,
        query=pairs,
        body=strip_volatile_body(form, canonical, volatile),
    )
