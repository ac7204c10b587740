"""The audit trail: one JSON line per call, hash-chained so that tampering is evident.

Each line carries ``prev``, the SHA-256 of the previous line's bytes (64 zeros for the first
line of a file). Deleting, inserting, reordering or editing a line breaks the chain at that
point, which ``verify`` reports with the line number. Lines never contain a token or a
credential: the stages only ever put ids, names and decisions in a record.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from gateway.errors import ConfigError
from gateway.secret_files import check_secret_file

if TYPE_CHECKING:
    from gateway.audit_record import AuditRecord
    from gateway.call import Call

GENESIS = "0" * 64
AUDIT_KEY_BYTES = 32


def audit_key_path(audit: Path | None, configured: Path | None) -> Path | None:
    """Where the audit key lives: as configured, or beside the audit file."""
    if configured is not None:
        return configured
    if audit is None:
        return None
    return audit.with_name(audit.name + ".key")


def load_audit_key(path: Path) -> bytes:
    """The audit key (hex text in a file only its owner may read), created when absent.

    The key makes the body digests in audit lines keyed (HMAC): whoever holds it can tell
    whether a given body is the one sent; whoever holds only the trail cannot guess bodies.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create audit key {str(path)!r}: {exc.strerror}") from exc
    else:
        with os.fdopen(fd, "w") as fh:
            fh.write(os.urandom(AUDIT_KEY_BYTES).hex() + "\n")
    try:
        check_secret_file(path)
        text = path.read_text("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read audit key {str(path)!r}: {exc}") from exc
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"audit key {str(path)!r} is not hex text") from None
    if len(key) < 16:
        raise ConfigError(f"audit key {str(path)!r} is shorter than 16 bytes")
    return key


def _last_line(path: Path) -> bytes | None:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            end = fh.tell()
            if end == 0:
                return None
            # Read backwards until the whole last line is in hand: one 64 KiB read used to
            # cut a longer line, so a reopened trail chained to half a line.
            pos, data = end, b""
            while pos > 0:
                step = min(65536, pos)
                pos -= step
                fh.seek(pos)
                data = fh.read(step) + data
                if b"\n" in data.rstrip(b"\n"):
                    break
            last = data.rstrip(b"\n").rsplit(b"\n", 1)[-1]
            return last or None
    except FileNotFoundError:
        return None


class AuditTrail:
    """Appends hash-chained JSON lines to one file."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._fh: IO[bytes] | None = None
        self._prev = GENESIS
        self.lines_written = 0

    def open(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        last = _last_line(self.path)
        self._prev = hashlib.sha256(last).hexdigest() if last else GENESIS
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._fh = os.fdopen(fd, "ab", buffering=64 * 1024)

    def call_ended(self, call: Call, records: Sequence[AuditRecord]) -> None:
        """Observer of ended calls: one line per record (per operation), from the closed
        audit record only."""
        for record in records:
            self.append(record)

    def append(self, record: Mapping[str, Any]) -> None:
        """One line: the record's JSON with ``prev``, the SHA-256 of the line before, last."""
        if self._fh is None:
            return
        body = orjson.dumps(record, default=str)
        line = (
            body[:-1] + b',"prev":"' + self._prev.encode() + b'"}\n'
            if len(body) > 2
            else (b'{"prev":"' + self._prev.encode() + b'"}\n')
        )
        self._prev = hashlib.sha256(memoryview(line)[:-1]).hexdigest()
        self._fh.write(line)
        self.lines_written += 1

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None


@dataclass(frozen=True)
class ChainBreak:
    line: int
    message: str


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    with Path(path).open("rb") as fh:
        for raw in fh:
            if raw.strip():
                yield json.loads(raw)


def verify(path: str | Path) -> tuple[int, ChainBreak | None]:
    """(lines checked, first break or None)."""
    prev = GENESIS
    count = 0
    with Path(path).open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            line = raw.rstrip(b"\n")
            if not line:
                return count, ChainBreak(number, "empty line")
            try:
                record = json.loads(line)
            except ValueError:
                return count, ChainBreak(number, "not valid JSON")
            if not isinstance(record, dict) or record.get("prev") != prev:
                return count, ChainBreak(
                    number, "hash chain broken: 'prev' does not match the line before"
                )
            prev = hashlib.sha256(line).hexdigest()
            count += 1
    return count, None
