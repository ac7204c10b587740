"""Chaos on demand: faults the gateway injects between itself and upstreams, from a file.

``capgate serve --faults FILE`` (or ``replay ... --faults FILE``) makes chosen calls slow or
failing, to see how an agent copes with an upstream that is down, slow or flaky, without
touching the upstream. A fault file::

    seed: 42                     # the same seed, the same faults
    faults:
      - upstream: metrics        # or rule: RULE_ID; neither: every call
        probability: 1           # default 1
        latency: 10s             # wait, then forward the call
      - upstream: services
        probability: 0.5
        error: 503               # answer this status without calling the upstream
      - rule: query-orders
        reset: true              # the connection breaks: upstream_unavailable
      - upstream: logs
        timeout: true            # no answer until the read timeout: upstream_timeout

Whether a call gets a fault is a pure function of the seed, the fault's place in the file,
the call's run, its canonical form (upstream, method, target, body: as recordings match it,
volatile fields left out) and its occurrence (the nth identical call of the run): not of
arrival order or time, so a run sees the same faults under concurrency, on a rerun and in
replay. The first fault (in file order) that applies wins.

Injected faults are marked: the audit line carries ``fault`` (``latency 10s``, ``error 503``,
``reset``, ``timeout``); an answer the gateway made or delayed carries the header
``X-Capgate-Fault``, so a recording (record mode) shows it; a reset or timeout is recorded as
the error it caused, whose detail says it was injected.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from multidict import CIMultiDict

from gateway.errors import ConfigError, UpstreamTimeout, UpstreamUnavailable
from gateway.policy_file import Node, PolicyError, read_document
from gateway.transport import Transport, UpstreamRequest, UpstreamResponse

FAULT_HEADER = "X-Capgate-Fault"
KINDS = ("latency", "error", "reset", "timeout")
MAX_OCCURRENCES = 100_000  # distinct (run, call) counters kept; then the oldest are dropped


@dataclass(frozen=True, slots=True)
class Fault:
    index: int  # place in the file: part of the draw, so two faults draw apart
    kind: str  # latency | error | reset | timeout
    probability: float = 1.0
    upstream: str | None = None
    rule: str | None = None
    latency: float = 0.0
    status: int = 503

    def applies(self, request: UpstreamRequest) -> bool:
        if self.upstream is not None and request.upstream.name != self.upstream:
            return False
        rule = request.rule.id if request.rule is not None else None
        return self.rule is None or rule == self.rule

    def describe(self) -> str:
        if self.kind == "latency":
            return f"latency {self.latency:g}s"
        if self.kind == "error":
            return f"error {self.status}"
        return self.kind


@dataclass(slots=True)
class FaultPlan:
    seed: str
    faults: tuple[Fault, ...]
    source: str = ""
    _seen: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)

    def draw(self, fault: Fault, run: str, call: str, occurrence: int) -> float:
        """A number in [0, 1) fixed by the seed, the fault, the run, the call, its occurrence."""
        message = f"{fault.index}\0{run}\0{call}\0{occurrence}".encode()
        digest = hmac.new(self.seed.encode(), message, hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    def choose(self, request: UpstreamRequest) -> Fault | None:
        """The fault this call gets, if any; counts the call's occurrence in its run."""
        candidates = [f for f in self.faults if f.applies(request)]
        if not candidates:
            return None
        run = request.run or request.agent
        call = canonical_call(request)
        key = (run, call)
        occurrence = self._seen.get(key, 0) + 1
        if len(self._seen) >= MAX_OCCURRENCES and key not in self._seen:
            self._seen.pop(next(iter(self._seen)))
        self._seen[key] = occurrence
        for fault in candidates:
            if self.draw(fault, run, call, occurrence) < fault.probability:
                return fault
        return None


def canonical_call(request: UpstreamRequest) -> str:
    """The call as recordings match it (JSON key order, volatile fields), as one string."""
    from gateway.recording.matching import make_probe

    body = request.body if isinstance(request.body, bytes) else None
    probe = make_probe(request.upstream.name, request.method, request.target, body, request.rule)
    return json.dumps(
        [probe.key.upstream, probe.key.method, probe.key.path, probe.key.query, probe.key.body],
        default=str,
    )


# --- the file ---------------------------------------------------------------------------------

FAULT_KEYS = ("upstream", "rule", "probability", "description", *KINDS)


def load_faults(path: str | Path) -> FaultPlan:
    """Read a fault file; ``ConfigError`` listing every ``FILE:LINE:COL`` problem."""
    try:
        root = read_document(path)
    except PolicyError as exc:
        raise ConfigError(f"fault file has errors:\n{exc}") from None
    doc = root.as_map(required=("faults",), optional=("seed", "faults", "description"))
    faults: list[Fault] = []
    seed = "0"
    if doc is not None:
        if "seed" in doc:
            value = doc["seed"].value
            if isinstance(value, bool) or not isinstance(value, int | str):
                doc["seed"].fail("seed: expected an integer or a string")
            else:
                seed = str(value)
        for i, item in enumerate((doc["faults"].as_list() or []) if "faults" in doc else []):
            fault = _fault(i, item)
            if fault is not None:
                faults.append(fault)
    if root.issues:
        raise ConfigError(f"fault file has errors:\n{PolicyError(root.issues)}")
    return FaultPlan(seed=seed, faults=tuple(faults), source=str(path))


def _fault(index: int, node: Node) -> Fault | None:
    m = node.as_map(optional=FAULT_KEYS)
    if m is None:
        return None
    kinds = [k for k in KINDS if k in m]
    if len(kinds) != 1:
        node.fail(f"{node.where}: say one of {', '.join(KINDS)} (found {len(kinds)})")
        return None
    kind = kinds[0]
    probability = 1.0
    if "probability" in m:
        value = m["probability"].value
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            m["probability"].fail(f"{m['probability'].where}: expected a number from 0 to 1")
        else:
            probability = float(value)
    latency, status = 0.0, 503
    if kind == "latency":
        latency = m["latency"].as_duration() or 0.0
    elif kind == "error":
        status = m["error"].as_int(minimum=400, maximum=599) or 503
    elif m[kind].as_bool() is not True:
        m[kind].fail(f"{m[kind].where}: write '{kind}: true'")
    upstream = m["upstream"].as_str() if "upstream" in m else None
    rule = m["rule"].as_str() if "rule" in m else None
    return Fault(index, kind, probability, upstream, rule, latency, status)


# --- the transport ----------------------------------------------------------------------------


class _Injected:
    """An answer the gateway makes instead of the upstream's (``error: STATUS``)."""

    def __init__(self, fault: Fault, upstream: str) -> None:
        self.status = fault.status
        self.reason = "Injected Fault"
        body = {"error": "injected by capgate chaos", "fault": fault.describe()}
        self._body = json.dumps({**body, "upstream": upstream}).encode()
        self.headers: CIMultiDict[str] = CIMultiDict(
            {
                "Content-Type": "application/json",
                "Content-Length": str(len(self._body)),
                FAULT_HEADER: fault.describe(),
            }
        )

    @property
    def complete(self) -> bool:
        return True

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield self._body

    async def read_all(self) -> bytes:
        return self._body

    async def close(self) -> None:
        return None


class ChaosTransport:
    """Wraps a transport: each call first asks the plan whether it gets a fault."""

    def __init__(self, inner: Transport, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        fault = self.plan.choose(request)
        if fault is None:
            return await self.inner.send(request)
        request.fault = fault.describe()
        up = request.upstream
        detail = f"(fault injected by capgate chaos: {fault.describe()})"
        if fault.kind == "error":
            return _Injected(fault, up.name)
        if fault.kind == "reset":
            raise UpstreamUnavailable(f"upstream {up.name!r}: the connection was reset {detail}")
        if fault.kind == "timeout":
            await asyncio.sleep(min(up.read_timeout, up.total_timeout))
            raise UpstreamTimeout(f"upstream {up.name!r} did not answer in time {detail}")
        await asyncio.sleep(fault.latency)
        response = await self.inner.send(request)
        headers = response.headers
        if isinstance(headers, CIMultiDict):
            headers[FAULT_HEADER] = fault.describe()
        return response

    async def close(self) -> None:
        await self.inner.close()
