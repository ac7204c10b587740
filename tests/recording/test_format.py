"""The on-disk format: round trip, blobs, manifest, migration, and readable errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from gateway.recording.format import FORMAT, INLINE_LIMIT, RecordingError, run_file_name
from gateway.recording.model import Spilled
from gateway.recording.reader import load_recording
from gateway.recording.writer import RecordingWriter
from tests.recording.helpers import exchange, mini_policy, write


def test_round_trip_inline_base64_and_blob(tmp_path: Path) -> None:
    policy = mini_policy()
    big = b"x" * (INLINE_LIMIT + 10)
    binary = bytes(range(256))
    write(
        tmp_path,
        exchange(1, "/items?a=1", b'{"items": []}', rule=policy.rules_by_id["items"]),
        exchange(
            2,
            "/items",
            b'{"id": 7}',
            method="POST",
            body=b'{ "b": 1,  "a": [1, 2] }',
            rule=policy.rules_by_id["create"],
            chunks=[(0.0, 4), (0.5, 5)],
        ),
        exchange(3, "/ping", binary),
        exchange(4, "/ping", big),
    )
    rec = load_recording(tmp_path)
    [run] = rec.runs.values()
    e1, e2, e3, e4 = run.entries
    assert (e1.method, e1.target, e1.upstream, e1.roles) == (
        "GET",
        "/items?a=1",
        "api",
        ("reader",),
    )
    assert e1.decision.rule == "items" and e1.decision.allowed
    assert e1.response is not None and e1.response.body is not None
    assert e1.response.body.read() == b'{"items": []}'
    # The canonical body is compact with sorted keys; the exact bytes are kept beside it.
    assert (e2.form, e2.canonical) == ("json", '{"a":[1,2],"b":1}')
    assert e2.request_bytes() == b'{ "b": 1,  "a": [1, 2] }'
    assert e2.response is not None and e2.response.chunks == ((0.0, 4), (0.5, 5))
    assert e3.response is not None and e3.response.body is not None
    assert e3.response.body.read() == binary
    line3 = (tmp_path / "runs" / "r1.jsonl").read_text().splitlines()[2]
    assert '"base64"' in line3
    assert e4.response is not None and e4.response.body is not None
    assert e4.response.body.blob is not None
    assert e4.response.body.read() == big
    digest = hashlib.sha256(big).hexdigest()
    assert (tmp_path / "blobs" / "sha256" / digest).read_bytes() == big
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["format"] == FORMAT and manifest["version"] == 1
    assert manifest["capgate_version"] and manifest["created"].endswith("Z")
    assert manifest["runs"] == [
        {
            "run": "r1",
            "file": "runs/r1.jsonl",
            "calls": 4,
            "denials": 0,
            "errors": 0,
            "started": manifest["runs"][0]["started"],
            "size": (tmp_path / "runs" / "r1.jsonl").stat().st_size,
        }
    ]


def test_spilled_bodies_are_redacted_into_blobs_and_the_spill_file_removed(tmp_path: Path) -> None:
    spill = tmp_path / "spill.bin"
    jwt = "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJib3QifQ.c2lnbmF0dXJl"
    spill.write_bytes(b"a" * INLINE_LIMIT + jwt.encode() + b"b" * 100)
    ex = exchange(1, "/ping", b"")
    assert ex.response is not None
    ex.response.body = Spilled(spill, spill.stat().st_size)
    write(tmp_path / "rec", ex)
    assert not spill.exists()
    body = load_recording(tmp_path / "rec").runs["r1"].entries[0].response.body  # type: ignore[union-attr]
    assert body is not None and body.blob is not None
    assert jwt.encode() not in body.read() and b"[redacted:jwt]" in body.read()


def test_run_ids_become_safe_file_names() -> None:
    assert run_file_name("ci-42") == "runs/ci-42.jsonl"
    for bad in ("../x", "a/b", ".hidden", "x..y", "", "é"):
        name = run_file_name(bad)
        assert name.startswith("runs/run-") and name.endswith(".jsonl") and "/" not in name[5:]


def test_appending_continues_a_run_and_repairs_a_torn_last_line(tmp_path: Path) -> None:
    write(tmp_path, exchange(1, "/ping", b"1"), exchange(2, "/ping", b"2"))
    path = tmp_path / "runs" / "r1.jsonl"
    with path.open("ab") as fh:
        fh.write(b'{"seq": 3, "t": 0.3, "kind": "exch')  # a crash in the middle of a write
    rec = load_recording(tmp_path)
    assert [e.seq for e in rec.runs["r1"].entries] == [1, 2]
    assert "truncated" in rec.warnings[0] and "r1.jsonl:3" in rec.warnings[0]
    writer = RecordingWriter(tmp_path)
    assert writer.last_seq("r1") == 2  # the torn line was cut off first
    writer.append(exchange(3, "/ping", b"3"))
    assert [e.seq for e in load_recording(tmp_path).runs["r1"].entries] == [1, 2, 3]


def _v0(tmp_path: Path) -> Path:
    (tmp_path / "runs").mkdir(parents=True)
    (tmp_path / "manifest.json").write_text(
        json.dumps(
            {
                "format": FORMAT,
                "version": 0,
                "created": "2024-01-01T00:00:00.000Z",
                "runs": [{"run": "old", "file": "runs/old.jsonl"}],
            }
        )
    )
    record = {
        "seq": 1,
        "t": 0.0,
        "agent": "a",
        "run": "old",
        "upstream": "api",
        "method": "GET",
        "target": "/ping",
        "rule": "ping",
        "request": {"headers": [], "form": None, "body": None, "raw": None},
        "response": {"status": 200, "reason": "OK", "headers": [], "body": {"text": "pong"}},
    }
    (tmp_path / "runs" / "old.jsonl").write_text(json.dumps(record) + "\n")
    return tmp_path


def test_version_0_is_migrated_step_by_step(tmp_path: Path) -> None:
    rec = load_recording(_v0(tmp_path))
    assert rec.version_read == 0 and rec.manifest["version"] == 1
    assert rec.manifest["capgate_version"] == "unknown"
    [e] = rec.runs["old"].entries
    assert e.kind == "exchange" and e.decision.allowed and e.decision.rule == "ping"
    assert e.roles == () and e.response is not None and e.response.body is not None
    assert e.response.body.read() == b"pong"


def test_old_versions_are_read_only(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match="version 0 recordings are read-only"):
        RecordingWriter(_v0(tmp_path))


def _corrupt(tmp_path: Path, edit: str, value: object) -> Path:
    write(tmp_path, exchange(1, "/ping", b"pong"), exchange(2, "/ping", b"pong"))
    path = tmp_path / "runs" / "r1.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    section, _, key = edit.rpartition(".")
    target = record[section] if section else record
    target[key] = value
    lines[1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("edit", "value", "message"),
    [
        ("response.status", "200", r"r1.jsonl:2: field 'response.status' must be an integer"),
        ("response.status", 42, r"r1.jsonl:2: field 'response.status' must be an HTTP status"),
        ("kind", "other", r"r1.jsonl:2: field 'kind' must be 'exchange' or 'denial'"),
        ("method", None, r"r1.jsonl:2: field 'method' must be a string"),
        ("response.body", {"blob": "sha256/" + "0" * 64}, r"r1.jsonl:2: blob sha256/0+ is missing"),
        ("response.body", {"blob": "../../etc/passwd"}, r"is not a blob reference"),
        ("response.body", {"base64": "!!"}, r"must be valid base64"),
        ("response.headers", [["A", 1]], r"must be a list of \[name, value\] pairs"),
        ("decision", "yes", r"r1.jsonl:2: decision. must be an object"),
    ],
)
def test_a_corrupt_record_gives_one_readable_error(
    tmp_path: Path, edit: str, value: object, message: str
) -> None:
    with pytest.raises(RecordingError, match=message):
        load_recording(_corrupt(tmp_path, edit, value))


def test_a_corrupt_line_in_the_middle_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, exchange(1, "/ping", b"1"), exchange(2, "/ping", b"2"))
    path = tmp_path / "runs" / "r1.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0][:20] + "\n" + lines[1] + "\n")
    with pytest.raises(RecordingError, match=r"r1.jsonl:1: not valid JSON"):
        load_recording(tmp_path)


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (None, "not a capgate recording \\(no manifest.json\\)"),
        ("{", "manifest.json: not valid JSON"),
        ({"format": "other"}, "format is not 'capgate-recording'"),
        ({"format": FORMAT, "version": 2, "runs": []}, "written by a newer capgate"),
        ({"format": FORMAT, "version": "1", "runs": []}, "'version' must be an integer"),
        ({"format": FORMAT, "version": 1, "runs": {}}, "'runs' must be a list"),
        (
            {"format": FORMAT, "version": 1, "runs": [{"run": "a", "file": "../a.jsonl"}]},
            "must be a path under runs/",
        ),
        (
            {"format": FORMAT, "version": 1, "runs": [{"run": "a", "file": "runs/a.jsonl"}]},
            "run file listed in the manifest is missing",
        ),
    ],
)
def test_a_bad_manifest_gives_one_readable_error(
    tmp_path: Path, manifest: object, message: str
) -> None:
    if manifest is not None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(RecordingError, match=message):
        load_recording(tmp_path)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match="no such recording directory"):
        load_recording(tmp_path / "nope")


def test_a_writer_refuses_a_broken_manifest(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format": FORMAT, "version": 1, "runs": [{"file": "runs/a.jsonl"}]})
    )
    with pytest.raises(RecordingError, match=r"runs\[0\]: not a valid manifest entry"):
        RecordingWriter(tmp_path)
