"""HAR 1.2: export a recording, import it back, and import a capture made by Chrome."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from gateway.errors import UpstreamUnavailable
from gateway.recording.har import HarError, export_har, import_har
from gateway.recording.lint import lint
from gateway.recording.reader import load_recording
from gateway.transports.replay import ReplayTransport
from tests.recording.conftest import read_all_bytes
from tests.recording.helpers import drain, mini_policy, request

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "recordings" / "example"
CHROME = Path(__file__).parent / "fixtures" / "chrome-devtools.har"
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
CHROME_SECRETS = [
    "eyJhbGciOiJSUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6IjFhMmIzYyJ9",
    "YW5vdGhlckJvZ3VzU2lnbmF0dXJlXzEyMzQ1Njc4OTA",
    "k8Jd82hQpL0zXv7bN1mC4rT9yW6e",
    "Zx81Kq0PmW2nR7vT4yB9cL3s",
    "correct horse battery staple",
    "rt_9c1f0e7d2b4a48d6a3e5f7c9b1d3e5f7",
    "AKIAIOSFODNN7EXAMPLE",
]


def test_export_is_har_1_2() -> None:
    har = export_har(EXAMPLE)
    log = har["log"]
    assert log["version"] == "1.2" and log["creator"]["name"] == "capgate"
    entries = log["entries"]
    assert [
        (e["request"]["method"], e["request"]["url"], e["response"]["status"]) for e in entries
    ] == [
        ("GET", "http://127.0.0.1:9101/metrics/cpu?window=5m", 200),
        ("GET", "http://127.0.0.1:9102/logs/application?level=error&limit=5", 200),
        ("POST", "http://127.0.0.1:9103/services/restart", 200),
        ("DELETE", "http://127.0.0.1:9103/services/web", 403),
    ]
    first = entries[0]
    assert {"name": "Authorization", "value": "[secret:metrics:bearer]"} in first["request"][
        "headers"
    ]
    assert first["request"]["queryString"] == [{"name": "window", "value": "5m"}]
    assert json.loads(first["response"]["content"]["text"])["metric"] == "cpu"
    assert entries[2]["request"]["postData"] == {
        "mimeType": "application/json",
        "text": '{"service": "web"}',
    }
    assert entries[3]["_capgate"]["kind"] == "denial"
    assert entries[0]["startedDateTime"] == "2024-06-01T12:00:00.001Z"
    for e in entries:
        assert set(e) >= {"startedDateTime", "time", "request", "response", "cache", "timings"}
        assert all(e["timings"][k] >= 0 for k in ("send", "wait", "receive"))
    json.dumps(har)


def test_export_then_import_keeps_the_recording(tmp_path: Path) -> None:
    har = export_har(EXAMPLE)
    upstreams = json.loads((EXAMPLE / "manifest.json").read_text())["upstreams"]
    result = import_har(har, tmp_path / "back", {url: name for name, url in upstreams.items()})
    assert result.imported == 4 and result.skipped == {} and result.runs == {"example"}
    before = load_recording(EXAMPLE).runs["example"].entries
    after = load_recording(tmp_path / "back").runs["example"].entries
    for a, b in zip(before, after, strict=True):
        assert (a.seq, a.kind, a.upstream, a.method, a.target) == (
            b.seq,
            b.kind,
            b.upstream,
            b.method,
            b.target,
        )
        assert (a.roles, a.decision, a.canonical, a.request_bytes()) == (
            b.roles,
            b.decision,
            b.canonical,
            b.request_bytes(),
        )
        if a.response is not None:
            assert b.response is not None and b.response.status == a.response.status
            assert a.response.body is not None and b.response.body is not None
            assert b.response.body.read() == a.response.body.read()
    assert lint(tmp_path / "back") == []


def test_import_of_a_chrome_capture(tmp_path: Path) -> None:
    har = json.loads(CHROME.read_text())
    out = tmp_path / "chrome"
    result = import_har(har, out, {"https://api.example.com/v1": "api"}, run="browser")
    assert result.imported == 5
    assert result.skipped == {"https://cdn.example.net": 1}
    entries = load_recording(out).runs["browser"].entries
    assert [(e.method, e.target) for e in entries] == [
        ("GET", "/items?limit=2&cursor=c3RhcnQ"),
        ("POST", "/login"),
        ("GET", "/avatar/7"),
        ("POST", "/search"),
        ("GET", "/slow"),
    ]
    items, login, avatar, search, slow = entries
    assert [round(e.t, 3) for e in entries] == [0.0, 0.19, 0.36, 0.48, 0.58]
    names = [k for k, _ in items.request_headers]
    assert ":authority" not in names and "accept" in names
    assert dict(items.request_headers)["authorization"] == {"redacted": "header"}
    assert dict(items.request_headers)["cookie"] == {"redacted": "header"}
    assert items.response is not None
    resp_headers = dict(items.response.headers)
    assert "content-encoding" not in resp_headers and "content-length" not in resp_headers
    assert resp_headers["set-cookie"] == {"redacted": "header"}
    assert (
        items.response.body is not None
        and json.loads(items.response.body.read())["next"] == "c2Vjb25k"
    )
    assert json.loads(login.request_bytes() or b"") == {
        "username": "alice",
        "password": "[redacted:key]",
        "remember": True,
    }
    assert login.response is not None and login.response.body is not None
    tokens = json.loads(login.response.body.read())
    assert tokens["access_token"] == tokens["refresh_token"] == "[redacted:key]"
    assert tokens["expires_in"] == 3600
    assert avatar.response is not None and avatar.response.body is not None
    assert avatar.response.body.read() == PNG
    assert search.request_bytes() == b"q=cpu&api_key=[redacted:aws-access-key]"
    assert slow.response is None and slow.error is not None
    assert slow.error.reason == "upstream_unavailable"
    assert abs((items.duration or 0) - 0.087412) < 1e-6
    files = read_all_bytes(out)
    for secret in CHROME_SECRETS:
        for name, data in files.items():
            assert secret.encode() not in data, f"{secret[:6]}... is in {name}"
    assert lint(out) == []


async def test_an_imported_capture_replays(tmp_path: Path) -> None:
    out = tmp_path / "chrome"
    import_har(json.loads(CHROME.read_text()), out, {"https://api.example.com/v1": "api"})
    policy = mini_policy()
    transport = ReplayTransport(out)
    resp = await transport.send(request(policy, None, "GET", "/avatar/7"))
    assert resp.status == 200 and await drain(resp) == PNG
    resp = await transport.send(request(policy, None, "GET", "/items?limit=2&cursor=c3RhcnQ"))
    assert json.loads(await drain(resp))["items"][1]["name"] == "web-2"
    resp = await transport.send(
        request(
            policy,
            None,
            "POST",
            "/login",
            body=json.dumps(
                {"remember": True, "username": "alice", "password": "correct horse battery staple"}
            ).encode(),
        )
    )
    assert json.loads(await drain(resp))["token_type"] == "Bearer"
    with pytest.raises(UpstreamUnavailable):
        await transport.send(request(policy, None, "GET", "/slow"))


@pytest.mark.parametrize(
    ("har", "message"),
    [
        ({"entries": []}, "not a HAR document"),
        ({"log": {"entries": ["x"]}}, r"entries\[0\] must be an object"),
        ({"log": {"entries": [{"request": {"method": "GET"}}]}}, r"entries\[0\].request must be"),
        (
            {
                "log": {
                    "entries": [
                        {
                            "request": {"method": "GET", "url": "https://a.test/x"},
                            "response": {"status": "200"},
                        }
                    ]
                }
            },
            r"response.status must be an integer",
        ),
        (
            {
                "log": {
                    "entries": [
                        {
                            "request": {
                                "method": "GET",
                                "url": "https://a.test/x",
                                "headers": "nope",
                            },
                            "response": {"status": 200},
                        }
                    ]
                }
            },
            r"request.headers must be a list",
        ),
    ],
)
def test_bad_har_gives_one_readable_error(tmp_path: Path, har: dict, message: str) -> None:
    with pytest.raises(HarError, match=message):
        import_har(har, tmp_path, {"https://a.test": "a"})


BLOB = bytes(range(256)) * 4


def _upload_har(text: str, *, encoding: str | None = None, run: str | None = None) -> dict:
    post = {"mimeType": "application/octet-stream", "text": text}
    if encoding:
        post["encoding"] = encoding
    entry: dict = {
        "startedDateTime": "2026-12-01T09:00:00Z",
        "request": {
            "method": "POST",
            "url": "https://api.example.com/v1/upload",
            "headers": [{"name": "Content-Type", "value": "application/octet-stream"}],
            "postData": post,
        },
        "response": {"status": 201, "content": {"mimeType": "text/plain", "text": "stored"}},
    }
    if run:
        entry["_capgate"] = {"run": run, "seq": 1}
    return {"log": {"version": "1.2", "entries": [entry]}}


@pytest.mark.parametrize(
    ("text", "encoding"),
    [
        (BLOB.decode("latin-1"), None),  # as browsers and proxies write bytes in a HAR
        (base64.b64encode(BLOB).decode(), "base64"),
    ],
    ids=["latin-1", "base64"],
)
async def test_a_binary_request_body_matches_on_replay(
    tmp_path: Path, text: str, encoding: str | None
) -> None:
    out = tmp_path / "rec"
    import_har(_upload_har(text, encoding=encoding), out, {"https://api.example.com/v1": "api"})
    policy = mini_policy()
    transport = ReplayTransport(out)
    resp = await transport.send(request(policy, None, "POST", "/upload", body=BLOB))
    assert resp.status == 201 and await drain(resp) == b"stored"


def test_a_second_import_appends_with_new_sequence_numbers(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    mapping = {"https://api.example.com/v1": "api"}
    for _ in range(2):
        assert import_har(_upload_har("x"), out, mapping, agent="bot", roles=["ops"]).imported == 1
    # An exported HAR says its own seq: imported twice into the same run, still unique.
    for _ in range(2):
        import_har(_upload_har("y", run="default"), out, mapping)
    entries = list(load_recording(out).entries())
    assert [e.seq for e in entries] == [1, 2, 3, 4]
    assert [(e.agent, e.roles) for e in entries[:2]] == [("bot", ("ops",))] * 2


def test_an_import_of_nothing_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    result = import_har(_upload_har("x"), out, {"https://other.example.com": "api"})
    assert result.imported == 0 and result.skipped == {"https://api.example.com": 1}
    assert not out.exists()
