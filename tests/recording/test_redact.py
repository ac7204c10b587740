"""Redaction by provenance, by name and by shape; streaming; lint."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest

from gateway.credentials import Injection, Secret
from gateway.recording.format import INLINE_LIMIT
from gateway.recording.lint import lint
from gateway.recording.reader import load_recording
from gateway.recording.redact import (
    OVERLAP,
    WINDOW,
    KnownSecret,
    Redactor,
    remap_offsets,
)
from tests.recording.helpers import exchange, write

SECRET = "mt-9f8e7d6c5b4a39281706f5e4d3c2b1a0"
KEY = KnownSecret.from_injection(
    Injection(
        header="Authorization",
        value=Secret("Bearer " + SECRET),
        secret=Secret(SECRET),
        name="metrics:bearer",
    )
)
R = Redactor()
JWT = (
    "eyJhbGciOiJFZERTQSIsImtpZCI6ImsxIn0"
    ".eyJzdWIiOiJzcmUtYm90IiwiYXVkIjoic2VydmljZXMifQ.Zm9vYmFyYmF6cXV4"
)


def test_known_secret_never_shows_its_value() -> None:
    assert SECRET not in repr(KEY)


def test_provenance_in_headers() -> None:
    out = R.headers(
        [
            ("Authorization", "Bearer " + SECRET),
            ("X-Echo", f"you sent {SECRET}"),
            ("Accept", "application/json"),
        ],
        [KEY],
    )
    assert out == [
        ("Authorization", {"secret": "metrics:bearer"}),
        ("X-Echo", "you sent [secret:metrics:bearer]"),
        ("Accept", "application/json"),
    ]


def test_provenance_in_bodies_in_every_encoding() -> None:
    weird = KnownSecret(name="db:bearer", value='p"w/d+ =x1')
    body = json.dumps({"echo": 'p"w/d+ =x1', "url": "https://x/?k=p%22w%2Fd%2B%20%3Dx1"}).encode()
    out = R.body(body, [weird]).data
    assert b'p\\"w/d+' not in out and b"p%22w" not in out
    # Each form has its own marker, so replay puts back (and masks) the very form sent.
    assert b"[secret:db:bearer#json]" in out and b"[secret:db:bearer#pct]" in out
    assert R.body(b"raw: " + SECRET.encode(), [KEY]).data == b"raw: [secret:metrics:bearer]"
    assert R.target(f"/x?echo={SECRET}", [KEY]) == "/x?echo=[secret:metrics:bearer]"


@pytest.mark.parametrize(
    "name",
    [
        "Authorization",
        "Cookie",
        "set-cookie",
        "X-Api-Key",
        "Proxy-Authorization",
        "X-Auth-Token",
        "x-amz-security-token",
    ],
)
def test_sensitive_headers(name: str) -> None:
    assert R.headers([(name, "anything at all")]) == [(name, {"redacted": "header"})]


def test_sensitive_body_keys_nested_and_case_insensitive() -> None:
    body = json.dumps(
        {
            "user": "bob",
            "Password": "hunter2",
            "auth": {"Client-Secret": "cs-1", "refresh_token": "rt-1", "expires_in": 3600},
            "items": [{"api_key": "k-1", "name": "n"}, {"PIN": 1234}],
            "db_password": 424242,
            "private_key": {"kty": "OKP", "d": "abc"},
            "page_token": "cursor-1",
            "token": None,
            "secret": True,
        },
        indent=2,
    ).encode()
    doc = json.loads(R.body(body).data)
    assert doc["user"] == "bob" and doc["auth"]["expires_in"] == 3600
    for value in (
        doc["Password"],
        doc["auth"]["Client-Secret"],
        doc["auth"]["refresh_token"],
        doc["items"][0]["api_key"],
        doc["db_password"],
        doc["private_key"]["d"],
        doc["private_key"]["kty"],
    ):
        assert value == "[redacted:key]"
    assert doc["items"][1] == {"PIN": 1234}  # not a secret name
    assert doc["page_token"] == "cursor-1"  # a pagination cursor, spared on purpose
    assert doc["token"] is None and doc["secret"] is True  # nothing to hide


def test_a_value_under_a_sensitive_key_is_redacted_where_else_it_appears_not_as_a_key() -> None:
    out = json.loads(R.body(b'{"password": "id", "id": 5, "copy": "id"}').data)
    assert out == {"password": "[redacted:key]", "id": 5, "copy": "[redacted:key]"}


def test_string_values_keep_the_document_formatting() -> None:
    body = b'{\n  "password" : "hunter2",\n  "n": 1\n}'
    red = R.body(body)
    assert red.data == b'{\n  "password" : "[redacted:key]",\n  "n": 1\n}'
    assert red.spans is not None


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (JWT, "jwt"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\nIBAAKC\n-----END RSA PRIVATE KEY-----", "pem"),
        ("AKIAIOSFODNN7EXAMPLE", "aws-access-key"),
        ("ghp_" + "a1B2c3D4e5" * 4, "github-token"),
        ("github_pat_11ABCDEFG0123456789_abcdefghijklmnop", "github-token"),
        ("xoxb-1234567890-0987654321-AbCdEfGhIjKl", "slack-token"),
        ("sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc", "stripe-key"),
        ("sk-proj-" + "A1b2C3d4E5f6G7h8I9j0K1l2", "openai-key"),
        ("AIza" + "SyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY", "google-api-key"),
    ],
)
def test_shapes_found_anywhere(text: str, kind: str) -> None:
    out = R.body(f"before {text} after".encode()).data
    assert out == f"before [redacted:{kind}] after".encode()
    assert [k for _, k, _ in R.scan(f"x {text} y".encode())] == [kind]


def test_an_unterminated_private_key_is_redacted_to_the_end_of_its_base64() -> None:
    text = b'{"key": "-----BEGIN OPENSSH PRIVATE KEY-----\\nb3BlbnNzaC1rZXk\\nAAAA", "n": 1}'
    assert R.body(text).data == b'{"key": "[redacted:pem]", "n": 1}'


def test_bearer_and_basic_need_to_look_like_credentials() -> None:
    assert R.text("Bearer a8Fk2LmQ9xZ7vB3nT5wR1yU") == "Bearer [redacted:bearer]"
    assert R.text("bearer tokens are explained below") == "bearer tokens are explained below"
    creds = base64.b64encode(b"admin:s3cret").decode()
    assert R.text(f"Basic {creds}") == "Basic [redacted:basic]"
    assert R.text("basic information") == "basic information"


def test_query_and_form_keys() -> None:
    assert R.target("/x?window=5m&api_key=abc&page_token=p&access_token=t") == (
        "/x?window=5m&api_key=[redacted:key]&page_token=p&access_token=[redacted:key]"
    )
    assert R.body(b"user=bob&password=hunter2").data == b"user=bob&password=[redacted:key]"


def test_markers_are_not_secrets() -> None:
    text = b"[redacted:jwt] Bearer [redacted:bearer] token=[redacted:key] [secret:metrics:bearer]"
    assert list(R.scan(text)) == []
    assert R.body(text).data == text


def test_streaming_finds_tokens_split_across_windows() -> None:
    for cut in (WINDOW - 10, WINDOW - OVERLAP - 5, WINDOW + 3):
        data = b"a " * (cut // 2) + JWT.encode() + b" " + SECRET.encode() + b" z" * 40000
        out = io.BytesIO()
        spans = R.stream(io.BytesIO(data), out, [KEY])
        assert out.getvalue() == R.body(data, [KEY]).data
        assert len(spans) == 2


def test_offsets_move_with_replacements() -> None:
    assert remap_offsets([5, 12, 40], [(10, 20, 3)]) == [5, 13, 33]


def test_chunk_boundaries_follow_redaction(tmp_path: Path) -> None:
    chunks = [b"data: one\n\n", f"data: {JWT}\n\n".encode(), b"data: three\n\n"]
    write(
        tmp_path,
        exchange(
            1,
            "/sse",
            b"".join(chunks),
            chunks=[(0.0, len(chunks[0])), (0.1, len(chunks[1])), (0.2, len(chunks[2]))],
        ),
    )
    resp = load_recording(tmp_path).runs["r1"].entries[0].response
    assert resp is not None and resp.body is not None
    pieces = list(resp.body.iter_sizes([n for _, n in resp.chunks]))
    assert pieces == [b"data: one\n\n", b"data: [redacted:jwt]\n\n", b"data: three\n\n"]


# --- lint ------------------------------------------------------------------------------------


def test_lint_passes_a_clean_recording_and_finds_planted_secrets(tmp_path: Path) -> None:
    clean = write(
        tmp_path / "rec",
        exchange(1, "/ping", b'{"password": "x", "t": "' + JWT.encode() + b'"}'),
        exchange(2, "/big", b"z" * (INLINE_LIMIT + 1)),
    )
    assert lint(clean) == []
    run = clean / "runs" / "r1.jsonl"
    lines = run.read_text().splitlines()
    record = json.loads(lines[1])
    record["request"]["headers"] = [["Cookie", "session=abc"]]
    record["response"]["body"] = {
        "base64": base64.b64encode(b"\x00\xffAKIAIOSFODNN7EXAMPLE").decode()
    }
    lines[1] = json.dumps(record)
    lines.append(json.dumps({"note": f"leaked {JWT}"}))
    run.write_text("\n".join(lines) + "\n")
    [blob] = (clean / "blobs" / "sha256").iterdir()
    blob.write_bytes(b"ok\nok\n-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")
    findings = lint(clean, known=["zzzz-known-value"])
    got = {(f.file, f.line, f.kind) for f in findings}
    assert ("runs/r1.jsonl", 2, "sensitive-header") in got
    assert ("runs/r1.jsonl", 2, "aws-access-key") in got
    assert ("runs/r1.jsonl", 3, "jwt") in got
    assert (f"blobs/sha256/{blob.name}", 3, "pem") in got
    assert all(JWT not in str(f) and "AKIAIOSFODNN7EXAMPLE" not in str(f) for f in findings)
    (clean / "notes.txt").write_text("the value zzzz-known-value leaked\n")
    assert ("notes.txt", 1, "known-secret") in {
        (f.file, f.line, f.kind) for f in lint(clean, ["zzzz-known-value"])
    }


def test_lint_reports_a_truncated_line(tmp_path: Path) -> None:
    clean = write(tmp_path, exchange(1, "/ping", b"1"))
    with (clean / "runs" / "r1.jsonl").open("a") as fh:
        fh.write('{"seq": 2')
    assert [(f.line, f.kind) for f in lint(clean)] == [(2, "truncated-line")]


# --- channels an upstream can hide a credential in ------------------------------------------


def test_a_secret_behind_json_escapes_is_redacted_and_the_json_stays_valid() -> None:
    escaped = "\\u00" + format(ord(SECRET[0]), "x") + SECRET[1:]
    body = ('{"msg": "login as admin:' + escaped + ' failed", "n": "caf\\u00e9"}').encode()
    out = R.body(body, [KEY]).data
    assert json.loads(out) == {"msg": "login as admin:[secret:metrics:bearer] failed", "n": "café"}
    jwt = "\\u0065" + JWT[1:]  # a token shape behind an escape
    assert json.loads(R.body(('["' + jwt + '"]').encode()).data) == ["[redacted:jwt]"]
    # NDJSON or server-sent events: JSON strings inside any body are checked the same way.
    sse = ("data: " + json.dumps({"t": JWT}).replace("e", "\\u0065", 1) + "\n\n").encode()
    assert b"[redacted:jwt]" in R.body(sse).data
    # Escapes of other characters hide nothing: the bytes are left as they are.
    plain = b'{"n": "caf\\u00e9", "p": "a\\nb"}'
    assert R.body(plain).data == plain and R.body(plain).spans == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://admin:hunter2@db.internal/x", "https://[redacted:userinfo]@db.internal/x"),
        ("https://ghp_token@github.com/o/r.git", "https://[redacted:userinfo]@github.com/o/r.git"),
        (
            "https://h/cb?code=1&key=AIzaXX&sig=abc%2Bdef&api-key=k&page_token=p&x=1",
            "https://h/cb?code=1&key=[redacted:key]&sig=[redacted:key]&api-key=[redacted:key]"
            "&page_token=p&x=1",
        ),
        (
            "s3 https://b.s3.amazonaws.com/o?X-Amz-Credential=AK%2F1&X-Amz-Signature=f00d",
            "s3 https://b.s3.amazonaws.com/o?X-Amz-Credential=[redacted:key]"
            "&X-Amz-Signature=[redacted:key]",
        ),
        (  # percent-encoded inside another URL's query
            "/login?next=https%3A%2F%2Fu%3Ap%40h%2Fx%3Ftoken%3Dabc%26b%3D1",
            "/login?next=https%3A%2F%2F[redacted:userinfo]%40h%2Fx%3Ftoken%3D[redacted:key]"
            "%26b%3D1",
        ),
        ("http://example.com/docs?q=token&page=2", "http://example.com/docs?q=token&page=2"),
        ("mailto:someone@example.com", "mailto:someone@example.com"),
    ],
)
def test_credentials_in_urls(text: str, expected: str) -> None:
    assert R.text(text) == expected
    assert R.text(expected) == expected  # redacting twice changes nothing


def test_credentials_in_json_escaped_urls_keep_the_json_valid() -> None:
    body = (
        b'{"next": "https:\\/\\/svc:pw@h\\/cb?access_token=abc\\u0026n=1",'
        b' "q": "a=1&password=x\\"y"}'
    )
    out = json.loads(R.body(body).data)
    assert out == {
        "next": "https://[redacted:userinfo]@h/cb?access_token=[redacted:key]&n=1",
        "q": 'a=1&password=[redacted:key]"y',
    }


def test_reason_phrases_and_header_names() -> None:
    b64 = base64.b64encode(b"k:" + SECRET.encode()).decode()
    assert "mt-9f8e" not in R.text(f"OK {SECRET} {b64}", [KEY])
    out = R.headers(
        [
            (f"X-Seen-{SECRET.upper()}", "1"),  # reflected in another case (HTTP/2 lower-cases)
            (f"X-{JWT}", "1"),  # a token shape as a name
            ("Location", "https://u:p@h/?token=t"),
            ("X-Ok", "fine"),
        ],
        [KEY],
    )
    assert out == [
        ("Location", "https://[redacted:userinfo]@h/?token=[redacted:key]"),
        ("X-Ok", "fine"),
    ]


def test_a_recording_made_before_url_redaction_still_matches(tmp_path: Path) -> None:
    from gateway.recording.matching import Matcher, make_probe

    write(tmp_path, exchange(1, "/go?next=https://u:pw@h/", b"ok"))
    path = tmp_path / "runs" / "r1.jsonl"
    record = json.loads(path.read_text())
    record["target"] = "/go?next=https://u:pw@h/"  # as an older capgate wrote it
    path.write_text(json.dumps(record) + "\n")
    probe = make_probe("api", "GET", "/go?next=https://u:pw@h/", None, None)
    assert probe.target == "/go?next=https://[redacted:userinfo]@h/"
    entry = Matcher(load_recording(tmp_path)).state("r1").answer(probe)
    assert entry.seq == 1
