"""The record transport on its own: sampling, limits, streaming tees, upstream failures."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.recording.denial import Denial
from gateway.recording.format import INLINE_LIMIT
from gateway.recording.reader import load_recording
from gateway.transports.record import RecordTransport, RunLimits, keep_fraction
from tests.recording.helpers import FakeLive, FakeResponse, drain, mini_policy, request

POLICY = mini_policy()


def denial(run: str) -> Denial:
    return Denial(
        request_id="d1",
        agent="a",
        run=run,
        upstream="api",
        method="DELETE",
        target="/items",
        body=None,
        headers=(("Authorization", "Bearer xyz"),),
        reason="no_rule",
        rule=None,
        status=403,
        roles=("reader",),
    )


def test_keep_fraction_is_stable_and_close_to_the_fraction() -> None:
    runs = [f"run-{i}" for i in range(4000)]
    kept = [r for r in runs if keep_fraction(r, 0.1)]
    assert 320 < len(kept) < 480
    assert kept == [r for r in runs if keep_fraction(r, 0.1)]  # the same answer every time
    assert set(kept) <= {r for r in runs if keep_fraction(r, 0.5)}  # a larger fraction keeps more
    assert keep_fraction("x", 1.0) and not keep_fraction("x", 0.0)


async def test_sampling_keeps_runs_with_denials_errors_and_a_stable_fraction(
    tmp_path: Path,
) -> None:
    live = FakeLive(FakeResponse())
    rec = RecordTransport(live, tmp_path, sample=0.0)

    async def call(run: str) -> None:
        await drain(await rec.send(request(POLICY, "ping", "GET", "/ping", run=run)))

    await call("clean")
    await call("denied")
    rec.observe_denial(denial("denied"))
    live.answers = [FakeResponse(status=503)]
    await call("failing")
    live.answers = [UpstreamTimeout("slow")]
    with pytest.raises(UpstreamTimeout):
        await call("timeout")
    live.answers = [FakeResponse()]
    assert rec.end_run("clean") is False
    assert not (tmp_path / "runs" / "clean.jsonl").exists()
    await rec.close()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {r["run"]: r["kept"] for r in manifest["runs"]} == {
        "denied": "denial",
        "failing": "error",
        "timeout": "error",
    }
    assert manifest["sampling"] == {"fraction": 0.0, "dropped_runs": 1}
    assert live.closed
    # The fraction kept is chosen by the run id: the same ids are kept on every gateway.
    kept_by_hash = [r for r in (f"r{i}" for i in range(40)) if keep_fraction(r, 0.25)]
    rec2 = RecordTransport(FakeLive(FakeResponse()), tmp_path / "two", sample=0.25)
    for i in range(40):
        await drain(await rec2.send(request(POLICY, "ping", "GET", "/ping", run=f"r{i}")))
    await rec2.close()
    assert sorted(load_recording(tmp_path / "two").runs) == sorted(kept_by_hash)


async def test_idle_runs_end_on_their_own(tmp_path: Path) -> None:
    now = [0.0]
    rec = RecordTransport(
        FakeLive(FakeResponse()), tmp_path, sample=0.0, idle_end=60, clock=lambda: now[0]
    )
    await drain(await rec.send(request(POLICY, "ping", "GET", "/ping", run="quiet")))
    now[0] = 61.0
    await drain(await rec.send(request(POLICY, "ping", "GET", "/ping", run="busy")))
    assert "quiet" not in rec.sessions and not (tmp_path / "runs" / "quiet.jsonl").exists()
    await rec.close()


async def test_limits_cap_calls_and_bytes_per_run(tmp_path: Path) -> None:
    live = FakeLive(FakeResponse(chunks=[b"x" * 1000]))
    rec = RecordTransport(live, tmp_path, limits=RunLimits(max_calls=2, max_bytes=10_000))
    for _ in range(3):
        assert (
            await drain(await rec.send(request(POLICY, "ping", "GET", "/ping", run="r")))
            == b"x" * 1000
        )
    live.answers = [FakeResponse(chunks=[b"y" * 20_000])]
    resp = await rec.send(request(POLICY, "ping", "GET", "/ping", run="big"))
    assert await drain(resp) == b"y" * 20_000  # forwarded whole, not recorded
    await rec.close()
    recording = load_recording(tmp_path)
    assert len(recording.runs["r"].entries) == 2
    assert recording.runs["big"].entries == []
    manifest = {r["run"]: r for r in json.loads((tmp_path / "manifest.json").read_text())["runs"]}
    assert manifest["r"]["truncated"] == {"reason": "max_calls", "calls_not_recorded": 1}
    assert manifest["big"]["truncated"]["reason"] == "max_bytes"


async def test_streamed_bodies_are_teed_with_bounded_memory(tmp_path: Path) -> None:
    big = [bytes([65 + i % 26]) * 50_000 for i in range(6)]  # 300 kB in 6 chunks
    live = FakeLive(FakeResponse(chunks=big))

    async def upload() -> AsyncIterator[bytes]:
        for i in range(3):
            yield b'{"part": %d}' % i + b" " * 40_000

    rec = RecordTransport(live, tmp_path / "rec", spill_dir=tmp_path / "spill")
    (tmp_path / "spill").mkdir()
    req = request(POLICY, "create", "POST", "/items", run="s")
    req.body = upload()
    resp = await rec.send(req)
    got = await drain(resp)
    await rec.close()
    assert got == b"".join(big)
    sent = live.sent[0][1]
    assert sent is not None and len(sent) > INLINE_LIMIT
    [entry] = load_recording(tmp_path / "rec").runs["s"].entries
    assert entry.request_bytes() == sent
    assert entry.form == "digest" or entry.form == "text"
    assert entry.response is not None and entry.response.body is not None
    assert entry.response.body.blob is not None and entry.response.body.read() == got
    assert [n for _, n in entry.response.chunks] == [50_000] * 6
    assert list((tmp_path / "spill").iterdir()) == []  # spill files are gone


async def test_upstream_failures_are_recorded_and_raised_unchanged(tmp_path: Path) -> None:
    live = FakeLive(UpstreamUnavailable("upstream 'api' cannot be reached"))
    rec = RecordTransport(live, tmp_path)
    with pytest.raises(UpstreamUnavailable):
        await rec.send(request(POLICY, "ping", "GET", "/ping"))
    live.answers = [FakeResponse(chunks=[b"part"], fail_after=UpstreamTimeout("stopped"))]
    resp = await rec.send(request(POLICY, "ping", "GET", "/ping"))
    with pytest.raises(UpstreamTimeout):
        await drain(resp)
    await rec.close()
    first, second = load_recording(tmp_path).runs["default"].entries
    assert first.error is not None and first.error.reason == "upstream_unavailable"
    assert first.response is None and first.decision.status == 502
    assert second.error is not None and second.error.reason == "upstream_timeout"
    assert second.response is not None and second.response.body is not None
    assert second.response.body.read() == b"part" and not second.response.complete


async def test_denials_are_recorded_with_redacted_headers(tmp_path: Path) -> None:
    rec = RecordTransport(FakeLive(FakeResponse()), tmp_path)
    rec.observe_denial(denial("r"))
    await rec.close()
    [e] = load_recording(tmp_path).runs["r"].entries
    assert e.kind == "denial" and not e.decision.allowed and e.decision.status == 403
    assert e.request_headers == [("Authorization", {"redacted": "header"})]


async def test_a_recording_that_cannot_be_written_never_fails_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rec = RecordTransport(FakeLive(FakeResponse(chunks=[b"fine"])), tmp_path)

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rec.writer, "append", full)
    resp = await rec.send(request(POLICY, "ping", "GET", "/ping"))
    assert await drain(resp) == b"fine"
    rec.observe_denial(denial("r"))
    monkeypatch.setattr(rec.writer, "ensure_run", full)
    resp = await rec.send(request(POLICY, "ping", "GET", "/ping", run="new"))
    assert await drain(resp) == b"fine"
    await rec.close()
    assert "No space left on device" in caplog.text
