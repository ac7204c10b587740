"""``capgate audit verify``: the chain, the signed checkpoints, the tail, and the anchor.

What is checked, in order, over one or more files given oldest first (a rotated trail):

1. every line is whole (ends with a newline), JSON, and its ``prev`` is the SHA-256 of the
   line before (across files); the first line starts a chain (``prev`` is 64 zeros) or is a
   signed checkpoint continuing one (a rotated file);
2. every checkpoint is signed by a key of the audit JWKS, and (but for a ``start``) counts
   the lines since the checkpoint before it: an edit, deletion, insertion or reordering
   whose chain was recomputed breaks the first checkpoint after it;
2b. the signing key changes only where the trail says so: a ``key`` line names the next
   key, a checkpoint signed by the key in force follows it (vouching for it), and only then
   may the next key sign; a ``start`` checkpoint of a new process (not the one after a
   ``rotate``) may also bring another key, which is noted as not vouched for. So part of a
   segment cannot be re-signed with another key of the JWKS (a later one, a retired one):
   whoever holds it has to rewrite from the trail's first line, or from a restart, which
   the anchor and the files given before catch;
3. the tail: the trail ends with a ``shutdown`` checkpoint, or the caller says the tail may
   be open (after a crash); lines after the last checkpoint are covered by no signature;
4. with an anchor: the latest checkpoint the anchor holds for these gateways is in the
   trail (otherwise the tail was cut or rewritten after it).

The result says what was verified and what could not be (``Report.statement``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.audit_sign import signature_ok
from gateway.audit_trail import GENESIS


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


@dataclass
class Report:
    files: list[str]
    lines: int = 0
    legacy_lines: int = 0
    checkpoints: int = 0
    kids: set[str] = field(default_factory=set)
    audit_keys: list[str] = field(default_factory=list)  # ids of the digests' keys, in order
    gateways: set[str] = field(default_factory=set)
    last_checkpoint: tuple[str, int, str] | None = None  # file, line, kind
    after_checkpoint: int = 0  # lines after the last checkpoint
    problem: Problem | None = None
    notes: list[str] = field(default_factory=list)  # what could not be verified

    @property
    def ok(self) -> bool:
        return self.problem is None

    def statement(self) -> dict[str, Any]:
        return {
            "verified": self.ok,
            "files": self.files,
            "lines": self.lines,
            "checkpoints": self.checkpoints,
            "signing_keys": sorted(self.kids),
            "audit_keys": self.audit_keys,
            "gateways": sorted(self.gateways),
            "last_checkpoint": (
                None
                if self.last_checkpoint is None
                else {
                    "file": self.last_checkpoint[0],
                    "line": self.last_checkpoint[1],
                    "kind": self.last_checkpoint[2],
                }
            ),
            "problem": str(self.problem) if self.problem else None,
            "not_verified": self.notes,
        }


class _Walk:
    """The state of one pass over the files."""

    def __init__(self, keys: Mapping[str, ed25519.Ed25519PublicKey] | None) -> None:
        self.keys = keys
        self.prev: str | None = None  # None: before the first line
        self.since = 0  # lines since the last checkpoint
        self.checkpoint_hashes: dict[str, tuple[str, int]] = {}
        self.last_kind: str | None = None
        self.position: tuple[str, int] = ("", 0)
        self.kid: str | None = None  # the key that signs now (the last checkpoint's)
        self.announced: str | None = None  # named by a key line, not yet vouched for
        self.vouched: str | None = None  # named by a key line and vouched for: may sign next


def verify_trail(
    paths: Sequence[str | Path],
    keys: Mapping[str, ed25519.Ed25519PublicKey] | None,
    *,
    anchor: Sequence[Mapping[str, Any]] | None = None,
    open_tail: bool = False,
) -> Report:
    """Check ``paths`` (oldest first) as one trail; OSError if a file cannot be read."""
    report = Report(files=[str(p) for p in paths])
    walk = _Walk(keys)
    for path in paths:
        name = str(path)
        with Path(path).open("rb") as fh:
            raws = fh.readlines()
        for number, raw in enumerate(raws, start=1):
            walk.position = (name, number)
            last = path is paths[-1] and number == len(raws)
            message = _line(report, walk, raw, last_of_all=last, open_tail=open_tail)
            if message is not None:
                report.problem = Problem(name, number, message)
                return report
    _tail(report, walk, open_tail)
    if report.problem is None and anchor is not None:
        _anchor(report, walk, anchor)
    if anchor is None:
        report.notes.append(
            "no anchor given: a trail cut back to an earlier shutdown checkpoint cannot be "
            "told from a whole one (pass --anchor)"
        )
    if report.legacy_lines:
        report.notes.append(
            f"{report.legacy_lines} lines of format 1 (before signed checkpoints) are covered "
            "by the hash chain only"
        )
    return report


def _line(
    report: Report, walk: _Walk, raw: bytes, *, last_of_all: bool, open_tail: bool
) -> str | None:
    if not raw.endswith(b"\n"):
        if last_of_all and open_tail:
            report.notes.append("a torn last line (a crash mid-write) was not counted")
            return None
        return "a torn line (no newline): the file was cut mid-line"
    line = raw[:-1]
    if not line:
        return "empty line"
    try:
        record = json.loads(line)
    except ValueError:
        return "not valid JSON"
    if not isinstance(record, dict):
        return "not a JSON object"
    kind = record.get("type")
    if walk.prev is None:
        if record.get("prev") != GENESIS:
            if kind != "checkpoint":
                return (
                    "the first line neither starts a chain nor is a signed checkpoint: "
                    "lines before it are missing"
                )
            report.notes.append(
                f"the first file continues a chain from an earlier file not given "
                f"(line hash {str(record.get('prev'))[:16]}...)"
            )
    elif record.get("prev") != walk.prev:
        return (
            "hash chain broken: 'prev' does not match the line before (that line was "
            "changed, or lines were removed, inserted or reordered here)"
        )
    problem = _typed(report, walk, record, line)
    if problem is not None:
        return problem
    walk.prev = hashlib.sha256(line).hexdigest()
    report.lines += 1
    if kind == "checkpoint":
        walk.checkpoint_hashes[walk.prev] = walk.position
    return None


def _typed(report: Report, walk: _Walk, record: dict[str, Any], line: bytes) -> str | None:
    """What a line of its type adds to the walk (a checkpoint's signature and count, a key
    line's keys), or the problem with it."""
    kind = record.get("type")
    if kind == "checkpoint":
        problem = _checkpoint(report, walk, record, line)
        if problem is None:
            _note_audit_key(report, record.get("audit_key"))
        return problem
    walk.since += 1
    if kind == "key":
        return _key_line(report, walk, record)
    if kind is None:
        report.legacy_lines += 1
    return None


def _checkpoint(report: Report, walk: _Walk, record: dict[str, Any], line: bytes) -> str | None:
    kid = record.get("kid")
    if walk.keys is None:
        return "a signed checkpoint, but no audit keys to check it with (pass --jwks)"
    key = walk.keys.get(kid) if isinstance(kid, str) else None
    if key is None:
        return f"checkpoint signed by a key not in the audit JWKS (kid {kid!r}): forged?"
    if not signature_ok(key, line):
        return (
            "checkpoint signature does not verify: this checkpoint was forged or edited, or "
            "a line since the checkpoint before it was changed and the chain recomputed"
        )
    kind = str(record.get("kind"))
    problem = _key_in_force(report, walk, str(kid), kind)
    if problem is not None:
        return problem
    if kind != "start" and record.get("lines") != walk.since:
        return (
            f"checkpoint counts {record.get('lines')} lines since the checkpoint before it; "
            f"the file has {walk.since}: lines were removed or added and the chain recomputed"
        )
    report.checkpoints += 1
    report.kids.add(kid)  # type: ignore[arg-type]
    if record.get("gateway"):
        report.gateways.add(str(record["gateway"]))
    report.last_checkpoint = (*walk.position, kind)
    walk.since = 0
    walk.last_kind = kind
    return None


def _key_in_force(report: Report, walk: _Walk, kid: str, kind: str) -> str | None:
    """The signing key may change only where a key line named it and a checkpoint of the
    key before vouched for it (or at a restart, noted); otherwise the segment was re-signed."""
    if walk.kid is None or kid == walk.kid:
        if walk.announced is not None:
            walk.vouched, walk.announced = walk.announced, None  # this checkpoint vouches
        walk.kid = kid
        return None
    if kid == walk.vouched:
        walk.kid, walk.vouched = kid, None
        return None
    if kind == "start" and walk.last_kind != "rotate":
        # A process that started with another key (after a shutdown or a crash). A rotated
        # file continues the same process: its start checkpoint keeps the key in force.
        file, number = walk.position
        report.notes.append(
            f"{file}:{number}: the signing key changed from {walk.kid} to {kid} at a restart, "
            "not vouched for by a checkpoint of the key before (trusted for being in the JWKS)"
        )
        walk.kid, walk.announced, walk.vouched = kid, None, None
        return None
    return (
        f"checkpoint signed by kid {kid}, but the key in force is {walk.kid} and no key "
        "line vouched for by it named this one: the segment was re-signed with another key"
    )


def _key_line(report: Report, walk: _Walk, record: Mapping[str, Any]) -> str | None:
    """A ``key`` line: the keys from here on (ids only); the next checkpoint vouches for it."""
    before = record.get("kid_before")
    if before is not None and before == walk.vouched:
        walk.kid, walk.vouched = before, None  # it took over with no checkpoint yet
    if walk.kid is not None and before is not None and before != walk.kid:
        return (
            f"key line says checkpoints were signed by {before}, but the key in force is "
            f"{walk.kid}: this line or the checkpoints before it were rewritten"
        )
    kid = record.get("kid")
    walk.announced = kid if isinstance(kid, str) and kid != walk.kid else None
    walk.vouched = None
    _note_audit_key(report, record.get("audit_key"))
    return None


def _note_audit_key(report: Report, audit_key: Any) -> None:
    if isinstance(audit_key, str) and (not report.audit_keys or report.audit_keys[-1] != audit_key):
        report.audit_keys.append(audit_key)


def _tail(report: Report, walk: _Walk, open_tail: bool) -> None:
    report.after_checkpoint = walk.since
    closed = walk.last_kind == "shutdown" and walk.since == 0
    if closed:
        return
    file, number = walk.position
    where = (
        "no checkpoint at all"
        if report.last_checkpoint is None
        else f"{walk.since} line(s) after the {report.last_checkpoint[2]} checkpoint at "
        f"line {report.last_checkpoint[1]}"
    )
    if open_tail:
        report.notes.append(
            f"the tail is open ({where}): those lines are covered by no signature, and "
            "lines after them may have been cut"
        )
        return
    report.problem = Problem(
        file,
        number + 1,
        f"the trail does not end with a shutdown checkpoint ({where}): its tail may have "
        "been cut here; after a crash, pass --open-tail",
    )


def _anchor(report: Report, walk: _Walk, entries: Sequence[Mapping[str, Any]]) -> None:
    mine = [e for e in entries if not report.gateways or e.get("gateway") in report.gateways]
    if not mine:
        report.notes.append("the anchor holds no checkpoint of these gateways")
        return
    latest = mine[-1]
    found = walk.checkpoint_hashes.get(str(latest.get("hash")))
    file, number = walk.position
    if found is None:
        report.problem = Problem(
            file,
            number + 1,
            f"the anchor's latest checkpoint ({latest.get('kind')} at {latest.get('time')}, "
            f"hash {str(latest.get('hash'))[:16]}...) is not in the trail: its tail was cut "
            "or rewritten after it",
        )
        return
    report.notes.append(
        f"the anchor's latest checkpoint is {found[0]}:{found[1]} ({latest.get('kind')} at "
        f"{latest.get('time')})"
    )
