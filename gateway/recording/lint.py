"""``lint``: everything secret-looking left in a recording, with where it is.

``capgate recording lint DIR`` reads every file of a recording and reports, one line each,
anything the writer's redactor (``redact.py``) would still change, and a little more:

- **Every place of a record**: the target, each header's name and value, the reason phrase,
  the error detail, every body (inline text, base64 or a blob), and any other string in the
  line, each reported with the record's ``seq`` and its place (``response.headers[2] name``).
- **Every body decoded**: ``{"base64": ...}`` bodies and blobs as bytes, and a response body
  with a content coding (its ``Content-Encoding`` headers, or gzip bytes with none)
  decompressed (``codings.py``); a coded body that cannot be decoded is a finding itself
  (``undecodable-body``): nobody can vouch for what it holds.
- **Every encoding of a value**: the bytes as they are (JSON strings whose escapes hide ASCII
  are decoded by the redactor itself), the text with all ``\\uXXXX`` and ``\\/`` escapes
  undone, percent-decoded, and each run of base64 (standard or URL-safe) decoded when it
  gives text or gzip; one level deep, and each finding says which view found it.
- **URLs**: userinfo (``https://user:pass@host``) and credential query parameters
  (``redact.URL_CREDENTIAL_PARAMS``) that are not markers.
- **Names**: sensitive headers with a value (``sensitive-header``), JSON bodies with a value
  under a sensitive key (``sensitive-key``), and the exact values passed as ``known`` (a test
  passes the workspace's secrets) in any of their forms, in a header name in any case too.

Files other than run files (the manifest, blobs no record names, anything else) are read as
bytes with the same views. A line that is not JSON is reported (``truncated-line`` for a torn
last line, ``corrupt-line`` else) and read as bytes.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

from gateway.recording.codings import CodingError, content_codings, decode, sniff
from gateway.recording.format import BLOB_REF, BLOBS_DIR, RUNS_DIR
from gateway.recording.redact import (
    DEFAULT_REDACTOR,
    SENSITIVE_HEADERS,
    KnownSecret,
    sensitive_values,
)

LINT_DECODE_LIMIT = 64 * 1024 * 1024
"""Decoded bytes read of one coded body; a body that inflates further is a finding."""

_ESCAPE = re.compile(rb"\\u([0-9A-Fa-f]{4})|\\/")
_PERCENT = re.compile(rb"%[0-9A-Fa-f]{2}")
_BASE64_RUN = re.compile(rb"[A-Za-z0-9+/_-]{16,}={0,2}")


@dataclass(frozen=True, slots=True)
class Finding:
    """Something secret-looking left in a recording."""

    file: str  # relative to the recording directory
    line: int  # 1-based; 0 when not line-based
    kind: str  # jwt, pem, aws-access-key, ..., sensitive-header, sensitive-key, known-secret
    preview: str  # a masked hint of what was found, never the value
    where: str = ""  # the record and the place in it, and the view that found it

    def __str__(self) -> str:
        text = f"{self.file}:{self.line}: {self.kind}: {self.preview}"
        return f"{text} in {self.where}" if self.where else text


def mask(value: bytes | str) -> str:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return f"{text[:4]}... ({len(text)} chars)" if len(text) > 8 else f"({len(text)} chars)"


# --- views: the same bytes as the ways they may be encoded -----------------------------------


def _texty(data: bytes) -> bool:
    if not data:
        return False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return sum(c.isprintable() or c in "\r\n\t" for c in text) >= 0.9 * len(text)


def _unescape(data: bytes) -> bytes:
    def one(m: re.Match[bytes]) -> bytes:
        if m.group(1) is None:
            return b"/"
        return chr(int(m.group(1), 16)).encode("utf-8", "surrogatepass")

    return _ESCAPE.sub(one, data)


def _base64_runs(data: bytes) -> Iterator[bytes]:
    for m in _BASE64_RUN.finditer(data):
        run = m.group().rstrip(b"=")
        run = run[: len(run) - len(run) % 4] if len(run) % 4 == 1 else run
        alphabet = b"-_" if b"-" in run or b"_" in run else b"+/"
        if alphabet == b"-_" and (b"+" in run or b"/" in run):
            continue
        try:
            decoded = base64.b64decode(run + b"=" * (-len(run) % 4), altchars=alphabet)
        except (binascii.Error, ValueError):
            continue
        if sniff(decoded):
            try:
                decoded = b"".join(decode([decoded], ("gzip",), LINT_DECODE_LIMIT))
            except CodingError:
                continue
        if _texty(decoded):
            yield decoded


def views(data: bytes) -> Iterator[tuple[str, bytes]]:
    """``data`` as it is, and decoded each way a secret may be encoded in it."""
    yield "", data
    if _ESCAPE.search(data):
        yield "unescaped", _unescape(data)
    if _PERCENT.search(data):
        yield "percent-decoded", unquote_to_bytes(data)
    for decoded in _base64_runs(data):
        yield "base64-decoded", decoded


# --- one place of a record --------------------------------------------------------------------


class _Collector:
    """Findings of one file, without repeats (a value seen in two views is one finding)."""

    def __init__(self, rel: str, known: Sequence[KnownSecret]) -> None:
        self.rel = rel
        self.known = known
        self.findings: list[Finding] = []
        self._seen: set[tuple[int, str, str]] = set()

    def add(self, line: int, kind: str, found: bytes | str, where: str, place: str = "") -> None:
        """One finding per kind and place (``place``: ``where`` without the view)."""
        mark = (line, kind, place or where)
        if mark in self._seen:
            return
        self._seen.add(mark)
        self.findings.append(Finding(self.rel, line, kind, mask(found), where))

    def scan(self, line: int, data: bytes, where: str, line_of: bool = False) -> None:
        """Every view of ``data``; ``line_of``: count lines within it (a file, not a record)."""
        for view, text in views(data):
            label = f"{where} ({view})" if view and where else view or where
            for offset, kind, found in DEFAULT_REDACTOR.scan(text, self.known):
                at = line + text.count(b"\n", 0, offset) if line_of else line
                self.add(at, kind, found, label, place=f"{at}:{where}" if line_of else where)

    def sensitive_keys(self, line: int, data: bytes, where: str, place: str) -> None:
        if data.lstrip()[:1] not in (b"{", b"["):
            return
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return
        values, non_string = sensitive_values(doc)
        if values or non_string:
            found = next(iter(values), "a number")
            self.add(line, "sensitive-key", found, where, place=place)


def _place(record: dict[str, Any], path: str) -> str:
    seq = record.get("seq")
    return f"seq {seq}, {path}" if isinstance(seq, int) else path


class _RecordLint:
    """One line of a run file: each place checked with the views that fit it."""

    def __init__(self, c: _Collector, root: Path, line: int, record: dict[str, Any]) -> None:
        self.c = c
        self.root = root
        self.line = line
        self.record = record
        self.blobs: set[str] = set()

    def run(self) -> None:
        for key, value in self.record.items():
            if key in ("request", "response") and isinstance(value, dict):
                self.section(key, value)
            else:
                self.strings(value, key)

    def strings(self, value: Any, path: str) -> None:
        """Every string (and key) in ``value``, scanned as text."""
        if isinstance(value, str):
            self.c.scan(self.line, value.encode("utf-8", "surrogateescape"), self.where(path))
        elif isinstance(value, dict):
            for k, v in value.items():
                self.strings(k, f"{path} key")
                self.strings(v, f"{path}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                self.strings(v, f"{path}[{i}]")

    def where(self, path: str) -> str:
        return _place(self.record, path)

    def section(self, part: str, section: dict[str, Any]) -> None:
        headers = section.get("headers")
        for key, value in section.items():
            if key == "headers" and isinstance(value, list):
                self.headers(part, value)
            elif key in ("body", "raw") and isinstance(value, dict):
                codings = content_codings(_pairs(headers)) if part == "response" else ()
                self.body(f"{part}.{key}", value, codings)
            else:
                self.strings(value, f"{part}.{key}")

    def headers(self, part: str, pairs: list[Any]) -> None:
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                self.strings(pair, f"{part}.headers[{i}]")
                continue
            name, value = pair
            where = f"{part}.headers[{i}]"
            self.c.scan(
                self.line, name.encode("utf-8", "surrogateescape"), self.where(f"{where} name")
            )
            low = name.lower().encode("utf-8", "surrogateescape")
            for secret in self.c.known:
                if any(form.lower() in low for _, form in secret.literals()):
                    self.c.add(self.line, "known-secret", name, self.where(f"{where} name"))
            if name.lower() in SENSITIVE_HEADERS and isinstance(value, str) and value:
                self.c.add(self.line, "sensitive-header", f"{name}: {value}", self.where(where))
            self.strings(value, f"{where} value")

    def body(self, path: str, value: dict[str, Any], codings: tuple[str, ...]) -> None:
        data = self.body_bytes(path, value)
        if data is None:
            return
        codings = codings or sniff(data[:4])
        label = path
        if codings:
            try:
                data = b"".join(decode([data], codings, LINT_DECODE_LIMIT))
            except CodingError as exc:
                self.c.add(self.line, "undecodable-body", str(exc), self.where(path))
                return
            label = f"{path} ({','.join(codings)}-decoded)"
        self.c.scan(self.line, data, self.where(label))
        self.c.sensitive_keys(self.line, data, self.where(label), self.where(path))

    def body_bytes(self, path: str, value: dict[str, Any]) -> bytes | None:
        if isinstance(value.get("text"), str):
            return str(value["text"]).encode("utf-8", "surrogateescape")
        if isinstance(value.get("base64"), str):
            try:
                return base64.b64decode(value["base64"], validate=True)
            except (binascii.Error, ValueError):
                self.c.add(self.line, "corrupt-base64", path, self.where(path))
                return None
        ref = value.get("blob")
        if isinstance(ref, str) and BLOB_REF.fullmatch(ref):
            self.blobs.add(f"{BLOBS_DIR}/{ref}")
            try:
                return (self.root / BLOBS_DIR / ref).read_bytes()
            except OSError:
                return None  # the reader reports a missing blob
        self.strings(value, path)
        return None


def _pairs(headers: Any) -> list[tuple[str, Any]]:
    if not isinstance(headers, list):
        return []
    return [
        (p[0], p[1])
        for p in headers
        if isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
    ]


def _lint_run_file(
    root: Path, rel: str, data: bytes, known: Sequence[KnownSecret], blobs: set[str]
) -> list[Finding]:
    c = _Collector(rel, known)
    lines = data.split(b"\n")
    for i, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            last = i == len(lines) and not data.endswith(b"\n")
            kind = "truncated-line" if last else "corrupt-line"
            c.add(i, kind, "not a complete JSON line", "")
            c.scan(i, raw, "")
            continue
        if not isinstance(record, dict):
            c.scan(i, raw, "")
            continue
        one = _RecordLint(c, root, i, record)
        one.run()
        blobs |= one.blobs
    return c.findings


def lint(directory: str | Path, known: Iterable[str] = ()) -> list[Finding]:
    """Everything secret-looking in a recording (see the module docstring).

    ``known`` are exact values that must not appear in any form. Run files are read a
    record at a time; other files whole, as bytes.
    """
    root = Path(directory)
    secrets = [KnownSecret(name="known", value=v) for v in known if v]
    if not root.is_dir():
        return [Finding(str(root), 0, "not-a-recording", "not a directory")]
    files = sorted(p for p in root.rglob("*") if p.is_file())
    runs = [p for p in files if p.relative_to(root).as_posix().startswith(f"{RUNS_DIR}/")]
    findings: list[Finding] = []
    named_blobs: set[str] = set()
    for path in [*runs, *(p for p in files if p not in runs)]:
        rel = path.relative_to(root).as_posix()
        if rel in named_blobs:
            continue  # read, decoded and checked as the body of the record that names it
        try:
            data = path.read_bytes()
        except OSError as exc:
            findings.append(Finding(rel, 0, "unreadable", exc.strerror or "cannot read"))
            continue
        if path in runs and rel.endswith(".jsonl"):
            findings.extend(_lint_run_file(root, rel, data, secrets, named_blobs))
            continue
        c = _Collector(rel, secrets)
        if sniff(data[:4]):
            try:
                data = b"".join(decode([data], ("gzip",), LINT_DECODE_LIMIT))
            except CodingError as exc:
                c.add(0, "undecodable-body", str(exc), "")
        c.scan(1, data, "", line_of=True)
        findings.extend(c.findings)
    return findings
