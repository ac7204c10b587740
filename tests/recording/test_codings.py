"""Content codings: decoded for redaction, encoded again deterministically, withheld when a
body cannot be read; and what replay sends back."""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict

from gateway.credentials import Injection, Secret
from gateway.recording.codings import (
    CodingError,
    content_codings,
    decode,
    encode,
    sniff,
)
from gateway.recording.model import Spilled
from gateway.recording.reader import load_recording
from gateway.recording.redact import STRUCTURED_LIMIT, KnownSecret
from gateway.transports.record import RecordTransport
from gateway.transports.replay import ReplayTransport
from tests.recording.helpers import (
    FakeLive,
    FakeResponse,
    drain,
    exchange,
    mini_policy,
    request,
    write,
)

SECRET = "up-7Hq2Lm9Xc4Vb8Nz1Kd5Rt"
KEY = KnownSecret.from_injection(
    Injection("X-Api-Key", Secret(SECRET), Secret(SECRET), "api:header")
)
DATA = b"".join(b"line %d of a body that compresses well\n" % i for i in range(3000))


def _decoded(data: bytes, codings: tuple[str, ...]) -> bytes:
    return b"".join(decode([data[i : i + 1000] for i in range(0, len(data), 1000)], codings))


@pytest.mark.parametrize(
    ("codings", "encoded"),
    [
        (("gzip",), gzip.compress(DATA)),
        (("x-gzip",), gzip.compress(DATA, mtime=12345)),
        (("deflate",), zlib.compress(DATA)),
        (("deflate",), zlib.compress(DATA)[2:-4]),  # raw deflate, as some servers send it
        (("gzip", "gzip"), gzip.compress(gzip.compress(DATA))),
        (("deflate", "gzip"), gzip.compress(zlib.compress(DATA))),
        (("gzip",), gzip.compress(DATA[:100]) + gzip.compress(DATA[100:])),  # two members
        (("gzip",), gzip.compress(DATA) + b"\0\0\0"),  # zero padding after the stream
    ],
)
def test_decode_in_pieces(codings: tuple[str, ...], encoded: bytes) -> None:
    assert _decoded(encoded, codings) == DATA


def test_encode_is_deterministic_and_decodes_back() -> None:
    for codings in (("gzip",), ("deflate",), ("deflate", "gzip")):
        once = b"".join(encode([DATA], codings))
        assert once == b"".join(encode([DATA[:7], DATA[7:5000], DATA[5000:]], codings))
        assert _decoded(once, codings) == DATA
    assert b"".join(encode([DATA], ("gzip",)))[4:8] == b"\0\0\0\0"  # no time stamp


@pytest.mark.parametrize(
    ("codings", "data", "message"),
    [
        (("zstd",), b"x", "content coding 'zstd' is not supported"),
        (("br",), b"x", "content coding 'br' is not supported here (install"),
        (("gzip",), b"not gzip at all", "not a valid gzip stream"),
        (("gzip",), gzip.compress(b"x") + b"hidden: " + SECRET.encode(), "data after the end"),
        (("gzip",), gzip.compress(b"\0" * 5_000_000), "more than 1000000 bytes once decoded"),
    ],
)
def test_what_cannot_be_decoded(codings: tuple[str, ...], data: bytes, message: str) -> None:
    with pytest.raises(CodingError, match=message.replace("(", r"\(")):
        b"".join(decode([data], codings, limit=1_000_000))


def test_which_codings_a_body_has() -> None:
    headers = [
        ("Content-Type", "application/json"),
        ("Content-Encoding", "identity"),
        ("content-encoding", "Deflate, GZIP"),
    ]
    assert content_codings(headers) == ("deflate", "gzip")
    assert content_codings([("Content-Encoding", {"redacted": "header"})]) == ("?",)
    assert content_codings([]) == ()
    assert sniff(gzip.compress(b"x")) == ("gzip",) and sniff(b"{}") == ()


# --- the writer -------------------------------------------------------------------------------


def _response(rec: Path) -> dict[str, Any]:
    response: dict[str, Any] = json.loads((rec / "runs" / "r1.jsonl").read_text())["response"]
    return response


def _stored(rec: Path) -> bytes:
    body = load_recording(rec).runs["r1"].entries[0].response.body  # type: ignore[union-attr]
    assert body is not None
    return body.read()


def _record(tmp_path: Path, body: bytes, headers: list[tuple[str, str]], chunks: int = 1) -> Path:
    ex = exchange(1, "/x", body, headers=headers)
    ex.secrets = (KEY,)
    assert ex.response is not None
    step = -(-len(body) // chunks)
    ex.response.chunks = [(0.01 * i, len(body[i * step : (i + 1) * step])) for i in range(chunks)]
    return write(tmp_path / "rec", ex)


@pytest.mark.parametrize(
    ("headers", "codings"),
    [
        ([("Content-Encoding", "gzip")], ("gzip",)),
        ([("Content-Encoding", "identity"), ("Content-Encoding", "gzip")], ("gzip",)),
        ([("Content-Encoding", "deflate")], ("deflate",)),
        ([], ("gzip",)),  # no header, but gzip bytes: a .gz download, a header dropped
    ],
)
def test_a_secret_inside_a_coded_body_is_redacted_and_the_body_encoded_again(
    tmp_path: Path, headers: list[tuple[str, str]], codings: tuple[str, ...]
) -> None:
    plain = json.dumps({"echo": f"key={SECRET}", "b64": base64.b64encode(SECRET.encode()).decode()})
    sent = b"".join(encode([plain.encode()], codings)) if headers else gzip.compress(plain.encode())
    rec = _record(tmp_path, sent, headers, chunks=3)
    stored = _stored(rec)
    inside = _decoded(stored, codings)
    assert SECRET.encode() not in inside and b"[secret:api:header]" in inside
    assert b"[secret:api:header#b64.0]" in inside
    response = _response(rec)
    assert [tuple(h) for h in response["headers"][1:]] == headers  # said as it was
    assert "chunks" not in response  # boundaries of other bytes mean nothing now
    assert stored == b"".join(encode([inside], codings))  # what replay sends: deterministic


def test_a_coded_body_with_nothing_to_redact_is_kept_byte_for_byte(tmp_path: Path) -> None:
    sent = gzip.compress(DATA, mtime=1700000000)
    rec = _record(tmp_path, sent, [("Content-Encoding", "gzip")], chunks=3)
    assert _stored(rec) == sent
    assert len(_response(rec)["chunks"]) == 3


def test_a_body_that_cannot_be_decoded_is_withheld(tmp_path: Path) -> None:
    for headers, why in (
        ([("Content-Encoding", "zstd")], "content coding 'zstd' is not supported"),
        ([("Content-Encoding", "gzip")], "not a valid gzip stream"),
    ):
        rec = _record(tmp_path / why[:8], b"opaque bytes " + SECRET.encode(), headers)
        response = _response(rec)
        assert response["body"] is None and response["withheld"].startswith(why)
        assert SECRET not in (rec / "runs" / "r1.jsonl").read_text()
        assert load_recording(rec).runs["r1"].entries[0].response.body is None  # type: ignore[union-attr]


def test_a_large_coded_body_is_decoded_and_redacted_as_a_stream(tmp_path: Path) -> None:
    plain = b"x" * (STRUCTURED_LIMIT + 100) + b" leaked " + SECRET.encode() + b" end"
    spill = tmp_path / "spill"
    spill.write_bytes(gzip.compress(plain))
    ex = exchange(1, "/x", b"", headers=[("Content-Encoding", "gzip")])
    ex.secrets = (KEY,)
    assert ex.response is not None
    ex.response.body = Spilled(spill, spill.stat().st_size)
    rec = write(tmp_path / "rec", ex)
    assert not spill.exists()
    inside = _decoded(_stored(rec), ("gzip",))
    assert inside.endswith(b" leaked [secret:api:header] end") and len(inside) > STRUCTURED_LIMIT


# --- record, then replay ----------------------------------------------------------------------


async def test_replay_sends_the_stored_bytes_of_a_coded_body(tmp_path: Path) -> None:
    policy = mini_policy()
    sent = gzip.compress(json.dumps({"echo": SECRET}).encode())
    headers = CIMultiDict({"Content-Type": "application/json", "Content-Encoding": "gzip"})
    live = FakeLive(FakeResponse(chunks=[sent[:10], sent[10:]], headers=headers))
    rec = RecordTransport(live, tmp_path / "rec")
    injection = Injection("X-Api-Key", Secret(SECRET), Secret(SECRET), "api:header")
    req = dataclasses.replace(
        request(policy, "ping", "GET", "/ping", run="r1"), injection=injection
    )
    assert await drain(await rec.send(req)) == sent  # the live answer passes unchanged
    await rec.close()
    stored = _stored(tmp_path / "rec")
    assert json.loads(gzip.decompress(stored)) == {"echo": "[secret:api:header]"}
    # Replay sends the stored bytes as they are: the same on every replay, no compressor run.
    first = await drain(await ReplayTransport(tmp_path / "rec").send(req))
    again = await drain(await ReplayTransport(tmp_path / "rec").send(req))
    assert first == again == stored


async def test_a_coded_body_is_written_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A few KiB of gzip may inflate to 256 MiB: decoding it must not stall other calls."""
    import asyncio

    threaded: list[str] = []
    real = asyncio.to_thread

    async def spy(fn: Any, *args: Any) -> Any:
        threaded.append(getattr(fn, "__name__", "?"))
        return await real(fn, *args)

    monkeypatch.setattr("gateway.transports.record.asyncio.to_thread", spy)
    bomb = gzip.compress(b"\0" * 1_000_000)
    for headers in ({"Content-Encoding": "gzip"}, {"Content-Type": "application/gzip"}):
        live = FakeLive(FakeResponse(chunks=[bomb], headers=CIMultiDict(headers)))
        rec = RecordTransport(live, tmp_path / "rec")
        await drain(await rec.send(request(mini_policy(), "ping", "GET", "/ping", run="r1")))
        await rec.close()
    assert threaded == ["append", "append"]
