"""``verify_trail``: every kind of tampering detected, with the record it names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.audit_anchor import AnchorSpec, publish
from gateway.audit_sign import CheckpointSigner, load_verify_keys
from gateway.audit_trail import GENESIS, AuditTrail, TrailOptions
from gateway.audit_verify import Report, verify_trail


@pytest.fixture
def signer(tmp_path: Path) -> CheckpointSigner:
    signer = CheckpointSigner.load_or_create(tmp_path / "audit.signing.pem")
    signer.publish(tmp_path / "audit.jwks.json")
    return signer


def write(path: Path, signer: CheckpointSigner, n: int = 12, every: int = 4) -> list[bytes]:
    """A trail of ``n`` decision lines (agents a0/a1 in turn), a checkpoint every ``every``."""
    trail = AuditTrail(path, TrailOptions(checkpoint_lines=every, gateway_id="gw"), signer=signer)
    trail.open()
    for i in range(n):
        trail.append(
            {"v": 2, "type": "decision", "request_id": f"r{i}", "agent": f"a{i % 2}", "n": i}
        )
    trail.close()
    return path.read_bytes().splitlines()


def save(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def check(path: Path, tmp_path: Path, **kw: object) -> Report:
    keys = load_verify_keys(tmp_path / "audit.jwks.json")
    return verify_trail([path], keys, **kw)  # type: ignore[arg-type]


def kinds(lines: list[bytes]) -> list[str]:
    return [json.loads(x).get("type", "") + ":" + json.loads(x).get("kind", "") for x in lines]


def test_a_whole_trail_verifies(tmp_path: Path, signer: CheckpointSigner) -> None:
    path = tmp_path / "audit.jsonl"
    lines = write(path, signer)
    # start, 12 decisions with a periodic checkpoint after each 4, then shutdown
    assert kinds(lines)[0] == "checkpoint:start" and kinds(lines)[-1] == "checkpoint:shutdown"
    report = check(path, tmp_path)
    assert report.ok, report.problem
    assert report.lines == len(lines) and report.checkpoints == 5
    assert report.kids == {signer.kid} and report.gateways == {"gw"}
    assert any("no anchor given" in n for n in report.notes)


def test_an_edited_field_is_found_at_the_next_line(
    tmp_path: Path, signer: CheckpointSigner
) -> None:
    path = tmp_path / "audit.jsonl"
    lines = write(path, signer)
    lines[3] = lines[3].replace(b'"agent":"a0"', b'"agent":"a9"')
    save(path, lines)
    problem = check(path, tmp_path).problem
    assert problem is not None and problem.line == 5 and "hash chain broken" in problem.message


def test_a_deleted_line_is_found(tmp_path: Path, signer: CheckpointSigner) -> None:
    path = tmp_path / "audit.jsonl"
    lines = write(path, signer)
    del lines[6]
    save(path, lines)
    problem = check(path, tmp_path).problem
    assert problem is not None and problem.line == 7 and "hash chain broken" in problem.message


def test_swapped_lines_are_found(tmp_path: Path, signer: CheckpointSigner) -> None:
    path = tmp_path / "audit.jsonl"
    lines = write(path, signer)
    lines[2], lines[3] = lines[3], lines[2]
    save(path, lines)
    problem = check(path, tmp_path).problem
    assert problem is not None and problem.line == 3


def test_a_cut_tail_is_found(tmp_path: Path, signer: CheckpointSigner) -> None:
    # `head -n -5 audit.jsonl`
    path = tmp_path / "audit.jsonl"
    lines = write(path, signer)
    save(path, lines[:-5])
    report = check(path, tmp_path)
    assert report.problem is not None and report.problem.line == len(lines) - 5 + 1
    assert "does not end with a shutdown checkpoint" in report.problem.message
    # After a crash the operator may accept an open tail: it passes, and says what it lacks.
    report = check(path, tmp_path, open_tail=True)
    assert report.ok and any("the tail is open" in n for n in report.notes)


def _recompute(lines: list[bytes]) -> list[bytes]:
    """What a forger with write access does: fix every ``prev`` after an edit."""
    out: list[bytes] = []
    prev = GENESIS
    for raw in lines:
        head, _, rest = raw.partition(b'"prev":"')
        fixed = head + b'"prev":"' + prev.encode() + rest[64:]
        out.append(fixed)
        prev = hashlib.sha256(fixed).hexdigest()
    return out


def test_removed_lines_with_the_chain_recomputed_are_found(
    tmp_path: Path, signer: CheckpointSigner
) -> None:
    # One agent's lines removed and the chain recomputed: the chain holds, the first checkpoint
    # after the first removed line does not.
    path = tmp_path / "audit.jsonl"
    lines = write(path, signer)
    kept = [x for x in lines if b'"agent":"a1"' not in x]
    forged = _recompute(kept)
    save(path, forged)
    problem = check(path, tmp_path).problem
    first_checkpoint_after = next(
        i + 1 for i, x in enumerate(forged) if i > 1 and b'"type":"checkpoint"' in x
    )
    assert problem is not None and problem.line == first_checkpoint_after
    assert "checkpoint signature does not verify" in problem.message


def test_an_edit_with_the_chain_recomputed_is_found(
    tmp_path: Path, signer: CheckpointSigner
) -> None:
    path = tmp_path / "audit.jsonl"
    lines = write(path, signer)
    assert b'"agent":"a1"' in lines[7]
    lines[7] = lines[7].replace(b'"agent":"a1"', b'"agent":"a7"')
    save(path, _recompute(lines))
    problem = check(path, tmp_path).problem
    assert kinds(lines)[10] == "checkpoint:periodic"
    assert problem is not None and problem.line == 11  # the periodic checkpoint after it
    assert "signature" in problem.message


def test_a_forged_checkpoint_is_found(tmp_path: Path, signer: CheckpointSigner) -> None:
    path = tmp_path / "audit.jsonl"
    lines = write(path, signer)
    # Cut the tail and close it with a shutdown checkpoint signed by another key ...
    other = CheckpointSigner(ed25519.Ed25519PrivateKey.generate())
    cut = lines[:8]
    unsigned = (
        b'{"v":2,"type":"checkpoint","time":"2026-12-01T00:00:00.000Z","kind":"shutdown","kid":"'
        + other.kid.encode()
        + b'","gateway":"gw","lines":2,"prev":"'
        + hashlib.sha256(cut[-1]).hexdigest().encode()
        + b'"'
    )
    save(path, [*cut, other.sign(unsigned)])
    problem = check(path, tmp_path).problem
    assert problem is not None and problem.line == 9 and "not in the audit JWKS" in problem.message
    # ... or claiming the real key's id.
    claimed = unsigned.replace(other.kid.encode(), signer.kid.encode())
    save(path, [*cut, other.sign(claimed)])
    problem = check(path, tmp_path).problem
    assert (
        problem is not None and problem.line == 9 and "signature does not verify" in problem.message
    )


def test_a_torn_line_is_found_unless_the_tail_is_open(
    tmp_path: Path, signer: CheckpointSigner
) -> None:
    path = tmp_path / "audit.jsonl"
    write(path, signer)
    with path.open("ab") as fh:
        fh.write(b'{"v":2,"type":"decision","request_')
    report = check(path, tmp_path)
    assert report.problem is not None and "torn line" in report.problem.message
    assert check(path, tmp_path, open_tail=True).ok


def test_the_anchor_finds_a_tail_cut_back_to_an_earlier_checkpoint(
    tmp_path: Path, signer: CheckpointSigner
) -> None:
    path = tmp_path / "audit.jsonl"
    anchor = tmp_path / "elsewhere" / "anchor.jsonl"
    trail = AuditTrail(path, TrailOptions(checkpoint_lines=4, gateway_id="gw"), signer=signer)
    trail.open()
    for i in range(12):
        trail.append({"v": 2, "type": "decision", "request_id": f"r{i}", "agent": "a"})
        if trail.latest_checkpoint is not None:
            publish(AnchorSpec("file", str(anchor)), trail.latest_checkpoint)
    trail.close()
    assert trail.latest_checkpoint is not None
    publish(AnchorSpec("file", str(anchor)), trail.latest_checkpoint)
    entries = [json.loads(x) for x in anchor.read_text().splitlines()]
    assert check(path, tmp_path, anchor=entries).ok
    lines = path.read_bytes().splitlines()
    # Cut back to the second periodic checkpoint: signed, and whole but for the anchor.
    save(path, lines[:11])
    assert check(path, tmp_path, open_tail=True).ok
    report = check(path, tmp_path, open_tail=True, anchor=entries)
    assert report.problem is not None and report.problem.line == 12
    assert "anchor's latest checkpoint" in report.problem.message


def test_rotated_files_verify_as_one_trail(tmp_path: Path, signer: CheckpointSigner) -> None:
    path = tmp_path / "audit.jsonl"
    trail = AuditTrail(path, TrailOptions(checkpoint_lines=100), signer=signer)
    trail.open()
    for i in range(3):
        trail.append({"v": 2, "type": "decision", "n": i})
    trail.rotate(move=True)
    for i in range(3):
        trail.append({"v": 2, "type": "decision", "n": 10 + i})
    trail.close()
    [old] = [p for p in tmp_path.iterdir() if p.name.startswith("audit.jsonl.2")]
    assert check(old, tmp_path, open_tail=True).ok
    keys = load_verify_keys(tmp_path / "audit.jwks.json")
    assert verify_trail([old, path], keys).ok
    # The new file alone: it starts with a signed checkpoint continuing the chain.
    alone = verify_trail([path], keys)
    assert alone.ok and any("continues a chain" in n for n in alone.notes)
    # Out of order, the chain breaks at the first line of the second file.
    wrong = verify_trail([path, old], keys)
    assert wrong.problem is not None and wrong.problem.file == str(old)
    assert wrong.problem.line == 1


def test_a_trail_begun_in_format_1_verifies_after_the_upgrade(
    tmp_path: Path, signer: CheckpointSigner
) -> None:
    # Lines of format 1 (one line per call, no type), then the upgraded gateway continues
    # the same file: the chain holds across, the new part is signed, the old part is named.
    path = tmp_path / "audit.jsonl"
    old = AuditTrail(path)
    old.open()
    for i in range(3):
        old.append({"v": 1, "request_id": f"old{i}", "agent": "a", "decision": "allow"})
    old.close()
    write(path, signer, n=4)
    report = check(path, tmp_path)
    assert report.ok, report.problem
    assert report.legacy_lines == 3
    assert any("3 lines of format 1" in n for n in report.notes)
