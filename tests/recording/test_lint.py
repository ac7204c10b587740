"""``lint``: every place of a record, every body decoded, every encoding of a value."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from gateway.commands.recording import cmd_recording_lint
from gateway.credentials import Injection, Secret
from gateway.recording.lint import lint
from gateway.recording.model import Exchange
from gateway.recording.redact import KnownSecret
from tests.recording.helpers import exchange, write

JWT = (
    "eyJhbGciOiJFZERTQSIsImtpZCI6ImsxIn0"
    ".eyJzdWIiOiJzcmUtYm90IiwiYXVkIjoic2VydmljZXMifQ.Zm9vYmFyYmF6cXV4"
)
SECRET = "Up-7Hq2Lm9Xc4Vb8Nz1Kd5Rt"


def _b64(data: bytes) -> dict[str, str]:
    return {"base64": base64.b64encode(data).decode()}


def _planted(tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """A clean recording of one exchange, then ``change`` applied to its line by hand (what an
    older or broken writer, or an edit, may leave)."""
    directory = write(tmp_path / "rec", exchange(7, "/ping", b'{"ok": true}'))
    path = directory / "runs" / "r1.jsonl"
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record) + "\n")
    return directory


def _found(directory: Path, known: tuple[str, ...] = ()) -> set[tuple[str, str]]:
    return {(f.kind, f.where) for f in lint(directory, known)}


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(record: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = record
        for p in parents:
            node = node[p]
        node[last] = value

    return change


def _add_header(name: str, value: str) -> Callable[[dict[str, Any]], None]:
    return lambda r: r["response"]["headers"].append([name, value])


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (_set("response.reason", f"OK {JWT}"), ("jwt", "seq 7, response.reason")),
        (_add_header(f"X-Seen-{JWT}", "1"), ("jwt", "seq 7, response.headers[1] name")),
        (
            _add_header("Location", "https://svc:pw@internal/"),
            ("url-userinfo", "seq 7, response.headers[1] value"),
        ),
        (
            _add_header("Location", "https://h/cb?sig=abc&x=1"),
            ("url-credential", "seq 7, response.headers[1] value"),
        ),
        (_set("error", {"detail": f"bad {JWT}"}), ("jwt", "seq 7, error.detail")),
        (_set("target", "/x?api_key=k1"), ("sensitive-key", "seq 7, target")),
        (
            _set("response.body", {"text": '{"a": "\\\\u0065' + JWT[1:] + '"}'}),
            ("jwt", "seq 7, response.body (unescaped)"),
        ),
        (
            _set("response.body", {"text": "next=" + "".join(f"%{b:02X}" for b in JWT.encode())}),
            ("jwt", "seq 7, response.body (percent-decoded)"),
        ),
        (
            _set("response.body", {"text": "blob=" + base64.b64encode(JWT.encode()).decode()}),
            ("jwt", "seq 7, response.body (base64-decoded)"),
        ),
        (
            _set("response.body", _b64(b"\x00\xff" + JWT.encode())),
            ("jwt", "seq 7, response.body"),
        ),
        (
            _set("response.body", {"text": '{"user": {"password": "hunter2"}}'}),
            ("sensitive-key", "seq 7, response.body"),
        ),
        (
            _set("request.headers", [["Cookie", "s=1"]]),
            ("sensitive-header", "seq 7, request.headers[0]"),
        ),
        (_set("note", {"deep": [JWT]}), ("jwt", "seq 7, note.deep[0]")),
    ],
)
def test_every_place_and_every_encoding(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], expected: tuple[str, str]
) -> None:
    assert expected in _found(_planted(tmp_path, change))


@pytest.mark.parametrize(
    ("headers", "body", "view"),
    [
        ([["Content-Encoding", "gzip"]], gzip.compress(JWT.encode()), "gzip-decoded"),
        (
            [["Content-Encoding", "identity"], ["Content-Encoding", "deflate"]],
            zlib.compress(JWT.encode()),
            "deflate-decoded",
        ),
        ([], gzip.compress(JWT.encode()), "gzip-decoded"),  # no header: gzip by its bytes
    ],
)
def test_coded_bodies_are_decompressed(
    tmp_path: Path, headers: list[list[str]], body: bytes, view: str
) -> None:
    def change(record: dict[str, Any]) -> None:
        record["response"]["headers"] += headers
        record["response"]["body"] = _b64(body)

    assert ("jwt", f"seq 7, response.body ({view})") in _found(_planted(tmp_path, change))


def test_a_coded_blob_is_decompressed_and_a_body_that_cannot_be_is_reported(
    tmp_path: Path,
) -> None:
    data = gzip.compress(b"x" * 100_000 + JWT.encode())
    digest = hashlib.sha256(data).hexdigest()

    def change(record: dict[str, Any]) -> None:
        record["response"]["headers"].append(["Content-Encoding", "gzip"])
        record["response"]["body"] = {"blob": f"sha256/{digest}", "size": len(data)}

    directory = _planted(tmp_path, change)
    (directory / "blobs" / "sha256").mkdir(parents=True)
    (directory / "blobs" / "sha256" / digest).write_bytes(data)
    found = lint(directory)
    # Checked once, as the body of the record that names it, decoded.
    assert [(f.file, f.kind, f.where) for f in found] == [
        ("runs/r1.jsonl", "jwt", "seq 7, response.body (gzip-decoded)")
    ]

    def opaque(record: dict[str, Any]) -> None:
        record["response"]["headers"].append(["Content-Encoding", "zstd"])
        record["response"]["body"] = _b64(b"(zstd bytes)")

    assert ("undecodable-body", "seq 7, response.body") in _found(_planted(tmp_path / "z", opaque))


def test_known_values_in_every_form_and_in_header_names_in_any_case(tmp_path: Path) -> None:
    forms = [
        SECRET,
        quote(SECRET, safe=""),
        base64.b64encode(b"user:" + SECRET.encode()).decode(),  # at an alignment of its own
        base64.urlsafe_b64encode(b"k=" + SECRET.encode()).decode(),
    ]

    def change(record: dict[str, Any]) -> None:
        record["response"]["headers"] += [[f"X-Seen-{SECRET.lower()}", "1"]]
        record["response"]["body"] = {"text": " ".join(forms)}

    found = lint(_planted(tmp_path, change), known=[SECRET])
    assert {(f.kind, f.where) for f in found} >= {
        ("known-secret", "seq 7, response.headers[1] name"),
        ("known-secret", "seq 7, response.body"),
    }
    assert all(SECRET not in str(f) for f in found)


def test_the_writer_leaves_nothing_lint_finds(tmp_path: Path) -> None:
    """What the writer redacts and what lint looks for are one set of rules: a recording of
    hostile answers is clean, also for lint told the secret's value."""
    key = KnownSecret.from_injection(
        Injection("X-Api-Key", Secret(SECRET), Secret(SECRET), "api:header")
    )
    answers: list[tuple[str, bytes, list[tuple[str, str]]]] = [
        (f"OK {SECRET}", b"{}", [(f"X-Seen-{SECRET.lower()}", "1")]),
        ("OK", gzip.compress(f'{{"k": "{SECRET}", "t": "{JWT}"}}'.encode()), []),
        (
            "OK",
            b'{"m": "admin:\\u00'
            + format(ord(SECRET[0]), "x").encode()
            + SECRET[1:].encode()
            + b'"}',
            [],
        ),
        (
            "OK",
            b'{"u": "https://admin:pw@h/?api_key=a&sig=b"}',
            [("Location", "https://h/?token=t")],
        ),
        ("OK", zlib.compress(f"Bearer {JWT}".encode()), [("Content-Encoding", "deflate")]),
    ]
    exchanges: list[Exchange] = []
    for i, (reason, body, headers) in enumerate(answers, start=1):
        ex = exchange(i, "/x", body, headers=headers)
        assert ex.response is not None
        ex.response.reason = reason
        ex.secrets = (key,)
        exchanges.append(ex)
    directory = write(tmp_path / "rec", *exchanges)
    assert lint(directory, known=[SECRET]) == []


def test_lint_lines_name_file_record_and_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _planted(tmp_path, _add_header("Location", "https://svc:pw@internal/"))
    assert cmd_recording_lint(directory) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "runs/r1.jsonl:1: url-userinfo: (6 chars) in seq 7, response.headers[1] value"
    )
    assert "1 finding(s)" in out[-1]
