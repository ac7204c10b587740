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

Writing (``writer.py``). ``RecordingWriter.append`` is the one function that writes a record:
it redacts (``redact.py``), stores large bodies as blobs (``blobs.py``), and appends the whole
line with a single ``write`` on an ``O_APPEND`` descriptor, so a crash leaves at worst a
truncated *last* line, which the reader reports and skips. The manifest is replaced atomically
(write to a temporary file, ``os.replace``); it is an index, rewritten from time to time and when
the recorder stops, and mended from the run files after a crash (``RecordingWriter._mend``,
``verify.py``). Unredacted bytes never touch the recording
directory: bodies too large for memory are spilled to the system temporary directory and
redacted into their blob.

Reading (``reader.py``). ``load_recording`` validates the manifest, migrates older versions
step by step (``compat.py``), parses every record into an ``Entry`` (``model.py``), checks that
every blob exists, and raises one ``RecordingError`` naming the file and line of the first
problem.

This module holds the format's names only: its version, the file layout, run file names, the
time stamps the manifest uses and ``RecordingError``.
"""

from __future__ import annotations

import hashlib
import re
import time

from gateway.recording.compat import CURRENT

FORMAT = "capgate-recording"
"""The manifest's ``format`` field."""
VERSION = CURRENT
"""The version this capgate writes (older ones are read through ``compat.py``)."""
MANIFEST = "manifest.json"
"""The index: format, version, runs; replaced atomically."""
RUNS_DIR = "runs"
"""One JSON Lines file per run (``run_file_name``)."""
BLOBS_DIR = "blobs"
"""Bodies larger than ``INLINE_LIMIT``: ``blobs/sha256/<hex>``."""
INLINE_LIMIT = 64 * 1024
"""Bodies up to this many bytes (after redaction) are written inline in the record."""
MAX_CHUNKS = 4096
"""Chunk boundaries kept per response; later chunks are merged into the last one."""

_SAFE_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,100}")
BLOB_REF = re.compile(r"sha256/[0-9a-f]{64}")
"""A blob reference as records write it: ``sha256/<hex>``, the path under ``BLOBS_DIR``."""


class RecordingError(Exception):
    """Raised when a recording cannot be read or written; the message names file and line."""


def run_id(run: str | None) -> str:
    return run if run else "default"


def run_file_name(run: str) -> str:
    """``runs/<run>.jsonl`` for a plain run id; a hashed name for anything else."""
    if _SAFE_RUN.fullmatch(run) and not run.endswith(".") and ".." not in run:
        return f"{RUNS_DIR}/{run}.jsonl"
    return f"{RUNS_DIR}/run-{hashlib.sha256(run.encode()).hexdigest()[:16]}.jsonl"


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
