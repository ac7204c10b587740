"""respond: the only builder of agent responses, a streamed upstream answer or problem+json.

Upstream bodies are streamed through chunk by chunk, never held whole. The response size
limit is enforced as bytes pass; any exact credential value the gateway injected is masked
if the upstream reflects it (in a header or the body), so the agent never sees it even from
an upstream that echoes its request.

The answer of an untrusted call is read (up to 256 KiB) and recorded for its run before any
of it is passed on, when the policy uses ``taint_arguments`` (``gateway/taint.py``).

A held MCP call kept alive on an event stream (``held_stream.py``) already has its head
sent (200, ``text/event-stream``): its answer is written there as the last events, through
the same limits, filters and masks. A refusal is its protocol's JSON-RPC answer as an event;
the upstream's event stream is relayed event by event, its JSON answer becomes one event;
an upstream answer that cannot be put on the stream (not 2xx, another media type, a content
coding) is refused as ``upstream_unavailable``. The call's status is the stream's, 200.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from aiohttp import web
from multidict import CIMultiDict

from gateway.audit_record import BodyMac
from gateway.call import Call
from gateway.credentials import Reflections, reflections_of
from gateway.errors import (
    PROBLEM_CONTENT_TYPE,
    BodyInvalid,
    ClientClosed,
    GatewayError,
    InternalError,
    PayloadTooLarge,
    TokenError,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.http_headers import HOP_BY_HOP, connection_named
from gateway.taint import Taints, taint_key
from gateway.taint_reads import RESPONSE_CAP

if TYPE_CHECKING:
    from gateway.held_stream import HeldStream
    from gateway.transport import UpstreamResponse

log = logging.getLogger("capgate")

# Never passed back to the agent: hop-by-hop, cookies set for the gateway's own credential,
# and lengths/encodings aiohttp recomputes for the agent's connection.
RESPONSE_DROP = HOP_BY_HOP | {"set-cookie", "set-cookie2", "x-request-id"}


class ResponseTooLarge(PayloadTooLarge):
    """Raised when an upstream's response exceeds the upstream's response size limit."""

    status = 502


class Scrubber:
    """Masks every reflection of one secret in a byte stream, across chunk boundaries."""

    __slots__ = ("seen", "tail")

    def __init__(self, seen: Reflections) -> None:
        self.seen = seen
        self.tail = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self.seen.mask(self.tail + chunk)
        # Hold back the longest suffix that could still begin a reflection: a prefix of an
        # exact form, or, when an escape is near the end, all the bytes an escaped form
        # still being written could span.
        cut = len(data)
        for form in self.seen.forms:
            i = data.find(form[:1], max(len(data) - len(form) + 1, 0))
            while i != -1 and i < cut:
                if form.startswith(data[i:]):
                    cut = i
                    break
                i = data.find(form[:1], i + 1)
        window = max(len(data) - self.seen.longest + 1, 0)
        if data.find(b"\\", window) != -1:
            cut = min(cut, window)
        self.tail = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        tail, self.tail = self.tail, b""
        return tail


# Leading bytes of compressed containers: an upstream holding a credential could hand it
# back inside one without any Content-Encoding, where no mask sees it. Defence in depth (raw
# deflate has no signature): the gateway asks for identity and checks what it can.
COMPRESSED_MAGIC = (
    b"\x1f\x8b",  # gzip
    b"\x78\x01",  # zlib, by level
    b"\x78\x5e",
    b"\x78\x9c",
    b"\x78\xda",
    b"BZh",  # bzip2
    b"\xfd7zXZ\x00",  # xz
    b"\x28\xb5\x2f\xfd",  # zstd
    b"PK\x03\x04",  # zip
    b"7z\xbc\xaf\x27\x1c",  # 7z
)


def _coded(headers: CIMultiDict[str]) -> bool:
    """Whether any Content-Encoding header (there may be several) names a coding."""
    return any(
        coding.strip().lower() not in ("", "identity")
        for value in headers.getall("Content-Encoding", ())
        for coding in value.split(",")
    )


def _compressed() -> UpstreamError:
    return UpstreamError(
        "the upstream holds this agent's credential and answered with compressed bytes the "
        "gateway cannot scrub"
    )


def _bearer_challenge(err: GatewayError) -> str:
    return f'Bearer realm="capgate", error="{err.reason.value}"'


def problem_response(err: GatewayError, request_id: str) -> web.Response:
    headers = {"X-Request-Id": request_id, **err.headers}
    if isinstance(err, TokenError):
        headers["WWW-Authenticate"] = _bearer_challenge(err)
    return web.Response(
        status=err.status,
        body=err.problem_bytes(request_id),
        content_type=PROBLEM_CONTENT_TYPE,
        headers=headers,
    )


def refusal(call: Call, err: GatewayError) -> web.Response:
    """The answer to a refused call: problem+json, or the protocol's own shape of refusal."""
    shaped = call.protocol.refusal(call, err) if call.protocol is not None else None
    if shaped is not None:
        call.status = shaped.status
        headers = {"X-Request-Id": call.request_id, **err.headers, **shaped.headers}
        if isinstance(err, TokenError):
            headers["WWW-Authenticate"] = _bearer_challenge(err)
        response = web.Response(
            status=shaped.status,
            body=shaped.body,
            content_type=shaped.content_type,
            headers=headers,
        )
    else:
        call.status = err.status
        response = problem_response(err, call.request_id)
    if err.close_connection or _body_left_unread(call):
        response.force_close()
    return response


def _body_left_unread(call: Call) -> bool:
    """A refused call whose body was never read: the connection closes after the answer, so
    the server does not read (drain) the rest of a body nobody was allowed to send."""
    request = call.request
    return request is not None and request.body_exists and not request.content.is_eof()


def _past_deadline(call: Call) -> UpstreamTimeout:
    assert call.upstream is not None
    return UpstreamTimeout(
        f"upstream {call.upstream.name!r} did not finish its answer within the call's deadline "
        f"({call.upstream.total_timeout:g} s)"
    )


async def _until_deadline(chunks: AsyncIterator[bytes], call: Call) -> AsyncIterator[bytes]:
    """The chunks, as long as the call's deadline (set by dispatch) has not passed."""
    if call.deadline is None:
        async for chunk in chunks:
            yield chunk
        return
    it = aiter(chunks)
    while True:
        deadline = asyncio.timeout_at(call.deadline)
        try:
            async with deadline:
                chunk = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if deadline.expired():
                raise _past_deadline(call) from None
            raise
        yield chunk


async def _read_all(call: Call, upstream: UpstreamResponse) -> bytes:
    if call.deadline is None or upstream.complete:  # (no wait: no timer)
        return await upstream.read_all()
    deadline = asyncio.timeout_at(call.deadline)
    try:
        async with deadline:
            return await upstream.read_all()
    except TimeoutError:
        if deadline.expired():
            raise _past_deadline(call) from None
        raise


async def _limited(chunks: AsyncIterator[bytes], call: Call, limit: int) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in _until_deadline(chunks, call):
        total += len(chunk)
        if total > limit:
            raise ResponseTooLarge(f"the upstream's response is larger than {limit} bytes")
        call.response_bytes = total
        yield chunk


SMALL_BODY = 64 * 1024  # bodies up to this size, of declared length, are sent in one write
NO_BODY_STATUSES = frozenset({204, 304})


def _masked_text(text: str, seen: Reflections) -> str:
    """``text`` (a header value or the reason) with its reflections masked, as the bytes the
    agent gets (aiohttp writes header text as UTF-8); unchanged when none is there."""
    data = text.encode("utf-8", "surrogateescape")
    masked = seen.mask(data)
    return text if masked == data else masked.decode("utf-8", "surrogateescape")


def _reflected_in_head(seen: Reflections, reason: str | None, headers: CIMultiDict[str]) -> bool:
    """Whether any header name, value or the reason might hold a reflection: the per-header
    checks run on the names, and on the values and reason, joined. Every reflection in one
    of them is in the join (the encoding is per character), so a miss here is a miss for
    each; a hit (perhaps across two) sends the head through the per-header checks."""
    if seen.in_name("\n".join(headers.keys())):
        return True
    texts = "\n".join(headers.values())
    if reason:
        texts += "\n" + reason
    data = texts.encode("utf-8", "surrogateescape")  # (as ``_masked_text`` reads each)
    return seen.mask(data) != data


def _head(
    call: Call, upstream: UpstreamResponse, drop: AbstractSet[str], seen: Reflections | None
) -> tuple[str | None, list[tuple[str, str]]]:
    """The reason phrase and headers passed back, with any reflection of the injected
    credential masked (in a value or the reason) or dropped (a header named after it, in any
    letter case)."""
    reason = upstream.reason or None
    if seen is not None and not _reflected_in_head(seen, reason, upstream.headers):
        seen = None  # (the common case: one look at the whole head, not one per header)
    if seen is not None and reason:
        reason = _masked_text(reason, seen)
    headers: list[tuple[str, str]] = []
    for name, value in upstream.headers.items():
        if name.lower() in drop:
            continue
        if seen is not None:
            if seen.in_name(name):
                continue
            if len(value.encode("utf-8", "surrogateescape")) >= seen.shortest:
                value = _masked_text(value, seen)
        headers.append((name, value))
    headers.append(("X-Request-Id", call.request_id))
    return reason, headers


async def _respond_small(
    call: Call,
    upstream: UpstreamResponse,
    drop: AbstractSet[str],
    seen: Reflections | None,
    mac: BodyMac,
) -> web.StreamResponse:
    """A small body of declared length: read whole, masked, sent in one write."""
    try:
        body = await _read_all(call, upstream)
    except GatewayError as err:
        call.error = err
        return refusal(call, err)
    finally:
        await upstream.close()  # also when a revocation cancels the call here
    if seen is not None:
        if body.startswith(COMPRESSED_MAGIC):
            call.error = _compressed()
            return refusal(call, call.error)
        body = seen.mask(body)
    reason, headers = _head(call, upstream, drop, seen)
    out = web.Response(status=upstream.status, reason=reason, body=body, headers=headers)
    call.status = upstream.status
    call.response_bytes = len(body)
    call.response_digest = mac.of(body)
    return out


class Respond:
    """Builds the agent's answer: the upstream's, streamed and masked, or a refusal."""

    def __init__(self, mac: BodyMac, taints: Taints | None = None) -> None:
        self.mac = mac
        self.taints = taints

    async def __call__(self, call: Call) -> web.StreamResponse:
        stream = call.held_stream
        if stream is not None and stream.response is not None:
            return await self._onto_stream(call, stream, stream.response)
        if call.error is not None or call.response is None:
            if call.response is not None:  # (an answer refused after it came: a revocation)
                await call.response.close()
            return refusal(call, call.error or InternalError("no response"))
        assert call.upstream is not None and call.protocol is not None
        assert call.request is not None
        upstream = call.response
        limit = call.upstream.max_response_body
        seen = reflections_of(call.injection.secret.reveal()) if call.injection else None
        headers = upstream.headers
        drop = (
            RESPONSE_DROP | connection_named(headers) if "Connection" in headers else RESPONSE_DROP
        )
        declared = headers.get("Content-Length")
        size = int(declared) if declared is not None and declared.isdigit() else None
        try:
            if size is not None and size > limit:
                raise ResponseTooLarge(f"the upstream's response is larger than {limit} bytes")
            if seen is not None and "Content-Encoding" in headers and _coded(headers):
                # SECURITY: masking reads bytes as sent; a compressed answer could carry the
                # credential where no mask sees it (the gateway asked for identity).
                raise UpstreamError(
                    "the upstream holds this agent's credential and answered with a content "
                    "coding the gateway cannot scrub"
                )
            rewriter = call.protocol.rewrite_response(call, upstream)
        except GatewayError as err:
            await upstream.close()
            call.error = err
            return refusal(call, err)
        if rewriter is not None:
            chunks = rewriter(_limited(upstream.iter_chunks(), call, limit), limit)
            drop = drop | {"content-length"}
        elif call.taint_read is None and (
            size is not None
            and size <= SMALL_BODY
            and call.method != "HEAD"
            and upstream.status not in NO_BODY_STATUSES
        ):
            return await _respond_small(
                call, upstream, drop | {"content-length"}, seen, self.mac.under(call.audit_key)
            )
        else:
            chunks = _limited(upstream.iter_chunks(), call, limit)
        if call.taint_read is not None:
            try:
                chunks = await self._recorded(call, upstream.headers, chunks)
            except GatewayError as err:
                await upstream.close()
                call.error = err
                return refusal(call, err)
            except BaseException:
                await upstream.close()
                raise
        return await self._stream(call, upstream, chunks, drop, seen)

    async def _recorded(
        self, call: Call, headers: CIMultiDict[str], chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """Taint: the answer of an untrusted call is read (up to ``RESPONSE_CAP``) and
        recorded for its run before any of it is passed on (``gateway/taint.py``); then the
        whole answer again. A record that cannot be written refuses the answer."""
        assert call.taint_read is not None and self.taints is not None
        key = taint_key(call)
        assert key is not None
        media = headers.get("Content-Type", "").split(";")[0].strip().lower()
        if media == "text/event-stream":
            return self._recorded_events(key, call.taint_read, headers, chunks)
        it = aiter(chunks)
        held: list[bytes] = []
        size = 0
        whole = True
        while size <= RESPONSE_CAP:
            try:
                chunk = await anext(it)
            except StopAsyncIteration:
                break
            held.append(chunk)
            size += len(chunk)
        else:
            whole = False
        await self.taints.record(key, call.taint_read, b"".join(held) if whole else None, headers)

        async def again() -> AsyncIterator[bytes]:
            for chunk in held:
                yield chunk
            async for chunk in it:
                yield chunk

        return again()

    async def _recorded_events(
        self, key: str, source: str, headers: CIMultiDict[str], chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """An event stream (an answer, or a stream the server keeps open) is recorded event
        by event, each before it is passed on; an event larger than ``RESPONSE_CAP`` ends
        the run's record, and the rest of the stream passes unrecorded."""
        assert self.taints is not None
        pending = b""
        recording = True
        async for chunk in chunks:
            if not recording:
                yield chunk
                continue
            pending += chunk
            cut = max(pending.rfind(b"\n\n"), pending.rfind(b"\r\n\r\n"))
            if cut < 0:
                if len(pending) > RESPONSE_CAP:
                    await self.taints.record(key, source, None, headers)
                    recording = False
                    yield pending
                    pending = b""
                continue
            end = cut + (4 if pending[cut : cut + 4] == b"\r\n\r\n" else 2)
            events, pending = pending[:end], pending[end:]
            if len(events) > RESPONSE_CAP:  # (events read in one go past the cap: the same)
                await self.taints.record(key, source, None, headers)
                recording = False
            else:
                await self.taints.record(key, source, events, headers)
            yield events
        if pending:
            if recording:
                await self.taints.record(key, source, pending, headers)
            yield pending

    async def _stream(
        self,
        call: Call,
        upstream: UpstreamResponse,
        chunks: AsyncIterator[bytes],
        drop: AbstractSet[str],
        seen: Reflections | None,
    ) -> web.StreamResponse:
        request = call.request
        assert request is not None
        if seen is not None:
            try:
                head, chunks = await _head_bytes(chunks)
                if head.startswith(COMPRESSED_MAGIC):
                    raise _compressed()
            except GatewayError as err:
                await upstream.close()
                call.error = err
                return refusal(call, err)
        reason, headers = _head(call, upstream, drop, seen)
        out = web.StreamResponse(status=upstream.status, reason=reason, headers=headers)
        call.status = upstream.status
        scrub = Scrubber(seen) if seen is not None else None
        hasher = self.mac.under(call.audit_key).stream()
        try:
            await out.prepare(request)
            call.streaming = True
            async for chunk in chunks:
                if scrub is not None:
                    chunk = scrub.feed(chunk)
                if chunk:
                    hasher.update(chunk)
                    await out.write(chunk)
            if scrub is not None and scrub.tail:
                tail = scrub.flush()
                hasher.update(tail)
                await out.write(tail)
            await out.write_eof()
        except (GatewayError, ConnectionResetError) as exc:
            # Headers are already sent: cutting the connection is the only honest signal left.
            call.error = (
                exc
                if isinstance(exc, GatewayError)
                else ClientClosed("the agent's connection closed during the response")
            )
            if request.transport is not None:
                request.transport.close()
        finally:
            call.response_digest = hasher.result()
            await upstream.close()
        return out

    async def _onto_stream(
        self, call: Call, stream: HeldStream, out: web.StreamResponse
    ) -> web.StreamResponse:
        """The answer of a call whose event stream was opened while it was held."""
        call.status = out.status
        call.streaming = True  # a revocation from now on cuts the connection
        try:
            if call.error is None and call.response is not None:
                try:
                    await self._relay(call, stream, call.response)
                except GatewayError as err:  # refused before any of the answer was written
                    call.error = err
            if call.error is not None or call.response is None:
                body = stream.refusal(call.error or InternalError("no response"))
                if body is not None:
                    await stream.send(body)
            await stream.end()
        except (_Cut, OSError) as exc:
            # Part of the answer was written, or the agent is gone: cutting the connection is
            # the only honest signal left. A refusal the agent did not get stays the reason.
            if isinstance(exc, _Cut):
                call.error = exc.error
            elif call.error is None:
                call.error = ClientClosed("the agent's connection closed during the response")
            if call.request is not None and call.request.transport is not None:
                call.request.transport.close()
        return out

    async def _relay(self, call: Call, stream: HeldStream, upstream: UpstreamResponse) -> None:
        """The upstream's answer as the stream's last events; a ``GatewayError`` raised
        before any of it is written is answered as a refusal."""
        assert call.upstream is not None and call.protocol is not None
        limit = call.upstream.max_response_body
        seen = reflections_of(call.injection.secret.reveal()) if call.injection else None
        headers = upstream.headers
        media = headers.get("Content-Type", "").split(";")[0].strip().lower()
        declared = headers.get("Content-Length")
        try:
            if not 200 <= upstream.status < 300 or media not in _ON_STREAM:
                raise UpstreamError(
                    f"the MCP server answered HTTP {upstream.status} ({media or 'no media type'})"
                    ", which cannot be passed on the event stream this held call is answered on"
                )
            if "Content-Encoding" in headers and _coded(headers):
                raise UpstreamError(
                    "the MCP server answered with a content coding, which cannot be passed on "
                    "the event stream this held call is answered on"
                )
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise ResponseTooLarge(f"the upstream's response is larger than {limit} bytes")
            rewriter = call.protocol.rewrite_response(call, upstream)
            chunks = _limited(upstream.iter_chunks(), call, limit)
            if rewriter is not None:
                chunks = rewriter(chunks, limit)
            if call.taint_read is not None:
                chunks = await self._recorded(call, headers, chunks)
            head, chunks = await _head_bytes(chunks)
            if seen is not None and head.startswith(COMPRESSED_MAGIC):
                raise _compressed()
            if media == "application/json":
                body = b"".join([chunk async for chunk in chunks])
                if seen is not None:
                    body = seen.mask(body)
                if not body.strip():
                    raise BodyInvalid("the MCP server's answer is empty")
                call.response_digest = self.mac.under(call.audit_key).of(body)
                await stream.send(body)
                return
            await self._relay_events(call, stream, chunks, seen)
        finally:
            await upstream.close()

    async def _relay_events(
        self,
        call: Call,
        stream: HeldStream,
        chunks: AsyncIterator[bytes],
        seen: Reflections | None,
    ) -> None:
        scrub = Scrubber(seen) if seen is not None else None
        hasher = self.mac.under(call.audit_key).stream()
        written = False
        try:
            async for chunk in chunks:
                if scrub is not None:
                    chunk = scrub.feed(chunk)
                if chunk:
                    hasher.update(chunk)
                    written = True
                    await stream.write(chunk)
            if scrub is not None and scrub.tail:
                tail = scrub.flush()
                hasher.update(tail)
                await stream.write(tail)
        except GatewayError as err:
            if not written:
                raise  # nothing of the answer was written: it is refused on the stream
            raise _Cut(err) from None
        finally:
            call.response_digest = hasher.result()


_ON_STREAM = frozenset({"application/json", "text/event-stream"})


class _Cut(Exception):
    """An answer on a held call's event stream broke off after part of it was written."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.detail)
        self.error = error


async def _head_bytes(chunks: AsyncIterator[bytes]) -> tuple[bytes, AsyncIterator[bytes]]:
    """The first bytes of a stream (read only while they could still begin a compressed
    container, so a stream that opens with a short event is not held up), and the whole
    stream again."""
    it = aiter(chunks)
    head = b""
    while not head or any(m.startswith(head) and m != head for m in COMPRESSED_MAGIC):
        try:
            head += await anext(it)
        except StopAsyncIteration:
            break

    async def again() -> AsyncIterator[bytes]:
        if head:
            yield head
        async for chunk in it:
            yield chunk

    return head, again()
