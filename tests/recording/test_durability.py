"""Recording at scale and through crashes: per-call work independent of the number of runs, a
bounded shutdown with many runs open, and a manifest mended from the records after a crash."""

from __future__ import annotations

import itertools
import json
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from gateway.commands.recording import cmd_recording_verify
from gateway.recording.reader import load_recording, tally_run_file
from gateway.recording.verify import repair, verify
from gateway.recording.writer import RecordingWriter
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
from tests.recording.test_sampling import denial

POLICY = mini_policy()
FIXTURES = Path(__file__).parent / "fixtures"


class Ticks:
    """A monotonic clock that moves 1 ms each time it is read."""

    def __init__(self) -> None:
        self._n = itertools.count()
        self.offset = 0.0

    def __call__(self) -> float:
        return next(self._n) * 0.001 + self.offset


@contextmanager
def gateway_work() -> Iterator[Counter[str]]:
    """Counts the Python work the gateway's own code does inside the block: one event per
    function call and per line executed (a loop over runs shows as lines per run), by
    function. A structural measure, not a timing: it does not vary with the machine's load."""
    counts: Counter[str] = Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        name = frame.f_code.co_filename
        if "/gateway/" not in name:
            return None
        counts[f"{name.rsplit('/gateway/', 1)[1]}:{frame.f_code.co_name}"] += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield counts
    finally:
        sys.settrace(previous)


def manifest(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "manifest.json").read_text())


def listed(directory: Path) -> dict[str, tuple[int, int, int]]:
    return {r["run"]: (r["calls"], r["denials"], r["errors"]) for r in manifest(directory)["runs"]}


async def call(rec: RecordTransport, run: str, rule: str = "ping") -> None:
    await drain(await rec.send(request(POLICY, rule, "GET", "/ping", run=run)))


# --- the cost of one call does not depend on how many runs there are -----------------------


async def test_work_per_call_does_not_grow_with_the_number_of_runs(tmp_path: Path) -> None:
    """Measured 166 -> 64 calls/s over 1,000 runs: every call rewrote an O(runs) manifest now
    and then and swept every open run. Now the gateway code a run's calls execute is the same
    for the 5th run as for the 995th, with 1,000 runs open."""
    clock = Ticks()
    rec = RecordTransport(FakeLive(FakeResponse()), tmp_path, clock=clock)
    runs = 1000
    work: dict[int, Counter[str]] = {}
    for r in range(runs):

        async def one_run(r: int = r) -> None:
            for _ in range(3):
                await call(rec, f"run-{r}")
            rec.observe_denial(denial(f"run-{r}"))

        if r in (5, runs - 5):
            with gateway_work() as counts:
                await one_run()
            work[r] = counts
        else:
            await one_run()
    assert len(rec.sessions) == runs  # all still open (idle for less than idle_end)
    early, late = work[5], work[runs - 5]
    grown = {k: (early[k], late[k]) for k in early.keys() | late.keys() if late[k] > early[k]}
    assert grown == {}, f"work that grew with the number of runs: {grown}"
    assert sum(late.values()) == sum(early.values())
    assert rec.writer.manifest_writes == 1  # the one at open; the next at close
    await rec.close()
    assert rec.writer.manifest_writes == 2
    assert len(listed(tmp_path)) == runs
    assert set(listed(tmp_path).values()) == {(3, 1, 0)}


async def test_the_idle_sweep_looks_at_idle_runs_only(tmp_path: Path) -> None:
    clock = Ticks()
    rec = RecordTransport(FakeLive(FakeResponse()), tmp_path, clock=clock, idle_end=10.0)
    for r in range(500):
        await call(rec, f"old-{r}")
    clock.offset += 20.0  # every run so far is idle now
    for r in range(500):
        await call(rec, f"new-{r}")
    assert list(rec.sessions) == [f"new-{r}" for r in range(500)]  # the first call ended them
    with gateway_work() as first:
        await call(rec, "new-0")
    with gateway_work() as again:
        await call(rec, "new-1")
    assert first["transports/record.py:_sweep"] == again["transports/record.py:_sweep"]
    await rec.close()
    assert len(listed(tmp_path)) == 1000


async def test_a_call_that_outlives_idle_end_keeps_its_run_open(tmp_path: Path) -> None:
    clock = Ticks()
    rec = RecordTransport(FakeLive(FakeResponse()), tmp_path, clock=clock, idle_end=10.0)
    slow = await rec.send(request(POLICY, "ping", "GET", "/ping", run="slow"))
    clock.offset += 20.0
    await call(rec, "other")
    assert "slow" in rec.sessions  # a call in flight: not ended under it
    await drain(slow)
    clock.offset += 5.0
    await call(rec, "other")
    assert "slow" in rec.sessions  # idle counts from the end of its last call
    await rec.close()
    assert listed(tmp_path) == {"slow": (1, 0, 0), "other": (2, 0, 0)}


# --- shutdown ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sample", [None, 0.5])
async def test_closing_with_many_runs_open_writes_the_manifest_once(
    tmp_path: Path, sample: float | None
) -> None:
    """SIGTERM took over 20 s with 1,000 runs open: ending each run rewrote the manifest
    (O(runs) each, O(runs^2) in all). Now the recorder ends every run, then writes once."""
    rec = RecordTransport(FakeLive(FakeResponse()), tmp_path, clock=Ticks(), sample=sample)
    runs = 2000
    for r in range(runs):
        await call(rec, f"run-{r}")
    writes = rec.writer.manifest_writes
    with gateway_work() as work:
        await rec.close()
    assert rec.writer.manifest_writes == writes + 1
    assert rec.sessions == {}
    # Linear in the runs: a bounded amount of work per run ended (no run visits the others).
    assert sum(work.values()) < 150 * runs
    kept = listed(tmp_path)
    if sample is None:
        assert len(kept) == runs
    else:
        assert 0.4 * runs < len(kept) < 0.6 * runs
        assert manifest(tmp_path)["sampling"]["dropped_runs"] == runs - len(kept)
        assert len(list((tmp_path / "runs").iterdir())) == len(kept)


# --- the manifest after a crash -------------------------------------------------------------


async def test_the_manifest_is_rewritten_at_most_once_per_interval(tmp_path: Path) -> None:
    clock = Ticks()
    rec = RecordTransport(FakeLive(FakeResponse()), tmp_path, clock=clock)
    for r in range(50):
        await call(rec, f"run-{r}")
    assert rec.writer.manifest_writes == 1 and listed(tmp_path) == {}
    clock.offset += rec.writer.manifest_interval
    await call(rec, "run-50")
    assert rec.writer.manifest_writes == 2 and len(listed(tmp_path)) == 51
    await call(rec, "run-51")
    assert rec.writer.manifest_writes == 2
    await rec.close()


def crashed_recording(directory: Path) -> None:
    """What a recorder killed with -9 leaves: a manifest from its last rewrite, records after
    it, runs it never listed, a torn last line."""
    writer = RecordingWriter(directory)
    writer.append(exchange(1, "/ping", b"1", run="r1"))
    writer.append(exchange(2, "/ping", b"2", run="r1", status=503))
    writer.write_manifest()  # the last rewrite before the crash
    writer.append(exchange(3, "/ping", b"3", run="r1"))
    writer.append(exchange(4, "/x", b"", run="r1", kind="denial"))
    writer.append(exchange(1, "/ping", b"1", run="r2"))
    writer.append(exchange(1, "/ping", b"1", run="odd run/id"))
    with (directory / "runs" / "r2.jsonl").open("ab") as fh:
        fh.write(b'{"seq": 2, "t": 0.2, "kind": "exch')  # killed in the middle of a write
    # (the writer is dropped without close: nothing else reaches the disk)


def test_verify_finds_a_stale_manifest_and_repair_mends_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crashed_recording(tmp_path)
    assert listed(tmp_path) == {"r1": (2, 0, 1)}
    report = verify(tmp_path)
    assert not report.ok
    text = report.text()
    assert "run 'r1' (runs/r1.jsonl): manifest says calls 2, the records hold 3" in text
    assert "manifest says denials 0, the records hold 1" in text
    assert "run 'r2' is not listed in the manifest" in text
    assert "r2.jsonl:2: the last line is truncated" in text
    assert cmd_recording_verify(tmp_path) == 1
    assert cmd_recording_verify(tmp_path, repair=True) == 0
    out = capsys.readouterr().out
    assert "repaired" in out and "3 run(s), 5 call(s), 1 denial(s), 1 error(s)" in out
    assert listed(tmp_path) == {"r1": (3, 1, 1), "r2": (1, 0, 0), "odd run/id": (1, 0, 0)}
    assert verify(tmp_path).ok and not load_recording(tmp_path).warnings
    assert repair(tmp_path).ok  # idempotent


def test_a_recorder_reopening_a_crashed_recording_mends_it_first(tmp_path: Path) -> None:
    crashed_recording(tmp_path)
    writer = RecordingWriter(tmp_path)
    assert listed(tmp_path) == {"r1": (3, 1, 1), "r2": (1, 0, 0), "odd run/id": (1, 0, 0)}
    assert writer.last_seq("r2") == 1  # the torn line was cut off before anything is appended
    writer.append(exchange(2, "/ping", b"2", run="r2"))
    writer.write_manifest()
    assert listed(tmp_path)["r2"] == (2, 0, 0)
    assert verify(tmp_path).ok


def test_reopening_counts_only_the_records_after_the_last_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed_recording(tmp_path)
    size = manifest(tmp_path)["runs"][0]["size"]
    starts: list[int] = []

    def spy(path: Path, start: int = 0) -> Any:
        starts.append(start)
        return tally_run_file(path, start)

    monkeypatch.setattr("gateway.recording.writer.tally_run_file", spy)
    RecordingWriter(tmp_path)
    assert sorted(starts) == [0, 0, size]  # two unlisted runs from 0; r1 from its checkpoint
    starts.clear()
    writes = RecordingWriter(tmp_path).manifest_writes
    # Mended and rewritten: only r2's torn last line lies beyond a checkpoint, and it is no
    # record, so nothing changes and the manifest is not rewritten.
    r2 = next(r for r in manifest(tmp_path)["runs"] if r["run"] == "r2")
    assert starts == [r2["size"]] and writes == 0


def test_a_listed_run_whose_file_is_gone_is_dropped(tmp_path: Path) -> None:
    write(tmp_path, exchange(1, "/ping", b"1", run="a"), exchange(1, "/ping", b"1", run="b"))
    (tmp_path / "runs" / "b.jsonl").unlink()
    RecordingWriter(tmp_path)
    assert listed(tmp_path) == {"a": (1, 0, 0)}


def test_replay_reads_runs_the_manifest_does_not_list(tmp_path: Path) -> None:
    crashed_recording(tmp_path)
    rec = load_recording(tmp_path)
    assert sorted(rec.runs) == ["odd run/id", "r1", "r2"]
    assert any("run 'r2' is not listed" in w for w in rec.warnings)
    ReplayTransport(tmp_path)  # loads


def test_a_recording_from_before_size_checkpoints_is_read_and_mended(tmp_path: Path) -> None:
    old = FIXTURES / "example-before-size"
    assert "size" not in json.dumps(manifest(old))
    assert verify(old).ok
    copy = tmp_path / "example"
    shutil.copytree(old, copy)
    RecordingWriter(copy)  # counts every record once, then checkpoints
    runs = manifest(copy)["runs"]
    assert runs[0]["size"] == (copy / "runs" / "example.jsonl").stat().st_size
    assert (runs[0]["calls"], runs[0]["denials"]) == (3, 1)
    assert (copy / "runs" / "example.jsonl").read_bytes() == (
        old / "runs" / "example.jsonl"
    ).read_bytes()
