"""The in-process benches still run against the code they measure (they are not timed tests:
only that they run to the end and print their table). ``bench.telemetry_bench`` once broke
unnoticed when stages were added to the pipeline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench import sql_bench, telemetry_bench
from gateway.pipeline import CHECK_STAGES
from gateway.telemetry_plan import PHASES


def test_the_telemetry_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert telemetry_bench.main(["--calls", "5", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for name in telemetry_bench.CONFIGS:
        assert name in out


def test_every_traced_phase_names_check_stages() -> None:
    for _span, first, after in PHASES:
        assert first in CHECK_STAGES and after in CHECK_STAGES


def test_the_sql_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert sql_bench.main(["--calls", "3", "--no-pure"]) == 0
    out = capsys.readouterr().out
    assert "postgres:medium" in out and "sqlite:small" in out


def test_the_instruction_count_parses_a_callgrind_dump(tmp_path: Path) -> None:
    """``bench.instructions`` reads the instruction total of the dump written after it asked
    for one (not an older dump of another process)."""
    from bench import instructions

    out = tmp_path / "capgate.1.callgrind"
    old = tmp_path / "capgate.1.callgrind.1"
    old.write_text("events: Ir\nsummary: 5\n")
    (tmp_path / "capgate.1.callgrind.2").write_text(
        "# callgrind format\nevents: Ir\ntotals: 1234567\n"
    )
    assert instructions._dumped_instructions(out, {str(old)}) == 1234567
    assert instructions.Count("x", 10, 1234567).per_request == 123456.7


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_the_instruction_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """One scenario under callgrind for one second (the figure itself is not asserted)."""
    from bench import instructions

    assert instructions.main(["--scenarios", "capgate", "--seconds", "1", "--no-bare"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("capgate "))
    assert "instructions/request" in line
    assert float(line.split()[1].replace(",", "")) > 10_000


def test_the_sql_targets_read_the_in_process_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench.run`` reports the SQL check targets from ``sql_bench.measure`` (a few calls)."""
    from bench import run

    monkeypatch.setattr(run, "SQL_CHECK_CALLS", 3)
    rows = {t["name"]: t for t in run.sql_targets({}, run.measure_sql_check())}
    new_tree = next(t for name, t in rows.items() if "never seen" in name)
    cached = next(t for name, t in rows.items() if "cached" in name)
    assert new_tree["verdict"] in ("PASS", "FAIL") and new_tree["value"] > 0
    assert "SQLite, new text" in new_tree["detail"]
    assert cached["verdict"] in ("PASS", "FAIL") and cached["value"] > 0
    unique = [t for name, t in rows.items() if name.startswith("never-seen SQL")]
    assert len(unique) == 2 and all(t["verdict"] == "NOT MEASURED" for t in unique)


def test_the_telemetry_floor_loop_runs_and_its_arithmetic_holds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The floor's loop runs in every mode (callgrind is not run here: too slow for a test);
    the figure per call is the difference of two lengths, the loop's own cost taken out."""
    from bench import telemetry_floor

    for mode in telemetry_floor.MODES:
        telemetry_floor.child(mode, 20)
    per_call = {"base": 10, "audit": 60, "spans": 40, "both": 95}  # instructions a call
    monkeypatch.setattr(
        telemetry_floor, "count", lambda mode, calls: 1_000_000 + per_call[mode] * calls
    )
    assert telemetry_floor.per_call(100) == {"audit": 50, "spans": 30, "both": 85}
    assert telemetry_floor.main(["--calls", "100"]) == 0
    assert "audit and spans" in capsys.readouterr().out
