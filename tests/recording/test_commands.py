"""The command functions the CLI calls: lint, HAR export/import, policy test, replay."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gateway.commands.recording import (
    cmd_export_har,
    cmd_import_har,
    cmd_policy_test,
    cmd_recording_lint,
    parse_upstream_map,
    replay_command,
)
from mocks.demo import prepare_workspace
from tests.recording.helpers import exchange, write

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "recordings" / "example"
JWT = "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJib3QifQ.c2lnbmF0dXJlMTIz"


def test_lint_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_recording_lint(EXAMPLE) == 0
    assert "nothing secret-looking found" in capsys.readouterr().out
    directory = write(tmp_path / "rec", exchange(1, "/ping", b"ok"))
    with (directory / "runs" / "r1.jsonl").open("a") as fh:
        fh.write(json.dumps({"leak": JWT}) + "\n")
    assert cmd_recording_lint(directory) == 2  # also not a valid record: both are reported
    out, err = capsys.readouterr()
    assert "runs/r1.jsonl:2: jwt: eyJh... (" in out and JWT not in out
    assert err.startswith("capgate: error: recording lint: ") and err.count("\n") == 1
    assert cmd_recording_lint(tmp_path / "missing") == 2


def test_har_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "example.har"
    assert cmd_export_har(EXAMPLE, out) == 0
    assert json.loads(out.read_text())["log"]["version"] == "1.2"
    upstreams = json.loads((EXAMPLE / "manifest.json").read_text())["upstreams"]
    mapping = parse_upstream_map([f"{url}={name}" for name, url in upstreams.items()])
    assert cmd_import_har(out, tmp_path / "back", mapping) == 0
    assert "imported 4 entries" in capsys.readouterr().out
    (tmp_path / "bad.har").write_text("{nope")
    assert cmd_import_har(tmp_path / "bad.har", tmp_path / "x", mapping) == 2
    assert "not JSON" in capsys.readouterr().err
    assert cmd_export_har(tmp_path / "nothing", None) == 2
    with pytest.raises(ValueError, match="expected URL_PREFIX=UPSTREAM"):
        parse_upstream_map(["api"])


def test_policy_test_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "new.yaml"
    policy.write_text((ROOT / "policies" / "example.yaml").read_text().replace('"5m", ', ""))
    assert cmd_policy_test(policy, EXAMPLE, allow_regressions=False) == 1
    assert "1 allowed->denied" in capsys.readouterr().out
    assert cmd_policy_test(policy, EXAMPLE, allow_regressions=True) == 0
    policy.write_text("version: 1\nupstreams: {}\n")
    assert cmd_policy_test(policy, EXAMPLE) == 2
    assert "has errors" in capsys.readouterr().err


@pytest.fixture(scope="module")
def replay_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], list[str]]:
    ws = prepare_workspace(tmp_path_factory.mktemp("replay-ws"))
    token = ws.token("sre-bot", ["sre-diagnostics"], run="ci-123")
    env = {**os.environ, **ws.environ(), "TOKEN": token}
    serve = [
        "--policy",
        str(ws.policy),
        "--jwks",
        str(ws.jwks),
        "--upstream-key",
        str(ws.upstream_key),
        "--secrets-dir",
        str(ws.secrets_dir),
        "--audit",
        "-",
        "--shutdown-grace",
        "2s",
    ]
    return env, serve


AGENT = r"""
import json, os, sys, urllib.request, urllib.error
base, tok = os.environ["CAPGATE_URL"], os.environ["TOKEN"]
def call(method, path, body=None):
    headers = {"Authorization": "Bearer " + tok, "Content-Type": "application/json"}
    req = urllib.request.Request(base + path, method=method, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
"""


def run_agent(code: str) -> list[str]:
    return [sys.executable, "-c", AGENT + code]


def test_replay_runs_a_command_against_the_recording(
    replay_env, capfd: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    env, serve = replay_env
    code = """
assert call("GET", "/metrics/metrics/cpu?window=5m") [0] == 200
assert call("GET", "/logs/logs/application?level=error&limit=5")[0] == 200
s, b = call("POST", "/services/services/restart", b'{"service": "web"}')
assert (s, json.loads(b)) == (200, {"restarted": "web", "by": "sre-bot"}), (s, b)
assert call("DELETE", "/services/services/web")[0] == 403
"""
    assert replay_command(EXAMPLE, run_agent(code), serve, env) == 0
    out = capfd.readouterr().out
    assert (
        "replay report: 3 call(s) answered from the recording, 0 miss(es), "
        "0 recording(s) never used" in out
    )


def test_replay_fails_on_a_miss_or_a_failed_command(
    replay_env, capfd: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    env, serve = replay_env
    code = 'assert call("GET", "/metrics/metrics/cpu?window=1m")[0] == 421'
    assert replay_command(EXAMPLE, run_agent(code), serve, env) == 1
    captured = capfd.readouterr()
    assert "miss    no recording in run 'ci-123' (replaying recorded run 'example')" in captured.out
    assert "query.window: '1m' != '5m'" in captured.out
    assert "1 call(s) had no recording" in captured.err
    assert replay_command(EXAMPLE, run_agent("sys.exit(3)"), serve, env) == 3
    assert "the command exited with status 3" in capfd.readouterr().err


def test_replay_reports_a_gateway_that_does_not_start(
    replay_env,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    capfd: pytest.CaptureFixture[str],
) -> None:
    env, serve = replay_env
    bad = [*serve, "--policy", str(tmp_path / "missing.yaml")]
    assert replay_command(EXAMPLE, run_agent("pass"), bad, env) == 2
    err = capfd.readouterr().err
    assert "capgate: error: replay: the gateway did not start" in err
    assert replay_command(tmp_path / "none", ["true"], serve, env) == 2
    assert "no such recording directory" in capfd.readouterr().err
    assert replay_command(EXAMPLE, [], serve, env) == 2


AGENT_WITH_MINTED_TOKEN = r"""
import os, urllib.request
token = os.environ["CAPGATE_TOKEN"]
req = urllib.request.Request(
    os.environ["CAPGATE_URL"] + "/metrics/metrics/cpu?window=5m",
    headers={"Authorization": "Bearer " + token},
)
with urllib.request.urlopen(req, timeout=10) as r:
    assert r.status == 200
"""


def test_ci_replay_mints_the_commands_token(
    replay_env, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    # What a CI job runs: no token made beforehand, only the test key on the command line;
    # options may come before or after DIR. The gateway never sees the key.
    from gateway.cli import main

    env, serve = replay_env
    key = Path(serve[serve.index("--jwks") + 1]).with_name("signing-key.pem")
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT_WITH_MINTED_TOKEN)
    argv = ["replay", "--agent", "sre-bot", str(EXAMPLE), "--role", "sre-diagnostics"]
    argv += ["--token-key", str(key), "--token-ttl", "2m", *serve, "--", sys.executable]
    assert main([*argv, str(agent)], env) == 0
    captured = capfd.readouterr()
    assert "1 call(s) answered from the recording, 0 miss(es)" in captured.out
    assert "a token for agent 'sre-bot' (roles sre-diagnostics), valid 120s, is in " in (
        captured.err
    )
    assert "$CAPGATE_TOKEN" in captured.err
    # A key the gateway does not trust: one line, before anything starts.
    from gateway.tokens import generate_keys

    other, _ = generate_keys(tmp_path / "other")
    argv[argv.index(str(key))] = str(other)
    assert main([*argv, str(agent)], env) == 2
    err = capfd.readouterr().err
    assert err.startswith("capgate: error: replay: the gateway would refuse the minted token")
    assert err.count("\n") == 1
    # Half the options: a usage error.
    assert main(["replay", str(EXAMPLE), "--agent", "sre-bot", *serve, "--", "true"], env) == 2
    assert "needs --agent, --role and --token-key" in capfd.readouterr().err


def test_import_har_cli_empty_import_fails_and_roles_make_calls_testable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main

    har = tmp_path / "example.har"
    assert cmd_export_har(EXAMPLE, har) == 0
    data = json.loads(har.read_text())
    for entry in data["log"]["entries"]:  # a HAR from a browser says nothing of capgate
        entry.pop("_capgate", None)
    har.write_text(json.dumps(data))
    capsys.readouterr()
    upstreams = json.loads((EXAMPLE / "manifest.json").read_text())["upstreams"]
    maps = [x for name, url in upstreams.items() for x in ("--map", f"{url}={name}")]
    argv = ["recording", "import-har", str(har)]
    # Nothing mapped: exit 1, one line, nothing written.
    assert main([*argv, str(tmp_path / "none"), "--map", "https://nowhere.test=api"], {}) == 1
    err = capsys.readouterr().err
    assert err.startswith("capgate: error: recording import-har: ") and err.count("\n") == 1
    assert "0 entries imported (entries of unmapped origins: " in err
    assert not (tmp_path / "none").exists()
    # Without --agent/--role, policy test on the import checks nothing and fails ...
    bare = tmp_path / "bare"
    assert main([*argv, str(bare), *maps], {}) == 0
    policy = str(ROOT / "policies" / "example.yaml")
    assert main(["policy", "test", "--policy", policy, str(bare)], {}) == 1
    assert "0 calls checked" in capsys.readouterr().err
    # ... with them, it checks every call.
    tagged = tmp_path / "tagged"
    who = ["--agent", "sre-bot", "--role", "sre-diagnostics"]
    assert main([*argv, str(tagged), *maps, *who], {}) == 0
    capsys.readouterr()
    assert main(["policy", "test", "--policy", policy, str(tagged), "--json"], {}) in (0, 1)
    [report] = json.loads(capsys.readouterr().out)["recordings"]
    assert report["checked"] == len(data["log"]["entries"]) and report["skipped"] == []
