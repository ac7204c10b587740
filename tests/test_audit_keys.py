"""The audit key and the checkpoint signing key change without a restart (``key_reload.py``,
``AuditTrail.change_keys``), and the trail still verifies across the change."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from gateway.app import build_gateway
from gateway.audit_anchor import Anchor, AnchorSpec, read_anchor
from gateway.audit_record import BodyMac, audit_key_id
from gateway.audit_sign import CheckpointSigner, load_verify_keys
from gateway.audit_trail import (
    AuditTrail,
    TrailOptions,
    call_records,
    load_audit_key,
    with_audit_keys,
)
from gateway.audit_verify import Report, verify_trail
from gateway.cli import main
from gateway.config import Settings
from gateway.key_reload import AuditKeyReloader
from gateway.tokens import key_id
from mocks.demo import Workspace
from tests.conftest import Mocks

# --- real key files, written as an operator would (a new file moved into place) ------------


def put_audit_key(path: Path, key: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(key.hex() + "\n")
    tmp.chmod(mode)
    os.replace(tmp, path)


def put_signing_key(path: Path, key: Any = None, mode: int = 0o600) -> str:
    key = key or ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(pem)
    tmp.chmod(mode)
    os.replace(tmp, path)
    return key_id(key.public_key()) if isinstance(key, ed25519.Ed25519PrivateKey) else ""


class Setup:
    """A trail with its two key files, its JWKS and the watcher, as ``build_gateway`` wires
    them (checkpoints every 4 lines)."""

    def __init__(self, root: Path, **options: Any) -> None:
        self.path = root / "audit.jsonl"
        self.key_file = root / "audit.jsonl.key"
        self.signing_file = root / "audit.jsonl.signing.pem"
        self.jwks = root / "audit.jsonl.jwks.json"
        self.mac = BodyMac(load_audit_key(self.key_file))
        signer = CheckpointSigner.load_or_create(self.signing_file)
        signer.publish(self.jwks)
        opts = {"checkpoint_lines": 4, "gateway_id": "gw", **options}
        self.trail = AuditTrail(
            self.path, TrailOptions(**opts), signer=signer, audit_key_id=self.mac.kid
        )
        self.reloader = AuditKeyReloader(
            self.trail, self.mac, self.key_file, self.signing_file, self.jwks
        )
        self.n = 0

    def call(self, body: bytes | None = None) -> None:
        """One decision line with the body's keyed digest, as the audit stage writes it."""
        body = body if body is not None else f"body-{self.n}".encode()
        self.trail.append(
            {
                "v": 2,
                "type": "decision",
                "request_id": f"r{self.n}",
                "agent": "a",
                "request_body": self.mac.of(body),
            }
        )
        self.n += 1

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.path.read_text().splitlines()]

    def verify(self, **kw: Any) -> Report:
        return verify_trail([self.path], load_verify_keys(self.jwks), **kw)


def digest(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, "sha256").hexdigest()  # the standard library's, not BodyMac


# --- the audit key -------------------------------------------------------------------------


def test_a_new_audit_key_is_recorded_then_used_and_lines_prove_under_their_key(
    tmp_path: Path,
) -> None:
    s = Setup(tmp_path)
    s.trail.open()
    old = load_audit_key(s.key_file)
    for _ in range(3):
        s.call()
    new = os.urandom(32)
    put_audit_key(s.key_file, new)
    s.reloader.tick()
    assert s.mac.kid == audit_key_id(new) and s.trail.audit_key_id == audit_key_id(new)
    for _ in range(3):
        s.call()
    s.trail.close()

    report = s.verify()
    assert report.ok, report.problem
    assert report.audit_keys == [audit_key_id(old), audit_key_id(new)]
    lines = s.lines()
    [change] = [x for x in lines if x["type"] == "key"]
    assert change["audit_key_before"] == audit_key_id(old)
    assert change["audit_key"] == audit_key_id(new)
    assert change["kid"] == change["kid_before"] == s.trail.signer.kid  # type: ignore[union-attr]
    at = lines.index(change)
    # The segment under the old key is closed by a checkpoint right after the key line.
    assert lines[at + 1]["type"] == "checkpoint" and lines[at + 1]["kind"] == "rekey"
    # No key material anywhere in the trail.
    text = s.path.read_text()
    assert old.hex() not in text and new.hex() not in text
    # Recompute every digest under the key the trail names for its line.
    keys = {audit_key_id(old): old, audit_key_id(new): new}
    decisions = [x for x in with_audit_keys(lines) if x["type"] == "decision"]
    assert [lines.index(x) < at for x in lines if x["type"] == "decision"] == [True] * 3 + [
        False
    ] * 3
    for i, line in enumerate(decisions):
        expected = old if i < 3 else new
        assert line["audit_key"] == audit_key_id(expected)
        body = f"body-{i}".encode()
        assert line["request_body"]["hmac"] == digest(keys[line["audit_key"]], body)
        assert line["request_body"]["hmac"] != digest(new if i < 3 else old, body)


def test_query_finds_a_body_under_the_key_of_its_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Setup(tmp_path)
    s.trail.open()
    s.call(b'{"pin":"1234"}')
    old_copy = tmp_path / "audit.jsonl.key.20261206"
    put_audit_key(old_copy, load_audit_key(s.key_file))  # the rotation keeps the old key
    put_audit_key(s.key_file, os.urandom(32))
    s.reloader.tick()
    s.call(b'{"pin":"1234"}')
    s.call(b'{"pin":"9999"}')
    s.trail.close()

    def query(*extra: str) -> dict[str, Any]:
        capsys.readouterr()
        code = main(["audit", "query", str(s.path), "--format", "json", *extra])
        out = json.loads(capsys.readouterr().out)
        assert code == 0, out["verification"]
        return out  # type: ignore[no-any-return]

    pin = tmp_path / "pin.json"
    pin.write_bytes(b'{"pin":"1234"}')
    # Default keys: FILE.key and the kept FILE.key.* beside the trail: both lines found.
    found = query("--body", str(pin))
    assert [m["request_id"] for m in found["matches"]] == ["r0", "r1"]
    assert found["verification"]["audit_keys"] == [m["audit_key"] for m in found["matches"]]
    # Only the current key given: the older line cannot be compared, and the answer says so.
    found = query("--body", str(pin), "--audit-key", str(s.key_file))
    assert [m["request_id"] for m in found["matches"]] == ["r1"]
    assert any("not given (--audit-key)" in n for n in found["verification"]["not_verified"])


# --- the signing key -----------------------------------------------------------------------


def _checkpoints(lines: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(x["kind"], x["kid"]) for x in lines if x["type"] == "checkpoint"]


def test_a_new_signing_key_is_published_vouched_for_and_signs_from_then_on(
    tmp_path: Path,
) -> None:
    s = Setup(tmp_path)
    s.trail.open()
    old_kid = s.trail.signer.kid  # type: ignore[union-attr]
    for _ in range(5):
        s.call()
    new_kid = put_signing_key(s.signing_file)
    s.reloader.tick()
    for _ in range(5):
        s.call()
    s.trail.close()

    assert set(load_verify_keys(s.jwks)) == {old_kid, new_kid}  # the old key stays
    lines = s.lines()
    cps = _checkpoints(lines)
    rekey = cps.index(("rekey", old_kid))
    assert all(kid == old_kid for _, kid in cps[: rekey + 1])
    assert all(kid == new_kid for _, kid in cps[rekey + 1 :]) and len(cps) > rekey + 2
    [change] = [x for x in lines if x["type"] == "key"]
    assert (change["kid_before"], change["kid"]) == (old_kid, new_kid)
    report = s.verify()
    assert report.ok, report.problem
    assert report.kids == {old_kid, new_kid}
    assert not any("restart" in n for n in report.notes)  # vouched for, not a restart

    # The rule for the JWKS: a key stays while a trail it signed needs verifying.
    only_new = tmp_path / "only-new.json"
    keys = json.loads(s.jwks.read_text())["keys"]
    only_new.write_text(json.dumps({"keys": [k for k in keys if k["kid"] == new_kid]}))
    report = verify_trail([s.path], load_verify_keys(only_new))
    assert report.problem is not None and report.problem.line == 1

    # A checkpoint forged with a key that is not in the JWKS fails, at its own line.
    forger = CheckpointSigner(ed25519.Ed25519PrivateKey.generate())
    raw = s.path.read_bytes().splitlines()
    prev = hashlib.sha256(raw[-1]).hexdigest()
    unsigned = (
        b'{"v":2,"type":"checkpoint","time":"2026-12-06T00:00:00.000Z","kind":"shutdown",'
        b'"kid":"'
        + forger.kid.encode()
        + b'","gateway":"gw","lines":0,"prev":"'
        + prev.encode()
        + b'"'
    )
    s.path.write_bytes(b"\n".join([*raw, forger.sign(unsigned)]) + b"\n")
    report = s.verify()
    assert report.problem is not None and report.problem.line == len(raw) + 1
    assert "not in the audit JWKS" in report.problem.message


def test_both_keys_change_at_once_and_a_rotation_carries_the_change(tmp_path: Path) -> None:
    s = Setup(tmp_path, rotate_size=10**9)
    s.trail.open()
    s.call()
    put_audit_key(s.key_file, os.urandom(32))
    new_kid = put_signing_key(s.signing_file)
    s.reloader.tick()
    s.call()
    s.trail.rotate(move=True)  # the new file starts under the new keys
    s.call()
    s.trail.close()
    files = sorted(tmp_path.glob("audit.jsonl.2*")) + [s.path]
    report = verify_trail(files, load_verify_keys(s.jwks))
    assert report.ok, report.problem
    assert len([x for f in files for x in f.read_text().splitlines() if '"type":"key"' in x]) == 1
    first = json.loads(s.path.read_text().splitlines()[0])
    assert (first["kind"], first["kid"], first["audit_key"]) == ("start", new_kid, s.mac.kid)


# --- what is refused -----------------------------------------------------------------------


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_bad_key_file_is_refused_in_one_line_and_the_keys_in_force_stay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Setup(tmp_path)
    s.trail.open()
    mac_kid, kid = s.mac.kid, s.trail.signer.kid  # type: ignore[union-attr]
    bad_audit_keys = [
        lambda: put_audit_key(s.key_file, os.urandom(32), mode=0o644),  # others may read it
        lambda: s.key_file.write_text("not hex\n"),
        lambda: put_audit_key(s.key_file, b"short"),
    ]
    bad_signing_keys = [
        lambda: put_signing_key(s.signing_file, mode=0o640 | 0o004),
        lambda: s.signing_file.write_text("-----BEGIN NOTHING-----\n"),
        lambda: put_signing_key(s.signing_file, ec.generate_private_key(ec.SECP256R1())),
    ]
    for spoil, which in [(f, "audit key") for f in bad_audit_keys] + [
        (f, "audit signing key") for f in bad_signing_keys
    ]:
        caplog.clear()
        spoil()
        s.reloader.tick()
        [line] = _errors(caplog)
        assert line.startswith(f"{which} reload refused:") and "keeping the key" in line
        assert s.reloader.error is not None
        s.reloader.tick()  # the same bad file: not read (and said) again
        assert _errors(caplog) == [line]
        s.call()  # calls are still audited, under the keys in force
        assert (s.mac.kid, s.trail.signer.kid) == (mac_kid, kid)  # type: ignore[union-attr]
    s.key_file.unlink()  # between a delete and a create: nothing changes
    s.reloader.tick()
    assert s.mac.kid == mac_kid
    assert set(load_verify_keys(s.jwks)) == {kid}  # nothing refused was published
    assert not [x for x in s.lines() if x["type"] == "key"]
    # A good file afterwards is taken, and the error is gone.
    put_audit_key(s.key_file, os.urandom(32))
    new_kid = put_signing_key(s.signing_file)
    s.reloader.tick()
    assert s.reloader.error is None and s.mac.kid != mac_kid
    s.call()
    s.call()
    s.trail.close()
    report = s.verify()
    assert report.ok, report.problem
    assert report.kids == {kid, new_kid}


def test_a_trail_that_cannot_be_written_keeps_the_keys_until_the_change_is_recorded(
    tmp_path: Path,
) -> None:
    s = Setup(tmp_path)
    s.trail.open()
    s.call()
    before = s.mac.kid
    assert s.trail._primary is not None
    full = os.open("/dev/full", os.O_WRONLY)  # a real ENOSPC on every write to the mirror
    sink = type(s.trail._primary).__new__(type(s.trail._primary))
    sink.path, sink.fd, sink.size = Path("/dev/full"), full, 0
    s.trail._mirror = sink
    put_audit_key(s.key_file, os.urandom(32))
    s.reloader.tick()
    assert s.mac.kid == before and s.trail.audit_key_id == before  # not recorded: not used
    s.trail._mirror = None
    os.close(full)
    s.reloader.tick()  # tried again: recorded (after the repair line), then used
    assert s.mac.kid != before
    s.call()
    s.trail.close()
    types = [x["type"] for x in s.lines()]
    assert types.index("repair") < types.index("key")
    report = s.verify()
    assert report.ok and report.audit_keys == [before, s.mac.kid], report.problem


# --- an attacker who can write the key files, the JWKS and the trail -----------------------


def resign(raw: list[bytes], start: int, signer: CheckpointSigner, edit: int) -> list[bytes]:
    """Edit line ``edit`` and recompute the chain from it, signing every checkpoint from
    ``start`` on with ``signer`` (its kid written in): what holding that key allows."""
    out = list(raw)
    out[edit] = out[edit].replace(b'"agent":"a"', b'"agent":"x"')
    for i in range(min(start, edit), len(out)):
        record = json.loads(out[i])
        if i > 0:
            record["prev"] = hashlib.sha256(out[i - 1]).hexdigest()
        if record.get("type") == "checkpoint" and i >= start:
            record.pop("sig")
            record["kid"] = signer.kid
            body = json.dumps(record, separators=(",", ":")).encode()
            out[i] = signer.sign(body[:-1])
        else:
            out[i] = json.dumps(record, separators=(",", ":")).encode()
    return out


def test_a_swapped_in_key_cannot_re_sign_an_earlier_segment(tmp_path: Path) -> None:
    anchor = tmp_path / "anchor.jsonl"
    s = Setup(tmp_path)
    s.trail.anchor = Anchor(AnchorSpec.parse(f"file:{anchor}"))
    s.trail.open()
    for _ in range(6):
        s.call()
    # The attacker writes their own signing key file: the gateway reads it, publishes it in
    # the JWKS beside the trail and signs with it from then on.
    attacker_key = ed25519.Ed25519PrivateKey.generate()
    put_signing_key(s.signing_file, attacker_key)
    s.reloader.tick()
    for _ in range(4):
        s.call()
    s.trail.close()
    attacker = CheckpointSigner(attacker_key)
    assert attacker.kid in load_verify_keys(s.jwks)
    raw = s.path.read_bytes().splitlines()
    assert s.verify().ok

    # Rewrite a line of the segment the old key signed and re-sign what follows with the
    # attacker's key: the first re-signed checkpoint is not the key in force, and no key line
    # vouched for by it named the attacker's key there.
    edit = 2
    forged = resign(raw, start=edit, signer=attacker, edit=edit)
    s.path.write_bytes(b"\n".join(forged) + b"\n")
    report = s.verify()
    first_checkpoint_after = next(
        i for i in range(edit, len(forged)) if b'"type":"checkpoint"' in forged[i]
    )
    assert report.problem is not None
    assert report.problem.line == first_checkpoint_after + 1
    assert "re-signed with another key" in report.problem.message

    # Rewritten from its very first line under the attacker's key (the key lines made to
    # agree), the trail is self-consistent: the JWKS beside it cannot tell. The anchor can
    # (and a JWKS copy that never held the attacker's key).
    old_kid = str(json.loads(raw[0])["kid"]).encode()
    agreeing = [
        x.replace(b'"kid_before":"' + old_kid, b'"kid_before":"' + attacker.kid.encode())
        for x in raw
    ]
    whole = resign(agreeing, start=0, signer=attacker, edit=edit)
    s.path.write_bytes(b"\n".join(whole) + b"\n")
    assert s.verify().ok  # honest: the trail alone does not prove which key was first
    report = verify_trail([s.path], load_verify_keys(s.jwks), anchor=read_anchor(str(anchor)))
    assert report.problem is not None and "not in the trail" in report.problem.message


# --- through a running gateway, with calls in flight ---------------------------------------


async def test_keys_change_while_concurrent_calls_flow_through_the_gateway(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    mocks: Mocks,
    tmp_path: Path,
) -> None:
    settings = dataclasses.replace(settings, audit_checkpoint_lines=7)
    gw = build_gateway(settings, workspace.environ())
    client = await serve_gateway(gw)
    assert settings.audit is not None
    key_file = settings.audit.with_name(settings.audit.name + ".key")
    signing_file = settings.audit.with_name(settings.audit.name + ".signing.pem")
    jwks = settings.audit.with_name(settings.audit.name + ".jwks.json")
    old = load_audit_key(key_file)
    old_kid = gw.audit.signer.kid  # type: ignore[union-attr]
    headers = {"Authorization": f"Bearer {workspace.token('tester', ['tester'])}"}
    bodies: dict[str, bytes] = {}

    async def post(n: int) -> None:
        body = f'{{"n":{n}}}'.encode()
        resp = await client.post("/echo/echo/post", data=body, headers=headers)
        assert resp.status == 200
        bodies[request_id(await resp.json())] = body

    async def flow(first: int, count: int) -> None:
        await asyncio.gather(*(post(n) for n in range(first, first + count)))

    # A slow call decided under the old key whose answer comes after the change.
    slow = asyncio.ensure_future(client.get("/echo/echo/slow?delay=0.6", headers=headers))
    await flow(0, 24)
    new = os.urandom(32)
    put_audit_key(key_file, new)
    new_kid = put_signing_key(signing_file)
    traffic = asyncio.ensure_future(flow(100, 48))  # calls flow while the change is taken
    for _ in range(100):
        if gw.mac.kid == audit_key_id(new):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the new audit key was never taken")
    await traffic
    await flow(200, 24)
    slow_resp = await slow
    assert slow_resp.status == 200
    slow_body = await slow_resp.read()
    slow_id = request_id(json.loads(slow_body))
    health = (await (await client.get("/_capgate/health")).json())["audit"]["keys"]
    assert health == {
        "audit_key": audit_key_id(new),
        "kid": new_kid,
        "next_kid": None,
        "error": None,
    }

    lines = [json.loads(x) for x in settings.audit.read_text().splitlines()]
    report = verify_trail([settings.audit], load_verify_keys(jwks), open_tail=True)
    assert report.ok, report.problem
    assert report.audit_keys == [audit_key_id(old), audit_key_id(new)]
    assert {old_kid, new_kid} <= set(load_verify_keys(jwks))
    # Every call written exactly once: one decision line, then one outcome line.
    ids = [*bodies, slow_id]
    for rid in ids:
        kinds = [x["type"] for x in lines if x.get("request_id") == rid]
        assert kinds == ["decision", "outcome"], (rid, kinds)
    [change] = [i for i, x in enumerate(lines) if x["type"] == "key"]
    assert lines[change]["audit_key_before"] == audit_key_id(old)
    assert lines[change]["audit_key"] == audit_key_id(new)
    calls = {c["request_id"]: c for c in call_records(with_audit_keys(lines))}
    position = {x["request_id"]: i for i, x in enumerate(lines) if x["type"] == "decision"}
    for rid, body in bodies.items():
        under = old if position[rid] < change else new
        assert calls[rid]["audit_key"] == audit_key_id(under)
        assert calls[rid]["request_body"]["hmac"] == digest(under, body)
    assert any(position[rid] > change for rid in bodies)
    # The slow call: decided before the change, its outcome line after it, its response
    # digest under its decision line's key.
    outcome = next(
        i for i, x in enumerate(lines) if x["type"] == "outcome" and x["request_id"] == slow_id
    )
    assert position[slow_id] < change < outcome
    assert calls[slow_id]["response_body"]["hmac"] == digest(old, slow_body)
    # Checkpoints after the rekey one are signed by the new key.
    cps = [(i, x["kind"], x["kid"]) for i, x in enumerate(lines) if x["type"] == "checkpoint"]
    assert all(kid == old_kid for i, _, kid in cps if i <= change + 1)
    assert all(kid == new_kid for i, _, kid in cps if i > change + 1)
    assert any(i > change + 1 for i, _, _ in cps)
    assert lines[change + 1]["kind"] == "rekey"


def request_id(echoed: dict[str, Any]) -> str:
    """The request id the gateway sent upstream, as the echo server saw it."""
    return next(v for k, v in echoed["headers"].items() if k.lower() == "x-request-id")


def test_a_rotated_file_cannot_be_re_signed_from_its_start_with_another_key(
    tmp_path: Path,
) -> None:
    s = Setup(tmp_path, rotate_size=10**9)
    s.trail.open()
    s.call()
    s.trail.rotate(move=True)
    for _ in range(5):
        s.call()
    s.trail.close()
    [earlier] = sorted(tmp_path.glob("audit.jsonl.2*"))
    raw = s.path.read_bytes().splitlines()
    # The attacker's key is in the JWKS (it was swapped in and published, say) and the whole
    # current file is rewritten under it, its first line still continuing the earlier file.
    attacker = CheckpointSigner(ed25519.Ed25519PrivateKey.generate())
    attacker.publish(s.jwks)
    s.path.write_bytes(b"\n".join(resign(raw, start=0, signer=attacker, edit=2)) + b"\n")
    report = verify_trail([earlier, s.path], load_verify_keys(s.jwks))
    assert report.problem is not None
    assert (report.problem.file, report.problem.line) == (str(s.path), 1)
    assert "re-signed with another key" in report.problem.message
    # Given alone, the file cannot show it, and the verdict says what was not checked.
    alone = verify_trail([s.path], load_verify_keys(s.jwks))
    assert alone.ok and any("earlier file not given" in n for n in alone.notes)


def test_kept_audit_keys_are_masked_in_a_sandbox(settings: Settings) -> None:
    from gateway.commands.sandbox import gateway_files

    assert settings.audit is not None
    key = settings.audit.with_name(settings.audit.name + ".key")
    kept = settings.audit.with_name(settings.audit.name + ".key.20261206")
    put_audit_key(kept, os.urandom(32))
    hidden = gateway_files(settings, None, None)
    assert key.resolve() in hidden and kept.resolve() in hidden


def test_changes_in_quick_succession_verify(tmp_path: Path) -> None:
    s = Setup(tmp_path, checkpoint_lines=1000)
    s.trail.open()
    s.call()
    first = put_signing_key(s.signing_file)
    s.reloader.tick()
    put_audit_key(s.key_file, os.urandom(32))  # the next change before any other checkpoint
    s.reloader.tick()
    second = put_signing_key(s.signing_file)
    s.reloader.tick()
    s.call()
    s.trail.close()
    report = s.verify()
    assert report.ok, report.problem
    changes = [(x["kid_before"], x["kid"]) for x in s.lines() if x["type"] == "key"]
    assert changes[1:] == [(first, first), (first, second)]
    assert len(report.audit_keys) == 2 and s.trail.signer.kid == second  # type: ignore[union-attr]
