"""The on-disk recording: a directory of JSON Lines run files, a manifest and blobs.

    recording/
      manifest.json              {"format": "capgate-recording", "version": 1, ...}
      runs/<run>.jsonl           one record per line, one file per run
      blobs/sha256/<hex>         bodies larger than INLINE_LIMIT, by content

``docs/recording.md`` documents every field. In short, a record is::

    {"seq": 3, "t": 0.512, "kind": "exchange" | "denial", "request_id": "...",
     "agent": "sre-bot", "run": "r1", "roles": ["sre-diagnostics"], "caps": null,
     "upstream": "metrics", "method": "GET", "target": "/metrics/cpu?window=5m",
     "request": {"headers": [[name, value]], "form": "json"|"text"|"digest"|null,
                 "body": <canonical body text>|null, "raw": <body>|null},
     "decision": {"allowed": true, "reason": "allowed", "rule": "read-cpu", "status": 200},
     "response": {"status": 200, "reason": "OK", "headers": [[name, value]],
                  "body": <body>|null, "chunks": [{"t": 0.01, "size": 42}], "complete": true}
                 | null,
     "error": {"reason": "upstream_timeout", "status": 504, "detail": "..."} | null,
     "duration": 0.02}

where a header value is a string or a marker ``{"secret": name}`` / ``{"redacted": kind}``
and a ``<body>`` is ``{"text": str}`` (UTF-8), ``{"base64": str}`` or
``{"blob": "sha256/<hex>", "size": n}``. ``raw`` holds the exact request bytes and is
``null`` when they equal ``body`` (the common case: compact JSON or plain text).

Writing. ``RecordingWriter.append`` is the one function that writes a record: it redacts
(``redact.py``), stores large bodies as blobs, and appends the whole line with a single
``write`` on an ``O_APPEND`` descriptor, so a crash leaves at worst a truncated *last* line,
which the reader reports and skips. The manifest is replaced atomically (write to a temporary
file, ``os.replace``). Unredacted bytes never touch the recording directory: bodies too large
for memory are spilled to the system temporary directory and redacted into their blob.

Reading. ``load_recording`` validates the manifest, migrates older versions step by step
(``compat.py``), parses every record into an ``Entry``, checks that every blob exists, and
raises one ``RecordingError`` naming the file and line of the first problem.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from gateway import __version__
from gateway.recording.canonical import Form, canonical_body
from gateway.recording.compat import CURRENT, MigrationError, migrate_manifest, migrate_record
from gateway.recording.redact import (
    DEFAULT_REDACTOR,
    STRUCTURED_LIMIT,
    HeaderValue,
    KnownSecret,
    Redactor,
    Span,
    remap_offsets,
)

if TYPE_CHECKING:
    from gateway.policy.model import Rule

log = logging.getLogger("capgate.recording")

FORMAT = "capgate-recording"
VERSION = CURRENT
INLINE_LIMIT = 64 * 1024
"""Bodies up to this many bytes (after redaction) are written inline in the record."""
MAX_CHUNKS = 4096
"""Chunk boundaries kept per response; later chunks are merged into the last one."""

_SAFE_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,100}")
_BLOB_REF = re.compile(r"sha256/[0-9a-f]{64}")
T = TypeVar("T")


class RecordingError(Exception):
    """Raised when a recording cannot be read or written; the message names file and line."""


def run_id(run: str | None) -> str:
    return run if run else "default"


def run_file_name(run: str) -> str:
    """``runs/<run>.jsonl`` for a plain run id; a hashed name for anything else."""
    if _SAFE_RUN.fullmatch(run) and not run.endswith(".") and ".." not in run:
        return f"runs/{run}.jsonl"
    return f"runs/run-{hashlib.sha256(run.encode()).hexdigest()[:16]}.jsonl"


def iso_time(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int((wall % 1) * 1000):03d}Z"


def parse_iso_time(text: str) -> float:
    import calendar

    base, _, frac = text.rstrip("Z").partition(".")
    try:
        seconds = calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return 0.0
    return seconds + (float("0." + frac) if frac.isdigit() else 0.0)


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


# --- blobs -----------------------------------------------------------------------------------


class _HashingWriter:
    def __init__(self, fh: IO[bytes]) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.fh.write(data)


class BlobStore:
    """Content-addressed bodies: ``blobs/sha256/<hex>``, written once, atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, ref: str) -> Path:
        if not _BLOB_REF.fullmatch(ref):
            raise RecordingError(f"{ref!r} is not a blob reference ('sha256/<64 hex digits>')")
        return self.root / "blobs" / ref

    def put_bytes(self, data: bytes) -> tuple[str, bool]:
        """(ref, created) for these bytes."""
        ref, created, _, _ = self.put_stream(lambda out: out.write(data))
        return ref, created

    def put_stream(self, fill: Callable[[Any], T]) -> tuple[str, bool, int, T]:
        """Write a blob through ``fill(writer)``; (ref, created, size, fill's result)."""
        tmp_dir = self.root / "blobs" / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix="blob-")
        try:
            with os.fdopen(fd, "wb") as fh:
                writer = _HashingWriter(fh)
                result = fill(writer)
            ref = "sha256/" + writer.sha.hexdigest()
            final = self.path(ref)
            final.parent.mkdir(parents=True, exist_ok=True)
            created = not final.exists()
            if created:
                os.replace(tmp, final)
            else:
                os.unlink(tmp)
            return ref, created, writer.size, result
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def remove(self, ref: str) -> None:
        with contextlib.suppress(OSError):
            self.path(ref).unlink()


# --- the one writer --------------------------------------------------------------------------


@dataclass(slots=True)
class RunEntry:
    """A run as listed in the manifest."""

    run: str
    file: str
    started: str
    calls: int = 0
    denials: int = 0
    errors: int = 0
    bytes: int = 0
    truncated: dict[str, Any] | None = None
    kept: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run": self.run,
            "file": self.file,
            "calls": self.calls,
            "denials": self.denials,
            "errors": self.errors,
            "started": self.started,
        }
        if self.truncated:
            out["truncated"] = self.truncated
        if self.kept:
            out["kept"] = self.kept
        return out


@dataclass(slots=True)
class Written:
    """What one ``append`` put on disk."""

    bytes: int
    blobs: list[str]  # blobs this append created (not ones that already existed)


class RecordingWriter:
    """Owns a recording directory while recording. Not for concurrent use by two processes.

    Opening a directory that already holds a recording of the current version appends to it
    (new runs get new files; a run seen again continues its file and its ``seq``).
    """

    def __init__(
        self,
        directory: Path,
        *,
        redactor: Redactor = DEFAULT_REDACTOR,
        wall: Callable[[], float] = time.time,
        spill_dir: Path | None = None,
    ) -> None:
        self.root = Path(directory)
        self.redactor = redactor
        self.wall = wall
        self.spill_dir = spill_dir
        self.blobs = BlobStore(self.root)
        self._lock = threading.Lock()
        self.runs: dict[str, RunEntry] = {}
        self.upstreams: dict[str, str] = {}
        self.sampling: dict[str, Any] | None = None
        self.created = iso_time(wall())
        self._dirty = 0
        self._open()

    def _open(self) -> None:
        try:
            (self.root / "runs").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RecordingError(
                f"{self.root}: cannot create the recording directory: {exc.strerror}"
            ) from exc
        manifest_path = self.root / "manifest.json"
        if not manifest_path.exists():
            self.write_manifest()
            return
        manifest = _read_manifest(self.root)
        if manifest.get("version") != VERSION:
            raise RecordingError(
                f"{manifest_path}: version {manifest.get('version')} recordings are read-only; "
                f"record into a new directory"
            )
        where = str(manifest_path)
        try:
            self.created = str(manifest.get("created", self.created))
            self.upstreams = {str(k): str(v) for k, v in (manifest.get("upstreams") or {}).items()}
            self.sampling = manifest.get("sampling")
            for i, item in enumerate(manifest.get("runs", [])):
                where = f"{manifest_path}: runs[{i}]"
                entry = RunEntry(
                    run=str(item["run"]),
                    file=str(_safe_member(self.root, item["file"], where).relative_to(self.root)),
                    started=str(item.get("started", self.created)),
                    calls=int(item.get("calls", 0)),
                    denials=int(item.get("denials", 0)),
                    errors=int(item.get("errors", 0)),
                    truncated=item.get("truncated"),
                    kept=item.get("kept"),
                )
                self.runs[entry.run] = entry
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RecordingError(f"{where}: not a valid manifest entry ({exc!r})") from None

    # -- runs --------------------------------------------------------------------------------

    def ensure_run(self, run: str) -> RunEntry:
        with self._lock:
            entry = self.runs.get(run)
            if entry is None:
                entry = RunEntry(run=run, file=run_file_name(run), started=iso_time(self.wall()))
                self.runs[run] = entry
                # The file exists as soon as the manifest lists it, even before a record.
                os.close(os.open(self.root / entry.file, os.O_WRONLY | os.O_CREAT, 0o600))
                self._write_manifest_locked()
            return entry

    def last_seq(self, run: str) -> int:
        """The highest ``seq`` already in a run's file (0 for a new run).

        Called when a run starts in this process: a truncated last line left by a crash is
        cut off first, so the lines appended now do not join it into one corrupt line.
        """
        entry = self.runs.get(run)
        path = self.root / (entry.file if entry else run_file_name(run))
        if not path.exists():
            return 0
        self._repair_tail(path)
        last = 0
        with path.open("rb") as fh:
            for raw in fh:
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    last = max(last, int(json.loads(raw).get("seq", 0)))
        return last

    @staticmethod
    def _repair_tail(path: Path) -> None:
        with path.open("r+b") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            if size == 0:
                return
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return
            # Find the last newline; everything after it is a half-written line.
            pos = size
            keep = 0
            while pos > 0:
                step = min(64 * 1024, pos)
                pos -= step
                fh.seek(pos)
                block = fh.read(step)
                nl = block.rfind(b"\n")
                if nl != -1:
                    keep = pos + nl + 1
                    break
            fh.truncate(keep)
        log.warning("%s: cut off a truncated last line (a recorder stopped while writing it)", path)

    def drop_run(self, run: str, blobs: Sequence[str]) -> None:
        """Forget a run a sampler did not keep: its file, its entry and the blobs it created."""
        with self._lock:
            entry = self.runs.pop(run, None)
            if entry is not None:
                with contextlib.suppress(OSError):
                    (self.root / entry.file).unlink()
            for ref in blobs:
                self.blobs.remove(ref)
            self._write_manifest_locked()

    def note(self, run: str, *, write: bool = True, **fields: Any) -> None:
        """Set manifest fields of a run (``truncated``, ``kept``); rewrite the manifest."""
        with self._lock:
            entry = self.runs.get(run)
            if entry is not None:
                for k, v in fields.items():
                    setattr(entry, k, v)
            if write:
                self._write_manifest_locked()

    # -- the one path every record takes ------------------------------------------------------

    def append(self, ex: Exchange) -> Written:
        """Redact ``ex``, store its bodies, append its line to the run's file."""
        created: list[str] = []
        record = self._encode(ex, created)
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        entry = self.ensure_run(ex.run)
        path = self.root / entry.file
        with self._lock:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                view = memoryview(line)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            finally:
                os.close(fd)
            if ex.kind == "denial":
                entry.denials += 1
            else:
                entry.calls += 1
            if ex.error is not None or (ex.response is not None and ex.response.status >= 500):
                entry.errors += 1
            size = len(line) + sum(self._blob_size(r) for r in created)
            entry.bytes += size
            self._dirty += 1
            if self._dirty >= 100:
                self._write_manifest_locked()
        return Written(size, created)

    def _blob_size(self, ref: str) -> int:
        try:
            return self.blobs.path(ref).stat().st_size
        except OSError:
            return 0

    def remember_upstream(self, name: str, url: str) -> None:
        if name not in self.upstreams:
            with self._lock:
                self.upstreams[name] = url
                self._write_manifest_locked()

    def _body(
        self, data: BodyData | None, secrets: Sequence[KnownSecret], created: list[str]
    ) -> tuple[dict[str, Any] | None, bytes | None, tuple[Span, ...] | None, str | None]:
        """(body value, redacted bytes when held in memory, spans, blob hex when a blob)."""
        if data is None:
            return None, None, (), None
        if isinstance(data, Spilled):
            if data.size > STRUCTURED_LIMIT:
                return self._stream_body(data, secrets, created)
            spilled = data.path
            try:
                data = spilled.read_bytes()
            finally:
                with contextlib.suppress(OSError):
                    spilled.unlink()
        red = self.redactor.body(data, secrets)
        out = red.data
        if len(out) <= INLINE_LIMIT:
            return encode_inline(out), out, red.spans, None
        ref, new = self.blobs.put_bytes(out)
        if new:
            created.append(ref)
        return {"blob": ref, "size": len(out)}, out, red.spans, ref[len("sha256/") :]

    def _stream_body(
        self, data: Spilled, secrets: Sequence[KnownSecret], created: list[str]
    ) -> tuple[dict[str, Any] | None, bytes | None, tuple[Span, ...] | None, str | None]:
        try:
            with data.path.open("rb") as src:
                ref, new, size, spans = self.blobs.put_stream(
                    lambda dst: self.redactor.stream(src, dst, secrets)
                )
        finally:
            with contextlib.suppress(OSError):
                data.path.unlink()
        if new:
            created.append(ref)
        return {"blob": ref, "size": size}, None, tuple(spans), ref[len("sha256/") :]

    def _encode(self, ex: Exchange, created: list[str]) -> dict[str, Any]:
        r = self.redactor
        secrets = ex.secrets
        raw_value, raw_bytes, _, blob_hex = self._body(ex.request_body, secrets, created)
        form: Form | None
        canonical: str | None
        if raw_bytes is not None:
            form, canonical = canonical_body(raw_bytes, ex.rule)
        elif blob_hex is not None:
            form, canonical = "digest", "sha256:" + blob_hex
        else:
            form, canonical = None, None
        if raw_bytes is not None and canonical is not None and raw_bytes == canonical.encode():
            raw_value = None  # the canonical text is the exact body
        record: dict[str, Any] = {
            "seq": ex.seq,
            "t": round(ex.t, 6),
            "kind": ex.kind,
            "request_id": ex.request_id,
            "agent": ex.agent,
            "run": ex.run,
            "roles": list(ex.roles),
            "caps": sorted(ex.caps) if ex.caps is not None else None,
            "upstream": ex.upstream,
            "method": ex.method,
            "target": r.target(ex.target, secrets),
            "request": {
                "headers": [list(p) for p in r.headers(ex.request_headers, secrets)],
                "form": form,
                "body": canonical,
                "raw": raw_value,
            },
            "decision": ex.decision.as_json(),
            "response": None,
            "error": None,
        }
        if ex.response is not None:
            resp = ex.response
            body_value, _, spans, _ = self._body(resp.body, secrets, created)
            out: dict[str, Any] = {
                "status": resp.status,
                "reason": resp.reason,
                "headers": [list(p) for p in r.headers(resp.headers, secrets)],
                "body": body_value,
            }
            chunks = _chunks_after_redaction(resp.chunks, spans)
            if len(chunks) > 1:
                out["chunks"] = [{"t": round(t, 6), "size": n} for t, n in chunks]
            if not resp.complete:
                out["complete"] = False
            record["response"] = out
        if ex.error is not None:
            record["error"] = {
                "reason": ex.error.reason,
                "status": ex.error.status,
                "detail": r.text(ex.error.detail, secrets),
            }
        if ex.duration is not None:
            record["duration"] = round(ex.duration, 6)
        return record

    # -- manifest ----------------------------------------------------------------------------

    def manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "capgate_version": __version__,
            "upstreams": dict(sorted(self.upstreams.items())),
            "runs": [e.as_json() for e in sorted(self.runs.values(), key=lambda e: e.run)],
        }
        if self.sampling is not None:
            out["sampling"] = self.sampling
        return out

    def write_manifest(self) -> None:
        with self._lock:
            self._write_manifest_locked()

    def _write_manifest_locked(self) -> None:
        self._dirty = 0
        text = json.dumps(self.manifest(), indent=2, ensure_ascii=False) + "\n"
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".manifest-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, self.root / "manifest.json")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def spill_file(self) -> tuple[IO[bytes], Path]:
        """A private temporary file for a body that outgrew memory (outside the recording)."""
        fd, name = tempfile.mkstemp(dir=self.spill_dir, prefix="capgate-spill-")
        return os.fdopen(fd, "w+b"), Path(name)


def _chunks_after_redaction(
    chunks: Sequence[tuple[float, int]], spans: tuple[Span, ...] | None
) -> list[tuple[float, int]]:
    if len(chunks) > MAX_CHUNKS:
        head = list(chunks[: MAX_CHUNKS - 1])
        tail_t = chunks[MAX_CHUNKS - 1][0]
        head.append((tail_t, sum(n for _, n in chunks[MAX_CHUNKS - 1 :])))
        chunks = head
    if len(chunks) <= 1:
        return list(chunks)
    if spans is None:  # the body was re-serialised: boundaries are lost, keep one chunk
        return []
    ends: list[int] = []
    total = 0
    for _, n in chunks:
        total += n
        ends.append(total)
    if spans:
        ends = remap_offsets(ends, spans)
    out: list[tuple[float, int]] = []
    prev = 0
    for (t, _), end in zip(chunks, ends, strict=True):
        out.append((t, end - prev))
        prev = end
    return out


def encode_inline(data: bytes) -> dict[str, Any]:
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


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


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / "manifest.json"
    if not root.is_dir():
        raise RecordingError(f"{root}: no such recording directory")
    try:
        text = path.read_text("utf-8")
    except FileNotFoundError:
        raise RecordingError(f"{root}: not a capgate recording (no manifest.json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordingError(f"{path}: cannot read: {exc}") from exc
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise RecordingError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise RecordingError(f"{path}: not a capgate recording (format is not {FORMAT!r})")
    return manifest


class _Fields:
    """Typed access to one record's fields; every failure names the file, line and field."""

    def __init__(self, data: Any, where: str, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise RecordingError(f"{where}: {prefix or 'record'} must be an object")
        self.data = data
        self.where = where
        self.prefix = prefix

    def _fail(self, name: str, expected: str) -> RecordingError:
        value = self.data.get(name)
        shown = repr(value)[:60]
        return RecordingError(
            f"{self.where}: field {self.prefix + name!r} must be {expected}, not {shown}"
        )

    def get(
        self, name: str, kind: type | tuple[type, ...], expected: str, optional: bool = False
    ) -> Any:
        value = self.data.get(name)
        if value is None and optional:
            return None
        if (
            isinstance(value, bool)
            and kind is not bool
            and bool not in (kind if isinstance(kind, tuple) else (kind,))
        ):
            raise self._fail(name, expected)
        if not isinstance(value, kind):
            raise self._fail(name, expected)
        return value

    def integer(self, name: str, optional: bool = False) -> Any:
        return self.get(name, int, "an integer", optional)

    def number(self, name: str, optional: bool = False) -> Any:
        value = self.get(name, (int, float), "a number", optional)
        return float(value) if value is not None else None

    def string(self, name: str, optional: bool = False) -> Any:
        return self.get(name, str, "a string", optional)

    def sub(self, name: str, optional: bool = False) -> _Fields | None:
        value = self.data.get(name)
        if value is None and optional:
            return None
        return _Fields(value, self.where, f"{self.prefix}{name}.")

    def strings(self, name: str, optional: bool = False) -> tuple[str, ...] | None:
        value = self.data.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._fail(name, "a list of strings")
        return tuple(value)

    def headers(self, name: str) -> list[tuple[str, HeaderValue]]:
        value = self.data.get(name) or []
        out: list[tuple[str, HeaderValue]] = []
        if not isinstance(value, list):
            raise self._fail(name, "a list of [name, value] pairs")
        for pair in value:
            ok = isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
            if ok and isinstance(pair[1], dict):
                ok = (
                    len(pair[1]) == 1
                    and next(iter(pair[1])) in ("secret", "redacted")
                    and all(isinstance(v, str) for v in pair[1].values())
                )
            elif ok:
                ok = isinstance(pair[1], str)
            if not ok:
                raise self._fail(name, "a list of [name, value] pairs")
            out.append((pair[0], pair[1]))
        return out


def _body_ref(f: _Fields, name: str, blobs: BlobStore) -> BodyRef | None:
    value = f.data.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise f._fail(name, "a body object")
    if isinstance(value.get("text"), str):
        data = value["text"].encode("utf-8")
        return BodyRef(data, None, len(data))
    if isinstance(value.get("base64"), str):
        try:
            data = base64.b64decode(value["base64"], validate=True)
        except ValueError:
            raise f._fail(name, "valid base64") from None
        return BodyRef(data, None, len(data))
    if isinstance(value.get("blob"), str):
        try:
            path = blobs.path(value["blob"])
        except RecordingError as exc:
            raise RecordingError(f"{f.where}: {exc}") from None
        if not path.is_file():
            raise RecordingError(f"{f.where}: blob {value['blob']} is missing from {blobs.root}")
        return BodyRef(None, path, path.stat().st_size)
    raise f._fail(name, "{'text': ...}, {'base64': ...} or {'blob': ...}")


def parse_entry(record: Any, where: str, file: str, line: int, blobs: BlobStore) -> Entry:
    f = _Fields(record, where)
    kind = f.string("kind")
    if kind not in ("exchange", "denial"):
        raise f._fail("kind", "'exchange' or 'denial'")
    req = f.sub("request")
    assert req is not None
    dec = f.sub("decision")
    assert dec is not None
    form = req.string("form", optional=True)
    if form not in (None, "json", "text", "digest"):
        raise req._fail("form", "'json', 'text', 'digest' or null")
    response: RecordedResponse | None = None
    resp = f.sub("response", optional=True)
    if resp is not None:
        status = resp.integer("status")
        if not 100 <= status <= 599:
            raise resp._fail("status", "an HTTP status (100-599)")
        chunks_raw = resp.data.get("chunks") or []
        chunks: list[tuple[float, int]] = []
        if not isinstance(chunks_raw, list):
            raise resp._fail("chunks", "a list")
        for c in chunks_raw:
            cf = _Fields(c, where, "response.chunks[].")
            chunks.append((cf.number("t"), cf.integer("size")))
        body = _body_ref(resp, "body", blobs)
        if body is not None and chunks and any(n < 0 for _, n in chunks):
            chunks = []
        if body is not None and chunks and sum(n for _, n in chunks) != body.size:
            raise RecordingError(
                f"{where}: response.chunks sizes add up to "
                f"{sum(n for _, n in chunks)}, the body has {body.size} bytes"
            )
        response = RecordedResponse(
            status=status,
            reason=resp.string("reason", optional=True) or "",
            headers=resp.headers("headers"),
            body=body,
            chunks=tuple(chunks),
            complete=resp.data.get("complete", True) is not False,
        )
    error: ErrorInfo | None = None
    err = f.sub("error", optional=True)
    if err is not None:
        error = ErrorInfo(
            err.string("reason"), err.integer("status"), err.string("detail", optional=True) or ""
        )
    caps = f.strings("caps", optional=True)
    return Entry(
        file=file,
        line=line,
        seq=f.integer("seq"),
        t=f.number("t"),
        kind=kind,
        request_id=f.string("request_id", optional=True) or "",
        agent=f.string("agent", optional=True),
        run=f.string("run"),
        roles=f.strings("roles", optional=True) or (),
        caps=caps,
        upstream=f.string("upstream", optional=True),
        method=f.string("method").upper(),
        target=f.string("target"),
        request_headers=req.headers("headers"),
        form=form,
        canonical=req.string("body", optional=True),
        raw=_body_ref(req, "raw", blobs),
        decision=Decision(
            allowed=dec.get("allowed", bool, "true or false"),
            reason=dec.string("reason"),
            rule=dec.string("rule", optional=True),
            status=dec.integer("status", optional=True),
        ),
        response=response,
        error=error,
        duration=f.number("duration", optional=True),
    )


def _safe_member(root: Path, rel: Any, where: str) -> Path:
    if (
        not isinstance(rel, str)
        or not rel.startswith("runs/")
        or ".." in rel.split("/")
        or ("\\" in rel)
    ):
        raise RecordingError(f"{where}: run file {rel!r} must be a path under runs/")
    return root / rel


def load_recording(directory: str | Path) -> Recording:
    """Read, validate and migrate a recording; one ``RecordingError`` for the first problem."""
    root = Path(directory)
    manifest = _read_manifest(root)
    where = str(root / "manifest.json")
    try:
        version = manifest.get("version")
        manifest = migrate_manifest(manifest, version)  # type: ignore[arg-type]
    except MigrationError as exc:
        raise RecordingError(f"{where}: {exc}") from None
    runs_list = manifest.get("runs")
    if not isinstance(runs_list, list):
        raise RecordingError(f"{where}: 'runs' must be a list")
    blobs = BlobStore(root)
    recording = Recording(root, manifest, {}, version_read=int(version))  # type: ignore[arg-type]
    for i, item in enumerate(runs_list):
        if not isinstance(item, dict) or not isinstance(item.get("run"), str):
            raise RecordingError(f"{where}: runs[{i}] must be an object with a 'run' string")
        run = item["run"]
        if run in recording.runs:
            raise RecordingError(f"{where}: run {run!r} is listed twice")
        path = _safe_member(root, item.get("file"), f"{where}: runs[{i}]")
        entries = _read_run_file(root, path, int(version), blobs, recording.warnings)  # type: ignore[arg-type]
        recording.runs[run] = RecordedRun(run, item["file"], entries, item)
    return recording


def _read_run_file(
    root: Path, path: Path, version: int, blobs: BlobStore, warnings: list[str]
) -> list[Entry]:
    rel = path.relative_to(root).as_posix()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RecordingError(f"{path}: run file listed in the manifest is missing") from None
    except OSError as exc:
        raise RecordingError(f"{path}: cannot read: {exc.strerror}") from exc
    lines = data.split(b"\n")
    entries: list[Entry] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(raw)
        except ValueError as exc:
            if number == len(lines) and not data.endswith(b"\n"):
                warnings.append(
                    f"{where}: the last line is truncated (the recorder stopped while writing "
                    "it); it was skipped"
                )
                continue
            raise RecordingError(f"{where}: not valid JSON: {exc}") from None
        if not isinstance(record, dict):
            raise RecordingError(f"{where}: a record must be a JSON object")
        record = migrate_record(record, version)
        entries.append(parse_entry(record, where, rel, number, blobs))
    entries.sort(key=lambda e: e.seq)
    return entries
