"""The hash-chained audit file: append, verify, and every kind of tampering found."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.audit_sign import CheckpointSigner, load_verify_keys
from gateway.audit_trail import (
    GENESIS,
    MAX_SUMMARY_KEYS,
    AuditTrail,
    ChainBreak,
    FsyncPolicy,
    TrailOptions,
    call_records,
    read_records,
    verify,
)
from gateway.audit_verify import verify_trail
from gateway.errors import AuditUnavailable, ConfigError
from gateway.testing import make_call


def write_trail(path: Path, n: int) -> list[bytes]:
    trail = AuditTrail(path)
    trail.open()
    for i in range(n):
        trail.append({"n": i, "decision": "allow" if i % 2 else "deny", "agent": f"a{i}"})
    trail.close()
    return path.read_bytes().splitlines()


def rewrite(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def test_append_writes_chained_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = write_trail(path, 3)
    assert len(lines) == 3
    records = [json.loads(line) for line in lines]
    assert [r["n"] for r in records] == [0, 1, 2]
    assert records[0]["prev"] == GENESIS == "0" * 64
    assert records[1]["prev"] == hashlib.sha256(lines[0]).hexdigest()
    assert records[2]["prev"] == hashlib.sha256(lines[1]).hexdigest()
    assert path.read_bytes().endswith(b"\n")
    assert verify(path) == (3, None)
    assert list(read_records(path)) == records


def test_new_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "audit.jsonl"
    write_trail(path, 1)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_lines_written_and_flush(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    trail = AuditTrail(path)
    trail.open()
    trail.append({"x": 1})
    trail.flush()
    assert trail.lines_written == 1
    assert verify(path) == (1, None)
    trail.close()
    trail.close()  # closing twice is harmless


def test_no_path_means_no_audit(tmp_path: Path) -> None:
    trail = AuditTrail(None)
    trail.open()
    trail.append({"x": 1})
    trail.close()
    assert trail.lines_written == 0


def test_empty_file_verifies(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"")
    assert verify(path) == (0, None)


def test_reopen_continues_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    write_trail(path, 3)
    trail = AuditTrail(path)
    trail.open()
    trail.append({"n": "after-restart"})
    trail.close()
    lines = path.read_bytes().splitlines()
    assert len(lines) == 4
    assert json.loads(lines[3])["prev"] == hashlib.sha256(lines[2]).hexdigest()
    assert verify(path) == (4, None)


def test_reopen_after_long_lines_continues_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    trail = AuditTrail(path)
    trail.open()
    trail.append({"big": "x" * 10_000})
    trail.append({"big": "y" * 10_000})
    trail.append({"big": "z" * 70_000})  # the last line, longer than one 64 KiB read
    trail.close()
    again = AuditTrail(path)
    again.open()
    again.append({"n": 4})
    again.close()
    assert verify(path) == (4, None)


def test_edited_line_breaks_the_chain_at_the_next_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    lines = write_trail(path, 5)
    lines[1] = lines[1].replace(b'"decision":"allow"', b'"decision":"deny"')
    rewrite(path, lines)
    count, broken = verify(path)
    # Line 2 itself still links to line 1; its new hash no longer matches line 3's "prev".
    assert broken == ChainBreak(3, "hash chain broken: 'prev' does not match the line before")
    assert count == 2


def test_edited_prev_field_breaks_at_that_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    lines = write_trail(path, 3)
    record = json.loads(lines[1])
    record["prev"] = "f" * 64
    lines[1] = json.dumps(record, separators=(",", ":")).encode()
    rewrite(path, lines)
    assert verify(path) == (
        1,
        ChainBreak(2, "hash chain broken: 'prev' does not match the line before"),
    )


def test_deleted_line_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    lines = write_trail(path, 5)
    del lines[2]
    rewrite(path, lines)
    count, broken = verify(path)
    assert broken is not None and broken.line == 3 and count == 2


def test_deleted_first_line_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    lines = write_trail(path, 3)
    rewrite(path, lines[1:])
    assert verify(path)[1] == ChainBreak(
        1, "hash chain broken: 'prev' does not match the line before"
    )


def test_reordered_lines_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    lines = write_trail(path, 5)
    lines[1], lines[3] = lines[3], lines[1]
    rewrite(path, lines)
    count, broken = verify(path)
    assert broken is not None and broken.line == 2 and count == 1


def test_inserted_line_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    lines = write_trail(path, 3)
    forged = json.dumps({"n": "forged", "prev": hashlib.sha256(lines[0]).hexdigest()}).encode()
    lines.insert(1, forged)
    rewrite(path, lines)
    count, broken = verify(path)
    assert broken is not None and broken.line == 3 and count == 2


def test_blank_and_garbage_lines_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    lines = write_trail(path, 3)
    rewrite(path, [lines[0], b"", *lines[1:]])
    assert verify(path) == (1, ChainBreak(2, "empty line"))
    rewrite(path, [lines[0], b"{not json", *lines[1:]])
    assert verify(path) == (1, ChainBreak(2, "not valid JSON"))
    rewrite(path, [lines[0], b"[1, 2]", *lines[1:]])
    assert verify(path)[1] is not None and verify(path)[1].line == 2  # type: ignore[union-attr]


def test_values_are_json_encoded_safely(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    trail = AuditTrail(path)
    trail.open()
    trail.append({"detail": "line\nbreak\r and \u2028", "path": Path("/x")})
    trail.close()
    (line,) = path.read_bytes().splitlines()
    assert json.loads(line)["detail"] == "line\nbreak\r and \u2028"
    assert json.loads(line)["path"] == "/x"
    assert verify(path) == (1, None)


def test_a_decision_line_is_its_record_with_type_after_v(tmp_path: Path) -> None:
    # The record's own encoding with ``type`` spliced in after ``v`` (its first member, as
    # the audit stage builds it), or the merged record when ``v`` is not first or another
    # version: the same bytes either way.
    path = tmp_path / "a.jsonl"
    trail = AuditTrail(path)
    trail.open()
    records: list[dict[str, Any]] = [
        {"v": 2, "request_id": "r1", "agent": None, "request_body": {"size": 3, "hmac": "ab"}},
        {"request_id": "r2", "v": 2},
        {"v": 1, "request_id": "r3"},
        {"v": 2},
    ]
    for record in records:
        trail.call_decided(make_call(), [record])  # type: ignore[list-item]
    trail.close()
    lines = path.read_bytes().splitlines()
    prev = GENESIS
    for line, record in zip(lines, records, strict=True):
        merged = orjson.dumps({"v": 2, "type": "decision", **record})
        assert line == merged[:-1] + b',"prev":"' + prev.encode() + b'"}'
        prev = hashlib.sha256(line).hexdigest()
    assert verify(path) == (4, None)


def test_truncating_the_last_line_is_not_detected(tmp_path: Path) -> None:
    # A known limit of a chain without an external anchor: the tail can be cut silently.
    path = tmp_path / "a.jsonl"
    lines = write_trail(path, 3)
    rewrite(path, lines[:2])
    assert verify(path) == (2, None)


def test_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        verify(tmp_path / "nope.jsonl")


# --- format 2: durability, failure, summaries ------------------------------------------------


def _signed(tmp_path: Path, **options: Any) -> AuditTrail:
    signer = CheckpointSigner.load_or_create(tmp_path / "k.pem")
    signer.publish(tmp_path / "jwks.json")
    return AuditTrail(tmp_path / "audit.jsonl", TrailOptions(**options), signer=signer)


async def test_fsync_always_is_a_group_commit(tmp_path: Path) -> None:
    trail = _signed(tmp_path, fsync=FsyncPolicy.parse("always"))
    trail.open()
    try:
        calls = [make_call() for _ in range(64)]
        waits = []
        for call in calls:
            pending = trail.call_decided(call, [{"request_id": call.request_id}])  # type: ignore[list-item]
            assert pending is not None and call.audit_decided
            waits.append(pending)
        await asyncio.gather(*waits)
        syncs = trail.health()["syncs"]
        assert 1 <= syncs < 64  # waiters that came together shared a sync
    finally:
        trail.close()


def test_fsync_settings() -> None:
    assert str(FsyncPolicy.parse("always")) == "always"
    assert str(FsyncPolicy.parse("never")) == "never"
    assert str(FsyncPolicy.parse("250ms")) == "0.25s"
    with pytest.raises(ValueError):
        FsyncPolicy.parse("0s")


def test_a_line_is_written_to_every_file_or_to_none(tmp_path: Path) -> None:
    # A mirror that refuses every write (/dev/full: a real ENOSPC): the primary's copy of the
    # line is cut back, the chain does not advance, the call is refused.
    trail = _signed(tmp_path, mirror=Path("/dev/full"))
    with pytest.raises(ConfigError, match="cannot write audit file"):
        trail.open()  # its start checkpoint cannot be written: the gateway does not start
    assert not (tmp_path / "audit.jsonl").read_bytes()
    trail = AuditTrail(tmp_path / "audit.jsonl")
    trail.open()
    trail.append({"n": 1})
    size = (tmp_path / "audit.jsonl").stat().st_size
    full = os.open("/dev/full", os.O_WRONLY)
    assert trail._primary is not None
    trail._mirror = type(trail._primary).__new__(type(trail._primary))
    trail._mirror.path, trail._mirror.fd, trail._mirror.size = Path("/dev/full"), full, 0
    with pytest.raises(AuditUnavailable):
        trail.append({"n": 2})
    assert (tmp_path / "audit.jsonl").stat().st_size == size
    assert trail.health()["ok"] is False and "No space" in str(trail.error)
    trail._mirror = None
    os.close(full)
    trail.append({"n": 3})
    trail.close()
    lines = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [x.get("n") for x in lines] == [1, None, 3]
    assert lines[1]["type"] == "repair" and lines[1]["what"] == "write_failed"
    assert verify(tmp_path / "audit.jsonl") == (3, None)


def test_a_short_write_is_completed_or_cut_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first write of a line is its whole line nearly always; when the OS takes only part
    # of it, the rest follows; when the rest fails, the part written is cut back, the chain
    # does not advance and the call is refused.
    path = tmp_path / "audit.jsonl"
    trail = AuditTrail(path)
    trail.open()
    real = os.write
    writes: list[int] = []

    def partly(fd: int, data: bytes) -> int:
        writes.append(len(data))
        if len(writes) == 1:
            return real(fd, data[:10])
        if fail_rest:
            raise OSError(28, "No space left on device")
        return real(fd, data)

    fail_rest = False
    monkeypatch.setattr("gateway.audit_trail.os.write", partly)
    trail.append({"n": 1})
    assert len(writes) == 2 and writes[1] == writes[0] - 10
    writes.clear()
    size = path.stat().st_size
    fail_rest = True
    with pytest.raises(AuditUnavailable):
        trail.append({"n": 2})
    assert path.stat().st_size == size and trail.error is not None
    monkeypatch.setattr("gateway.audit_trail.os.write", real)
    trail.append({"n": 3})
    trail.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x.get("n") for x in lines] == [1, None, 3]  # the repair line between
    assert verify(path) == (3, None)


def test_refusals_are_counted_into_one_summary_with_bounded_sources(tmp_path: Path) -> None:
    trail = AuditTrail(tmp_path / "audit.jsonl")
    trail.open()
    for i in range(MAX_SUMMARY_KEYS + 50):
        trail.count_refusal("token_missing", f"10.0.{i // 256}.{i % 256}")
    trail.count_refusal("http_invalid", None)
    trail.flush()
    trail.close()
    [summary] = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    counts = {(c["reason"], c["source"]): c["n"] for c in summary["counts"]}
    assert len(counts) <= MAX_SUMMARY_KEYS + 2  # and one "other" per reason
    assert sum(counts.values()) == MAX_SUMMARY_KEYS + 51
    assert counts[("token_missing", "other")] >= 50


def test_rotation_by_size(tmp_path: Path) -> None:
    trail = _signed(tmp_path, rotate_size=2000)
    trail.open()
    for i in range(40):
        trail.append({"v": 2, "type": "decision", "n": i, "pad": "x" * 40})
        trail.tick()
    trail.close()
    files = sorted(tmp_path.glob("audit.jsonl.*"))
    rotated = [f for f in files if f.name[len("audit.jsonl.") :][:1].isdigit()]
    assert len(rotated) >= 2, files  # names within one second get .001, .002, ...
    assert all(f.stat().st_size < 2000 + 1000 for f in rotated)
    keys = load_verify_keys(tmp_path / "jwks.json")
    report = verify_trail([*rotated, tmp_path / "audit.jsonl"], keys)
    assert report.ok, report.problem
    decisions = [
        json.loads(x)["n"]
        for f in [*rotated, tmp_path / "audit.jsonl"]
        for x in f.read_text().splitlines()
        if '"decision"' in x
    ]
    assert decisions == list(range(40))


def test_call_records_join_decision_and_outcome() -> None:
    lines = [
        {"type": "checkpoint"},
        {"type": "decision", "request_id": "a", "status": None, "decision": "allow"},
        {"type": "decision", "request_id": "b", "status": 403, "decision": "deny"},
        {"type": "outcome", "request_id": "a", "status": 200, "duration_ms": 1.5},
        {"v": 1, "request_id": "old", "status": 200},
    ]
    assert call_records(lines) == [
        {"request_id": "a", "status": 200, "decision": "allow", "duration_ms": 1.5},
        {"request_id": "b", "status": 403, "decision": "deny"},
        {"v": 1, "request_id": "old", "status": 200},
    ]


def test_checkpoints_and_rotation_by_time(tmp_path: Path) -> None:
    trail = _signed(tmp_path, checkpoint_interval=0.05, rotate_interval=0.3)
    trail.open()
    trail.tick()  # nothing written since the start checkpoint: no periodic one
    assert trail.checkpoints == 1
    trail.append({"v": 2, "type": "decision", "n": 1})
    time.sleep(0.06)
    trail.tick()
    assert trail.latest_checkpoint is not None
    assert trail.latest_checkpoint["kind"] == "periodic" and trail.checkpoints == 2
    time.sleep(0.3)
    trail.tick()  # rotated: a rotate checkpoint closes the old file, a start opens the new
    trail.append({"v": 2, "type": "decision", "n": 2})
    trail.close()
    [old] = tmp_path.glob("audit.jsonl.2*")
    kinds = [json.loads(x).get("kind") for x in old.read_text().splitlines()]
    assert kinds == ["start", None, "periodic", "rotate"]
    keys = load_verify_keys(tmp_path / "jwks.json")
    assert verify_trail([old, tmp_path / "audit.jsonl"], keys).ok
