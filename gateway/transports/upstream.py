"""The live transport: one pooled aiohttp client for every upstream.

- no redirects are followed (a redirect would reach a target the policy never checked);
- no cookies are kept, no proxy from the environment is used;
- ``Accept-Encoding: identity`` is asked for and bodies are never decompressed, so size
  limits count real bytes and nothing is inflated in memory;
- per-upstream connect and read timeouts; errors are translated here, most specific first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.policy.model import Upstream
from gateway.transport import UpstreamRequest

CHUNK_SIZE = 64 * 1024


class LiveResponse:
    __slots__ = ("_resp", "status", "reason", "headers")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.reason = resp.reason or ""
        self.headers = CIMultiDict(resp.headers)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_chunked(CHUNK_SIZE):
                yield chunk
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout("the upstream stopped sending its response in time") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable("the upstream connection broke during the response") from exc

    async def read_all(self) -> bytes:
        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout("the upstream stopped sending its response in time") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable("the upstream connection broke during the response") from exc

    async def close(self) -> None:
        if not self._resp.content.at_eof():
            self._resp.close()  # not fully read: drop the connection, do not reuse it
        else:
            self._resp.release()


class LiveTransport:
    # The pool itself is not the bound: each upstream's ``limits.concurrency`` (and each
    # agent's share of it) is, counted by the pipeline around every exchange. A pool limit
    # here would be one queue shared by every upstream and agent: the starvation the shares
    # prevent. So connections are bounded by the sum of the upstreams' concurrency.
    def __init__(self, *, limit: int = 0, limit_per_host: int = 0) -> None:
        self._limit = limit
        self._limit_per_host = limit_per_host
        self._session: aiohttp.ClientSession | None = None
        self._routes: dict[Upstream, tuple[str, aiohttp.ClientTimeout]] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._limit,
                limit_per_host=self._limit_per_host,
                ttl_dns_cache=60,
                enable_cleanup_closed=False,
            )
            session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                trust_env=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                timeout=aiohttp.ClientTimeout(total=None),
            )
            # SECURITY: aiohttp resends an idempotent request (GET, PUT, DELETE) once on a new
            # connection when a pooled one was reset; the upstream may then act twice on one
            # call the policy allowed once. There is no public switch; a test pins this one
            # (test_advisories.test_no_call_is_sent_twice).
            session._retry_connection = False
            self._session = session
        return self._session

    def _route(self, up: Upstream) -> tuple[str, aiohttp.ClientTimeout]:
        """The URL prefix and timeouts of an upstream, computed once per upstream object."""
        route = self._routes.get(up)
        if route is None:
            timeout = aiohttp.ClientTimeout(
                total=None,
                connect=up.connect_timeout,
                sock_connect=up.connect_timeout,
                sock_read=up.read_timeout,
            )
            route = (str(up.url.origin()) + up.base_path, timeout)
            if len(self._routes) > 1024:  # policy reloads bring new Upstream objects
                self._routes.clear()
            self._routes[up] = route
        return route

    async def send(self, request: UpstreamRequest) -> LiveResponse:
        up = request.upstream
        prefix, timeout = self._route(up)
        url = URL(prefix + request.target, encoded=True)
        try:
            resp = await self._client().request(
                request.method,
                url,
                headers=request.headers,
                data=request.body,
                allow_redirects=False,
                timeout=timeout,
                compress=None,
            )
        except (TimeoutError, aiohttp.ServerTimeoutError, aiohttp.ConnectionTimeoutError) as exc:
            raise UpstreamTimeout(f"upstream {up.name!r} did not answer in time") from exc
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnavailable(f"upstream {up.name!r} cannot be reached") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"upstream {up.name!r} failed to answer") from exc
        return LiveResponse(resp)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
            await asyncio.sleep(0)
