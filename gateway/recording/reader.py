"""``load_recording``: read, validate and migrate a recording directory.

The manifest is checked first, older versions are migrated step by step (``compat.py``), then
every run file is parsed line by line into ``Entry`` records (``model.py``), every blob a record
names must exist, and the first problem is one ``RecordingError`` naming the file and line. A
truncated last line (a recorder stopped while writing it) is skipped with a warning. The
directory format itself is described in ``format.py``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.recording.blobs import BlobStore
from gateway.recording.compat import MigrationError, migrate_manifest, migrate_record
from gateway.recording.format import FORMAT, MANIFEST, RUNS_DIR, RecordingError
from gateway.recording.model import (
    BodyRef,
    Decision,
    Entry,
    ErrorInfo,
    RecordedResponse,
    RecordedRun,
    Recording,
)
from gateway.recording.redact import HeaderValue


def classify(record: dict[str, Any]) -> tuple[bool, bool]:
    """(is a denial, is an error) of one record, as the manifest counts them: ``denials`` are
    records of kind ``denial``, ``calls`` the others; ``errors`` are records with an ``error``
    or a 5xx response."""
    response = record.get("response")
    status = response.get("status") if isinstance(response, dict) else None
    error = record.get("error") is not None or (isinstance(status, int) and status >= 500)
    return record.get("kind") == "denial", error


@dataclass(slots=True)
class Tally:
    """What ``tally_run_file`` counted in a run file from ``start`` to ``end``."""

    start: int  # where counting began (0 when the given start was not at a line's end)
    end: int  # just after the last complete line
    calls: int = 0
    denials: int = 0
    errors: int = 0
    run: str | None = None  # the run id the first complete record names
    last_t: float = 0.0  # the largest ``t`` counted


def tally_run_file(path: Path, start: int = 0) -> Tally:
    """Count the records of a run file from byte ``start`` (a line's end), for the manifest.

    Only complete lines count: a torn last line (a recorder killed while writing it) is not a
    record. ``start`` not at a line's end (the file changed under its checkpoint) counts the
    whole file.
    """
    with path.open("rb") as fh:
        if start > 0:
            fh.seek(start - 1)
            if fh.read(1) != b"\n":
                start = 0
        fh.seek(start)
        tally = Tally(start=start, end=start)
        pos = start
        for raw in fh:
            pos += len(raw)
            if not raw.endswith(b"\n"):
                break
            tally.end = pos
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            denial, error = classify(record)
            tally.denials += denial
            tally.calls += not denial
            tally.errors += error
            if tally.run is None and isinstance(record.get("run"), str):
                tally.run = record["run"]
            with contextlib.suppress(TypeError, ValueError):
                tally.last_t = max(tally.last_t, float(record.get("t", 0.0)))
    return tally


def read_manifest(root: Path) -> dict[str, Any]:
    """``manifest.json`` of ``root``, checked to be a capgate recording's (any version)."""
    path = root / MANIFEST
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


def safe_member(root: Path, rel: Any, where: str) -> Path:
    """``root / rel`` for a run file named by a manifest; refused unless it stays in ``runs/``."""
    if (
        not isinstance(rel, str)
        or not rel.startswith(RUNS_DIR + "/")
        or ".." in rel.split("/")
        or ("\\" in rel)
    ):
        raise RecordingError(f"{where}: run file {rel!r} must be a path under runs/")
    return root / rel


def load_recording(directory: str | Path) -> Recording:
    """Read, validate and migrate a recording; one ``RecordingError`` for the first problem."""
    root = Path(directory)
    manifest = read_manifest(root)
    where = str(root / MANIFEST)
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
        path = safe_member(root, item.get("file"), f"{where}: runs[{i}]")
        entries = _read_run_file(root, path, int(version), blobs, recording.warnings)  # type: ignore[arg-type]
        recording.runs[run] = RecordedRun(run, item["file"], entries, item)
    _read_unlisted(recording, int(version), blobs)  # type: ignore[arg-type]
    return recording


def _read_unlisted(recording: Recording, version: int, blobs: BlobStore) -> None:
    """Run files the manifest does not list (a recorder killed before it rewrote the manifest)
    are read too, with a warning: their records are as valid as any."""
    root = recording.directory
    listed = {run.file for run in recording.runs.values()}
    runs_dir = root / RUNS_DIR
    if not runs_dir.is_dir():
        return
    with os.scandir(runs_dir) as found:
        names = sorted(d.name for d in found if d.name.endswith(".jsonl") and d.is_file())
    for name in names:
        rel = f"{RUNS_DIR}/{name}"
        if rel in listed:
            continue
        entries = _read_run_file(root, root / rel, version, blobs, recording.warnings)
        if not entries:
            continue
        run = entries[0].run
        if run in recording.runs:
            recording.warnings.append(
                f"{root / rel}: holds run {run!r}, which the manifest gives another file; skipped"
            )
            continue
        recording.warnings.append(
            f"{root / rel}: run {run!r} is not listed in the manifest (the recorder stopped "
            "before it rewrote it); read anyway. 'capgate recording verify --repair' lists it"
        )
        item = {"run": run, "file": rel, "unlisted": True}
        recording.runs[run] = RecordedRun(run, rel, entries, item)


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
