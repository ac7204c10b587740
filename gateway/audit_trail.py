"""The audit trail: hash-chained JSON lines that lose nothing and cannot be rewritten unseen.

Each line carries ``prev``, the SHA-256 of the previous line's bytes (64 zeros for the first
line of a trail). Deleting, inserting, reordering or editing a line breaks the chain at that
point. A chain alone can be recomputed by whoever can write the file, and its tail can be cut:
so every N lines, every T seconds, at a rotation and at shutdown a **checkpoint** line is
signed with the audit's own Ed25519 key (``audit_sign.py``), and the latest checkpoint is
published to an **anchor** outside the sandbox (``audit_anchor.py``). ``audit_verify.py``
checks all of it. The line format is specified once, in ``docs/audit.md``.

How a line is written (the per-call path):

- one ``os.write`` of a pre-encoded line to a file opened with ``O_APPEND``: no user-space
  buffer, so a ``kill -9`` loses nothing the gateway wrote;
- the line recording an **allowed** decision is written before the call is forwarded (and,
  with ``fsync: always``, made durable by the writer thread's group commit first); its
  outcome (status, sizes, duration) follows in an ``outcome`` line; a refused call is one
  ``decision`` line holding its outcome;
- the chain advances only after the write succeeded; a failed or short write is cut back
  (``ftruncate``) so the file stays a clean chain, the trail turns unavailable (health
  ``degraded``) and allowed calls are refused with 503 ``audit_unavailable`` until a write
  succeeds again, which is recorded in a ``repair`` line;
- refusals without an authenticated agent (and what the HTTP parser refused) are counted by
  reason and source into one ``summary`` line per interval, never one line each.

Lines never contain a token or a credential: the stages only put ids, names and decisions in
a record.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import orjson

from gateway.audit_record import timestamp
from gateway.errors import AuditUnavailable, ConfigError
from gateway.secret_files import check_secret_file

if TYPE_CHECKING:
    from gateway.audit_anchor import Anchor
    from gateway.audit_record import AuditRecord
    from gateway.audit_sign import CheckpointSigner
    from gateway.call import Call

log = logging.getLogger("capgate.audit")

GENESIS = "0" * 64
AUDIT_KEY_BYTES = 32
FORMAT_VERSION = 2  # ``v`` of the lines this module writes; lines without ``type`` are v1
SUMMARY_EVERY = 10.0  # seconds between summary lines (when something was counted)
ROTATE_RETRY = 60.0  # seconds before a rotation that could not rename the file is tried again
MAX_SUMMARY_KEYS = 256  # distinct (reason, source) pairs per summary; more go to "other"
# A ``decision`` line is its record with ``type`` after ``v``: the record's own encoding with
# ``type`` spliced in after its ``v`` (where ``audit_record`` puts it), not a merged copy of
# the record encoded again; any other record is merged (``_decision``). Same bytes either way.
_RECORD_HEAD = b'{"v":%d,' % FORMAT_VERSION
_DECISION_HEAD = b'{"v":%d,"type":"decision",' % FORMAT_VERSION
# The members of each line type but ``decision`` (which is an ``AuditRecord`` and ``type``):
# a closed set each, specified in docs/audit.md and checked by tests/test_advisories.py.
LINE_FIELDS: dict[str, frozenset[str]] = {
    "outcome": frozenset(
        {"v", "type", "time", "request_id", "agent", "decision", "reason", "status"}
        | {"duration_ms", "response_body", "operator", "fault", "prev"}
    ),
    "checkpoint": frozenset(
        {"v", "type", "time", "kind", "kid", "gateway", "lines", "audit_key", "prev", "sig"}
    ),
    "key": frozenset(
        {"v", "type", "time", "audit_key", "audit_key_before", "kid", "kid_before", "prev"}
    ),
    "repair": frozenset(
        {"v", "type", "time", "what", "file", "cut_bytes", "cut_sha256", "since", "error"}
        | {"unwritten_lines", "prev"}
    ),
    "summary": frozenset({"v", "type", "time", "since", "counts", "prev"}),
}


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
    return read_audit_key(path)


def read_audit_key(path: Path) -> bytes:
    """The audit key in ``path`` (never created: a reload, or a reader of the trail)."""
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


@dataclass(frozen=True)
class FsyncPolicy:
    """When written lines are forced to stable storage (``fsync`` setting).

    ============  ===========================================================================
    value         exposure to a power loss (a ``kill -9`` never loses a written line)
    ============  ===========================================================================
    ``1s``        (default) the writer thread syncs at most this long after a write
    ``always``    an allowed call is forwarded only after its decision line is synced
                  (concurrent calls share one ``fdatasync``: group commit)
    ``never``     the operating system decides
    ============  ===========================================================================
    """

    always: bool = False
    interval: float | None = 1.0

    @classmethod
    def parse(cls, value: Any) -> FsyncPolicy:
        from gateway.policy_file import parse_duration

        if value == "always":
            return cls(always=True, interval=None)
        if value in ("never", "off"):
            return cls(always=False, interval=None)
        seconds = parse_duration(value)
        if seconds <= 0:
            raise ValueError("expected 'always', 'never' or a positive duration such as 1s")
        return cls(always=False, interval=seconds)

    def __str__(self) -> str:
        if self.always:
            return "always"
        return "never" if self.interval is None else f"{self.interval:g}s"


@dataclass(frozen=True)
class TrailOptions:
    """How one trail is kept; built from ``Settings`` in ``app.py``."""

    fsync: FsyncPolicy = FsyncPolicy()
    mirror: Path | None = None  # a second copy, on a volume that outlives the sandbox
    checkpoint_lines: int = 1000  # a signed checkpoint at least every this many lines ...
    checkpoint_interval: float = 10.0  # ... and every this many seconds (if any line came)
    rotate_size: int | None = None  # bytes after which the file is rotated
    rotate_interval: float | None = None  # seconds after which the file is rotated
    gateway_id: str | None = None  # names this gateway's checkpoints at the anchor


class _Sink:
    """One open file of the trail: its descriptor, the size we know it has, its identity."""

    __slots__ = ("path", "fd", "size", "ident")

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        st = os.fstat(self.fd)
        self.size = st.st_size
        self.ident = (st.st_dev, st.st_ino)

    def moved(self) -> bool:
        """True when ``path`` no longer names this file (moved away, deleted, replaced)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self.ident

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _read_tail(path: Path) -> tuple[bytes | None, bytes]:
    """(the last complete line, bytes after it that are not a complete line)."""
    try:
        with path.open("rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            pos, data = end, b""
            while pos > 0:
                step = min(65536, pos)
                pos -= step
                fh.seek(pos)
                data = fh.read(step) + data
                body = data[: data.rfind(b"\n")] if b"\n" in data else b""
                if b"\n" in body or (pos == 0):
                    break
    except FileNotFoundError:
        return None, b""
    cut = data.rfind(b"\n") + 1
    torn = data[cut:]
    complete = data[:cut].rstrip(b"\n")
    last = complete.rsplit(b"\n", 1)[-1] if complete else b""
    return (last or None), torn


def _aside(path: Path) -> Path:
    """A name for ``path`` moved aside: ``NAME.<UTC time>``, and ``.1``, ``.2``, ... when
    that is taken (never replacing an earlier file). Sorted by name, oldest first."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}.{stamp}")
    n = 0
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.{stamp}.{n:03d}")
    return aside


def _write_all(fd: int, line: bytes) -> None:
    view = memoryview(line)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "short write")
        view = view[n:]


class _Syncer(threading.Thread):
    """The writer thread: ``fdatasync`` of the trail's files, off the event loop.

    ``always``: each waiter (an allowed call about to be forwarded) gets a future that is
    resolved after a sync that began after its line was written; waiters that arrive while
    a sync runs share the next one (group commit). ``interval``: dirty files are synced at
    most ``interval`` seconds after a write."""

    def __init__(self, trail: AuditTrail, policy: FsyncPolicy) -> None:
        super().__init__(name="capgate-audit-sync", daemon=True)
        self.trail = trail
        self.interval = policy.interval
        self.cond = threading.Condition()
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.dirty = False
        self.stopping = False
        self.syncs = 0

    def wait(self) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self.cond:
            self.waiters.append((loop, fut))
            self.cond.notify()
        return fut

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.join(timeout=5)

    def run(self) -> None:
        while True:
            with self.cond:
                if not self.waiters and not self.stopping:
                    self.cond.wait(timeout=self.interval)
                batch, self.waiters = self.waiters, []
                dirty, self.dirty = self.dirty, False
                stopping = self.stopping
            error: OSError | None = None
            if batch or dirty:
                try:
                    self.trail.sync()
                    self.syncs += 1
                except OSError as exc:
                    error = exc
            by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
            for loop, fut in batch:
                by_loop.setdefault(loop, []).append(fut)
            for loop, futs in by_loop.items():  # one wake-up of each loop per sync
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(_settle, futs, error)
            if stopping:
                return


def _settle(futs: list[asyncio.Future[None]], error: OSError | None) -> None:
    for fut in futs:
        if fut.done():
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(
                AuditUnavailable(f"the audit file could not be synced ({error.strerror or error})")
            )


def _decision(record: AuditRecord) -> bytes:
    """The JSON of a ``decision`` line of ``record`` (before ``prev``)."""
    body = orjson.dumps(record, default=str)
    if body.startswith(_RECORD_HEAD):
        return _DECISION_HEAD + body[len(_RECORD_HEAD) :]
    return orjson.dumps({"v": FORMAT_VERSION, "type": "decision", **record}, default=str)


def _outcome(record: AuditRecord) -> dict[str, Any]:
    line: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "type": "outcome",
        "time": timestamp(time.time()),
        "request_id": record["request_id"],
        "agent": record["agent"],
        "decision": record["decision"],
        "reason": record["reason"],
        "status": record["status"],
        "duration_ms": record["duration_ms"],
    }
    if "response_body" in record:
        line["response_body"] = record["response_body"]
    if "operator" in record:  # an operator's stop cut the call after its decision line
        line["operator"] = record["operator"]
    if "fault" in record:  # chaos on demand injected one into the exchange
        line["fault"] = record["fault"]
    return line


class AuditTrail:
    """Appends hash-chained JSON lines to one file (and its mirror), fail closed."""

    def __init__(
        self,
        path: str | Path | None,
        options: TrailOptions | None = None,
        signer: CheckpointSigner | None = None,
        anchor: Anchor | None = None,
        audit_key_id: str | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.options = options or TrailOptions()
        self.signer = signer
        self.anchor = anchor
        self.audit_key_id = audit_key_id  # the key of the digests written now (its id)
        # A signing key announced by a ``key`` line: it signs from the checkpoint after the
        # next one on (the next one, by the key in force, vouches for the announcement).
        self._next_signer: CheckpointSigner | None = None
        self._primary: _Sink | None = None
        self._mirror: _Sink | None = None
        self._fd_lock = threading.Lock()
        self._syncer: _Syncer | None = None
        self._prev = GENESIS  # the SHA-256 (hex) of the last line written
        self._prev_member = b""  # ``,"prev":"<_prev>"}``: how the next line ends
        self._chain_to(GENESIS)
        self._opened = False
        self.lines_written = 0
        self.checkpoints = 0
        self._since_checkpoint = 0
        self._last_checkpoint = 0.0
        self._file_started = 0.0
        self.latest_checkpoint: dict[str, Any] | None = None
        self.error: str | None = None  # why the trail cannot be written now (health)
        self.failures = 0  # failed writes since start
        self.unwritten = 0  # lines that could not be written during the current outage
        self._outage_since: float | None = None
        self._counts: Counter[tuple[str, str]] = Counter()
        self._counts_since = time.time()
        self._last_summary = time.monotonic()
        self._rotate_after = 0.0  # monotonic time before which no rotation is tried again

    # --- opening and closing ----------------------------------------------------------------

    def open(self) -> None:
        """Open (or create) the file, cut a torn last line back, continue the chain."""
        if self.path is None:
            return
        repairs: list[dict[str, Any]] = []
        try:
            last, torn = _read_tail(self.path)
            self._primary = _Sink(self.path)
            if torn:
                repairs.append(self._cut(self._primary, torn))
            if last is None and self.options.mirror is not None:
                # The primary is new (a new sandbox) but the mirror survived: continue its chain.
                last, _ = _read_tail(self.options.mirror)
            self._chain_to(hashlib.sha256(last).hexdigest() if last else GENESIS)
            if self.options.mirror is not None:
                self._mirror = self._open_mirror(self.options.mirror, repairs)
        except OSError as exc:
            self._close_files()
            raise ConfigError(
                f"cannot open audit file {str(self.path)!r}: {exc.strerror or exc}"
            ) from exc
        now = time.time()
        self._file_started = self._last_checkpoint = now
        self._opened = True
        try:
            # The start checkpoint first: a new file (or mirror) begins with a signed line.
            self.checkpoint("start")
            for repair in repairs:
                self.append(repair)
        except AuditUnavailable as exc:
            self._close_files()
            self._opened = False
            raise ConfigError(f"cannot write audit file {str(self.path)!r}: {self.error}") from exc
        policy = self.options.fsync
        if policy.always or policy.interval is not None:
            self._syncer = _Syncer(self, policy)
            self._syncer.start()

    def _cut(self, sink: _Sink, torn: bytes) -> dict[str, Any]:
        """Cut a torn last line (a crash mid-write) back; the ``repair`` line says so."""
        keep = sink.size - len(torn)
        os.ftruncate(sink.fd, keep)
        sink.size = keep
        log.warning("audit file %s: a torn last line (%d bytes) was cut back", sink.path, len(torn))
        return {
            "v": FORMAT_VERSION,
            "type": "repair",
            "time": timestamp(time.time()),
            "what": "torn_line_cut",
            "file": sink.path.name,
            "cut_bytes": len(torn),
            "cut_sha256": hashlib.sha256(torn).hexdigest(),
        }

    def _open_mirror(self, path: Path, repairs: list[dict[str, Any]]) -> _Sink:
        last, torn = _read_tail(path)
        sink = _Sink(path)
        if torn:
            repairs.append(self._cut(sink, torn))
        head = hashlib.sha256(last).hexdigest() if last else GENESIS
        if head != self._prev and sink.size > 0:
            # The mirror holds another chain than the primary: keep it, start a fresh one.
            sink.close()
            aside = _aside(path)
            os.replace(path, aside)
            log.warning("audit mirror %s held another chain; moved aside to %s", path, aside)
            sink = _Sink(path)
        return sink

    def _close_files(self) -> None:
        with self._fd_lock:
            for sink in (self._primary, self._mirror):
                if sink is not None:
                    sink.close()
            self._primary = self._mirror = None

    def close(self) -> None:
        """Write the pending summary and the shutdown checkpoint, sync, close."""
        if not self._opened:
            return
        with contextlib.suppress(AuditUnavailable):
            self._write_summary()
            self.checkpoint("shutdown")
        if self._syncer is not None:
            self._syncer.stop()
            self._syncer = None
        with contextlib.suppress(OSError):
            self.sync()
        self._close_files()
        self._opened = False
        if self.anchor is not None:
            self.anchor.close()

    def sync(self) -> None:
        """``fdatasync`` every open file of the trail (the writer thread, or ``close``)."""
        with self._fd_lock:
            for sink in (self._primary, self._mirror):
                if sink is not None:
                    os.fdatasync(sink.fd)

    # --- writing ----------------------------------------------------------------------------

    def _chain_to(self, digest: str) -> None:
        """The next line's ``prev``: ``digest``, the SHA-256 of the line before (hex)."""
        self._prev = digest
        self._prev_member = b',"prev":"' + digest.encode() + b'"}'  # its encoding, kept

    def _encode(self, record: Mapping[str, Any]) -> bytes:
        """The line of ``record`` without its newline: its JSON with ``prev`` last."""
        return self._chained(orjson.dumps(record, default=str))

    def _chained(self, body: bytes) -> bytes:
        """The line of ``body`` (the JSON of an object) without its newline, ``prev`` last."""
        if len(body) > 2:
            return body[:-1] + self._prev_member
        return b"{" + self._prev_member[1:]

    def _write(self, content: bytes) -> None:
        """Write one whole line (``content`` and a newline) to every file, or to none (cut
        back); then advance the chain to the SHA-256 of ``content``."""
        primary, mirror = self._primary, self._mirror
        if primary is None:
            self._failed(OSError(errno.ENOENT, "the audit file is not open"))
        line = content + b"\n"
        size = len(line)
        try:
            # Nearly always one whole write; the rest of a short one is written after it.
            written = os.write(primary.fd, line)
            if written < size:
                _write_all(primary.fd, line[written:])
            if mirror is not None:
                _write_all(mirror.fd, line)
        except OSError as exc:
            for sink in (primary, mirror):
                if sink is not None:
                    with contextlib.suppress(OSError):
                        os.ftruncate(sink.fd, sink.size)
            self._failed(exc)
        primary.size += size
        if mirror is not None:
            mirror.size += size
        self._chain_to(hashlib.sha256(content).hexdigest())
        self.lines_written += 1
        self._since_checkpoint += 1
        if self._syncer is not None:
            self._syncer.dirty = True

    def _failed(self, exc: OSError) -> NoReturn:
        self.failures += 1
        if self.error is None:
            self._outage_since = time.time()
            log.error(
                "audit file %s cannot be written (%s): allowed calls are refused "
                "(audit_unavailable) until it can",
                self.path,
                exc.strerror or exc,
            )
        self.error = f"{exc.strerror or exc}"
        raise AuditUnavailable(
            "the audit trail cannot be written; the call was not forwarded"
        ) from exc

    def _recover(self) -> None:
        """The first write after an outage: a ``repair`` line saying what was not written."""
        self._write(
            self._encode(
                {
                    "v": FORMAT_VERSION,
                    "type": "repair",
                    "time": timestamp(time.time()),
                    "what": "write_failed",
                    "since": timestamp(self._outage_since or time.time()),
                    "error": self.error,
                    "unwritten_lines": self.unwritten,
                }
            )
        )
        log.info(
            "audit file %s writable again (%d lines were not written)", self.path, self.unwritten
        )
        self.error = None
        self.unwritten = 0
        self._outage_since = None

    def append(self, record: Mapping[str, Any]) -> None:
        """One line: the record's JSON with ``prev`` last. Raises ``AuditUnavailable``."""
        if not self._opened:
            return
        self._append(orjson.dumps(record, default=str))

    def _append(self, body: bytes) -> None:
        """One line of ``body`` (the JSON of an object), ``prev`` added last."""
        if self.error is not None:
            self._recover()  # before chaining: the repair line comes first in the chain
        self._write(self._chained(body))
        if self._since_checkpoint >= self.options.checkpoint_lines:
            self.checkpoint("periodic")

    def checkpoint(self, kind: str) -> None:
        """A signed line vouching for every line before it (start, periodic, rotate,
        shutdown); the latest one is offered to the anchor."""
        if self.signer is None or not self._opened:
            return
        if self.error is not None and kind != "start":
            self._recover()  # (a new file begins with its start checkpoint, then the repair)
        record = {
            "v": FORMAT_VERSION,
            "type": "checkpoint",
            "time": timestamp(time.time()),
            "kind": kind,
            "kid": self.signer.kid,
            "gateway": self.options.gateway_id,
            "lines": self._since_checkpoint,
        }
        if kind == "start" and self.audit_key_id is not None:
            record["audit_key"] = self.audit_key_id  # the digests' key from here on
        unsigned = orjson.dumps(record)[:-1] + b',"prev":"' + self._prev.encode() + b'"'
        self._write(self.signer.sign(unsigned))
        if self._next_signer is not None:  # this checkpoint vouched for the key line before
            self.signer, self._next_signer = self._next_signer, None
        self._since_checkpoint = 0
        self._last_checkpoint = time.time()
        self.checkpoints += 1
        self.latest_checkpoint = {
            "gateway": self.options.gateway_id,
            "kid": record["kid"],
            "time": record["time"],
            "kind": kind,
            "hash": self._prev,  # the checkpoint line's own SHA-256
            "file": self.path.name if self.path else None,
        }
        if self.anchor is not None:
            self.anchor.offer(self.latest_checkpoint)

    @property
    def upcoming_signer(self) -> CheckpointSigner | None:
        """The key that will sign from the next checkpoint but one on (``change_keys``)."""
        return self._next_signer or self.signer

    def change_keys(self, audit_key_id: str | None, signer: CheckpointSigner | None) -> None:
        """The audit key, the signing key or both change (``key_reload.py``), at this line.

        A ``key`` line names the keys before and after (ids only), then a ``rekey``
        checkpoint signed by the key in force closes the segment and vouches for the new
        signing key's id; later checkpoints are signed by the new key. The caller digests
        under the new audit key only once this returned: lines after the ``key`` line are
        under it. Raises ``AuditUnavailable`` when the ``key`` line cannot be written (then
        nothing changed: the caller keeps the keys in force and tries again)."""
        signing = signer if signer is not None else (self._next_signer or self.signer)
        if self._opened:
            if self.error is not None:
                self._recover()
            record = {
                "v": FORMAT_VERSION,
                "type": "key",
                "time": timestamp(time.time()),
                "audit_key": audit_key_id,
                "audit_key_before": self.audit_key_id,
                "kid": signing.kid if signing is not None else None,
                "kid_before": self.signer.kid if self.signer is not None else None,
            }
            self._write(self._encode(record))
        self.audit_key_id = audit_key_id
        if self.signer is None or not self._opened:
            self.signer, self._next_signer = signing, None
        elif signing is not None and signing.kid != self.signer.kid:
            self._next_signer = signing
        else:
            self._next_signer = None
        with contextlib.suppress(AuditUnavailable):  # the next checkpoint will vouch then
            self.checkpoint("rekey")

    # --- observers of the call --------------------------------------------------------------

    def call_decided(self, call: Call, records: Sequence[AuditRecord]) -> Awaitable[None] | None:
        """Before an allowed call is forwarded: its decision line(s), written (and synced
        with ``fsync: always``). Raises ``AuditUnavailable`` when they cannot be written."""
        if not self._opened:
            return None
        for record in records:
            self._append(_decision(record))
            # From the first line on, the call's end is an outcome line (even if a later
            # record of the same call cannot be written and the call is refused).
            call.audit_decided = True
        if self.options.fsync.always and self._syncer is not None:
            return self._syncer.wait()
        return None

    def call_ended(self, call: Call, records: Sequence[AuditRecord]) -> None:
        """Observer of ended calls: the outcome of a forwarded call; a refused call's decision
        with its outcome; a refusal without an authenticated agent counted for the summary."""
        if not self._opened:
            return
        try:
            if call.audit_decided:
                self._append(orjson.dumps(_outcome(records[0]), default=str))
            elif call.claims is None and call.error is not None:
                source = call.request.remote if call.request is not None else None
                self.count_refusal(call.error.reason.value, source)
            else:
                for record in records:
                    self._append(_decision(record))
        except AuditUnavailable:
            self.unwritten += 1

    def count_refusal(self, reason: str, source: str | None) -> None:
        """A refusal counted into the next summary line (by reason and source), not a line."""
        key = (reason, source or "-")
        if key not in self._counts and len(self._counts) >= MAX_SUMMARY_KEYS:
            key = (reason, "other")
        self._counts[key] += 1

    def _write_summary(self) -> None:
        if not self._counts:
            return
        now = time.time()
        counts = [
            {"reason": reason, "source": source, "n": n}
            for (reason, source), n in sorted(self._counts.items())
        ]
        self.append(
            {
                "v": FORMAT_VERSION,
                "type": "summary",
                "time": timestamp(now),
                "since": timestamp(self._counts_since),
                "counts": counts,
            }
        )
        self._counts.clear()
        self._counts_since = now

    # --- the background tick ----------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Called about once a second by the gateway's background loop: reopen a file that
        was moved away, rotate, write the summary and time-based checkpoints, retry after an
        outage. Never raises: a failure shows in ``health``."""
        if not self._opened:
            return
        mono = time.monotonic() if now is None else now
        wall = time.time()
        opts = self.options
        try:
            if self._primary is None or self._primary.moved():
                self.rotate(move=False)
            elif mono >= self._rotate_after and (
                (opts.rotate_size is not None and self._primary.size >= opts.rotate_size)
                or (
                    opts.rotate_interval is not None
                    and wall - self._file_started >= opts.rotate_interval
                )
            ):
                self.rotate(move=True)
            if mono - self._last_summary >= SUMMARY_EVERY:
                self._last_summary = mono
                self._write_summary()
            if self._since_checkpoint and wall - self._last_checkpoint >= opts.checkpoint_interval:
                self.checkpoint("periodic")
            if self.error is not None:
                self._recover()
        except AuditUnavailable:
            pass

    def flush(self) -> None:
        """Write what is held for the next summary now (lines themselves are never held)."""
        with contextlib.suppress(AuditUnavailable):
            self._write_summary()

    def rotate(self, *, move: bool) -> None:
        """Close this file with a ``rotate`` checkpoint and continue the chain in a new one
        at the same path (whose first line is a ``start`` checkpoint). ``move``: rename the
        old file aside first; otherwise it was already moved or deleted by someone else."""
        assert self.path is not None
        old = self._primary
        if old is not None:
            with contextlib.suppress(AuditUnavailable):
                self.checkpoint("rotate")
            if move:
                aside = _aside(self.path)
                try:
                    os.replace(self.path, aside)
                except OSError as exc:
                    # The file itself is still writable: keep writing to it, try again later.
                    log.error("audit file %s cannot be rotated: %s", self.path, exc.strerror)
                    self._file_started = time.time()
                    self._rotate_after = time.monotonic() + ROTATE_RETRY
                    return
                log.info("audit file rotated to %s", aside)
            else:
                log.warning("audit file %s was moved away or deleted; reopening it", self.path)
        try:
            new = _Sink(self.path)
        except OSError as exc:
            with self._fd_lock:
                self._primary = None
                if old is not None:
                    old.close()
            self._failed(exc)
        with self._fd_lock:
            self._primary = new
            if old is not None:
                old.close()
        self._file_started = time.time()
        self.checkpoint("start")

    def health(self) -> dict[str, Any]:
        return {
            "ok": self.error is None,
            "file": str(self.path) if self.path else None,
            "error": self.error,
            "lines": self.lines_written,
            "unwritten": self.unwritten,
            "failures": self.failures,
            "fsync": str(self.options.fsync),
            "syncs": self._syncer.syncs if self._syncer is not None else 0,
            "checkpoints": self.checkpoints,
            "latest_checkpoint": self.latest_checkpoint,
            "keys": {
                "audit_key": self.audit_key_id,
                "kid": self.signer.kid if self.signer is not None else None,
                "next_kid": self._next_signer.kid if self._next_signer is not None else None,
            },
            "anchor": self.anchor.health() if self.anchor is not None else None,
        }


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


OUTCOME_FIELDS = (
    "decision",
    "reason",
    "status",
    "duration_ms",
    "response_body",
    "operator",
    "fault",
)


def call_records(lines: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One record per call (per operation), as format 1 wrote them: each ``decision`` line
    with its ``outcome`` folded in; checkpoint, repair and summary lines left out. Lines of
    format 1 (no ``type``) are already such records."""
    out: list[dict[str, Any]] = []
    pending: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        kind = line.get("type")
        if kind is None:
            out.append(dict(line))
        elif kind == "decision":
            record = {k: v for k, v in line.items() if k not in ("type", "prev")}
            out.append(record)
            if record.get("status") is None:
                pending.setdefault(str(record.get("request_id")), []).append(record)
        elif kind == "outcome":
            for record in pending.pop(str(line.get("request_id")), []):
                for name in OUTCOME_FIELDS:
                    if name in line:
                        record[name] = line[name]
    return out


def with_audit_keys(lines: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The lines, each ``decision`` line (and line of format 1) given ``audit_key``: the id of
    the key its digests are under, as the trail declared it (the ``audit_key`` of the latest
    ``start`` checkpoint or ``key`` line before it; absent when none did). A call's outcome
    digests are under its decision line's key, so ``call_records`` carries it to the call."""
    current: str | None = None
    for line in lines:
        kind = line.get("type")
        if kind in ("checkpoint", "key") and isinstance(line.get("audit_key"), str):
            current = line["audit_key"]
        elif current is not None and kind in (None, "decision"):
            line = {**line, "audit_key": current}
        yield line
