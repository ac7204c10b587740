"""The content-addressed blob store, and how a body is written inline.

A body larger than ``INLINE_LIMIT`` (after redaction) is a file ``blobs/sha256/<hex>`` named by
the SHA-256 of its bytes, written once, through a temporary file and ``os.replace``; a smaller
one is written in the record as ``{"text": ...}`` or ``{"base64": ...}`` (``encode_inline``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from gateway.recording.format import BLOB_REF, BLOBS_DIR, RecordingError

T = TypeVar("T")


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
        if not BLOB_REF.fullmatch(ref):
            raise RecordingError(f"{ref!r} is not a blob reference ('sha256/<64 hex digits>')")
        return self.root / BLOBS_DIR / ref

    def put_bytes(self, data: bytes) -> tuple[str, bool]:
        """(ref, created) for these bytes."""
        ref, created, _, _ = self.put_stream(lambda out: out.write(data))
        return ref, created

    def put_stream(self, fill: Callable[[Any], T]) -> tuple[str, bool, int, T]:
        """Write a blob through ``fill(writer)``; (ref, created, size, fill's result)."""
        tmp_dir = self.root / BLOBS_DIR / "tmp"
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


def encode_inline(data: bytes) -> dict[str, Any]:
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}
