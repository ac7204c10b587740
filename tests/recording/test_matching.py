"""Replay matching: nth call, exhaustion, repeat-last, per-run isolation, explained misses."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gateway.errors import ReplayMiss, UpstreamUnavailable
from gateway.recording.matching import Matcher, ReplayMissed, make_probe
from gateway.recording.model import ErrorInfo
from gateway.recording.reader import load_recording
from gateway.transports.replay import ReplayTransport
from tests.recording.helpers import drain, exchange, mini_policy, request, write

POLICY = mini_policy()
ITEMS = POLICY.rules_by_id["items"]
CREATE = POLICY.rules_by_id["create"]


@pytest.fixture
def recording_dir(tmp_path: Path) -> Path:
    return write(
        tmp_path / "rec",
        exchange(1, "/items?window=5m", b"first", rule=ITEMS),
        exchange(2, "/items?window=5m", b"second", rule=ITEMS),
        exchange(3, "/items?window=15m", b"other", rule=ITEMS),
        exchange(
            4,
            "/items",
            b'{"id": 1}',
            method="POST",
            body=b'{"service": "web", "n": 1}',
            rule=CREATE,
        ),
        exchange(5, "/admin", b"", kind="denial"),
    )


def probe(target: str, rule=ITEMS, method: str = "GET", body: bytes | None = None):  # type: ignore[no-untyped-def]
    return make_probe("api", method, target, body, rule)


def test_the_nth_identical_call_gets_the_nth_recording(recording_dir: Path) -> None:
    state = Matcher(load_recording(recording_dir)).state("r1")
    assert state.answer(probe("/items?window=5m")).seq == 1
    assert state.answer(probe("/items?window=15m")).seq == 3
    assert state.answer(probe("/items?window=5m")).seq == 2
    with pytest.raises(ReplayMissed) as info:
        state.answer(probe("/items?window=5m"))
    miss = info.value.miss
    assert miss.kind == "exhausted"
    assert "all 2 recording(s)" in miss.detail() and "repeat_last: true" in miss.detail()
    assert "rule 'items'" in miss.detail()


@pytest.mark.parametrize("option", [True, {"items"}])
def test_repeat_last_answers_again_with_the_last_recording(
    recording_dir: Path, option: object
) -> None:
    state = Matcher(load_recording(recording_dir), repeat_last=option).state("r1")  # type: ignore[arg-type]
    seqs = [state.answer(probe("/items?window=5m")).seq for _ in range(4)]
    assert seqs == [1, 2, 2, 2] and state.repeats == 2


def test_repeat_last_is_per_rule(recording_dir: Path) -> None:
    state = Matcher(load_recording(recording_dir), repeat_last={"create"}).state("r1")
    state.answer(probe("/items?window=15m"))
    with pytest.raises(ReplayMissed):
        state.answer(probe("/items?window=15m"))


def test_runs_are_isolated(recording_dir: Path) -> None:
    matcher = Matcher(load_recording(recording_dir))
    a, b = matcher.state("job-a"), matcher.state("job-b")
    assert a.answer(probe("/items?window=5m")).seq == 1
    assert b.answer(probe("/items?window=5m")).seq == 1  # b is not affected by a
    assert a.answer(probe("/items?window=5m")).seq == 2
    assert b.answer(probe("/items?window=5m")).seq == 2
    assert matcher.state("job-a") is a


async def test_parallel_runs_through_the_transport(recording_dir: Path) -> None:
    transport = ReplayTransport(recording_dir)

    async def run(name: str) -> list[bytes]:
        out = []
        for _ in range(2):
            resp = await transport.send(
                request(POLICY, "items", "GET", "/items?window=5m", run=name)
            )
            out.append(await drain(resp))
            await asyncio.sleep(0)
        return out

    results = await asyncio.gather(*(run(f"job-{i}") for i in range(5)))
    assert results == [[b"first", b"second"]] * 5


def test_a_miss_names_the_nearest_recordings_and_the_fields_that_differ(
    recording_dir: Path,
) -> None:
    state = Matcher(load_recording(recording_dir)).state("r1")
    with pytest.raises(ReplayMissed) as info:
        state.answer(probe("/items?window=1m"))
    miss = info.value.miss
    assert miss.kind == "no_match" and len(miss.nearest) == 3
    detail = miss.detail()
    assert "GET api /items?window=1m" in detail
    assert "query.window: '1m' != '5m'" in detail
    errors = miss.errors()
    assert errors[0]["recording"] == "runs/r1.jsonl#1"
    assert errors[0]["differences"] == [{"field": "query.window", "call": "1m", "recorded": "5m"}]
    with pytest.raises(ReplayMissed) as info:
        state.answer(probe("/items", CREATE, "POST", b'{"n": 1, "service": "db"}'))
    best = info.value.miss.nearest[0]
    assert best.entry.seq == 4
    assert [str(d) for d in best.differences] == ["body./service: '\"db\"' != '\"web\"'"]


def test_a_recorded_denial_is_shown_as_such_in_a_miss(recording_dir: Path) -> None:
    state = Matcher(load_recording(recording_dir)).state("r1")
    with pytest.raises(ReplayMissed) as info:
        state.answer(probe("/admin", None))
    assert "decision: 'allowed' != 'denied (no_rule)'" in info.value.miss.detail()


def test_runs_map_by_id_by_single_run_or_explicitly(tmp_path: Path) -> None:
    two = write(
        tmp_path / "two", exchange(1, "/ping", b"a", run="a"), exchange(1, "/ping", b"b", run="b")
    )
    matcher = Matcher(load_recording(two))
    assert matcher.state("b").answer(probe("/ping", None)).run == "b"
    with pytest.raises(ReplayMissed) as info:
        matcher.state("c").answer(probe("/ping", None))
    assert "has no run 'c' to replay (runs: a, b)" in info.value.miss.detail()
    assert (
        Matcher(load_recording(two), run_map={"c": "a"}).state("c").answer(probe("/ping", None)).run
        == "a"
    )
    one = write(tmp_path / "one", exchange(1, "/ping", b"a", run="only"))
    assert Matcher(load_recording(one)).state("anything").answer(probe("/ping", None)).run == "only"


def test_report_lists_misses_unused_and_unexpected_denials(recording_dir: Path) -> None:
    matcher = Matcher(load_recording(recording_dir))
    state = matcher.state("r1")
    state.answer(probe("/items?window=5m"))
    with pytest.raises(ReplayMissed):
        state.answer(probe("/items?window=1m"))
    state.denial(probe("/nope", None), "no_rule")
    report = matcher.report()
    data = report.as_dict()
    assert not report.ok
    assert data["counts"] == {
        "served": 1,
        "misses": 1,
        "unused": 4,
        "unexpected_denials": 1,
        "differences": 0,
        "recorded": 0,
    }
    assert [u["recording"] for u in data["unused"]] == [
        "runs/r1.jsonl#2",
        "runs/r1.jsonl#3",
        "runs/r1.jsonl#4",
        "runs/r1.jsonl#5",
    ]
    text = report.text()
    assert "1 miss(es), 4 recording(s) never used" in text
    assert "runs/r1.jsonl#5 denial GET api /admin" in text
    assert "not denied when recorded" in text
    json.dumps(data)  # serialisable


async def test_replay_transport_raises_replay_miss_with_structured_errors(
    recording_dir: Path,
) -> None:
    transport = ReplayTransport(recording_dir)
    with pytest.raises(ReplayMiss) as info:
        await transport.send(request(POLICY, "items", "GET", "/items?window=1m", run="r1"))
    err = info.value
    assert err.status == 421 and err.rule == "items"
    assert err.errors and err.errors[0]["differences"][0]["field"] == "query.window"
    problem = err.problem("rid")
    assert problem["reason"] == "replay_miss" and "query.window" in problem["detail"]


async def test_recorded_upstream_failures_are_replayed(tmp_path: Path) -> None:
    ex = exchange(1, "/ping", b"")
    ex.response = None
    ex.error = ErrorInfo("upstream_unavailable", 502, "upstream 'api' cannot be reached")
    part = exchange(2, "/items", b"partial", rule=ITEMS)
    part.error = ErrorInfo("upstream_timeout", 504, "the upstream stopped sending")
    transport = ReplayTransport(write(tmp_path, ex, part))
    with pytest.raises(UpstreamUnavailable, match="cannot be reached"):
        await transport.send(request(POLICY, "ping", "GET", "/ping"))
    resp = await transport.send(request(POLICY, "items", "GET", "/items"))
    got = b""
    with pytest.raises(TimeoutError):
        async for chunk in resp.iter_chunks():
            got += chunk
    assert got == b"partial"


async def test_replay_reproduces_status_headers_and_chunks(tmp_path: Path) -> None:
    events = [b"id: 1\ndata: a\n\n", b"id: 2\ndata: b\n\n", b"id: 3\ndata: c\n\n"]
    write(
        tmp_path,
        exchange(
            1,
            "/items",
            b"".join(events),
            rule=ITEMS,
            status=201,
            headers=[("Content-Length", "999"), ("X-Thing", "1")],
            chunks=[(0.0, 15), (0.05, 15), (0.1, 15)],
        ),
    )
    resp = await ReplayTransport(tmp_path).send(request(POLICY, "items", "GET", "/items"))
    assert resp.status == 201 and resp.headers["X-Thing"] == "1"
    assert resp.headers["Content-Length"] == str(sum(map(len, events)))
    assert [c async for c in resp.iter_chunks()] == events


def test_replay_transport_has_no_way_out(recording_dir: Path) -> None:
    transport = ReplayTransport(recording_dir)
    assert not any(
        "session" in name or "live" in name or "connector" in name for name in vars(transport)
    )
