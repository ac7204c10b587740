"""``verify``: does a recording's manifest say what its run files hold? ``repair``: make it so.

The manifest is an index rewritten from time to time while recording (``writer.py``); a
recorder killed in between (``kill -9``, a crash, the machine) leaves it behind its run files:
runs it does not list, counts that stop at its last rewrite, a torn last line. ``verify`` reads
every record (``load_recording``, which reads unlisted run files too) and compares, run by run,
what the manifest says with what is there. ``repair`` opens the directory with the writer,
which mends the manifest from the records (``RecordingWriter._mend``), cuts torn last lines off,
and rewrites the manifest; a recorder that starts on the directory does the same by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.recording.model import Recording
from gateway.recording.reader import load_recording

COUNTS = ("calls", "denials", "errors")


@dataclass(slots=True)
class RunCounts:
    """One run: what its records are, and what the manifest says they are (None: unlisted)."""

    run: str
    file: str
    records: dict[str, int]
    listed: dict[str, int] | None

    @property
    def problems(self) -> list[str]:
        if self.listed is None:
            return []  # the reader's warning says so
        return [
            f"run {self.run!r} ({self.file}): manifest says {k} {self.listed[k]}, "
            f"the records hold {self.records[k]}"
            for k in COUNTS
            if self.listed[k] != self.records[k]
        ]


@dataclass(slots=True)
class VerifyReport:
    directory: Path
    runs: list[RunCounts]
    warnings: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return [p for run in self.runs for p in run.problems] + self.warnings

    @property
    def ok(self) -> bool:
        return not self.problems

    def totals(self) -> dict[str, int]:
        return {k: sum(r.records[k] for r in self.runs) for k in COUNTS}

    def text(self) -> str:
        t = self.totals()
        head = (
            f"{self.directory}: {len(self.runs)} run(s), {t['calls']} call(s), "
            f"{t['denials']} denial(s), {t['errors']} error(s)"
        )
        if self.ok:
            return head + "; the manifest matches the records"
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


def _record_counts(recording: Recording, run: str) -> dict[str, int]:
    entries = recording.runs[run].entries
    errors = sum(
        1
        for e in entries
        if e.error is not None or (e.response is not None and e.response.status >= 500)
    )
    denials = sum(1 for e in entries if e.kind == "denial")
    return {"calls": len(entries) - denials, "denials": denials, "errors": errors}


def _listed_counts(item: dict[str, Any]) -> dict[str, int] | None:
    if item.get("unlisted"):
        return None
    out: dict[str, int] = {}
    for k in COUNTS:
        value = item.get(k, 0)
        out[k] = value if isinstance(value, int) and not isinstance(value, bool) else -1
    return out


def verify(directory: str | Path) -> VerifyReport:
    """Compare the manifest with the records; ``RecordingError`` if the recording is unreadable."""
    recording = load_recording(directory)
    runs = [
        RunCounts(
            run=name,
            file=run.file,
            records=_record_counts(recording, name),
            listed=_listed_counts(run.manifest),
        )
        for name, run in sorted(recording.runs.items())
    ]
    return VerifyReport(Path(directory), runs, list(recording.warnings))


def repair(directory: str | Path) -> VerifyReport:
    """Mend the manifest from the records, cut torn last lines off; then verify again."""
    from gateway.recording.writer import RecordingWriter

    writer = RecordingWriter(Path(directory))
    for run in list(writer.runs):
        writer.ensure_run(run)  # the first use in a process cuts a torn last line off
    writer.write_manifest()
    return verify(directory)
