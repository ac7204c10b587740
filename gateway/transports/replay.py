"""Modes ``replay``, ``replay-or-record`` and ``shadow``: answers from a recording.

``ReplayTransport`` (mode ``replay``) is strict and has no way to reach an upstream: it holds
a loaded ``Recording`` and a ``Matcher``, no client session, no connector and no reference to
the live transport. Each call is redacted and canonicalised as the recorder did
(``matching.make_probe``) and answered with the recorded status, reason, headers and body,
byte for byte, cut at the recorded chunk boundaries (so SSE events arrive as they did); a
recorded upstream failure is raised again as the same ``UpstreamError``. A call with no
recording raises ``ReplayMiss`` (421) whose ``detail`` names the nearest recordings and the
fields that differ, and whose ``errors`` carry the same as data. ``close()`` writes the
end-of-run report to ``report_path`` (JSON) when one was given.

``ReplayOrRecordTransport`` answers from the recording and forwards (and records) the calls it
has no answer for. It is refused in CI (``ci=True``): a CI run must never reach a live API.

``ShadowTransport`` (mode ``shadow``) forwards every call live and compares each response with
its recording (status, ``Content-Type``, body after redaction); differences are logged and
listed in the report, and never change or fail the call.

Recorded markers come back as text: ``{"redacted": kind}`` as ``[redacted:<kind>]``, and a
reference to a credential (``{"secret": name}``, ``[secret:<name>]``) as that credential when
it is the one injected into this call (``Unmarker``: the ``respond`` stage then masks it as it
masked the original), else as ``[secret:<name>]``. ``Content-Length`` is set to the length of
the body played back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multidict import CIMultiDict

from gateway.credentials import labelled_forms
from gateway.errors import (
    ERROR_CLASSES,
    ConfigError,
    GatewayError,
    Reason,
    ReplayMiss,
    UpstreamError,
)
from gateway.recording.format import RecordingError
from gateway.recording.matching import Matcher, Probe, ReplayMissed, ReplayReport, make_probe
from gateway.recording.model import Entry, ErrorInfo, Recording
from gateway.recording.reader import load_recording
from gateway.recording.redact import DEFAULT_REDACTOR, HeaderValue, Redactor, marker_name
from gateway.transport import Body, Transport, UpstreamRequest, UpstreamResponse
from gateway.transports.record import RecordTransport, secrets_of

if TYPE_CHECKING:
    from gateway.recording.denial import Denial

log = logging.getLogger("capgate.recording")

COMPARE_LIMIT = 1024 * 1024
"""Shadow mode compares bodies up to this size; larger ones are compared by size only."""


def header_text(value: HeaderValue) -> str:
    if isinstance(value, dict):
        if "secret" in value:
            return f"[secret:{value['secret']}]"
        return f"[redacted:{value.get('redacted', 'value')}]"
    return value


def error_from(info: ErrorInfo) -> GatewayError:
    """The recorded upstream failure as the gateway error it was."""
    try:
        cls = ERROR_CLASSES[Reason(info.reason)]
    except (ValueError, KeyError):
        cls = UpstreamError
    return cls(info.detail or f"recorded upstream failure ({info.reason})")


async def read_body(body: Body) -> bytes | None:
    if body is None or isinstance(body, bytes):
        return body
    parts = [chunk async for chunk in body]
    return b"".join(parts)


class Unmarker:
    """Puts the credential this gateway holds back where the recording says it was.

    An upstream that echoes its request (a debugging endpoint, an error page) sent the
    credential back; the recording holds ``[secret:<name>]`` there. On replay the marker of the
    credential injected into *this* call becomes that credential again, so the ``respond``
    stage masks it exactly as it masked the original: the agent sees the same bytes, and never
    the value. Markers of other credentials stay as they are.
    """

    def __init__(self, mapping: Mapping[bytes, bytes]) -> None:
        self.mapping = dict(mapping)
        self.longest = max((len(k) for k in self.mapping), default=0)
        self.tail = b""

    def feed(self, data: bytes) -> bytes:
        if not self.mapping:
            return data
        data = self.tail + data
        for marker, value in self.mapping.items():
            data = data.replace(marker, value)
        cut = len(data)
        i = data.rfind(b"[", max(len(data) - self.longest + 1, 0))
        if i != -1 and any(k.startswith(data[i:]) for k in self.mapping):
            cut = i  # may be the start of a marker split across pieces: hold it back
        self.tail = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        tail, self.tail = self.tail, b""
        return tail

    @classmethod
    def whole(cls, mapping: Mapping[bytes, bytes], text: str) -> str:
        """One complete text (a header value, a reason phrase) with its markers put back."""
        if not mapping:
            return text
        unmarker = cls(mapping)
        return (unmarker.feed(text.encode()) + unmarker.flush()).decode()


def _markers(request: UpstreamRequest | None) -> dict[bytes, bytes]:
    """Each marker of the injected credential's forms -> that form of this gateway's value."""
    injection = request.injection if request is not None else None
    if injection is None:
        return {}
    markers = {
        f"[secret:{marker_name(injection.name, label)}]".encode(): form
        for label, form in labelled_forms(injection.secret.reveal())
    }
    markers[f"[secret:{marker_name(injection.name, 'header')}]".encode()] = (
        injection.value.reveal().encode()
    )
    return markers


class ReplayResponse:
    """A recorded response, played back."""

    def __init__(
        self, entry: Entry, pace: bool = False, request: UpstreamRequest | None = None
    ) -> None:
        resp = entry.response
        assert resp is not None
        self._entry = entry
        self._pace = pace
        self._markers = _markers(request)
        self.status = resp.status
        self.reason = Unmarker.whole(self._markers, resp.reason) if resp.reason else resp.reason
        self.headers: CIMultiDict[str] = CIMultiDict(
            (name, self._header(value)) for name, value in resp.headers
        )
        if "Content-Length" in self.headers and resp.complete:
            # A body cut short keeps its declared length: the gateway refused or lost it for
            # that reason, and replay must meet the same condition.
            self.headers["Content-Length"] = str(self._length())

    def _header(self, value: HeaderValue) -> str:
        if isinstance(value, dict) and "secret" in value:
            marker = f"[secret:{value['secret']}]".encode()
            if marker in self._markers:
                return self._markers[marker].decode()
        return Unmarker.whole(self._markers, header_text(value))

    def _length(self) -> int:
        body = self._entry.response.body if self._entry.response else None
        if body is None:
            return 0
        if not self._markers:
            return body.size
        unmark = Unmarker(self._markers)
        size = sum(len(unmark.feed(piece)) for piece in body.iter_sizes(()))
        return size + len(unmark.flush())

    @property
    def complete(self) -> bool:
        return not self._pace  # (a paced answer waits between its chunks)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        resp = self._entry.response
        assert resp is not None
        if resp.body is not None:
            unmark = Unmarker(self._markers)
            elapsed = 0.0
            sizes = [n for _, n in resp.chunks]
            times = [t for t, _ in resp.chunks]
            for i, piece in enumerate(resp.body.iter_sizes(sizes)):
                if self._pace and i < len(times) and times[i] > elapsed:
                    await asyncio.sleep(times[i] - elapsed)
                    elapsed = times[i]
                piece = unmark.feed(piece)
                if piece:
                    yield piece
            tail = unmark.flush()
            if tail:
                yield tail
        if self._entry.error is not None:
            raise error_from(self._entry.error)

    async def read_all(self) -> bytes:
        return b"".join([piece async for piece in self.iter_chunks()])

    async def close(self) -> None:
        return None


def _write_report(path: Path, report: ReplayReport) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".replay-report-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(report.as_dict(), fh, indent=2, ensure_ascii=False)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class ReplayTransport:
    """Answers every call from a recording; never opens a connection (mode ``replay``)."""

    mode = "replay"

    def __init__(
        self,
        directory: Path,
        *,
        repeat_last: bool | Collection[str] = False,
        run_map: Mapping[str, str] | None = None,
        report_path: Path | None = None,
        redactor: Redactor = DEFAULT_REDACTOR,
        pace: bool = False,
        recording: Recording | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.recording = recording if recording is not None else load_recording(self.directory)
        self.matcher = Matcher(self.recording, repeat_last=repeat_last, run_map=run_map)
        self.report_path = report_path
        self.redactor = redactor
        self.pace = pace
        for warning in self.recording.warnings:
            log.warning("recording: %s", warning)

    def probe(self, request: UpstreamRequest, body: bytes | None) -> Probe:
        return make_probe(
            request.upstream.name,
            request.method,
            request.target,
            body,
            request.rule,
            secrets_of(request),
            self.redactor,
        )

    def lookup(self, request: UpstreamRequest, body: bytes | None) -> Entry:
        """The recorded exchange for this call, or ``ReplayMiss`` explaining why not."""
        probe = self.probe(request, body)
        state = self.matcher.state(request.run)
        try:
            return state.answer(probe)
        except ReplayMissed as missed:
            log.warning("replay miss: %s", missed.miss.detail())
            raise ReplayMiss(
                missed.miss.detail(), rule=probe.rule_id, errors=missed.miss.errors()
            ) from None

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        body = await read_body(request.body)
        entry = self.lookup(request, body)
        return self.respond(entry, request)

    def respond(self, entry: Entry, request: UpstreamRequest | None = None) -> UpstreamResponse:
        if entry.response is None:
            assert entry.error is not None, f"{entry.ref} has neither a response nor an error"
            raise error_from(entry.error)
        return ReplayResponse(entry, self.pace, request)

    def observe_denial(self, denial: Denial) -> None:
        probe = make_probe(
            denial.upstream or "",
            denial.method,
            denial.target,
            denial.body,
            None,
            (),
            self.redactor,
        )
        self.matcher.state(denial.run).denial(probe, denial.reason)

    def report(self) -> ReplayReport:
        return self.matcher.report(self.mode)

    async def close(self) -> None:
        report = self.report()
        log.info("%s", report.text())
        if self.report_path is not None:
            _write_report(self.report_path, report)


class ReplayOrRecordTransport:
    """Replay what was recorded; forward and record the rest. Refused in CI."""

    mode = "replay-or-record"

    def __init__(
        self,
        directory: Path,
        live: Transport,
        *,
        ci: bool,
        sample: float | None = None,
        repeat_last: bool | Collection[str] = False,
        run_map: Mapping[str, str] | None = None,
        report_path: Path | None = None,
        redactor: Redactor = DEFAULT_REDACTOR,
    ) -> None:
        if ci:
            raise ConfigError(
                "mode replay-or-record is refused when CI=true: a CI run must not reach live "
                "upstreams; use mode replay (and record the missing calls outside CI)"
            )
        # The recorder first: it creates the directory and manifest when they do not exist.
        self.recorder = RecordTransport(live, Path(directory), sample=sample, redactor=redactor)
        self.replay = ReplayTransport(
            Path(directory),
            repeat_last=repeat_last,
            run_map=run_map,
            report_path=report_path,
            redactor=redactor,
        )
        self.replay.mode = self.mode

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        body = await read_body(request.body)
        request = dataclasses.replace(request, body=body)
        try:
            entry = self.replay.lookup(request, body)
        except ReplayMiss:
            state = self.replay.matcher.state(request.run)
            if state.misses:
                state.misses.pop()  # not a miss in this mode: it is recorded now
            state.recorded.append(f"{request.method} {request.upstream.name} {request.target}")
            return await self.recorder.send(request)
        return self.replay.respond(entry, request)

    def observe_denial(self, denial: Denial) -> None:
        self.replay.observe_denial(denial)
        self.recorder.observe_denial(denial)

    async def close(self) -> None:
        try:
            await self.recorder.close()
        finally:
            await self.replay.close()


class ShadowResponse:
    """The live response, passed through unchanged, compared with its recording at the end."""

    def __init__(
        self,
        inner: UpstreamResponse,
        shadow: ShadowTransport,
        request: UpstreamRequest,
        probe: Probe,
        entry: Entry | None,
    ) -> None:
        self._inner = inner
        self._shadow = shadow
        self._request = request
        self._probe = probe
        self._entry = entry
        self._body = bytearray()
        self._size = 0
        self._complete = False
        self._compared = False
        self.status = inner.status
        self.reason = inner.reason
        self.headers: CIMultiDict[str] = inner.headers

    @property
    def complete(self) -> bool:
        return self._inner.complete

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner.iter_chunks():
            self._size += len(chunk)
            if len(self._body) + len(chunk) <= COMPARE_LIMIT:
                self._body += chunk
            yield chunk
        self._complete = True

    async def read_all(self) -> bytes:
        body = await self._inner.read_all()
        self._size = len(body)
        self._body = bytearray(body[:COMPARE_LIMIT])
        self._complete = True
        return body

    async def close(self) -> None:
        try:
            await self._inner.close()
        finally:
            if not self._compared:
                self._compared = True
                try:
                    self._shadow.compare(
                        self._request,
                        self._probe,
                        self._entry,
                        self.status,
                        self.headers,
                        bytes(self._body),
                        self._size,
                        self._complete,
                    )
                except (OSError, RecordingError) as exc:  # a comparison never fails a call
                    log.error("shadow: comparing %s failed: %s", self._probe.describe(), exc)


class ShadowTransport:
    """Forwards live and reports how each answer differs from its recording (mode ``shadow``)."""

    mode = "shadow"

    def __init__(
        self,
        directory: Path,
        live: Transport,
        *,
        run_map: Mapping[str, str] | None = None,
        report_path: Path | None = None,
        redactor: Redactor = DEFAULT_REDACTOR,
    ) -> None:
        self.live = live
        self.replay = ReplayTransport(
            Path(directory), run_map=run_map, report_path=report_path, redactor=redactor
        )
        self.replay.mode = self.mode
        self.redactor = redactor

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        body = await read_body(request.body)
        request = dataclasses.replace(request, body=body)
        probe = self.replay.probe(request, body)
        state = self.replay.matcher.state(request.run)
        entry: Entry | None
        try:
            entry = state.answer(probe)
        except ReplayMissed as missed:
            entry = None
            self._differ(request, probe, [f"no recording: {missed.miss.detail()}"])
        try:
            response = await self.live.send(request)
        except GatewayError as exc:
            if entry is not None and (
                entry.error is None or entry.error.reason != exc.reason.value
            ):
                recorded = (
                    entry.error.reason
                    if entry.error
                    else str(entry.response and entry.response.status)
                )
                self._differ(
                    request, probe, [f"live failed ({exc.reason.value}), recorded {recorded}"]
                )
            raise
        return ShadowResponse(response, self, request, probe, entry)

    def _differ(self, request: UpstreamRequest, probe: Probe, differences: list[str]) -> None:
        state = self.replay.matcher.state(request.run)
        item: dict[str, Any] = {
            "run": state.run,
            "call": probe.describe(),
            "request_id": request.request_id,
            "differences": differences,
        }
        state.differences.append(item)
        log.warning(
            "shadow: %s differs from its recording: %s", probe.describe(), "; ".join(differences)
        )

    def compare(
        self,
        request: UpstreamRequest,
        probe: Probe,
        entry: Entry | None,
        status: int,
        headers: CIMultiDict[str],
        body: bytes,
        size: int,
        complete: bool,
    ) -> None:
        if entry is None:
            return
        diffs: list[str] = []
        rec = entry.response
        if rec is None:
            diffs.append(
                f"status: {status} != recorded failure "
                f"({entry.error.reason if entry.error else 'unknown'})"
            )
            self._differ(request, probe, diffs)
            return
        if status != rec.status:
            diffs.append(f"status: {status} != {rec.status}")
        live_type = headers.get("Content-Type")
        rec_type = next(
            (header_text(v) for k, v in rec.headers if k.lower() == "content-type"), None
        )
        if live_type != rec_type:
            diffs.append(f"header Content-Type: {live_type!r} != {rec_type!r}")
        recorded = (
            rec.body.read() if rec.body is not None and rec.body.size <= COMPARE_LIMIT else None
        )
        if not complete:
            diffs.append("the live body was not read to its end")
        elif size > COMPARE_LIMIT or recorded is None:
            rec_size = rec.body.size if rec.body is not None else 0
            if size != rec_size:
                diffs.append(f"body size: {size} != {rec_size}")
        else:
            live = self.redactor.body(body, secrets_of(request)).data
            if live != recorded:
                diffs.append(_body_difference(live, recorded))
        if diffs:
            self._differ(request, probe, diffs)

    def observe_denial(self, denial: Denial) -> None:
        self.replay.observe_denial(denial)

    async def close(self) -> None:
        try:
            await self.live.close()
        finally:
            await self.replay.close()


def _body_difference(live: bytes, recorded: bytes) -> str:
    try:
        a, b = json.loads(live), json.loads(recorded)
    except ValueError:
        a = b = None
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        shown = ", ".join(f"/{k}" for k in keys[:6])
        return f"body: JSON fields differ: {shown}" + (" ..." if len(keys) > 6 else "")
    at = next(
        (i for i, (x, y) in enumerate(zip(live, recorded, strict=False)) if x != y),
        min(len(live), len(recorded)),
    )
    return (
        f"body: {len(live)} bytes != {len(recorded)} bytes recorded (first difference at byte {at})"
    )
