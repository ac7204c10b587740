"""The typed records of a recording, on both sides of the file.

Write side: what the recorder knows about one call before redaction (``Exchange`` with its
``Decision``, ``ResponseData``, ``ErrorInfo``; ``Spilled`` for a body that outgrew memory).
``RecordingWriter.append`` (``writer.py``) turns one into a line.

Read side: one validated record (``Entry``, with ``BodyRef`` bodies and a ``RecordedResponse``),
a run file (``RecordedRun``) and a whole directory (``Recording``), as ``load_recording``
(``reader.py``) returns them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.recording.canonical import Form
from gateway.recording.format import RecordingError
from gateway.recording.redact import HeaderValue, KnownSecret

if TYPE_CHECKING:
    from gateway.policy.model import Rule


# --- write side: what the recorder knows about one call --------------------------------------


@dataclass(frozen=True, slots=True)
class Spilled:
    """A body written to a temporary file because it grew past ``INLINE_LIMIT``."""

    path: Path
    size: int


BodyData = bytes | Spilled


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str
    rule: str | None
    status: int | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"allowed": self.allowed, "reason": self.reason, "rule": self.rule}
        if self.status is not None:
            out["status"] = self.status
        return out


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An upstream failure the gateway turned into an error (502/504), replayed as such."""

    reason: str
    status: int
    detail: str


@dataclass(slots=True)
class ResponseData:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: BodyData | None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (t, size) as received
    complete: bool = True


@dataclass(slots=True)
class Exchange:
    """One call as the recorder saw it, before redaction. ``RecordingWriter.append`` writes it."""

    kind: str  # "exchange" | "denial"
    run: str
    seq: int
    t: float
    method: str
    target: str
    upstream: str | None
    agent: str | None = None
    roles: tuple[str, ...] = ()
    caps: tuple[str, ...] | None = None
    request_id: str = ""
    request_headers: list[tuple[str, str]] = field(default_factory=list)
    request_body: BodyData | None = None
    decision: Decision = Decision(True, "allowed", None)
    response: ResponseData | None = None
    error: ErrorInfo | None = None
    duration: float | None = None
    rule: Rule | None = None  # for the canonical body (SQL fields); not written
    secrets: tuple[KnownSecret, ...] = ()  # known by provenance; never written


# --- read side -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BodyRef:
    """A recorded body: inline bytes or a blob file."""

    inline: bytes | None
    blob: Path | None
    size: int

    def read(self) -> bytes:
        if self.inline is not None:
            return self.inline
        assert self.blob is not None
        try:
            return self.blob.read_bytes()
        except OSError as exc:
            raise RecordingError(f"{self.blob}: cannot read blob: {exc.strerror}") from exc

    def iter_sizes(self, sizes: Sequence[int], piece: int = 64 * 1024) -> Iterator[bytes]:
        """The body cut at the recorded chunk sizes (or in ``piece``-sized parts)."""
        if self.inline is not None:
            data = self.inline
            pos = 0
            for n in sizes:
                yield data[pos : pos + n]
                pos += n
            while pos < len(data):
                yield data[pos : pos + piece]
                pos += piece
            return
        assert self.blob is not None
        with self.blob.open("rb") as fh:
            for n in sizes:
                yield fh.read(n)
            while block := fh.read(piece):
                yield block


@dataclass(slots=True)
class RecordedResponse:
    status: int
    reason: str
    headers: list[tuple[str, HeaderValue]]
    body: BodyRef | None
    chunks: tuple[tuple[float, int], ...]
    complete: bool


@dataclass(slots=True)
class Entry:
    """One record of a run file, validated."""

    file: str
    line: int
    seq: int
    t: float
    kind: str
    request_id: str
    agent: str | None
    run: str
    roles: tuple[str, ...]
    caps: tuple[str, ...] | None
    upstream: str | None
    method: str
    target: str
    request_headers: list[tuple[str, HeaderValue]]
    form: Form | None
    canonical: str | None
    raw: BodyRef | None
    decision: Decision
    response: RecordedResponse | None
    error: ErrorInfo | None
    duration: float | None = None

    @property
    def ref(self) -> str:
        return f"{self.file}#{self.seq}"

    def request_bytes(self) -> bytes | None:
        """The request body as it was sent (after redaction)."""
        if self.raw is not None:
            return self.raw.read()
        if self.canonical is not None and self.form in ("json", "text"):
            return self.canonical.encode()
        return None

    def describe(self) -> str:
        up = self.upstream or "-"
        return f"{self.method} {up} {self.target}"


@dataclass(slots=True)
class RecordedRun:
    run: str
    file: str
    entries: list[Entry]
    manifest: dict[str, Any]

    @property
    def exchanges(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "exchange"]

    @property
    def denials(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "denial"]


@dataclass(slots=True)
class Recording:
    directory: Path
    manifest: dict[str, Any]
    runs: dict[str, RecordedRun]
    version_read: int
    warnings: list[str] = field(default_factory=list)

    def entries(self) -> Iterator[Entry]:
        for run in self.runs.values():
            yield from run.entries
