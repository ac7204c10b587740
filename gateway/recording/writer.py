"""``RecordingWriter``: the one writer of a recording directory.

Every record goes through ``RecordingWriter.append``, which redacts it (``redact.py``), stores
its large bodies as blobs (``blobs.py``) and appends it as one line with a single ``write`` on an
``O_APPEND`` descriptor. The manifest lists the runs (``RunEntry``) and is replaced atomically.
The directory format itself is described in ``format.py``.

The manifest is an index, not the truth: everything it says can be rebuilt from the run files.
So the work of one ``append`` never depends on how many runs the recording holds: the manifest
is rewritten when the writer opens a directory that needs mending, at most every
``MANIFEST_INTERVAL`` seconds while records arrive, and on ``write_manifest`` (the recorder
calls it once when it stops). Each run's entry says how much of its file its counts cover
(``size``); a writer that opens the directory again counts the records beyond that (a crash
after the last rewrite), adds run files the manifest does not list, and forgets entries whose
file is gone (``_mend``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gateway import __version__
from gateway.recording.blobs import BlobStore, encode_inline
from gateway.recording.canonical import Form, canonical_body
from gateway.recording.codings import (
    CodingError,
    content_codings,
    decode,
    encode,
    read_pieces,
    sniff,
)
from gateway.recording.format import (
    BLOBS_DIR,
    FORMAT,
    INLINE_LIMIT,
    MANIFEST,
    MAX_CHUNKS,
    RUNS_DIR,
    VERSION,
    RecordingError,
    iso_time,
    run_file_name,
)
from gateway.recording.model import BodyData, Exchange, ResponseData, Spilled
from gateway.recording.reader import classify, read_manifest, safe_member, tally_run_file
from gateway.recording.redact import (
    DEFAULT_REDACTOR,
    STRUCTURED_LIMIT,
    KnownSecret,
    Redactor,
    Span,
    remap_offsets,
)

log = logging.getLogger("capgate.recording")

MANIFEST_INTERVAL = 60.0
"""Seconds between two rewrites of the manifest while recording (it is also rewritten when the
recorder stops). A rewrite costs time in proportion to the number of runs, so it is bounded by
time, never done per call; a crash in between loses nothing: the next writer mends it."""


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
    size: int = -1  # length of the run file the counts cover; -1: unknown (count it all)
    last_seq: int | None = None  # highest seq in the file, once this process knows it
    checked: bool = False  # this process cut a torn last line off before appending

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run": self.run,
            "file": self.file,
            "calls": self.calls,
            "denials": self.denials,
            "errors": self.errors,
            "started": self.started,
            "size": max(self.size, 0),
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
    (new runs get new files; a run seen again continues its file and its ``seq``), after
    mending its manifest from the run files (``_mend``).
    """

    def __init__(
        self,
        directory: Path,
        *,
        redactor: Redactor = DEFAULT_REDACTOR,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        spill_dir: Path | None = None,
        manifest_interval: float = MANIFEST_INTERVAL,
    ) -> None:
        self.root = Path(directory)
        self.redactor = redactor
        self.wall = wall
        self.clock = clock
        self.spill_dir = spill_dir
        self.manifest_interval = manifest_interval
        self.blobs = BlobStore(self.root)
        self._lock = threading.Lock()
        self.runs: dict[str, RunEntry] = {}
        self.upstreams: dict[str, str] = {}
        self.sampling: dict[str, Any] | None = None
        self.created = iso_time(wall())
        self._dirty = False
        self._written_at = clock()
        self.manifest_writes = 0  # how often this writer replaced the manifest
        self._open()

    def _open(self) -> None:
        try:
            (self.root / RUNS_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RecordingError(
                f"{self.root}: cannot create the recording directory: {exc.strerror}"
            ) from exc
        manifest_path = self.root / MANIFEST
        if not manifest_path.exists():
            self._mend()
            self.write_manifest()
            return
        manifest = read_manifest(self.root)
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
                    file=str(safe_member(self.root, item["file"], where).relative_to(self.root)),
                    started=str(item.get("started", self.created)),
                    calls=int(item.get("calls", 0)),
                    denials=int(item.get("denials", 0)),
                    errors=int(item.get("errors", 0)),
                    truncated=item.get("truncated"),
                    kept=item.get("kept"),
                    size=int(item.get("size", -1)),
                )
                self.runs[entry.run] = entry
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RecordingError(f"{where}: not a valid manifest entry ({exc!r})") from None
        if self._mend():
            self.write_manifest()

    def _mend(self) -> bool:
        """Bring the runs' entries in line with the run files on disk; True if any changed.

        A recorder that was killed leaves a manifest from its last rewrite: runs it started
        since are not listed, and the counts of the others stop where the rewrite was. Each
        entry's ``size`` says how much of its file its counts cover, so only the records
        beyond it are read (all of a file whose entry has no ``size``: older recordings).
        """
        changed = False
        for entry in list(self.runs.values()):
            if not (self.root / entry.file).is_file():
                log.warning(
                    "%s: run %r has no file %s; dropped from the manifest",
                    self.root,
                    entry.run,
                    entry.file,
                )
                del self.runs[entry.run]
                changed = True
        listed = {entry.file: entry for entry in self.runs.values()}
        with os.scandir(self.root / RUNS_DIR) as found:
            names = sorted(d.name for d in found if d.name.endswith(".jsonl") and d.is_file())
        for name in names:
            rel = f"{RUNS_DIR}/{name}"
            changed |= self._mend_run(rel, listed.get(rel))
        with contextlib.suppress(OSError):  # blobs a killed recorder was writing
            for tmp in (self.root / BLOBS_DIR / "tmp").glob("blob-*"):
                tmp.unlink()
        if changed:
            log.warning(
                "%s: the manifest did not match the run files (a recorder stopped "
                "without finishing it); mended from the records",
                self.root,
            )
        return changed

    def _mend_run(self, rel: str, entry: RunEntry | None) -> bool:
        path = self.root / rel
        stat = path.stat()
        if entry is not None and entry.size == stat.st_size:
            return False
        start = entry.size if entry is not None and 0 <= entry.size <= stat.st_size else 0
        tally = tally_run_file(path, start)
        if tally.start != start:  # the checkpoint was not at a line's end: count it all
            start = 0
        if entry is None:
            if tally.run is None:
                return False  # no complete record yet: nothing to list
            if tally.run in self.runs:
                log.warning(
                    "%s: run %r also has file %s; that file is not listed",
                    self.root,
                    tally.run,
                    rel,
                )
                return False
            started = iso_time(max(stat.st_mtime - tally.last_t, 0.0))
            entry = RunEntry(run=tally.run, file=rel, started=started)
            self.runs[entry.run] = entry
        before = (entry.calls, entry.denials, entry.errors, entry.size)
        if start == 0:
            entry.calls = entry.denials = entry.errors = 0
        entry.calls += tally.calls
        entry.denials += tally.denials
        entry.errors += tally.errors
        entry.size = tally.end  # a torn last line stays outside (it is not a record)
        return (entry.calls, entry.denials, entry.errors, entry.size) != before

    # -- runs --------------------------------------------------------------------------------

    def ensure_run(self, run: str) -> RunEntry:
        """The run's entry, created (with its empty file) when new. The first time this
        process uses a run, a torn last line a crash left in its file is cut off, so the lines
        appended now do not join it into one corrupt line."""
        with self._lock:
            entry = self.runs.get(run)
            if entry is None:
                entry = RunEntry(
                    run=run, file=run_file_name(run), started=iso_time(self.wall()), size=0
                )
                path = self.root / entry.file
                if path.exists():  # a file the manifest never listed (mended away as empty)
                    self._repair_tail(path)
                    entry.size = path.stat().st_size
                else:
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
                    entry.last_seq = 0
                entry.checked = True
                self.runs[run] = entry
                self._dirty = True
            elif not entry.checked:
                path = self.root / entry.file
                self._repair_tail(path)
                entry.checked = True
            return entry

    def last_seq(self, run: str) -> int:
        """The highest ``seq`` already in a run's file (0 for a new run); read once per run."""
        entry = self.ensure_run(run)
        if entry.last_seq is None:
            last = 0
            with (self.root / entry.file).open("rb") as fh:
                for raw in fh:
                    with contextlib.suppress(ValueError, AttributeError, TypeError):
                        last = max(last, int(json.loads(raw).get("seq", 0)))
            entry.last_seq = last
        return entry.last_seq

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
            self._dirty = True

    def note(self, run: str, **fields: Any) -> None:
        """Set manifest fields of a run (``truncated``, ``kept``); written with the manifest."""
        with self._lock:
            entry = self.runs.get(run)
            if entry is not None:
                for k, v in fields.items():
                    setattr(entry, k, v)
            self._dirty = True

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
            denial, error = classify(record)
            if denial:
                entry.denials += 1
            else:
                entry.calls += 1
            if error:
                entry.errors += 1
            if entry.size >= 0:
                entry.size += len(line)
            if entry.last_seq is not None:
                entry.last_seq = max(entry.last_seq, ex.seq)
            size = len(line) + sum(self._blob_size(r) for r in created)
            entry.bytes += size
            self._dirty = True
            if self.clock() - self._written_at >= self.manifest_interval:
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
                self._dirty = True

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

    def _response_body(
        self, resp: ResponseData, secrets: Sequence[KnownSecret], created: list[str]
    ) -> tuple[dict[str, Any] | None, tuple[Span, ...] | None, str | None]:
        """(body value, spans, why it was withheld) of a response body, decoded first when it
        has a content coding (``codings.py``): redaction must see what the coding hides."""
        data = resp.body
        if data is None:
            return None, (), None
        codings = content_codings(resp.headers) or sniff(_head(data))
        if not codings:
            value, _, spans, _ = self._body(data, secrets, created)
            return value, spans, None
        try:
            value, spans = self._coded_body(data, codings, secrets, created)
            return value, spans, None
        except CodingError as exc:
            # SECURITY: bytes no scan can read are not kept: the body is left out.
            log.warning("a %s response body was not recorded: %s", ",".join(codings), exc)
            return None, (), f"{exc}; the body was not recorded"
        finally:
            if isinstance(data, Spilled):
                with contextlib.suppress(OSError):
                    data.path.unlink()

    def _coded_body(
        self,
        data: BodyData,
        codings: tuple[str, ...],
        secrets: Sequence[KnownSecret],
        created: list[str],
    ) -> tuple[dict[str, Any], tuple[Span, ...] | None]:
        """Decode, redact the decoded bytes; when redaction changed nothing, keep the bytes as
        received (replayed byte for byte, chunks kept), else encode the redacted bytes again
        with the same codings (``codings.encode``: fixed parameters) and keep those."""
        spill = str(self.spill_dir) if self.spill_dir is not None else None
        with tempfile.SpooledTemporaryFile(max_size=STRUCTURED_LIMIT, dir=spill) as plain:
            for piece in decode(_pieces(data), codings):
                plain.write(piece)
            size = plain.tell()
            plain.seek(0)
            if size <= STRUCTURED_LIMIT:
                red = self.redactor.body(plain.read(), secrets)
                if not red.changed:
                    return self._store(_pieces(data), created), ()
                return self._store(encode([red.data], codings), created), None
            with tempfile.TemporaryFile(dir=self.spill_dir) as redacted:
                spans = self.redactor.stream(plain, redacted, secrets)
                if not spans:
                    return self._store(_pieces(data), created), ()
                redacted.seek(0)
                return self._store(encode(read_pieces(redacted.read), codings), created), None

    def _store(self, pieces: Iterable[bytes], created: list[str]) -> dict[str, Any]:
        """A body value for bytes already redacted: inline, or a blob beyond ``INLINE_LIMIT``."""
        pieces = iter(pieces)
        buf = bytearray()
        for piece in pieces:
            buf += piece
            if len(buf) > INLINE_LIMIT:
                break
        else:
            return encode_inline(bytes(buf))

        def fill(dst: Any) -> None:
            dst.write(bytes(buf))
            for piece in pieces:
                dst.write(piece)

        ref, new, size, _ = self.blobs.put_stream(fill)
        if new:
            created.append(ref)
        return {"blob": ref, "size": size}

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
            body_value, spans, withheld = self._response_body(resp, secrets, created)
            out: dict[str, Any] = {
                "status": resp.status,
                "reason": r.text(resp.reason, secrets),
                "headers": [list(p) for p in r.headers(resp.headers, secrets)],
                "body": body_value,
            }
            if withheld is not None:
                out["withheld"] = withheld
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
        self._dirty = False
        self._written_at = self.clock()
        self.manifest_writes += 1
        text = json.dumps(self.manifest(), indent=2, ensure_ascii=False) + "\n"
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".manifest-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, self.root / MANIFEST)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def spill_file(self) -> tuple[IO[bytes], Path]:
        """A private temporary file for a body that outgrew memory (outside the recording)."""
        fd, name = tempfile.mkstemp(dir=self.spill_dir, prefix="capgate-spill-")
        return os.fdopen(fd, "w+b"), Path(name)


def _head(data: BodyData) -> bytes:
    if isinstance(data, bytes):
        return data[:4]
    with data.path.open("rb") as fh:
        return fh.read(4)


def _pieces(data: BodyData) -> Iterator[bytes]:
    if isinstance(data, bytes):
        yield data
        return
    with data.path.open("rb") as fh:
        yield from read_pieces(fh.read)


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
