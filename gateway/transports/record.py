"""Mode ``record``: forward through the live transport, and write every exchange down.

``RecordTransport`` wraps another transport (the ``LiveTransport``). For each call it tees
the request body (also when it streams as an async iterator) and the response, chunk by
chunk with the time each arrived, into a ``BodySink``: bytes stay in memory up to
``INLINE_LIMIT`` and spill to a private temporary file beyond, so memory per call is bounded
whatever the body size. When the response has been passed on (``close()``), the exchange goes
to ``RecordingWriter.append``, the one writer, which redacts it. Upstream failures
(``UpstreamError``) are recorded as errors and re-raised unchanged; refused calls arrive
through ``observe_denial`` and are recorded as denials.

Runs. Records are grouped by the token's ``run`` claim (``"default"`` without one). A run
ends on ``end_run(run)``, after ``idle_end`` seconds without calls, or when the transport
closes. Open runs are kept least recently active first, so a call's sweep for idle runs looks
at those only; ending a run changes the manifest in memory, and ``close()`` writes it once
after ending them all: nothing a call does costs in proportion to the number of runs.

With ``sample`` set, an ended run is kept only if it saw a denial, an upstream error
(a 5xx answer or a transport error, timeouts included) or its id hashes into the ``sample``
fraction (``keep_fraction``: the same run id always gets the same answer); the files of a run
not kept are deleted. ``RunLimits`` caps the calls and bytes written per run; calls beyond
are still forwarded, not recorded, and the manifest says so (``truncated``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from multidict import CIMultiDict

from gateway.errors import GatewayError
from gateway.recording.codings import content_codings, sniff
from gateway.recording.format import INLINE_LIMIT, RecordingError, parse_iso_time, run_id
from gateway.recording.model import BodyData, Decision, ErrorInfo, Exchange, ResponseData, Spilled
from gateway.recording.redact import DEFAULT_REDACTOR, KnownSecret, Redactor
from gateway.recording.writer import RecordingWriter
from gateway.transport import Transport, UpstreamRequest, UpstreamResponse

if TYPE_CHECKING:
    from gateway.recording.denial import Denial

log = logging.getLogger("capgate.recording")

DEFAULT_IDLE_END = 300.0
"""Seconds without a call after which a run counts as ended (sampling decides then)."""


def keep_fraction(run: str, fraction: float) -> bool:
    """Whether a run falls in the kept ``fraction``: a stable hash of its id, so the same run
    id gets the same answer on every gateway and every time."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    digest = hashlib.sha256(run.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass(frozen=True, slots=True)
class RunLimits:
    """What one run may put on disk; beyond, calls are forwarded but not recorded."""

    max_calls: int = 10_000
    max_bytes: int = 256 * 1024 * 1024


@dataclass(slots=True)
class RunSession:
    """A run being recorded by this process."""

    run: str
    mono_start: float
    offset: float  # seconds from the run's first recorded start to this session's start
    next_seq: int
    last_active: float
    calls: int = 0
    bytes: int = 0
    reserved: int = 0
    dropped: int = 0
    truncated: str | None = None
    saw_denial: bool = False
    saw_error: bool = False
    inflight: int = 0
    blobs: list[str] = field(default_factory=list)
    discard: bool = False  # ended and not kept: late records are thrown away

    def take_seq(self) -> int:
        self.next_seq += 1
        return self.next_seq


class Reservation:
    """Bytes one call holds against its run's ``max_bytes`` while its bodies stream."""

    def __init__(self, session: RunSession, limit: int) -> None:
        self.session = session
        self.limit = limit
        self.amount = 0

    def __call__(self, n: int) -> bool:
        s = self.session
        if s.bytes + s.reserved + n > self.limit:
            return False
        s.reserved += n
        self.amount += n
        return True

    def release(self) -> None:
        self.session.reserved -= self.amount
        self.amount = 0


class BodySink:
    """Collects a body as it streams: in memory up to ``INLINE_LIMIT``, then a spill file."""

    def __init__(
        self, spill: Callable[[], tuple[IO[bytes], Path]], reserve: Callable[[int], bool]
    ) -> None:
        self._spill = spill
        self._reserve = reserve
        self._buf = bytearray()
        self._file: IO[bytes] | None = None
        self._path: Path | None = None
        self.size = 0
        self.abandoned = False

    def write(self, chunk: bytes) -> None:
        if self.abandoned or not chunk:
            return
        if not self._reserve(len(chunk)):
            self.abandon()
            return
        self.size += len(chunk)
        if self._file is None and len(self._buf) + len(chunk) <= INLINE_LIMIT:
            self._buf += chunk
            return
        if self._file is None:
            self._file, self._path = self._spill()
            self._file.write(self._buf)
            self._buf = bytearray()
        self._file.write(chunk)

    def finish(self) -> BodyData | None:
        if self.abandoned:
            return None
        if self._file is not None:
            assert self._path is not None
            self._file.close()
            self._file = None
            return Spilled(self._path, self.size)
        return bytes(self._buf)

    def abandon(self) -> None:
        self.abandoned = True
        self._buf = bytearray()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._path is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()


async def _tee(source: AsyncIterator[bytes], sink: BodySink) -> AsyncIterator[bytes]:
    async for chunk in source:
        sink.write(chunk)
        yield chunk


def upstream_origin(request: UpstreamRequest) -> str:
    """The upstream's URL without credentials, query or fragment."""
    up = request.upstream
    return str(up.url.origin()) + up.base_path


def secrets_of(request: UpstreamRequest) -> tuple[KnownSecret, ...]:
    return (KnownSecret.from_injection(request.injection),) if request.injection else ()


class TeeResponse:
    """The live response, passed through unchanged while a copy is recorded."""

    def __init__(
        self,
        inner: UpstreamResponse,
        recorder: RecordTransport,
        session: RunSession,
        exchange: Exchange,
        sink: BodySink,
        reservation: Reservation,
        started: float,
    ) -> None:
        self._inner = inner
        self._recorder = recorder
        self._session = session
        self._exchange = exchange
        self._sink = sink
        self._reservation = reservation
        self._started = started
        self._chunks: list[tuple[float, int]] = []
        self._complete = False
        self._error: GatewayError | None = None
        self._finished = False
        self.status = inner.status
        self.reason = inner.reason
        self.headers: CIMultiDict[str] = inner.headers

    @property
    def complete(self) -> bool:
        return self._inner.complete

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        clock = self._recorder.clock
        t0 = clock()
        try:
            async for chunk in self._inner.iter_chunks():
                self._sink.write(chunk)
                self._chunks.append((clock() - t0, len(chunk)))
                yield chunk
        except GatewayError as exc:
            self._error = exc
            self._session.saw_error = True
            raise
        self._complete = True

    async def read_all(self) -> bytes:
        clock = self._recorder.clock
        t0 = clock()
        try:
            body = await self._inner.read_all()
        except GatewayError as exc:
            self._error = exc
            self._session.saw_error = True
            raise
        self._sink.write(body)
        self._chunks.append((clock() - t0, len(body)))
        self._complete = True
        return body

    async def close(self) -> None:
        try:
            await self._inner.close()
        finally:
            if not self._finished:
                self._finished = True
                ex = self._exchange
                body = self._sink.finish()
                if not self._complete and not self._chunks:
                    body = None  # never read (refused by its declared size, agent gone)
                ex.response = ResponseData(
                    status=self.status,
                    reason=self.reason,
                    headers=list(self.headers.items()),
                    body=body,
                    chunks=self._chunks,
                    complete=self._complete,
                )
                if self._error is not None:
                    ex.error = ErrorInfo(
                        self._error.reason.value, self._error.status, self._error.detail
                    )
                ex.duration = self._recorder.clock() - self._started
                await self._recorder._finish(
                    self._session, ex, self._reservation, self._sink.abandoned
                )


class RecordTransport:
    """Live forwarding plus a recording of every exchange and denial (mode ``record``)."""

    mode = "record"

    def __init__(
        self,
        live: Transport,
        directory: Path,
        *,
        sample: float | None = None,
        limits: RunLimits | None = None,
        redactor: Redactor = DEFAULT_REDACTOR,
        idle_end: float | None = DEFAULT_IDLE_END,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        spill_dir: Path | None = None,
    ) -> None:
        if sample is not None and not 0.0 <= sample <= 1.0:
            raise ValueError(f"sample must be a fraction between 0 and 1, not {sample!r}")
        self.live = live
        self.sample = sample
        self.limits = limits or RunLimits()
        self.idle_end = idle_end
        self.clock = clock
        self.wall = wall
        self.writer = RecordingWriter(
            Path(directory), redactor=redactor, wall=wall, clock=clock, spill_dir=spill_dir
        )
        if sample is not None:
            previous = self.writer.sampling or {}
            self.writer.sampling = {
                "fraction": sample,
                "dropped_runs": int(previous.get("dropped_runs", 0)),
            }
        # Least recently active first: the idle sweep looks at the front only, so its work per
        # call does not grow with the number of runs open.
        self.sessions: OrderedDict[str, RunSession] = OrderedDict()
        self._closed = False

    # -- runs --------------------------------------------------------------------------------

    def _session(self, run: str) -> RunSession:
        session = self.sessions.get(run)
        now = self.clock()
        if session is None:
            entry = self.writer.ensure_run(run)
            offset = max(self.wall() - parse_iso_time(entry.started), 0.0)
            session = RunSession(
                run=run,
                mono_start=now,
                offset=offset,
                next_seq=self.writer.last_seq(run),
                last_active=now,
            )
            self.sessions[run] = session
        else:
            self.sessions.move_to_end(run)
        session.last_active = now
        return session

    def _sweep(self) -> None:
        """End the runs idle for longer than ``idle_end``: the oldest first, stopping at the
        first one still active, so a call pays for the runs it ends, not for the runs open. A
        run with a call still in flight is kept (there are at most as many as calls)."""
        if self.idle_end is None:
            return
        deadline = self.clock() - self.idle_end
        idle: list[str] = []
        for run, s in self.sessions.items():
            if s.last_active >= deadline:
                break
            if s.inflight == 0:
                idle.append(run)
        for run in idle:
            self.end_run(run)

    def _admit(self, session: RunSession) -> bool:
        if session.calls >= self.limits.max_calls:
            self._truncate(session, "max_calls")
            return False
        if session.bytes >= self.limits.max_bytes:
            self._truncate(session, "max_bytes")
            return False
        session.calls += 1
        return True

    def _truncate(self, session: RunSession, why: str) -> None:
        session.dropped += 1
        first = session.truncated is None
        if first:
            session.truncated = why
            log.warning(
                "run %r reached its recording limit (%s); later calls are not recorded",
                session.run,
                why,
            )
        self.writer.note(
            session.run,
            truncated={"reason": session.truncated, "calls_not_recorded": session.dropped},
        )

    def end_run(self, run: str) -> bool | None:
        """End a run: with sampling, keep or drop it. True kept, False dropped, None unknown."""
        session = self.sessions.pop(run, None)
        if session is None:
            return None
        if self.sample is None:
            self.writer.note(run)
            return True
        if session.saw_denial:
            why = "denial"
        elif session.saw_error:
            why = "error"
        elif keep_fraction(run, self.sample):
            why = "sampled"
        else:
            session.discard = True
            self.writer.drop_run(run, session.blobs)
            assert self.writer.sampling is not None
            self.writer.sampling["dropped_runs"] = int(self.writer.sampling["dropped_runs"]) + 1
            log.debug("run %r not kept by sampling", run)
            return False
        self.writer.note(run, kept=why)
        return True

    # -- the transport -----------------------------------------------------------------------

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        try:
            self._sweep()
            session = self._session(run_id(request.run))
            self.writer.remember_upstream(request.upstream.name, upstream_origin(request))
        except (OSError, RecordingError) as exc:
            log.error("recording failed (%s); the call is forwarded unrecorded", exc)
            return await self.live.send(request)
        if not self._admit(session):
            return await self._forward_unrecorded(session, request)
        session.inflight += 1
        seq = session.take_seq()
        t = session.offset + (self.clock() - session.mono_start)
        reserve = Reservation(session, self.limits.max_bytes)
        request_sink: BodySink | None = None
        body = request.body
        if body is not None and not isinstance(body, bytes):
            request_sink = BodySink(self.writer.spill_file, reserve)
            request = dataclasses.replace(request, body=_tee(body, request_sink))
        elif isinstance(body, bytes) and not reserve(len(body)):
            session.inflight -= 1
            self._truncate(session, "max_bytes")
            return await self._forward_unrecorded(session, request)
        caps = getattr(request, "caps", None)
        ex = Exchange(
            kind="exchange",
            run=session.run,
            seq=seq,
            t=t,
            method=request.method,
            target=request.target,
            upstream=request.upstream.name,
            agent=request.agent,
            roles=tuple(getattr(request, "roles", ()) or ()),
            caps=tuple(sorted(caps)) if caps is not None else None,
            request_id=request.request_id,
            request_headers=list(request.headers.items()),
            request_body=body if isinstance(body, bytes) else None,
            decision=Decision(True, "allowed", request.rule.id if request.rule else None),
            rule=request.rule,
            secrets=secrets_of(request),
        )
        started = self.clock()
        try:
            response = await self.live.send(request)
        except GatewayError as exc:
            if request_sink is not None:
                ex.request_body = request_sink.finish()
            ex.error = ErrorInfo(exc.reason.value, exc.status, exc.detail)
            ex.decision = dataclasses.replace(ex.decision, status=exc.status)
            ex.duration = self.clock() - started
            session.saw_error = True
            await self._finish(
                session, ex, reserve, request_sink is not None and request_sink.abandoned
            )
            raise
        except BaseException:
            session.inflight -= 1
            reserve.release()
            if request_sink is not None:
                request_sink.abandon()
            raise
        if request_sink is not None:
            ex.request_body = request_sink.finish()
        ex.decision = dataclasses.replace(ex.decision, status=response.status)
        if response.status >= 500:
            session.saw_error = True
        sink = BodySink(self.writer.spill_file, reserve)
        if request_sink is not None and request_sink.abandoned:
            sink.abandon()
        return TeeResponse(response, self, session, ex, sink, reserve, started)

    async def _forward_unrecorded(
        self, session: RunSession, request: UpstreamRequest
    ) -> UpstreamResponse:
        try:
            response = await self.live.send(request)
        except GatewayError:
            session.saw_error = True
            raise
        if response.status >= 500:
            session.saw_error = True
        return response

    async def _finish(
        self, session: RunSession, ex: Exchange, reservation: Reservation, abandoned: bool
    ) -> None:
        session.inflight -= 1
        reservation.release()
        if self.sessions.get(session.run) is session:  # idle from the end of its last call
            session.last_active = self.clock()
            self.sessions.move_to_end(session.run)
        if session.discard or abandoned:
            if abandoned and not session.discard:
                self._truncate(session, "max_bytes")
            for body in (ex.request_body, ex.response.body if ex.response else None):
                if isinstance(body, Spilled):
                    with contextlib.suppress(OSError):
                        body.path.unlink()
            return
        try:
            if _large(ex):
                written = await asyncio.to_thread(self.writer.append, ex)
            else:
                written = self.writer.append(ex)
        except (OSError, RecordingError) as exc:
            self._write_failed(ex, exc)
            return
        session.bytes += written.bytes
        session.blobs.extend(written.blobs)

    def _write_failed(self, ex: Exchange, exc: Exception) -> None:
        """A recording that cannot be written never changes the call: log it, go on."""
        log.error(
            "recording of %s %s (run %r, seq %d) failed: %s",
            ex.method,
            ex.target,
            ex.run,
            ex.seq,
            exc,
        )
        for body in (ex.request_body, ex.response.body if ex.response else None):
            if isinstance(body, Spilled):
                with contextlib.suppress(OSError):
                    body.path.unlink()

    def observe_denial(self, denial: Denial) -> None:
        """Record a call the gateway refused (the pipeline calls this for every denial)."""
        if self._closed:
            return
        try:
            self._sweep()
            session = self._session(run_id(denial.run))
        except (OSError, RecordingError) as exc:
            log.error("recording of a denial failed: %s", exc)
            return
        session.saw_denial = True
        if not self._admit(session):
            return
        ex = Exchange(
            kind="denial",
            run=session.run,
            seq=session.take_seq(),
            t=session.offset + (self.clock() - session.mono_start),
            method=denial.method,
            target=denial.target,
            upstream=denial.upstream,
            agent=denial.agent,
            roles=denial.roles,
            caps=tuple(sorted(denial.caps)) if denial.caps is not None else None,
            request_id=denial.request_id,
            request_headers=list(denial.headers),
            request_body=denial.body,
            decision=Decision(False, denial.reason, denial.rule, denial.status),
        )
        try:
            written = self.writer.append(ex)
        except (OSError, RecordingError) as exc:
            self._write_failed(ex, exc)
            return
        session.bytes += written.bytes
        session.blobs.extend(written.blobs)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for run in list(self.sessions):
                self.end_run(run)
            self.writer.write_manifest()
        except (OSError, RecordingError) as exc:
            log.error("the recording in %s could not be finished: %s", self.writer.root, exc)
        finally:
            await self.live.close()


def _large(ex: Exchange) -> bool:
    """Whether writing ``ex`` may take long enough to leave the event loop for a thread: a
    large body, or a coded one (a few KiB of gzip may inflate to ``DECODE_LIMIT``)."""
    bodies = (ex.request_body, ex.response.body if ex.response else None)
    if any(
        isinstance(b, Spilled) or (isinstance(b, bytes) and len(b) > INLINE_LIMIT) for b in bodies
    ):
        return True
    resp = ex.response
    if resp is None or not resp.body:
        return False
    return bool(content_codings(resp.headers)) or (
        isinstance(resp.body, bytes) and bool(sniff(resp.body[:4]))
    )
