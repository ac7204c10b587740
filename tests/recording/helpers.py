"""Small builders for recording unit tests: a policy, requests, a fake live upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multidict import CIMultiDict

from gateway.errors import GatewayError
from gateway.policy.load import load_policy
from gateway.policy.model import Policy, Rule
from gateway.recording.model import Decision, Exchange, ResponseData
from gateway.recording.writer import RecordingWriter
from gateway.transport import UpstreamRequest

MINI_POLICY = """
version: 1
agents: {"*": [reader]}
upstreams:
  api: {url: "http://127.0.0.1:9/base"}
  db: {url: "http://127.0.0.1:9"}
roles:
  reader:
    rules:
      - id: items
        upstream: api
        allow: GET /items
        allow_extra_query: true
        volatile: ["query:nonce"]
      - id: create
        upstream: api
        allow: POST /items
        volatile: ["/request_id", "/items/*/ts"]
      - id: ping
        upstream: api
        allow: GET /ping
"""


def mini_policy(text: str = MINI_POLICY) -> Policy:
    return load_policy("mini.yaml", text)


def request(
    policy: Policy,
    rule_id: str | None,
    method: str,
    target: str,
    *,
    upstream: str = "api",
    body: bytes | None = None,
    run: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
    agent: str = "agent-1",
) -> UpstreamRequest:
    rule: Rule | None = policy.rules_by_id[rule_id] if rule_id else None
    return UpstreamRequest(
        upstream=policy.upstreams[upstream],
        method=method,
        target=target,
        headers=CIMultiDict(headers),
        body=body,
        agent=agent,
        run=run,
        rule=rule,
        request_id="rid",
    )


@dataclass
class FakeResponse:
    status: int = 200
    reason: str = "OK"
    chunks: list[bytes] = field(default_factory=lambda: [b'{"ok":true}'])
    headers: CIMultiDict[str] = field(
        default_factory=lambda: CIMultiDict({"Content-Type": "application/json"})
    )
    fail_after: GatewayError | None = None
    closed: bool = False
    complete: bool = True  # (every chunk is here: reading does not wait)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c
        if self.fail_after is not None:
            raise self.fail_after

    async def read_all(self) -> bytes:
        return b"".join([c async for c in self.iter_chunks()])

    async def close(self) -> None:
        self.closed = True


class FakeLive:
    """A live transport stand-in: answers from a list, or raises; remembers what it got."""

    def __init__(self, *answers: FakeResponse | GatewayError) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[UpstreamRequest, bytes | None]] = []
        self.closed = False

    async def send(self, req: UpstreamRequest) -> FakeResponse:
        body = req.body
        if body is not None and not isinstance(body, bytes):
            body = b"".join([c async for c in body])
        self.sent.append((req, body))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, GatewayError):
            raise answer
        return FakeResponse(
            answer.status,
            answer.reason,
            list(answer.chunks),
            CIMultiDict(answer.headers),
            answer.fail_after,
        )

    async def close(self) -> None:
        self.closed = True


async def drain(resp: Any) -> bytes:
    try:
        return b"".join([c async for c in resp.iter_chunks()])
    finally:
        await resp.close()


def exchange(
    seq: int,
    target: str,
    response_body: bytes,
    *,
    run: str = "r1",
    upstream: str = "api",
    method: str = "GET",
    body: bytes | None = None,
    rule: Rule | None = None,
    kind: str = "exchange",
    status: int = 200,
    headers: Sequence[tuple[str, str]] = (),
    roles: tuple[str, ...] = ("reader",),
    chunks: Sequence[tuple[float, int]] = (),
) -> Exchange:
    allowed = kind == "exchange"
    return Exchange(
        kind=kind,
        run=run,
        seq=seq,
        t=seq * 0.1,
        method=method,
        target=target,
        upstream=upstream,
        agent="agent-1",
        roles=roles,
        request_id=f"req-{seq}",
        request_headers=[("Content-Type", "application/json")] if body else [],
        request_body=body,
        decision=Decision(
            allowed,
            "allowed" if allowed else "no_rule",
            rule.id if rule else None,
            status if allowed else 403,
        ),
        response=ResponseData(
            status,
            "OK",
            [("Content-Type", "application/json"), *headers],
            response_body,
            list(chunks),
        )
        if allowed
        else None,
        rule=rule,
    )


def write(directory: Path, *exchanges: Exchange) -> Path:
    writer = RecordingWriter(directory)
    for ex in exchanges:
        writer.append(ex)
    writer.write_manifest()
    return directory
