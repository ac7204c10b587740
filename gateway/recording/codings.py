"""Content codings of recorded bodies: decoded so redaction and lint see the bytes inside.

An upstream may send its body compressed (``Content-Encoding: gzip``), and a compressed body
hides what it carries from any scan of its bytes: a credential the upstream echoed, a token,
a key. The writer therefore decodes every coded response body before redacting it
(``RecordingWriter._coded_body``), and ``lint`` decodes every coded body it reads.

Which codings a body has: every ``Content-Encoding`` header, comma-separated, in the order the
sender applied them (``identity`` is none); a body that declares none but starts with the gzip
magic bytes is taken as gzip too (``sniff``), so a ``.gz`` file or a header an intermediary
dropped hides nothing. Supported: ``gzip`` (and ``x-gzip``), ``deflate`` (zlib-wrapped, or
raw deflate as some servers send it) and ``br`` when the ``brotli`` module is installed. Any
other coding, a corrupt stream, data after the end of a gzip stream, or more than
``DECODE_LIMIT`` decoded bytes raise ``CodingError``: the body cannot be checked, so the
writer does not keep it (``withheld``) and lint reports it.

``encode`` applies the codings again, with fixed parameters (level 6, no file name, mtime 0),
so the same decoded bytes always give the same encoded bytes on one machine. It runs at
record time only: the writer stores the encoded bytes, and replay sends them as stored.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

DECODE_LIMIT = 256 * 1024 * 1024
"""Decoded bytes one body may grow to (a run's default ``max_bytes``); beyond, it is withheld."""

GZIP_MAGIC = b"\x1f\x8b\x08"
"""The first bytes of a gzip stream (magic number, deflate method)."""

_PIECE = 64 * 1024
LEVEL = 6
"""Compression level of ``encode`` (zlib's default; brotli quality 5, its streaming default)."""

try:  # brotli is optional: "br" bodies are decoded where it is installed, withheld elsewhere
    import brotli  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # pragma: no cover - depends on the environment
    brotli = None

ALIASES = {"x-gzip": "gzip"}
SUPPORTED = frozenset({"gzip", "x-gzip", "deflate"} | ({"br"} if brotli is not None else set()))
"""Content codings this capgate can decode (and encode again)."""


class CodingError(ValueError):
    """Raised when a coded body cannot be decoded: an unknown coding, corrupt or trailing
    data, or more than ``DECODE_LIMIT`` decoded bytes. The message says which."""


def content_codings(headers: Iterable[tuple[str, Any]]) -> tuple[str, ...]:
    """The codings applied to a body, in the order they were applied, from every
    ``Content-Encoding`` header (lower-case; ``identity`` left out). A recorded header whose
    value is a marker (not text) counts as an unknown coding."""
    out: list[str] = []
    for name, value in headers:
        if name.lower() != "content-encoding":
            continue
        if not isinstance(value, str):
            out.append("?")
            continue
        for item in value.split(","):
            coding = item.strip().lower()
            if coding and coding != "identity":
                out.append(coding)
    return tuple(out)


def sniff(head: bytes) -> tuple[str, ...]:
    """``("gzip",)`` for bytes that start a gzip stream, else ``()``."""
    return ("gzip",) if head.startswith(GZIP_MAGIC) else ()


def check(codings: Iterable[str]) -> None:
    """``CodingError`` for the first coding this capgate cannot decode."""
    for coding in codings:
        if coding not in SUPPORTED:
            hint = " (install the 'brotli' package)" if coding == "br" else ""
            raise CodingError(f"content coding {coding!r} is not supported here{hint}")


class _Step(Protocol):
    def feed(self, data: bytes) -> Iterator[bytes]: ...

    def flush(self) -> Iterator[bytes]: ...


class _Inflate:
    """gzip (every member of a multi-member stream) or deflate (zlib-wrapped or raw), in
    pieces of at most 64 KiB, so a small bomb never sits in memory whole."""

    def __init__(self, coding: str) -> None:
        self.coding = ALIASES.get(coding, coding)
        self._d: Any = None
        self._head = b""
        self._done = False

    def _start(self, data: bytes) -> Any:
        if self.coding == "gzip":
            return zlib.decompressobj(wbits=31)
        # "deflate" is zlib-wrapped by the standard; some servers send raw deflate.
        zlib_header = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
        return zlib.decompressobj(wbits=15 if zlib_header else -15)

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self._d is None:
            self._head += data
            if len(self._head) < 2:
                return
            data, self._head = self._head, b""
            self._d = self._start(data)
        yield from self._inflate(data)

    def _inflate(self, data: bytes) -> Iterator[bytes]:
        while data:
            if self._done:
                if self.coding == "gzip" and data.startswith(GZIP_MAGIC[:2]):
                    self._d, self._done = zlib.decompressobj(wbits=31), False
                elif data.strip(b"\0"):
                    raise CodingError(f"data after the end of the {self.coding} stream")
                else:
                    return  # zero padding after the stream: nothing hides there
            try:
                piece = self._d.decompress(data, _PIECE)
            except zlib.error as exc:
                raise CodingError(f"not a valid {self.coding} stream ({exc})") from None
            if piece:
                yield piece
            if self._d.eof:
                self._done = True
                data = self._d.unused_data
            else:
                data = self._d.unconsumed_tail

    def flush(self) -> Iterator[bytes]:
        if self._d is None:
            if not self._head:
                return
            data, self._head = self._head, b""
            self._d = self._start(data)
            yield from self._inflate(data)
        if not self._done:
            try:
                tail = self._d.flush()
            except zlib.error as exc:
                raise CodingError(f"not a valid {self.coding} stream ({exc})") from None
            if tail:
                yield tail


class _Unbrotli:
    def __init__(self) -> None:
        assert brotli is not None
        self._d = brotli.Decompressor()

    def feed(self, data: bytes) -> Iterator[bytes]:
        try:
            out = bytes(self._d.process(data))
        except brotli.error as exc:
            raise CodingError(f"not a valid br stream ({exc})") from None
        if out:
            yield out

    def flush(self) -> Iterator[bytes]:
        return iter(())


def _pipe(pieces: Iterator[bytes], step: _Step) -> Iterator[bytes]:
    for piece in pieces:
        yield from step.feed(piece)
    yield from step.flush()


def decode(
    chunks: Iterable[bytes], codings: tuple[str, ...], limit: int = DECODE_LIMIT
) -> Iterator[bytes]:
    """The decoded bytes of a body sent with ``codings`` (the last applied is undone first).

    Raises ``CodingError`` (see the module docstring), also part-way: consume it whole before
    trusting any of it.
    """
    check(codings)
    pieces: Iterator[bytes] = iter(chunks)
    for coding in reversed(codings):
        pieces = _pipe(pieces, _Unbrotli() if coding == "br" else _Inflate(coding))
    total = 0
    for piece in pieces:
        total += len(piece)
        if total > limit:
            raise CodingError(f"more than {limit} bytes once decoded")
        yield piece


class _Deflate:
    def __init__(self, coding: str) -> None:
        coding = ALIASES.get(coding, coding)
        self._c: Any = zlib.compressobj(LEVEL, zlib.DEFLATED, 31 if coding == "gzip" else 15)

    def feed(self, data: bytes) -> Iterator[bytes]:
        out = self._c.compress(data)
        if out:
            yield bytes(out)

    def flush(self) -> Iterator[bytes]:
        yield bytes(self._c.flush())


class _Brotli:
    def __init__(self) -> None:
        assert brotli is not None
        self._c = brotli.Compressor(quality=5)

    def feed(self, data: bytes) -> Iterator[bytes]:
        out = self._c.process(data)
        if out:
            yield bytes(out)

    def flush(self) -> Iterator[bytes]:
        yield bytes(self._c.finish())


def encode(chunks: Iterable[bytes], codings: tuple[str, ...]) -> Iterator[bytes]:
    """``chunks`` with ``codings`` applied in order, deterministically (fixed parameters)."""
    check(codings)
    pieces: Iterator[bytes] = iter(chunks)
    for coding in codings:
        pieces = _pipe(pieces, _Brotli() if coding == "br" else _Deflate(coding))
    yield from pieces


def read_pieces(read: Callable[[int], bytes]) -> Iterator[bytes]:
    """A file's bytes in pieces (``read`` is a file's ``read``)."""
    while piece := read(_PIECE):
        yield piece
