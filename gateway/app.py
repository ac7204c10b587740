"""Wiring: builds every collaborator once, lists the observers of ended calls, and serves.

``build_gateway`` turns ``Settings`` into a ``Gateway``: the resources (state store,
transport, audit file, trace exporter, approvals) and the ``Pipeline`` built from them.
Resources open and close in one ``cleanup_ctx`` generator (state store, transport, audit
file, policy watcher). The transport is chosen here, once, by mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from aiohttp import web

from gateway import __version__
from gateway.admin import create_admin_app, read_admin_token
from gateway.approvals import Approvals
from gateway.audit_anchor import Anchor, AnchorSpec
from gateway.audit_record import BodyMac
from gateway.audit_sign import CheckpointSigner, jwks_path, signing_key_path
from gateway.audit_trail import AuditTrail, TrailOptions, audit_key_path, load_audit_key
from gateway.call import CallObserver
from gateway.chaos import ChaosTransport, load_faults
from gateway.check_workers import CheckWorkers
from gateway.config import Settings, revocations_path
from gateway.credentials import Credentialing, CredentialStore
from gateway.errors import ConfigError, StateUnavailable
from gateway.events import EventHub
from gateway.inflight import InFlight
from gateway.key_reload import AuditKeyReloader, KeyReloader
from gateway.listener import AgentServer, ConnectionGuard, fd_budget, tracked
from gateway.operators import OperatorBook
from gateway.pipeline import Pipeline, Services
from gateway.policy.load import load_policy
from gateway.policy.model import Policy
from gateway.policy_file import PolicyError
from gateway.protocols import PROTOCOLS
from gateway.recording.denial import DenialRecorder, DenialSink
from gateway.recording.placeholders import PlaceholderCredentials
from gateway.secret_files import check_secret_file
from gateway.shares import UpstreamShares
from gateway.stages.audit import audit_record
from gateway.state import open_store
from gateway.state.base import PauseKind, StateStore
from gateway.state.journal import RevocationJournal
from gateway.taint import Taints
from gateway.telemetry_plan import plan
from gateway.tokens import Keyset, TokenVerifier, load_private_key
from gateway.transport import Transport
from gateway.transports.modes import build_transport
from gateway.transports.upstream import LiveTransport
from gateway.webhook import ApprovalWebhook

if TYPE_CHECKING:
    from gateway.telemetry import Telemetry
log = logging.getLogger("capgate")

HEALTH_PATH = "/_capgate/health"


Stamp = tuple[tuple[int, int], ...]


def file_stamps(paths: Sequence[str | Path]) -> Stamp:
    """(mtime, size) of each file a policy was read from: a change to any means a reload."""
    stamps = []
    for path in paths:
        st = Path(path).stat()
        stamps.append((st.st_mtime_ns, st.st_size))
    return tuple(stamps)


@dataclass
class WatchState:
    """The background loop's own health: shown by the health endpoint, logged once per kind
    of error (later ones counted), cleared by the next clean tick."""

    next_health: float = 0.0
    store_reachable: bool = True
    error: str | None = None
    failures: int = 0
    _logged: set[str] = field(default_factory=set)

    def failed(self, exc: Exception) -> None:
        kind = type(exc).__name__
        self.failures += 1
        self.error = f"{kind}: {exc}"[:300]
        if kind not in self._logged and len(self._logged) < 64:
            self._logged.add(kind)
            log.error("background loop: %s (it keeps running)", self.error, exc_info=exc)
        else:
            log.error("background loop: %s (it keeps running; %d failures)", kind, self.failures)

    def passed(self) -> None:
        if self.error is not None:
            log.info("background loop: a clean pass after %d failure(s)", self.failures)
        self.error = None
        self.failures = 0

    def health(self) -> dict[str, Any]:
        return {"ok": self.error is None, "error": self.error, "failures": self.failures}


@dataclass
class LoopLag:
    """How late the event loop runs a timer: every call waits behind whatever holds the loop
    (a long check, a blocking call, a garbage collection), so the worst lag of the last
    minute is the first figure to read when answers are slow now and then."""

    every: float = 0.05  # seconds between probes
    stall: float = 0.010  # a lag above this is counted as a stall
    window: float = 60.0  # seconds the worst lag is kept
    worst_ms: float = 0.0  # the worst lag in the current window
    previous_worst_ms: float = 0.0  # ... and in the window before it
    stalls: int = 0  # lags above ``stall`` since start
    _window_started: float = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._window_started = loop.time()
        while True:
            planned = loop.time() + self.every
            await asyncio.sleep(self.every)
            now = loop.time()
            lag = max(0.0, now - planned)
            if lag > self.stall:
                self.stalls += 1
            if now - self._window_started >= self.window:
                self.previous_worst_ms, self.worst_ms = self.worst_ms, 0.0
                self._window_started = now
            self.worst_ms = max(self.worst_ms, lag * 1000)

    def health(self) -> dict[str, Any]:
        return {
            "worst_lag_ms": round(max(self.worst_ms, self.previous_worst_ms), 3),
            "stalls_over_10ms": self.stalls,
        }


class PolicyHolder:
    """The policy in force; ``match_policy`` reads it once per call, a reload swaps it."""

    def __init__(self, policy: Policy, stamp: Stamp = ()) -> None:
        self.policy = policy
        self.stamp = stamp


@dataclass(eq=False)
class Gateway:
    """One process's collaborators and the pipeline built from them (``build_gateway``)."""

    settings: Settings
    policies: PolicyHolder
    verifier: TokenVerifier
    state: StateStore
    credentials: Credentialing
    transport: Transport
    audit: AuditTrail
    mac: BodyMac
    telemetry: Telemetry | None  # None: nothing exported, the SDK not even imported
    approvals: Approvals
    observers: tuple[CallObserver, ...] = ()
    inflight: InFlight = field(default_factory=InFlight)
    upstream_shares: UpstreamShares = field(default_factory=UpstreamShares)
    check_workers: CheckWorkers = field(default_factory=CheckWorkers)
    guard: ConnectionGuard = field(default_factory=ConnectionGuard)
    watch: WatchState = field(default_factory=WatchState)
    lag: LoopLag = field(default_factory=LoopLag)
    events: EventHub = field(default_factory=EventHub)
    operators: OperatorBook | None = None
    webhook: ApprovalWebhook | None = None
    journal: RevocationJournal | None = None  # revocations kept on this gateway's disk
    keys: KeyReloader | None = None  # the JWKS and upstream signing key, read again on change
    audit_keys: AuditKeyReloader | None = None  # the audit's two keys, read again on change
    taints: Taints = field(init=False)
    pipeline: Pipeline = field(init=False)
    # Calls cut by the revocation each stop() in progress made (filled by apply_revocation).
    _cuts: dict[tuple[str, str], int] = field(default_factory=dict, init=False, repr=False)
    _stopped_by: dict[tuple[str, str], str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.taints = Taints(self.state, self.events.publish)
        self.pipeline = Pipeline(
            Services(
                policies=self.policies,
                protocols=PROTOCOLS,
                verifier=self.verifier,
                state=self.state,
                credentials=self.credentials,
                approvals=self.approvals,
                inflight=self.inflight,
                transport=self.transport,
                mac=self.mac,
                observers=self.observers,
                upstream_shares=self.upstream_shares,
                taints=self.taints,
                notify=self.events.publish,
                pause_hold=self.settings.pause_hold,
                check_workers=self.check_workers,
                decisions=self.audit if self.audit.path is not None else None,
                telemetry=self.telemetry,
            )
        )
        if self.audit.path is not None:
            self.guard.refused = self.audit.count_refusal
        audit_stage, trail = self.pipeline.audit, self.audit
        if self.telemetry is None:
            return
        self.telemetry.watch(
            pending=lambda: self.approvals.count,
            # Lines the trail failed to write: its own count (when it keeps one) and the
            # calls whose audit observer raised.
            audit_errors=lambda: (
                int(getattr(trail, "failures", 0)) + audit_stage.failures.get(trail, 0)
            ),
        )

    @property
    def policy(self) -> Policy:
        return self.policies.policy

    def inflight_calls(self) -> list[dict[str, Any]]:
        """Calls held for approval or being forwarded now, as the console shows them: the
        fields of their audit record so far (no body, query value or argument)."""
        out = []
        for call in self.inflight.calls():
            record = audit_record(call, self.mac)
            out.append(
                {
                    "request_id": record["request_id"],
                    "agent": record["agent"],
                    "run": record["run"],
                    "upstream": record["upstream"],
                    "method": record["method"],
                    "path": record["path"],
                    "rule": record["rule"],
                    "seconds": round(record["duration_ms"] / 1000, 3),
                    "state": "forwarded" if call.dispatched else "held for approval",
                }
            )
        return out

    async def taint_report(self, key: str) -> dict[str, Any]:
        """Whether a run (or a token, ``jti:<id>``) read untrusted content, and what."""
        cause = await self.taints.of(key)
        return {"key": key, "tainted": cause is not None, "cause": cause}

    def journal_health(self) -> dict[str, Any]:
        if self.journal is None:
            return {
                "ok": True,
                "path": None,
                "detail": "no revocation journal (the audit is off and revocations_file is "
                "unset): revocations do not survive a restart of this gateway",
            }
        error = self.journal.error
        return {
            "ok": error is None,
            "path": str(self.journal.path),
            "lines": self.journal.lines,
            "detail": f"the last revocation could not be written: {error}" if error else "ok",
        }

    async def health_report(self) -> tuple[int, dict[str, Any]]:
        """The health check's status and body (agents' port and admin API alike)."""
        state = await self.state.health()
        background = self.watch.health()
        audit = self.audit.health()
        if self.audit_keys is not None:
            audit["keys"]["error"] = self.audit_keys.error  # a refused reload; keys in force
        journal = self.journal_health()
        ok = (
            bool(state.get("reachable", False))
            and background["ok"]
            and audit["ok"]
            and journal["ok"]
        )
        body = {
            "status": "ok" if ok else "degraded",
            "version": __version__,
            "policy": {"source": self.policy.source, "digest": self.policy.digest},
            "state": state,
            "background": background,
            "audit": audit,
            "revocations_journal": journal,
            "connections": {
                "open": self.guard.open,
                "max": self.guard.max_connections,
                "refused": dict(self.guard.totals),
            },
            "upstreams_in_flight": self.upstream_shares.snapshot(),
            "event_loop": self.lag.health(),
            "held_by_pause": self.pipeline.pause.held.snapshot(),
            "held_for_approval": self.approvals.slots.snapshot(),
            "waiting_for_approval": self.approvals.waiting.snapshot(),
            "check_workers": self.check_workers.snapshot(),
        }
        if self.webhook is not None:
            body["approval_webhook"] = self.webhook.health()
        return (200 if ok else 503), body

    # --- operators: pause, resume, stop (called by the admin API) -----------------------------

    async def pause(
        self, kind: PauseKind, value: str, *, until: float | None, by: str, reason: str
    ) -> None:
        """Hold the new calls of an agent or a run at every gateway sharing the state store,
        until ``resume`` or ``until`` (unix time; None: until resumed). Calls already past
        the pause stage go on. ``ValueError`` on bad arguments, ``StateUnavailable`` when the
        store could not record it (then nothing is paused)."""
        await self.state.pause(kind, value, until=until, by=by, reason=reason)
        log.info(
            "%s %r paused by %s%s: %s",
            kind,
            value,
            by,
            "" if until is None else f" for {max(0.0, until - time.time()):.0f} s",
            reason or "(no reason given)",
        )

    async def resume(self, kind: PauseKind, value: str, *, by: str) -> bool:
        """Lift a pause everywhere; its held calls go on. False when it was not paused."""
        lifted = await self.state.resume(kind, value, by=by)
        if lifted:
            log.info("%s %r resumed by %s", kind, value, by)
        else:
            log.info("%s %r was not paused (resume asked by %s)", kind, value, by)
        return lifted

    async def stop(self, kind: Literal["agent", "run"], value: str, *, by: str, reason: str) -> int:
        """Revoke an agent or a run (forever), recording who and why: its calls in flight here,
        held by a pause or for approval included, are cut (``token_revoked``), and every
        gateway sharing the store refuses its tokens. Returns the calls cut at this gateway.
        ``StateUnavailable`` when the shared write failed: this gateway enforces the stop
        anyway, and writes it back at its next resync with Redis; stop again to be sure."""
        if kind not in ("agent", "run"):
            raise ValueError(f"stop takes kind 'agent' or 'run', not {kind!r}")
        key = (kind, value)
        self._cuts.setdefault(key, 0)
        self._stopped_by[key] = by
        try:
            await self.state.revoke(kind, value, by=by, reason=reason)
        except StateUnavailable as exc:
            log.error(
                "%s %r stopped by %s at this gateway only (%d call(s) cut): %s; the next "
                "resync writes it back, or stop it again",
                kind,
                value,
                by,
                self._cuts.pop(key, 0),
                exc.detail,
            )
            raise
        finally:
            cut = self._cuts.pop(key, 0)
            self._stopped_by.pop(key, None)
        log.info(
            "%s %r stopped by %s: %s; %d call(s) cut",
            kind,
            value,
            by,
            reason or "(no reason given)",
            cut,
        )
        return cut

    def apply_revocation(self, kind: str, value: str) -> None:
        """The store's ``on_revoke`` listener: drop cached verdicts of the revoked token,
        agent or run, and cut its calls in flight (held ones included)."""
        self.verifier.forget(lambda c: getattr(c, kind, None) == value)
        cancelled = self.inflight.cancel(kind, value, by=self._stopped_by.get((kind, value)))
        if (kind, value) in self._cuts:
            self._cuts[(kind, value)] += cancelled
        log.info(
            "revocation of %s %r applied; %d call(s) in flight cancelled", kind, value, cancelled
        )

    def with_transport(self, transport: Transport, denials: DenialSink | None) -> Gateway:
        """The same gateway sending through ``transport`` (tests, the example recording)."""
        observers = tuple(o for o in self.observers if not isinstance(o, DenialRecorder))
        if denials is not None:
            observers += (DenialRecorder(denials),)
        return dataclasses.replace(self, transport=transport, observers=observers)

    def reload_policy(self) -> bool:
        """Load the policy file again; swap it in only if it is valid. True when swapped."""
        path = self.settings.policy
        try:
            stamp = file_stamps((path, *self.policy.files[1:]))
        except OSError as exc:
            # Between a delete and a create (git checkout, some editors): said once, retried.
            if self.policies.stamp != ():
                log.error(
                    "policy file %s cannot be read: %s; keeping the policy in force", path, exc
                )
                self.policies.stamp = ()
            return False
        if stamp == self.policies.stamp:
            return False
        try:
            policy = load_policy(path)
            self.credentials.check_policy(policy)
            check_approvers(policy, self.settings)
        except PolicyError as exc:
            self.policies.stamp = stamp  # reported once; the next edit is tried again
            for issue in exc.issues:
                log.error("policy reload refused: %s", issue)
            log.error("keeping the policy in force (%s)", self.policy.digest)
            return False
        except ConfigError as exc:
            self.policies.stamp = stamp
            log.error("policy reload refused: %s; keeping the policy in force", exc)
            return False
        # Anything else escapes to the background loop, which reports it; the stamp is left
        # as it was, so the same file is tried again on the next pass.
        self.policies.stamp = stamp
        if policy.digest == self.policy.digest:
            return False
        self.policies.policy = policy
        log.info("policy reloaded from %s (digest %s)", path, policy.digest)
        return True


def _operator_book(settings: Settings) -> OperatorBook | None:
    """Who may use the admin API: the operators file, and the legacy admin token."""
    if settings.admin_port is None:
        return None
    legacy = read_admin_token(settings.admin_token_file) if settings.admin_token_file else None
    book = OperatorBook(settings.operators_file, admin_token=legacy)
    if not len(book):
        raise ConfigError(
            f"the admin listener has no operators: {settings.operators_file} lists none "
            "(capgate operators add NAME --role admin --file FILE)"
        )
    return book


def check_approvers(policy: Policy, settings: Settings) -> None:
    """A rule that holds calls for approval needs someone who can approve (fail closed)."""
    held = [
        r.id
        for role in policy.roles.values()
        for r in role.rules
        if r.approval or (r.sensitive and r.when_tainted == "approve")
    ]
    if held and settings.admin_port is None:
        raise ConfigError(
            f"rules {held} require approval, but no admin listener is configured to approve "
            "them (--admin-port and --operators)"
        )


def build_gateway(settings: Settings, environ: Mapping[str, str]) -> Gateway:
    """Everything that can fail at start fails here, with one readable ``ConfigError``."""
    try:
        policy = load_policy(settings.policy)
    except PolicyError as exc:
        raise ConfigError(f"policy {settings.policy} has errors:\n{exc}") from exc
    keyset = Keyset.from_file(settings.jwks, settings.tokens.algorithm)
    verifier = TokenVerifier(keyset, settings.tokens)
    credentials: Credentialing
    if settings.mode == "replay":
        # Replay never reaches an upstream, so CI needs none of the real secrets: each
        # credential is a placeholder, recorded answers carry the same placeholder back.
        credentials = PlaceholderCredentials()
    else:
        if settings.upstream_key is not None:
            check_secret_file(settings.upstream_key)  # as every other secret file
        signing = load_private_key(settings.upstream_key) if settings.upstream_key else None
        credentials = CredentialStore(
            environ=environ,
            base_dir=(settings.secrets_dir or settings.policy.resolve().parent).resolve(),
            signing_key=signing,
        )
        credentials.check_policy(policy)
    check_approvers(policy, settings)
    try:
        state = open_store(settings.state)
    except ValueError as exc:
        raise ConfigError(f"state has value {settings.state!r}; {exc}") from exc
    stamp = file_stamps((settings.policy, *policy.files[1:]))
    live: Transport = LiveTransport()
    faults = load_faults(settings.faults) if settings.faults is not None else None
    if faults is not None and settings.mode not in ("replay", "replay-or-record"):
        live = ChaosTransport(live, faults)  # inside the recorder: recordings show the faults
    transport, denials = build_transport(
        settings.mode,
        settings.recordings,
        live,
        ci=settings.ci,
        sample=settings.sample,
        report_path=settings.replay_report,
    )
    if faults is not None and settings.mode in ("replay", "replay-or-record"):
        transport = ChaosTransport(transport, faults)  # over the recorded answers
    key_path = audit_key_path(settings.audit, settings.audit_key)
    mac = BodyMac(load_audit_key(key_path) if key_path is not None else None)
    audit = build_audit_trail(settings, mac.kid)
    telemetry_plan = plan(settings)
    telemetry: Telemetry | None = None
    if telemetry_plan.enabled:
        from gateway.telemetry import Telemetry

        telemetry = Telemetry(telemetry_plan)
    # Every ended call, allowed or refused, is told to each of these, in this order.
    observers: list[CallObserver] = []
    if settings.audit is not None:
        observers.append(audit)
    if telemetry is not None:
        observers.append(telemetry)
    if denials is not None:
        observers.append(DenialRecorder(denials))
    events = EventHub()
    observers.append(events)  # the live stream and the console's table of recent calls
    webhook = ApprovalWebhook(settings.approval_webhook) if settings.approval_webhook else None
    if webhook is not None:
        events.listeners.append(webhook)
    return Gateway(
        settings=settings,
        policies=PolicyHolder(policy, stamp),
        verifier=verifier,
        state=state,
        credentials=credentials,
        transport=transport,
        audit=audit,
        mac=mac,
        telemetry=telemetry,
        approvals=Approvals(
            settings.approval_timeout,
            per_agent=settings.approvals_per_agent,
            on_event=events.publish,
            board=state.approval_board(),
        ),
        observers=tuple(observers),
        events=events,
        webhook=webhook,
        operators=_operator_book(settings),
        journal=RevocationJournal(journal) if (journal := revocations_path(settings)) else None,
        keys=KeyReloader(
            verifier,
            settings.jwks,
            overlap=settings.jwks_overlap,
            credentials=credentials if isinstance(credentials, CredentialStore) else None,
            upstream_key=settings.upstream_key,
        ),
        audit_keys=_audit_key_reloader(settings, audit, mac),
        guard=ConnectionGuard(
            max_connections=settings.max_connections,
            head_timeout=settings.head_timeout,
            idle_timeout=settings.idle_timeout,
        ),
    )


def _audit_key_reloader(
    settings: Settings, audit: AuditTrail, mac: BodyMac
) -> AuditKeyReloader | None:
    if settings.audit is None:
        return None
    return AuditKeyReloader(
        audit,
        mac,
        audit_key_path(settings.audit, settings.audit_key),
        signing_key_path(settings.audit, settings.audit_signing_key),
        jwks_path(settings.audit, settings.audit_jwks),
    )


def build_audit_trail(settings: Settings, audit_key_id: str | None = None) -> AuditTrail:
    """The audit trail as configured: its signing key made (0600) and published in the
    audit JWKS when absent; nothing is opened yet (``running``). ``audit_key_id`` names the
    key of the body digests (``audit_record.audit_key_id``) in the start checkpoints."""
    if settings.audit is None:
        return AuditTrail(None)
    signer = CheckpointSigner.load_or_create(
        signing_key_path(settings.audit, settings.audit_signing_key)
    )
    signer.publish(jwks_path(settings.audit, settings.audit_jwks))
    options = TrailOptions(
        fsync=settings.audit_fsync,
        mirror=settings.audit_mirror,
        checkpoint_lines=settings.audit_checkpoint_lines,
        checkpoint_interval=settings.audit_checkpoint_interval,
        rotate_size=settings.audit_rotate_size,
        rotate_interval=settings.audit_rotate_interval,
        gateway_id=settings.audit_gateway_id,
    )
    spec = settings.audit_anchor
    if spec is None and settings.state.startswith(("redis://", "rediss://")):
        # A fleet with Redis: each gateway's latest checkpoint is kept there by default.
        spec = AnchorSpec("redis", settings.state)
    anchor = Anchor(spec) if spec is not None else None
    return AuditTrail(
        settings.audit, options, signer=signer, anchor=anchor, audit_key_id=audit_key_id
    )


async def _health(gw: Gateway) -> web.Response:
    status, body = await gw.health_report()
    return web.json_response(body, status=status)


@contextlib.asynccontextmanager
async def running(gw: Gateway) -> AsyncIterator[Gateway]:
    """The gateway's resources, open: the audit file, the state store (and revocations it
    announces), the policy watcher. Closed, in reverse, when the block ends."""
    gw.audit.open()
    if gw.journal is not None:
        # Before start: what Redis lacks (it restarted empty) is written back by its sync.
        loaded = gw.state.keep_revocations(gw.journal)
        if loaded:
            log.info("%d revocation(s) restored from %s", loaded, gw.journal.path)
    await gw.state.start()
    gw.state.on_revoke(gw.apply_revocation)
    gw.state.on_pause(gw.pipeline.pause.changed)
    watcher = asyncio.create_task(_watch(gw), name="capgate-policy-watcher")
    lag_probe = asyncio.create_task(gw.lag.run(), name="capgate-loop-lag")
    if gw.webhook is not None:
        gw.webhook.start()
    try:
        yield gw
    finally:
        for task in (watcher, lag_probe):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await gw.approvals.close()
        if gw.webhook is not None:
            await gw.webhook.close()
        await gw.transport.close()
        gw.check_workers.close()
        await gw.state.close()
        gw.audit.close()
        if gw.telemetry is not None:
            gw.telemetry.close()


def _reload_operators(gw: Gateway) -> None:
    """A changed operators file takes effect at once; a bad one is reported, the operators
    in force stay."""
    if gw.operators is None:
        return
    try:
        if gw.operators.reload():
            log.info("operators reloaded from %s (%d)", gw.operators.path, len(gw.operators))
    except ConfigError as exc:
        log.error("operators reload refused: %s; keeping the operators in force", exc)


STATE_HEALTH_EVERY = 5.0
# A call allocates a few dozen objects; with the default first threshold (700) the young
# generation is scanned every ~20 calls. 5000 scans it ~7x less often for the HTTP path
# (bench: ~4% less CPU per call) while a burst of never-seen SQL (large syntax trees) keeps a
# moderate peak (bench: ~215 MiB instead of ~145 MiB with the default, ~390 MiB at 20000).
GC_THRESHOLDS = (5_000, 10, 10)


async def _watch(gw: Gateway) -> None:
    """Reload the policy when its file changes; flush the audit file; log the store's health
    when it changes (reachable <-> unreachable) and the listener's summaries.

    The loop survives every error: one that escapes a tick is logged (its traceback once per
    kind of error, then counted) and shown by the health endpoint until a tick passes clean;
    policy edits are still picked up after it."""
    loop = asyncio.get_running_loop()
    watch = gw.watch
    task = asyncio.current_task()
    while True:
        await asyncio.sleep(gw.settings.reload_interval)
        try:
            await _tick(gw, loop.time())
        except Exception as exc:
            watch.failed(exc)
        else:
            watch.passed()
        if task is not None and task.cancelling():
            # A cancellation a library turned into an error (or swallowed) mid-tick: stop
            # anyway, or the shutdown that cancelled this loop would wait for it forever.
            raise asyncio.CancelledError


async def _tick(gw: Gateway, now: float) -> None:
    gw.reload_policy()
    if gw.keys is not None:
        gw.keys.tick()
    if gw.audit_keys is not None:
        gw.audit_keys.tick()
    _reload_operators(gw)
    gw.audit.tick()
    summary = gw.guard.summarise(now)
    if summary is not None:
        log.warning("%s", summary)
    watch = gw.watch
    if now < watch.next_health:
        return
    watch.next_health = now + STATE_HEALTH_EVERY
    health = await gw.state.health()
    now_reachable = bool(health.get("reachable"))
    if now_reachable != watch.store_reachable:
        if now_reachable:
            log.info("state store %s reachable again", health.get("backend"))
        else:
            log.error(
                "state store %s unreachable: %s; calls that need it are denied (state_unavailable)",
                health.get("backend"),
                health.get("detail"),
            )
        watch.store_reachable = now_reachable


# A handler is cancelled when its agent hangs up, so an abandoned call (a held approval, an
# event stream nobody reads) lets its upstream connection go at once.
# Request bodies are never inflated by the server: a compressed upload is refused (receive)
# rather than decompressed, even after an early answer (a gzip bomb without a token).
SERVER_OPTIONS: dict[str, Any] = {
    "access_log": None,
    "handler_cancellation": True,
    "auto_decompress": False,
}


def agent_handler(gw: Gateway) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """What answers on the agents' port: the health check, and the pipeline for the rest.

    There is no router: every request but ``GET /_capgate/health`` is an agent's call, and
    the pipeline reads only its raw target, so targets a router could not match (``OPTIONS
    *``, absolute form) get the target check's problem+json like any other refusal.
    """
    run = gw.pipeline.run

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.raw_path == HEALTH_PATH and request.method == "GET":
            return await _health(gw)
        return await run(request)

    return handle


def health_handler(gw: Gateway) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """What answers on the health listener (``--health-port``): ``GET /_capgate/health`` and
    nothing else. It is what a kubelet probes on the pod IP while the agents' port stays on
    loopback: no agent call, no admin route is ever served here."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.raw_path == HEALTH_PATH and request.method in ("GET", "HEAD"):
            return await _health(gw)
        return web.Response(status=404, text="only GET /_capgate/health is served here\n")

    return handle


def create_server(gw: Gateway) -> web.Server:
    """The agents' listener (aiohttp's low-level server: no router, no middleware, with the
    connection guard of ``listener.py``); its resources are opened by ``running(gw)``. Call
    within a running event loop."""
    return AgentServer(tracked(agent_handler(gw)), gw.guard, **SERVER_OPTIONS)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(asctime)s capgate %(levelname)s %(message)s",
    )
    # sqlglot logs the agent's raw SQL when it falls back to an opaque Command (which the
    # SQL check denies anyway); agent text may carry secrets, so it stays out of the logs.
    logging.getLogger("sqlglot").setLevel(logging.ERROR)


async def serve(
    settings: Settings,
    environ: Mapping[str, str],
    on_ready: Callable[[str], None] | None = None,
    *,
    listen: Listen | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (or until ``listen.main`` returns); then stop accepting, let
    calls finish (bounded), flush. Returns ``listen.main``'s result, else 0."""
    gw = build_gateway(settings, environ)
    async with running(gw):
        # What start-up built (modules, the policy, keys) lives as long as the process: keep
        # it out of the garbage collector's scans, which otherwise walk it on every full pass.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        code = await _listen(gw, settings, on_ready, listen or Listen())
    log.info("stopped; audit lines written: %d", gw.audit.lines_written)
    return code


@dataclass(frozen=True)
class Listen:
    """Where agents' calls come in, and what runs while they do: by default the configured
    host and port until SIGTERM/SIGINT; ``capgate sandbox run`` gives a socket made inside the
    sandbox's network namespace and the sandboxed command (``main``), whose result ends the
    gateway and becomes its exit status. The ready line goes to ``announce``."""

    sock: socket.socket | None = None
    url: str | None = None  # how agents reach ``sock``
    main: Callable[[asyncio.Event], Awaitable[int]] | None = None
    announce: TextIO | None = None  # None: standard output


CANCEL_WAIT = 0.5
"""Seconds aiohttp waits for calls cut at the end of the grace to unwind."""


async def _drain(gw: Gateway, runner: web.ServerRunner, grace: float) -> None:
    """Let calls in flight finish, up to ``grace`` seconds; idle connections close now."""
    server = runner.server
    if server is not None:
        server.pre_shutdown()  # closes idle connections; busy ones close after their answer
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while gw.guard.busy and loop.time() < deadline:
        await asyncio.sleep(min(0.05, max(deadline - loop.time(), 0)))
    if gw.guard.busy:
        log.warning("shutdown grace over: cutting %d call(s) still in flight", gw.guard.busy)


def _fit_connections(gw: Gateway) -> None:
    """Keep the cap on agent connections below what the descriptor limit leaves after the
    upstreams' connections (a flood must meet the cap, never EMFILE)."""
    upstreams = sum(up.concurrency for up in gw.policy.upstreams.values())
    budget = fd_budget(upstreams)
    if budget < 16:
        raise ConfigError(
            f"the file descriptor limit leaves room for {budget} agent connections after "
            f"{upstreams} upstream connections; raise it (ulimit -n) or lower the upstreams' "
            "limits.concurrency"
        )
    if gw.guard.max_connections > budget:
        log.warning(
            "max_connections %d lowered to %d to stay below the file descriptor limit",
            gw.guard.max_connections,
            budget,
        )
        gw.guard.max_connections = budget


async def _listen(
    gw: Gateway,
    settings: Settings,
    on_ready: Callable[[str], None] | None,
    listen: Listen,
) -> int:
    """Listen for agents (and operators) until SIGTERM/SIGINT or ``listen.main`` ends; then
    drain, bounded."""
    _fit_connections(gw)
    # The grace is kept here (``_drain``); aiohttp's own shutdown then only cancels what is
    # left, briefly, so SIGTERM ends within the grace and a second.
    runner = web.ServerRunner(create_server(gw), handle_signals=False, shutdown_timeout=CANCEL_WAIT)
    await runner.setup()
    site: web.BaseSite = (
        web.TCPSite(runner, settings.host, settings.port, backlog=1024)
        if listen.sock is None
        else web.SockSite(runner, listen.sock)
    )
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(
            f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}"
        ) from exc
    extra: list[web.BaseRunner] = []  # the admin and health listeners, cleaned up last
    admin_runner: web.AppRunner | None = None
    health_runner: web.ServerRunner | None = None
    try:
        if settings.admin_port is not None and gw.operators is not None:
            telemetry = gw.telemetry
            metrics = telemetry.prometheus_text if telemetry and telemetry.plan.prometheus else None
            admin_app = create_admin_app(gw, gw.operators, metrics=metrics)
            # Event streams never end by themselves: at shutdown they are cut after a moment.
            admin_runner = web.AppRunner(
                admin_app, handle_signals=False, access_log=None, shutdown_timeout=CANCEL_WAIT
            )
            await _start_site(
                admin_runner,
                extra,
                settings.admin_host or settings.host,
                settings.admin_port,
                "admin",
            )
        if settings.health_port is not None:
            health_runner = web.ServerRunner(
                web.Server(health_handler(gw), **SERVER_OPTIONS),
                handle_signals=False,
                shutdown_timeout=CANCEL_WAIT,
            )
            await _start_site(
                health_runner,
                extra,
                settings.health_host or settings.host,
                settings.health_port,
                "health",
            )
    except ConfigError:
        for other in reversed(extra):
            await other.cleanup()
        await runner.cleanup()
        raise
    port = runner.addresses[0][1] if runner.addresses else settings.port  # real port for 0
    url = listen.url or f"http://{settings.host}:{port}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {
        "ready": True,
        "url": url,
        "health": f"{url}{HEALTH_PATH}",
        "policy": str(settings.policy),
        "state": gw.state.backend,
        "admin": _runner_url(admin_runner, settings.admin_host or settings.host),
        "health_listener": _runner_url(health_runner, settings.health_host or settings.host),
        "pid": os.getpid(),
    }
    print(
        f"capgate {__version__} listening {json.dumps(ready)}",
        file=listen.announce or sys.stdout,
        flush=True,
    )
    if on_ready is not None:
        on_ready(url)
    code = 0
    try:
        if listen.main is None:
            await stop.wait()
        else:
            code = await listen.main(stop)
        log.info(
            "shutting down: no new calls; waiting up to %ss for calls in flight",
            settings.shutdown_grace,
        )
        await site.stop()
        await _drain(gw, runner, settings.shutdown_grace)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        # Calls still running now are cut: answered 503 where their answer has not started,
        # audited as gateway_stopping either way.
        gw.inflight.cut_all()
        await runner.cleanup()
        for other in reversed(extra):
            await other.cleanup()
    return code


async def _start_site(
    runner: web.BaseRunner, started: list[web.BaseRunner], host: str, port: int, name: str
) -> None:
    """Set up and start one more listener; ``started`` gets it (for the cleanup) at once."""
    await runner.setup()
    started.append(runner)
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port} ({name}): {exc.strerror}") from exc


def _runner_url(runner: web.BaseRunner | None, host: str) -> str | None:
    """The URL a listener was asked for, with its real port (port 0: any free one)."""
    if runner is None or not runner.addresses:
        return None
    port = runner.addresses[0][1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
