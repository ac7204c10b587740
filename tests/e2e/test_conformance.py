"""The official MCP conformance suite (``@modelcontextprotocol/conformance`` 0.1.9) against
``mocks/conformance_server.py``, directly and through ``capgate serve``.

``python -m mocks.conformance`` (``make conformance``) runs the comparison once for this module;
its JSON report is what these tests read. Through capgate the permissive policy
(``conformance/policies/permissive.yaml``) is meant to let every scenario pass as it does
directly; the restrictive one (``restrictive.yaml``) must make scenarios fail only on capgate's
clean refusals.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

LAST_LINE = re.compile(r"mcp-conformance: direct (\d+)/(\d+), through capgate (\d+)/(\d+)")


@pytest.fixture(scope="module")
def conformance(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    report = tmp_path_factory.mktemp("conformance") / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mocks.conformance", "--json", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the conformance suite could not run:\n{output}"
    last = proc.stdout.strip().splitlines()[-1]
    match = LAST_LINE.fullmatch(last)
    assert match, f"unexpected last line {last!r}"
    value: dict[str, Any] = json.loads(Path(report).read_text())
    value["output"] = proc.stdout
    assert (int(match[1]), int(match[2])) == (value["direct"]["passed"], value["direct"]["total"])
    assert (int(match[3]), int(match[4])) == (value["capgate"]["passed"], value["capgate"]["total"])
    return value


def _failing(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in run["scenarios"].items() if not s["passed"]}


@pytest.mark.timeout(300)
def test_direct_passes_every_scenario(conformance: dict[str, Any]) -> None:
    direct = conformance["direct"]
    assert direct["total"] == len(conformance["scenarios"]) >= 31
    failing = {name: s["error"] or s["failures"] for name, s in _failing(direct).items()}
    assert failing == {}, conformance["output"]
    assert direct["passed"] == direct["total"]


@pytest.mark.timeout(300)
def test_capgate_passes_what_direct_passes(conformance: dict[str, Any]) -> None:
    """With the permissive policy every scenario passes through capgate as it does directly
    (same graded checks). Where one does not, the message names the JSON-RPC methods that
    capgate refused and the methods still to govern."""
    direct, gated = conformance["direct"], conformance["capgate"]
    refused = {name: s["refusals"] or s["failures"] for name, s in _failing(gated).items()}
    detail = json.dumps(
        {"refused": refused, "to_govern": conformance["to_govern"]}, indent=1, sort_keys=True
    )
    assert gated["passed"] == direct["passed"], detail
    assert refused == {}, detail


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["capgate", "restrictive"])
def test_every_failure_through_capgate_is_a_clean_refusal(
    conformance: dict[str, Any], policy: str
) -> None:
    """A scenario that fails through capgate fails on capgate's JSON-RPC error (HTTP 200,
    code -32001, error.data.reason), never on a broken stream, session or answer."""
    run = conformance[policy]
    assert run is not None
    unexplained = {
        name: {"failures": s["failures"], "error": s["error"], "refusals": s["refusals"]}
        for name, s in _failing(run).items()
        if s["error"] or not s["refusals"] or not s["clean_refusals"]
    }
    assert unexplained == {}, json.dumps(unexplained, indent=1)
    for name, s in _failing(run).items():
        assert all(e["reason"] and e["code"] == -32001 for e in s["refusal_errors"]), name
    if policy == "restrictive":
        assert _failing(run), "the restrictive policy refused nothing"
