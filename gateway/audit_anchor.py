"""Anchors: where the latest signed checkpoint of a trail is kept, outside the sandbox.

A trail and its signing key in the same sidecar cannot prove their own tail: whoever can
write the file can cut it back to an earlier checkpoint, signature and all. An anchor is a
place the sandbox cannot rewrite that holds the latest checkpoint (its line's hash, kind,
time, key id): ``capgate audit verify --anchor ...`` then fails on a trail that does not reach
it (a cut tail) or holds another line there (a rewrite).

``--audit-anchor`` takes:

=========================  ===================================================================
``file:/other/volume/a``   appends one JSON line per checkpoint (synced); verify reads it
``exec:COMMAND ARGS``      runs the command with the checkpoint's JSON on stdin (a collector,
                           a signer, ``logger``); verify needs the collector's copy as a file
``redis`` / ``redis://..`` ``SET capgate:audit:anchor:<gateway>`` (``redis``: the state URL)
=========================  ===================================================================

Publication runs in its own thread and keeps only the latest checkpoint pending, so a slow
anchor never holds a call; ``close`` publishes the last one (the shutdown checkpoint) before
the gateway exits.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("capgate.audit")

REDIS_PREFIX = "capgate:audit:anchor:"
EXEC_TIMEOUT = 10.0
CLOSE_WAIT = 5.0


@dataclass(frozen=True)
class AnchorSpec:
    kind: str  # file | exec | redis
    target: str

    @classmethod
    def parse(cls, value: str, state_url: str | None = None) -> AnchorSpec:
        if value.startswith("file:") and len(value) > 5:
            return cls("file", value[5:])
        if value.startswith("exec:") and shlex.split(value[5:]):
            return cls("exec", value[5:])
        if value in ("redis", "redis:"):
            if state_url is None or not state_url.startswith(("redis://", "rediss://")):
                raise ValueError("'redis' needs a redis:// state URL (--state)")
            return cls("redis", state_url)
        if value.startswith(("redis://", "rediss://")):
            return cls("redis", value)
        raise ValueError("expected file:PATH, exec:COMMAND, redis or a redis:// URL")

    def __str__(self) -> str:
        return f"{self.kind}:{self.target}" if self.kind != "redis" else "redis"


class Anchor:
    """Publishes the latest checkpoint offered, in a worker thread."""

    def __init__(self, spec: AnchorSpec) -> None:
        self.spec = spec
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._busy = False
        self._closed = False
        self.published = 0
        self.error: str | None = None
        self.last: str | None = None
        self._thread = threading.Thread(target=self._run, name="capgate-audit-anchor", daemon=True)
        self._thread.start()

    def offer(self, checkpoint: dict[str, Any]) -> None:
        with self._cond:
            self._pending = dict(checkpoint)
            self._cond.notify()

    def close(self) -> None:
        """Publish what is pending (bounded by ``CLOSE_WAIT``) and stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=CLOSE_WAIT)

    def health(self) -> dict[str, Any]:
        return {
            "target": str(self.spec),
            "published": self.published,
            "last": self.last,
            "error": self.error,
        }

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                item, self._pending = self._pending, None
                closed = self._closed
            if item is not None:
                try:
                    publish(self.spec, item)
                except Exception as exc:  # an anchor's failure is shown, never fatal
                    if self.error is None:
                        log.error("audit anchor %s: %s", self.spec, exc)
                    self.error = f"{type(exc).__name__}: {exc}"[:300]
                else:
                    self.published += 1
                    self.last = str(item.get("hash"))
                    self.error = None
            if closed:
                with self._cond:
                    if self._pending is None:
                        return


def publish(spec: AnchorSpec, checkpoint: dict[str, Any]) -> None:
    data = json.dumps(checkpoint, separators=(",", ":"), sort_keys=True)
    if spec.kind == "file":
        path = Path(spec.target)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(data + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    elif spec.kind == "exec":
        subprocess.run(  # noqa: S603 (the operator's configured command, never agent input)
            shlex.split(spec.target),
            input=data.encode(),
            check=True,
            timeout=EXEC_TIMEOUT,
            capture_output=True,
        )
    else:
        import redis

        client = redis.Redis.from_url(spec.target, socket_timeout=5, socket_connect_timeout=5)
        try:
            client.set(REDIS_PREFIX + str(checkpoint.get("gateway") or "-"), data)
        finally:
            client.close()


def read_anchor(value: str) -> list[dict[str, Any]]:
    """The checkpoints an anchor holds (oldest first), for ``verify --anchor``: a file (as
    written by ``file:``, or a collector's copy of what ``exec:`` received) or a redis URL."""
    if value.startswith(("redis://", "rediss://")):
        import redis

        client = redis.Redis.from_url(value, socket_timeout=5, socket_connect_timeout=5)
        try:
            out = []
            for key in sorted(client.scan_iter(match=REDIS_PREFIX + "*")):
                raw = client.get(key)
                if isinstance(raw, bytes | str):
                    out.append(json.loads(raw))
            return out
        finally:
            client.close()
    path = Path(value[5:] if value.startswith("file:") else value)
    entries = []
    for line in path.read_text("utf-8").splitlines():
        if line.strip():
            entry = json.loads(line)
            if isinstance(entry, dict):
                entries.append(entry)
    return entries
