"""Replay matching: per-run queues of recorded answers, and misses that explain themselves.

State is per live run (the token's ``run`` claim), never global: two runs replaying at once
each get every recording once, in order, whatever the other does. A live run replays the
recorded run with the same id; when the recording has exactly one run, every live run
replays that one (CI usually mints a fresh run id per job); ``run_map`` overrides both.

For one live run, each call is reduced to its key (``canonical.call_key``, with the volatile
fields of the rule that allowed it) and answered by the first recording with that key that
this run has not used yet: the nth identical call gets the nth recorded answer. When they are
used up the call misses, unless the rule may repeat its last answer (``repeat_last``: the
constructor option, a set of rule ids, or a rule attribute ``replay_repeat_last`` set by the
policy loader from ``replay: {repeat_last: true}``).

A miss names the three nearest recordings, by a similarity over upstream, method, path
segments, query parameters and JSON body fields, with the fields that differ::

    query.window: '1m' != '5m'          (this call != recorded)
    body./service: 'db' != 'web'

``Matcher.report()`` is the end-of-run report: misses, recordings never used, denials that
did not happen when recorded, and (shadow mode) responses that differ.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.recording.canonical import (
    CallKey,
    Form,
    call_key,
    canonical_body,
    recanonicalise,
    sql_fields,
)
from gateway.recording.format import run_id
from gateway.recording.model import Entry, RecordedRun, Recording
from gateway.recording.redact import DEFAULT_REDACTOR, STRUCTURED_LIMIT, KnownSecret, Redactor

if TYPE_CHECKING:
    from gateway.policy.model import Rule

NEAREST = 3
MAX_DIFFERENCES = 6
MAX_REPORTED = 1000  # items per list in a report; the counts stay exact
WEIGHTS = {"upstream": 3.0, "method": 2.0, "path": 3.0, "query": 2.0, "body": 2.0}


def _short(value: Any, limit: int = 48) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class Difference:
    field: str
    call: str | None  # None: absent in this call
    recorded: str | None  # None: absent in the recording

    def __str__(self) -> str:
        call = repr(self.call) if self.call is not None else "(absent)"
        rec = repr(self.recorded) if self.recorded is not None else "(absent)"
        return f"{self.field}: {call} != {rec}"

    def as_json(self) -> dict[str, Any]:
        return {"field": self.field, "call": self.call, "recorded": self.recorded}


@dataclass(frozen=True, slots=True)
class Probe:
    """An incoming call, redacted and canonical, ready to be matched."""

    upstream: str
    method: str
    target: str
    form: Form | None
    canonical: str | None
    rule: Rule | None
    key: CallKey

    @property
    def rule_id(self) -> str | None:
        return self.rule.id if self.rule is not None else None

    def describe(self) -> str:
        return f"{self.method} {self.upstream} {self.target}"


def make_probe(
    upstream: str,
    method: str,
    target: str,
    body: bytes | None,
    rule: Rule | None,
    secrets: Iterable[KnownSecret] = (),
    redactor: Redactor = DEFAULT_REDACTOR,
) -> Probe:
    """Redact and canonicalise a call exactly as the recorder did when it wrote one."""
    secrets = tuple(secrets)
    red_target = redactor.target(target, secrets)
    form: Form | None
    canonical: str | None
    if not body:
        form, canonical = None, None
    else:
        data = redactor.body(body, secrets).data
        if len(data) > STRUCTURED_LIMIT:
            form, canonical = "digest", "sha256:" + hashlib.sha256(data).hexdigest()
        else:
            form, canonical = canonical_body(data, rule)
    volatile = rule.volatile if rule is not None else ()
    key = call_key(upstream, method, red_target, form, canonical, volatile)
    return Probe(upstream, method.upper(), red_target, form, canonical, rule, key)


def _rule_signature(rule: Rule | None) -> tuple[Any, ...]:
    if rule is None:
        return ()
    fields = tuple((f.pointer, f.dialect) for f in sql_fields(rule))
    return (rule.id, tuple(rule.volatile), fields)


def _flatten(
    doc: Any, prefix: str = "", out: dict[str, str] | None = None, limit: int = 500
) -> dict[str, str]:
    out = {} if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(doc, dict) and doc:
        for k, v in doc.items():
            _flatten(v, f"{prefix}/{str(k).replace('~', '~0').replace('/', '~1')}", out, limit)
    elif isinstance(doc, list) and doc:
        for i, v in enumerate(doc):
            _flatten(v, f"{prefix}/{i}", out, limit)
    else:
        out[prefix or "/"] = json.dumps(doc, ensure_ascii=False, sort_keys=True)
    return out


def _body_view(key: CallKey, form: Form | None) -> dict[str, str] | str | None:
    if key.body is None:
        return None
    if form == "json":
        try:
            return _flatten(json.loads(key.body))
        except ValueError:
            return key.body
    return key.body


def _ratio(same: float, total: float) -> float:
    return 1.0 if total == 0 else same / total


def compare(probe: Probe, entry: Entry, entry_key: CallKey) -> tuple[float, list[Difference]]:
    """Similarity in [0, 1] and the differing fields (this call vs the recording)."""
    a, b = probe.key, entry_key
    diffs: list[Difference] = []
    score = 0.0
    if a.upstream == b.upstream:
        score += WEIGHTS["upstream"]
    else:
        diffs.append(Difference("upstream", a.upstream, b.upstream))
    if a.method == b.method:
        score += WEIGHTS["method"]
    else:
        diffs.append(Difference("method", a.method, b.method))
    sa, sb = a.path.split("/"), b.path.split("/")
    same = sum(1 for x, y in zip(sa, sb, strict=False) if x == y)
    score += WEIGHTS["path"] * _ratio(same, max(len(sa), len(sb)))
    if a.path != b.path:
        diffs.append(Difference("path", a.path, b.path))
    qa: dict[str, list[str]] = {}
    qb: dict[str, list[str]] = {}
    for k, v in a.query:
        qa.setdefault(k, []).append(v)
    for k, v in b.query:
        qb.setdefault(k, []).append(v)
    names = sorted(set(qa) | set(qb))
    same_q = 0
    for name in names:
        va, vb = qa.get(name), qb.get(name)
        if va == vb:
            same_q += 1
        else:
            diffs.append(
                Difference(
                    f"query.{name}",
                    ",".join(va) if va is not None else None,
                    ",".join(vb) if vb is not None else None,
                )
            )
    if a.query != b.query and same_q == len(names):
        diffs.append(
            Difference(
                "query order",
                "&".join(f"{k}={v}" for k, v in a.query),
                "&".join(f"{k}={v}" for k, v in b.query),
            )
        )
    score += WEIGHTS["query"] * _ratio(same_q, len(names))
    ba, bb = _body_view(a, probe.form), _body_view(b, entry.form)
    if isinstance(ba, dict) and isinstance(bb, dict):
        keys = sorted(set(ba) | set(bb))
        same_b = 0
        for k in keys:
            if ba.get(k) == bb.get(k):
                same_b += 1
            else:
                diffs.append(
                    Difference(
                        f"body.{k}",
                        _short(ba[k]) if k in ba else None,
                        _short(bb[k]) if k in bb else None,
                    )
                )
        score += WEIGHTS["body"] * _ratio(same_b, len(keys))
    elif ba == bb:
        score += WEIGHTS["body"]
    else:
        diffs.append(
            Difference(
                "body",
                _short(ba) if isinstance(ba, str) else (None if ba is None else "(JSON)"),
                _short(bb) if isinstance(bb, str) else (None if bb is None else "(JSON)"),
            )
        )
    if entry.kind == "denial":
        diffs.append(Difference("decision", "allowed", f"denied ({entry.decision.reason})"))
        score -= 0.5
    total = sum(WEIGHTS.values())
    return max(score, 0.0) / total, diffs[: MAX_DIFFERENCES + 1]


@dataclass(slots=True)
class Candidate:
    entry: Entry
    score: float
    differences: list[Difference]

    def as_json(self) -> dict[str, Any]:
        return {
            "recording": self.entry.ref,
            "line": self.entry.line,
            "call": self.entry.describe(),
            "score": round(self.score, 3),
            "differences": [d.as_json() for d in self.differences[:MAX_DIFFERENCES]],
        }

    def describe(self) -> str:
        shown = "; ".join(str(d) for d in self.differences[:MAX_DIFFERENCES]) or "same key"
        return f"{self.entry.ref} {self.entry.describe()} [{shown}]"


@dataclass(slots=True)
class Miss:
    """Why a call had no recorded answer."""

    run: str
    source: str | None
    call: str
    rule: str | None
    kind: str  # "no_match" | "exhausted" | "no_run"
    nearest: list[Candidate] = field(default_factory=list)
    used: list[str] = field(default_factory=list)  # for "exhausted": the recordings used
    available_runs: list[str] = field(default_factory=list)

    def detail(self) -> str:
        where = f"run {self.run!r}" + (
            f" (replaying recorded run {self.source!r})"
            if self.source not in (None, self.run)
            else ""
        )
        if self.kind == "no_run":
            return (
                f"the recording has no run {self.run!r} to replay (runs: "
                f"{', '.join(self.available_runs) or 'none'}); no answer for {self.call}"
            )
        if self.kind == "exhausted":
            rule = f"rule {self.rule!r}" if self.rule else "the rule"
            return (
                f"all {len(self.used)} recording(s) of {self.call} in {where} were already used "
                f"({', '.join(self.used)}); the nth identical call gets the nth recording. To "
                f"answer later calls with the last one, set replay: {{repeat_last: true}} on {rule}"
            )
        if not self.nearest:
            return f"no recording in {where} matches {self.call}, and it has no recordings"
        near = "; ".join(f"({i}) {c.describe()}" for i, c in enumerate(self.nearest, start=1))
        return (
            f"no recording in {where} matches {self.call}; nearest (this call != recorded): {near}"
        )

    def errors(self) -> list[dict[str, Any]]:
        return [c.as_json() for c in self.nearest]

    def as_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "source": self.source,
            "call": self.call,
            "rule": self.rule,
            "kind": self.kind,
            "detail": self.detail(),
            "nearest": self.errors(),
        }


class ReplayMissed(Exception):
    """Raised by ``RunState.answer`` with the explained ``Miss``."""

    def __init__(self, miss: Miss) -> None:
        super().__init__(miss.detail())
        self.miss = miss


def _redacted_today(e: Entry) -> tuple[str, str | None]:
    """A recorded target and canonical body under this capgate's redaction. A call is
    redacted before it is matched; redaction only learns (never forgets) what to hide, and
    redacting twice changes nothing, so redacting the recorded side again lets a recording
    made before the redaction learned something still match."""
    target = DEFAULT_REDACTOR.target(e.target)
    canonical = e.canonical
    if canonical is not None and e.form in ("json", "text"):
        red = DEFAULT_REDACTOR.body(canonical.encode())
        if red.changed:
            canonical = canonical_body(red.data, None)[1]
    return target, canonical


class RunState:
    """One live run's replay: which recordings it has used, its misses."""

    def __init__(
        self,
        live_run: str,
        source: RecordedRun | None,
        repeat_last: bool | Collection[str],
        available: list[str],
    ) -> None:
        self.run = live_run
        self.source = source
        self.entries: list[Entry] = source.entries if source is not None else []
        self.used = [False] * len(self.entries)
        self.repeat_last = repeat_last
        self.available = available
        self.served = 0
        self.repeats = 0
        self.misses: list[Miss] = []
        self.unexpected_denials: list[dict[str, Any]] = []
        self.differences: list[dict[str, Any]] = []
        self.recorded: list[str] = []  # replay-or-record: calls forwarded and recorded
        self._index: dict[tuple[str, str, str], list[int]] = {}
        self._keys: dict[tuple[int, tuple[Any, ...]], CallKey] = {}
        for i, e in enumerate(self.entries):
            path = e.target.partition("?")[0]
            self._index.setdefault((e.upstream or "", e.method, path), []).append(i)

    def _key(self, i: int, rule: Rule | None) -> CallKey:
        sig = _rule_signature(rule)
        cached = self._keys.get((i, sig))
        if cached is None:
            e = self.entries[i]
            target, canonical = _redacted_today(e)
            canonical = recanonicalise(e.form, canonical, rule)
            volatile = rule.volatile if rule is not None else ()
            cached = call_key(e.upstream or "", e.method, target, e.form, canonical, volatile)
            self._keys[(i, sig)] = cached
        return cached

    def _matching(self, probe: Probe, kind: str) -> list[int]:
        bucket = self._index.get((probe.upstream, probe.method, probe.key.path), [])
        return [
            i
            for i in bucket
            if self.entries[i].kind == kind and self._key(i, probe.rule) == probe.key
        ]

    def _may_repeat(self, rule: Rule | None) -> bool:
        if getattr(rule, "replay_repeat_last", False):
            return True
        if isinstance(self.repeat_last, bool):
            return self.repeat_last
        return rule is not None and rule.id in self.repeat_last

    def nearest(self, probe: Probe, n: int = NEAREST) -> list[Candidate]:
        scored = [
            Candidate(e, *compare(probe, e, self._key(i, probe.rule)))
            for i, e in enumerate(self.entries)
        ]
        scored.sort(key=lambda c: (-c.score, c.entry.seq))
        return scored[:n]

    def answer(self, probe: Probe) -> Entry:
        """The recorded exchange for this call; ``ReplayMissed`` when there is none."""
        if self.source is None:
            miss = Miss(
                self.run,
                None,
                probe.describe(),
                probe.rule_id,
                "no_run",
                available_runs=self.available,
            )
            self.misses.append(miss)
            raise ReplayMissed(miss)
        matching = self._matching(probe, "exchange")
        for i in matching:
            if not self.used[i]:
                self.used[i] = True
                self.served += 1
                return self.entries[i]
        if matching and self._may_repeat(probe.rule):
            self.repeats += 1
            self.served += 1
            return self.entries[matching[-1]]
        if matching:
            miss = Miss(
                self.run,
                self.source.run,
                probe.describe(),
                probe.rule_id,
                "exhausted",
                used=[self.entries[i].ref for i in matching],
            )
        else:
            miss = Miss(
                self.run,
                self.source.run,
                probe.describe(),
                probe.rule_id,
                "no_match",
                nearest=self.nearest(probe),
            )
        self.misses.append(miss)
        raise ReplayMissed(miss)

    def denial(self, probe: Probe, reason: str) -> Entry | None:
        """Mark the recorded denial this denial reproduces; note it when there is none."""
        for i in self._matching(probe, "denial"):
            if not self.used[i]:
                self.used[i] = True
                return self.entries[i]
        self.unexpected_denials.append(
            {"run": self.run, "call": probe.describe(), "reason": reason, "rule": probe.rule_id}
        )
        return None


class Matcher:
    """Replay state of every live run of one process, over one loaded recording."""

    def __init__(
        self,
        recording: Recording,
        *,
        repeat_last: bool | Collection[str] = False,
        run_map: Mapping[str, str] | None = None,
    ) -> None:
        self.recording = recording
        self.repeat_last = repeat_last if isinstance(repeat_last, bool) else frozenset(repeat_last)
        self.run_map = dict(run_map or {})
        self.states: dict[str, RunState] = {}

    def source_for(self, live_run: str) -> RecordedRun | None:
        runs = self.recording.runs
        if live_run in self.run_map:
            return runs.get(self.run_map[live_run])
        if live_run in runs:
            return runs[live_run]
        if len(runs) == 1:
            return next(iter(runs.values()))
        return None

    def state(self, run: str | None) -> RunState:
        live = run_id(run)
        state = self.states.get(live)
        if state is None:
            state = RunState(
                live, self.source_for(live), self.repeat_last, sorted(self.recording.runs)
            )
            self.states[live] = state
        return state

    def report(self, mode: str = "replay") -> ReplayReport:
        used: dict[str, set[int]] = {}
        for st in self.states.values():
            if st.source is None:
                continue
            mark = used.setdefault(st.source.run, set())
            mark.update(i for i, u in enumerate(st.used) if u)
        unused: list[dict[str, Any]] = []
        for name, rec in sorted(self.recording.runs.items()):
            seen = used.get(name, set())
            for i, e in enumerate(rec.entries):
                if i not in seen:
                    unused.append(
                        {"run": name, "recording": e.ref, "kind": e.kind, "call": e.describe()}
                    )
        runs = [
            {
                "run": st.run,
                "source": st.source.run if st.source else None,
                "served": st.served,
                "repeats": st.repeats,
                "misses": len(st.misses),
                "recorded": len(st.recorded),
            }
            for st in sorted(self.states.values(), key=lambda s: s.run)
        ]
        misses = [m.as_json() for st in self.states.values() for m in st.misses]
        unexpected = [d for st in self.states.values() for d in st.unexpected_denials]
        differences = [d for st in self.states.values() for d in st.differences]
        recorded = [{"run": st.run, "call": c} for st in self.states.values() for c in st.recorded]
        return ReplayReport(
            mode,
            runs,
            misses,
            unused,
            unexpected,
            differences,
            recorded=recorded,
            warnings=list(self.recording.warnings),
        )


@dataclass(slots=True)
class ReplayReport:
    """The end-of-run report: misses, recordings never used, and what differed."""

    mode: str
    runs: list[dict[str, Any]]
    misses: list[dict[str, Any]]
    unused: list[dict[str, Any]]
    unexpected_denials: list[dict[str, Any]]
    differences: list[dict[str, Any]]
    recorded: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.misses

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "ok": self.ok,
            "counts": {
                "served": sum(r["served"] for r in self.runs),
                "misses": len(self.misses),
                "unused": len(self.unused),
                "unexpected_denials": len(self.unexpected_denials),
                "differences": len(self.differences),
                "recorded": len(self.recorded),
            },
            "runs": self.runs,
            "misses": self.misses[:MAX_REPORTED],
            "unused": self.unused[:MAX_REPORTED],
            "unexpected_denials": self.unexpected_denials[:MAX_REPORTED],
            "differences": self.differences[:MAX_REPORTED],
            "recorded": self.recorded[:MAX_REPORTED],
            "warnings": self.warnings,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplayReport:
        return cls(
            mode=str(data.get("mode", "replay")),
            runs=list(data.get("runs", [])),
            misses=list(data.get("misses", [])),
            unused=list(data.get("unused", [])),
            unexpected_denials=list(data.get("unexpected_denials", [])),
            differences=list(data.get("differences", [])),
            recorded=list(data.get("recorded", [])),
            warnings=list(data.get("warnings", [])),
        )

    def text(self) -> str:
        served = sum(r["served"] for r in self.runs)
        lines = [
            f"{self.mode} report: {served} call(s) answered from the recording, "
            f"{len(self.misses)} miss(es), {len(self.unused)} recording(s) never used"
            + (f", {len(self.differences)} difference(s)" if self.differences else "")
            + (
                f", {len(self.unexpected_denials)} unexpected denial(s)"
                if self.unexpected_denials
                else ""
            )
            + (f", {len(self.recorded)} call(s) recorded" if self.recorded else "")
        ]
        for m in self.misses[:50]:
            lines.append(f"  miss    {m['detail']}")
        for u in self.unused[:50]:
            lines.append(f"  unused  {u['recording']} {u['kind']} {u['call']}")
        for d in self.unexpected_denials[:50]:
            lines.append(
                f"  denied  run {d['run']!r}: {d['call']} ({d['reason']}), not denied when recorded"
            )
        for d in self.differences[:50]:
            lines.append(f"  differs run {d['run']!r}: {d['call']}: {'; '.join(d['differences'])}")
        for w in self.warnings:
            lines.append(f"  warning {w}")
        hidden = sum(max(len(x) - 50, 0) for x in (self.misses, self.unused, self.differences))
        if hidden:
            lines.append(f"  ... and {hidden} more (see the JSON report)")
        return "\n".join(lines)
