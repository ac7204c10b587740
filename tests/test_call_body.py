"""``Call.read_body``: a body that is all here already (it came with the head) is read
without waiting, and held to the same limit as one that trickles in. Request ids: drawn from
a buffer of the CSPRNG's bytes, never repeated, and not shared with a forked child."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from aiohttp import StreamReader
from aiohttp.test_utils import make_mocked_request

from gateway.call import Call
from gateway.errors import PayloadTooLarge


def _call(chunks: list[bytes], *, eof: bool) -> tuple[Call, StreamReader]:
    protocol = mock.Mock(_reading_paused=False)
    stream = StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())
    for chunk in chunks:
        stream.feed_data(chunk)
    if eof:
        stream.feed_eof()
    request = make_mocked_request(
        "POST", "/up/x", headers={"Transfer-Encoding": "chunked"}, payload=stream
    )
    call = Call(
        method="POST", raw_target="/up/x", headers=request.headers, request_id="r", request=request
    )
    return call, stream


async def test_a_body_already_here_is_read_whole() -> None:
    call, _ = _call([b"ab", b"cd", b"ef"], eof=True)
    assert await call.read_body(6) == b"abcdef"
    assert await call.read_body(6) == b"abcdef"  # read once, kept


async def test_a_body_already_here_over_the_limit_is_refused() -> None:
    call, _ = _call([b"x" * 4, b"y" * 4], eof=True)
    with pytest.raises(PayloadTooLarge):
        await call.read_body(7)


async def test_a_body_still_arriving_is_read_to_its_end() -> None:
    call, stream = _call([b"ab"], eof=False)
    reading = asyncio.ensure_future(call.read_body(10))
    await asyncio.sleep(0)
    stream.feed_data(b"cd")
    stream.feed_eof()
    assert await reading == b"abcd"


async def test_a_failed_stream_raises_its_error() -> None:
    call, stream = _call([b"ab"], eof=True)
    stream.set_exception(ConnectionResetError("gone"))
    with pytest.raises(ConnectionResetError):
        await call.read_body(10)


def test_request_ids_are_distinct_and_fresh_after_a_fork() -> None:
    import os

    from gateway.pipeline import new_request_id

    ids = [new_request_id() for _ in range(2000)]  # several refills of the buffer
    assert len(set(ids)) == len(ids) and all(len(i) == 16 for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id must not be the parent's next one
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert child != new_request_id()
