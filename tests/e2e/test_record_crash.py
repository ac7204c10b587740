"""``capgate serve --record`` as a real subprocess: killed with -9, restarted, stopped with
many runs open. The manifest ends up saying what the run files hold."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from mocks.demo import Workspace
from tests.conftest import ROOT, Mocks
from tests.e2e.test_serve import start_capgate

pytestmark = pytest.mark.e2e

GRACE = 10.0  # --shutdown-grace of these gateways


class Agent:
    """Calls through one keep-alive connection (hundreds of calls stay quick)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)

    def call(self, method: str, path: str, token: str) -> int:
        self.conn.request(method, path, headers={"Authorization": f"Bearer {token}"})
        resp = self.conn.getresponse()
        resp.read()
        return resp.status

    def close(self) -> None:
        self.conn.close()


def capgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def runs_listed(directory: Path) -> dict[str, tuple[int, int]]:
    manifest = json.loads((directory / "manifest.json").read_text())
    return {r["run"]: (r["calls"], r["denials"]) for r in manifest["runs"]}


def record_runs(served: dict[str, Any], ws: Workspace, runs: range, denials: bool) -> None:
    agent = Agent(served["url"])
    try:
        for r in runs:
            tok = ws.token("sre-bot", ["sre-diagnostics"], run=f"run-{r}")
            assert agent.call("GET", "/metrics/metrics/cpu?window=1m", tok) == 200
            assert agent.call("GET", "/metrics/metrics/cpu?window=5m", tok) == 200
            if denials:
                assert agent.call("DELETE", "/services/services/web", tok) == 403
    finally:
        agent.close()


def test_kill_9_then_verify_and_restart_give_the_true_counts(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    rec = tmp_path / "rec"
    args = [
        *workspace.serve_args(0, tmp_path / "audit.jsonl", policy_file),
        "--record",
        str(rec),
        "--shutdown-grace",
        f"{GRACE:g}s",
    ]
    proc, ready = start_capgate(args, workspace.environ(), tmp_path)
    try:
        record_runs(ready, workspace, range(40), denials=True)
    finally:
        proc.kill()  # SIGKILL: no cleanup runs, the manifest is whatever was last written
        proc.communicate(timeout=10)
    assert runs_listed(rec) == {}  # written once at start, before any run

    check = capgate("recording", "verify", str(rec))
    assert check.returncode == 1, check.stdout + check.stderr
    assert "40 run(s), 80 call(s), 40 denial(s)" in check.stdout
    assert "is not listed in the manifest" in check.stdout

    # A recorder started on the directory mends the manifest before recording more; stopped
    # with 240 runs open, it ends them all and exits well within its grace period.
    proc, ready = start_capgate(args, workspace.environ(), tmp_path)
    try:
        record_runs(ready, workspace, range(30, 270), denials=False)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=GRACE) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    expected = {f"run-{r}": (2, 1) for r in range(30)}
    expected |= {f"run-{r}": (4, 1) for r in range(30, 40)}
    expected |= {f"run-{r}": (2, 0) for r in range(40, 270)}
    assert runs_listed(rec) == expected
    check = capgate("recording", "verify", str(rec))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "the manifest matches the records" in check.stdout
    lint = capgate("recording", "lint", str(rec))
    assert lint.returncode == 0, lint.stdout + lint.stderr
