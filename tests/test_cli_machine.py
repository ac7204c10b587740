"""The CLI for scripts and CI: ``--json`` outputs parsed, help on every option, one ``capgate:``
prefix on errors, ``export-har -o``, and config-file paths relative to the config file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gateway.cli import build_parser, main
from gateway.config import load_settings
from gateway.errors import ConfigError
from tests.helpers_core import FIXTURES, REPO

EXAMPLE = REPO / "policies" / "example.yaml"
RECORDING = REPO / "recordings" / "example"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv), {})
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _options(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.Action]]:
    out: list[tuple[str, argparse.Action]] = []
    assert parser.format_help()  # every parser's help renders (metavars and all)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.extend(_options(sub, f"{path} {name}"))
        elif not isinstance(action, argparse._HelpAction | argparse._VersionAction):
            out.append((path, action))
    return out


def test_every_option_and_argument_has_help() -> None:
    options = _options(build_parser(), "capgate")
    assert len(options) > 100
    missing = [
        f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in options if not a.help
    ]
    assert missing == []


def test_policy_check_json(capsys: pytest.CaptureFixture[str]) -> None:
    bad = FIXTURES / "policies" / "bad" / "unknown_upstream.yaml"
    code, out, _ = run(capsys, "policy", "check", str(EXAMPLE), str(bad), "--json")
    assert code == 1
    result = json.loads(out)
    assert result["ok"] is False
    good, wrong = result["files"]
    assert good == {
        "file": str(EXAMPLE),
        "ok": True,
        "errors": [],
        "counts": {"upstreams": 5, "roles": 3, "rules": 7},
    }
    assert wrong["ok"] is False
    first = wrong["errors"][0]
    assert set(first) == {"file", "line", "col", "message"} and first["file"] == str(bad)
    code, out, _ = run(capsys, "policy", "check", str(EXAMPLE), "--json")
    assert code == 0 and json.loads(out)["ok"] is True


def test_recording_lint_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "recording", "lint", str(RECORDING), "--json")
    assert code == 0
    result = json.loads(out)
    assert result["ok"] is True and result["findings"] == [] and result["files"] > 0
    from tests.recording.helpers import exchange, write

    directory = write(tmp_path / "rec", exchange(1, "/ping", b"ok"))
    leak = "AKIAIOSFODNN7EXAMPLE"
    (directory / "notes.txt").write_text(f"aws {leak}\n")
    code, out, _ = run(capsys, "recording", "lint", str(directory), "--json")
    assert code == 1
    result = json.loads(out)
    assert result["ok"] is False and leak not in out
    assert {"file", "line", "kind", "preview", "where"} <= set(result["findings"][0])


def test_errors_have_one_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "policy", "explain", "--policy", str(EXAMPLE), "GET", "/x")
    assert code == 2 and out == ""
    assert err == ("capgate: error: policy explain: the following arguments are required: --role\n")
    code, _, err = run(capsys, "recording", "lint", "/nonexistent")
    assert err == "capgate: error: recording lint: /nonexistent: no such recording directory\n"


def test_export_har_has_o(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.har"
    code, printed, _ = run(capsys, "recording", "export-har", str(RECORDING), "-o", str(out))
    assert code == 0 and printed.startswith(f"wrote {out} (")
    assert json.loads(out.read_text())["log"]["version"] == "1.2"


def test_config_file_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "etc" / "capgate.yaml"
    conf.parent.mkdir()
    conf.write_text(
        "policy: policy.yaml\n"
        "jwks: keys/jwks.json\n"
        "audit: ../var/audit.jsonl\n"
        "audit_anchor: file:anchor.jsonl\n"
        "traces: spans.jsonl\n"
        "recordings: /abs/recordings\n"
        "host: 127.0.0.1\n"
    )
    s = load_settings({}, {}, conf)
    assert s.policy == conf.parent / "policy.yaml"
    assert s.jwks == conf.parent / "keys" / "jwks.json"
    assert s.audit == conf.parent / ".." / "var" / "audit.jsonl"
    assert s.traces == str(conf.parent / "spans.jsonl")
    assert s.recordings == Path("/abs/recordings")
    assert s.audit_anchor is not None and str(conf.parent / "anchor.jsonl") in repr(s.audit_anchor)
    # A flag or the environment is a command line: relative to the current directory.
    s = load_settings({"policy": "p.yaml"}, {"CAPGATE_JWKS": "j.json"}, conf)
    assert s.policy == Path("p.yaml") and s.jwks == Path("j.json")


def test_max_token_lifetime_is_at_most_a_day() -> None:
    required = {"policy": "p.yaml", "jwks": "j.json"}
    assert load_settings({**required}, {"CAPGATE_MAX_TOKEN_LIFETIME": "24h"}).tokens
    with pytest.raises(ConfigError, match="at most 24h"):
        load_settings(required, {"CAPGATE_MAX_TOKEN_LIFETIME": "48h"})
