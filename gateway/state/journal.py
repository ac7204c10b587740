"""The revocation journal: every revocation this gateway learns, on its own disk.

Revocations (``capgate revoke``, an operator's stop, an eviction) must outlive everything
but the token's expiry: a Redis that restarts empty, and every gateway restarting with it.
Each gateway appends every revocation its mirror learns (its own, and those other gateways
publish) to a JSON-lines file, synced before the append returns; at start it loads the file
into the mirror before it serves, and the Redis store then writes back what Redis lacks (its
resync already does, for a Redis that restarted while the gateway ran). With memory state the
journal is what makes an operator's stop survive a restart.

One line per revocation: ``{"kind", "value", "until" (null: forever), "since", "by",
"reason"}``. A torn last line (a crash mid-append) and unreadable lines are skipped with a
warning; expired entries are dropped when the file is compacted (at start, when more than
half of its lines are dead), by writing a new file and renaming it over the old one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import ConfigError
from gateway.state.base import REVOCATION_KINDS, RevocationInfo, Revocations, check_revocation

log = logging.getLogger("capgate.state")


@dataclass(frozen=True, slots=True)
class JournalEntry:
    kind: str
    value: str
    until: float | None  # None: forever
    info: RevocationInfo | None

    def line(self) -> bytes:
        body: dict[str, Any] = {"kind": self.kind, "value": self.value, "until": self.until}
        if self.info is not None:
            body.update(self.info.as_json())
        return json.dumps(body, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"

    @classmethod
    def parse(cls, raw: bytes) -> JournalEntry | None:
        try:
            body = json.loads(raw)
            kind, value, until = body["kind"], body["value"], body["until"]
            if kind not in REVOCATION_KINDS or not isinstance(value, str):
                return None
            if until is not None and (
                isinstance(until, bool) or not isinstance(until, int | float)
            ):
                return None
            check_revocation(kind, value, until)
        except (ValueError, KeyError, TypeError):
            return None
        return cls(kind, value, until, RevocationInfo.from_json(body))

    def live(self, now: float) -> bool:
        return self.until is None or self.until > now


class RevocationJournal:
    """Appends revocations to ``path`` (synced) and reads them back at start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0  # lines in the file, live or not
        self.error: str | None = None  # the last append that failed, for health

    def load(self, now: float | None = None) -> list[JournalEntry]:
        """The live entries, oldest first; the file is compacted when mostly dead. A file
        that cannot be read at all is a ``ConfigError`` (revocations would be forgotten)."""
        now = time.time() if now is None else now
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ConfigError(
                f"revocation journal {str(self.path)!r} cannot be read: {exc.strerror}"
            ) from None
        entries: list[JournalEntry] = []
        skipped = 0
        lines = raw.split(b"\n")
        torn = lines.pop() if lines else b""  # text after the last newline: a torn append
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            entry = JournalEntry.parse(line)
            if entry is None:
                skipped += 1
                log.warning("revocation journal %s:%d: unreadable line skipped", self.path, n)
                continue
            entries.append(entry)
        live = [e for e in entries if e.live(now)]
        self.lines = len(entries)
        if torn.strip() or skipped or len(live) * 2 < len(entries):
            if torn.strip():
                log.warning("revocation journal %s: torn last line cut", self.path)
            self._rewrite(live)
        return live

    def restore(self, mirror: Revocations, now: float) -> int:
        """``StateStore.keep_revocations``: the live entries into ``mirror`` (before the store
        starts), then every revocation it learns appended here."""
        entries = self.load(now)
        for e in entries:
            mirror.apply(e.kind, e.value, e.until, now=now, info=e.info)
        mirror.add_recorder(self.record)
        return len(entries)

    def record(
        self, kind: str, value: str, until: float | None, info: RevocationInfo | None
    ) -> None:
        """A ``Revocations`` recorder: one revocation the mirror learnt."""
        self.append(JournalEntry(kind, value, until, info))

    def append(self, entry: JournalEntry) -> None:
        """One line, written and synced; on failure the error is kept (health) and logged."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                data = entry.line()
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(f"short write ({written} of {len(data)} bytes)")
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self.error = f"{exc.strerror or exc}"
            log.error(
                "revocation journal %s could not be written (%s): the %s revocation of %r "
                "is enforced but would not survive a restart of this gateway",
                self.path,
                self.error,
                entry.kind,
                entry.value,
            )
            return
        self.error = None
        self.lines += 1

    def _rewrite(self, entries: list[JournalEntry]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"".join(e.line() for e in entries))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            log.error("revocation journal %s could not be compacted: %s", self.path, exc)
            return
        self.lines = len(entries)
