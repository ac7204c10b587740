"""A gateway runs beside every agent: it loads what its policy uses and nothing else.

Each case builds and starts a gateway in a fresh interpreter (as ``capgate serve`` does, from
the command line's own imports) and lists which heavy libraries it imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mocks.demo import Workspace
from tests.conftest import ROOT

HEAVY = (
    "sqlglot",
    "pglast",
    "jsonschema",
    "redis",
    "rfc3987_syntax",
    "isoduration",
    "arrow",
    "rfc3986_validator",
    "prometheus_client",
    "opentelemetry.sdk",
)

PLAIN = """\
version: 1
agents: {tester: [tester]}
upstreams:
  metrics:
    url: http://127.0.0.1:9
    credentials: {type: bearer, secret: "env:METRICS_TOKEN"}
roles:
  tester:
    rules:
      - id: cpu
        upstream: metrics
        allow: GET /metrics/cpu
"""

PROBE = """\
import asyncio, json, os, sys
from gateway.cli import build_parser
from gateway.config import load_settings, serve_flags
from gateway import app

args = build_parser().parse_args(["serve", *json.loads(sys.argv[1])])
settings = load_settings(serve_flags(args), os.environ, None)

async def go():
    gw = app.build_gateway(settings, os.environ)
    async with app.running(gw):
        pass

asyncio.run(go())
real = lambda m: m in sys.modules and not getattr(sys.modules[m], "__capgate_stand_in__", 0)
print(json.dumps(sorted(m for m in json.loads(sys.argv[2]) if real(m))))
"""


def loaded(workspace: Workspace, policy: Path, tmp_path: Path) -> list[str]:
    args = workspace.serve_args(0, tmp_path / "audit.jsonl", policy)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **workspace.environ()},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


@pytest.fixture
def plain_policy(tmp_path: Path) -> Path:
    path = tmp_path / "plain.yaml"
    path.write_text(PLAIN)
    return path


def test_a_plain_http_policy_loads_no_sql_schema_or_redis_library(
    base_workspace: Workspace, plain_policy: Path, tmp_path: Path
) -> None:
    assert loaded(base_workspace, plain_policy, tmp_path) == []


def test_the_example_policy_loads_what_its_rules_use(
    base_workspace: Workspace, tmp_path: Path
) -> None:
    """JSON Schemas bring jsonschema (not the libraries of formats its schemas do not name);
    its SQL rules are SQLite's, read by SQLite's compiler (names included), so neither sqlglot
    nor PostgreSQL's parser loads; the memory state never brings redis, and with telemetry off
    (the default) the OpenTelemetry SDK is not loaded."""
    found = loaded(base_workspace, base_workspace.policy, tmp_path)
    assert found == ["jsonschema"]


SQL_RULE = """\
version: 1
agents: {tester: [tester]}
upstreams:
  db: {url: "http://127.0.0.1:9"}
roles:
  tester:
    rules:
      - id: query
        upstream: db
        allow: POST /query
        sql:
          field: sql
          dialect: %s
          tables: [orders, public.customers]
          default_schema: public
          deny_columns: [customers.ssn]
"""


@pytest.mark.parametrize(
    ("dialect", "extra", "expected"),
    [
        ("postgres", "          server_version: %d\n", ["pglast"]),
        ("mysql", "", ["sqlglot"]),
    ],
)
def test_a_sql_rule_loads_its_own_reader_only(
    base_workspace: Workspace, tmp_path: Path, dialect: str, extra: str, expected: list[str]
) -> None:
    """A PostgreSQL rule loads PostgreSQL's parser and no sqlglot (its names are read without
    it); a MySQL rule loads sqlglot and no pglast."""
    if "%d" in extra:
        from gateway.checks.sql.pg_version import PARSER_MAJOR

        extra %= PARSER_MAJOR
    path = tmp_path / "sql.yaml"
    path.write_text(SQL_RULE % dialect + extra)
    assert loaded(base_workspace, path, tmp_path) == expected
