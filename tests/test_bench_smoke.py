"""The in-process benches still run against the code they measure (they are not timed tests:
only that they run to the end and print their table). ``bench.telemetry_bench`` once broke
unnoticed when stages were added to the pipeline."""

from __future__ import annotations

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
