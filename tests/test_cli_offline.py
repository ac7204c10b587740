"""The ``capgate`` command, offline: keys, tokens, policy check/explain, audit verify, usage.

Exit codes: 0 ok, 1 a negative verdict, 2 bad usage or configuration (one line on stderr,
never a traceback).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from gateway.audit_trail import AuditTrail
from gateway.cli import main
from tests.helpers_core import FIXTURES, REPO, b64, unb64

EXAMPLE = str(REPO / "policies" / "example.yaml")
BAD = FIXTURES / "policies" / "bad"


def run(
    capsys: pytest.CaptureFixture[str], *argv: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    code = main(list(argv), env if env is not None else {})
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str, contains: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("capgate: error: ")
    assert lines[0].count("capgate") == 1, lines[0]  # one prefix, not "capgate: error: capgate"
    assert contains in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    code, out, _ = run(capsys, "keys", "generate", "--dir", str(tmp_path / "keys"))
    assert code == 0
    key, jwks = tmp_path / "keys" / "signing-key.pem", tmp_path / "keys" / "jwks.json"
    assert out.strip() == f"wrote {key} (mode 0600) and {jwks}"
    return key, jwks


def mint(capsys: pytest.CaptureFixture[str], key: Path, *extra: str) -> str:
    code, out, err = run(
        capsys,
        "token",
        "mint",
        "--key",
        str(key),
        "--agent",
        "sre-bot",
        "--role",
        "sre-diagnostics",
        *extra,
    )
    assert code == 0 and err == ""
    token = out.strip()
    assert token.count(".") == 2
    return token


# --- keys and tokens --------------------------------------------------------------------------


def test_keys_generate(keys: tuple[Path, Path]) -> None:
    key, jwks = keys
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    (jwk,) = json.loads(jwks.read_text())["keys"]
    assert jwk["kty"] == "OKP" and "d" not in jwk


def test_keys_generate_es256(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(capsys, "keys", "generate", "--dir", str(tmp_path), "--algorithm", "ES256")
    assert code == 0
    (jwk,) = json.loads((tmp_path / "jwks.json").read_text())["keys"]
    assert (jwk["kty"], jwk["crv"], jwk["alg"]) == ("EC", "P-256", "ES256")


def test_token_mint_and_inspect_verified(
    keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key, jwks = keys
    token = mint(
        capsys, key, "--role", "analyst", "--cap", "read-cpu", "--ttl", "2m", "--run", "run-1"
    )
    code, out, err = run(capsys, "token", "inspect", token, "--jwks", str(jwks))
    assert code == 0 and err == ""
    report = json.loads(out)
    assert report["header"]["typ"] == "capgate+jwt" and report["header"]["alg"] == "EdDSA"
    claims = report["claims"]
    assert claims["sub"] == "sre-bot" and claims["roles"] == ["sre-diagnostics", "analyst"]
    assert claims["caps"] == ["read-cpu"] and claims["run"] == "run-1"
    assert claims["exp"] - claims["iat"] == 120
    assert report["verdict"]["valid"] is True and report["verdict"]["agent"] == "sre-bot"
    assert 100 <= report["verdict"]["expires_in_s"] <= 120


def test_token_inspect_without_jwks_does_not_verify(
    keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    token = mint(capsys, keys[0])
    code, out, _ = run(capsys, "token", "inspect", token)
    assert code == 0
    assert json.loads(out)["verdict"] == {
        "valid": None,
        "detail": "not verified: pass --jwks to verify",
    }


def test_token_inspect_tampered_exits_1(
    keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key, jwks = keys
    h, p, s = mint(capsys, key).split(".")
    claims = json.loads(unb64(p))
    claims["roles"] = ["admin"]
    forged = f"{h}.{b64(json.dumps(claims).encode())}.{s}"
    code, out, err = run(capsys, "token", "inspect", forged, "--jwks", str(jwks))
    assert code == 1 and err == ""
    report = json.loads(out)
    assert report["claims"]["roles"] == ["admin"]  # shown, but ...
    assert report["verdict"] == {
        "valid": False,
        "reason": "token_invalid",
        "detail": "the token's signature does not verify",
    }


def test_token_inspect_other_keyset_exits_1(
    keys: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = mint(capsys, keys[0])
    run(capsys, "keys", "generate", "--dir", str(tmp_path / "other"))
    code, out, _ = run(
        capsys, "token", "inspect", token, "--jwks", str(tmp_path / "other" / "jwks.json")
    )
    assert code == 1
    assert json.loads(out)["verdict"]["reason"] == "token_invalid"


def test_token_inspect_wrong_audience_exits_1(
    keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    token = mint(capsys, keys[0], "--audience", "elsewhere")
    code, out, _ = run(capsys, "token", "inspect", token, "--jwks", str(keys[1]))
    assert code == 1
    assert "audience" in json.loads(out)["verdict"]["detail"]


def test_token_inspect_garbage(keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "token", "inspect", "not-a-token", "--jwks", str(keys[1]))
    assert code == 1
    report = json.loads(out)
    assert report["header"] is None and report["claims"] is None
    assert report["verdict"]["valid"] is False


def test_token_mint_long_ttl_is_refused_by_inspect(
    keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # Above the default max_token_lifetime: signed, with a warning (a gateway may raise it).
    argv = ("token", "mint", "--key", str(keys[0]), "--agent", "sre-bot", "--role", "sre")
    code, token, err = run(capsys, *argv, "--ttl", "2h")
    assert code == 0
    assert err == (
        "capgate: warning: --ttl 7200s is above the default max_token_lifetime (1h): a "
        "gateway keeping the default refuses this token\n"
    )
    code, out, _ = run(capsys, "token", "inspect", token.strip(), "--jwks", str(keys[1]))
    assert code == 1 and "longer than" in json.loads(out)["verdict"]["detail"]
    # Above what any gateway accepts (max_token_lifetime is at most 24h): refused.
    usage_error(capsys, *argv, "--ttl", "25h", contains="every gateway refuses a token living")


# --- policy check -----------------------------------------------------------------------------


def test_policy_check_good(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "policy", "check", EXAMPLE)
    assert code == 0 and err == ""
    assert out.strip() == f"{EXAMPLE}: ok (5 upstreams, 3 roles, 7 rules)"


def test_policy_check_bad_prints_file_line_col(capsys: pytest.CaptureFixture[str]) -> None:
    path = BAD / "many_errors.yaml"
    code, out, err = run(capsys, "policy", "check", str(path))
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert len(lines) == 9
    assert all(line.startswith(f"{path}:") for line in lines)
    assert lines[0] == f"{path}:2:10: version: unsupported version 3; expected 1"
    assert any(":14:13: duplicate rule id 'read-cpu'" in line for line in lines)


def test_policy_check_several_files(capsys: pytest.CaptureFixture[str]) -> None:
    bad = BAD / "unknown_upstream.yaml"
    code, out, _ = run(capsys, "policy", "check", EXAMPLE, str(bad))
    assert code == 1
    assert out.splitlines() == [
        f"{EXAMPLE}: ok (5 upstreams, 3 roles, 7 rules)",
        f"{bad}:8:19: unknown upstream 'logs'; defined upstreams: ['metrics']",
    ]


def test_policy_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "policy", "check", str(tmp_path / "nope.yaml"))
    assert code == 1
    assert out.startswith(f"{tmp_path / 'nope.yaml'}:1:1: cannot read file")


# --- policy explain ---------------------------------------------------------------------------


def explain(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code, out, err = run(capsys, "policy", "explain", "--policy", EXAMPLE, *argv)
    assert err == ""
    return code, json.loads(out)


def test_explain_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    code, d = explain(
        capsys,
        "--role",
        "sre-diagnostics",
        "GET",
        "http://127.0.0.1:8787/metrics/metrics/cpu?window=5m",
    )
    assert code == 0
    assert d["decision"] == "allow" and d["reason"] == "allowed"
    assert d["rule"] == "read-cpu" and d["matched"] == "GET /metrics/cpu"
    assert d["target"] == "/metrics/metrics/cpu?window=5m" and d["upstream"] == "metrics"
    assert d["approval"] == "none" and d["params"] == {}


def test_explain_denied_query(capsys: pytest.CaptureFixture[str]) -> None:
    code, d = explain(capsys, "--role", "sre-diagnostics", "GET", "/metrics/metrics/cpu?window=2h")
    assert code == 1
    assert d["decision"] == "deny" and d["reason"] == "query_invalid"
    assert d["rule"] == "read-cpu" and d["status"] == 400
    assert "'window' must be one of" in d["detail"]


def test_explain_denied_no_rule(capsys: pytest.CaptureFixture[str]) -> None:
    code, d = explain(capsys, "--role", "analyst", "GET", "/metrics/metrics/cpu?window=5m")
    assert code == 1
    assert (d["decision"], d["reason"], d["rule"], d["status"]) == ("deny", "no_rule", None, 403)


def test_explain_denied_by_caps(capsys: pytest.CaptureFixture[str]) -> None:
    code, d = explain(
        capsys,
        "--role",
        "sre-diagnostics",
        "--cap",
        "read-app-logs",
        "GET",
        "/metrics/metrics/cpu?window=5m",
    )
    assert code == 1 and d["reason"] == "no_rule"


def test_explain_ambiguous_target(capsys: pytest.CaptureFixture[str]) -> None:
    code, d = explain(
        capsys, "--role", "sre-diagnostics", "GET", "/metrics/metrics/%2E%2E/cpu?window=5m"
    )
    assert code == 1
    assert (d["reason"], d["status"], d["upstream"]) == ("target_ambiguous", 400, None)


def test_explain_body_allowed_and_denied(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, d = explain(
        capsys,
        "--role",
        "sre-diagnostics",
        "-d",
        '{"service": "web"}',
        "POST",
        "/services/services/restart",
    )
    assert code == 0 and d["rule"] == "restart-service"
    body = tmp_path / "body.json"
    body.write_text('{"service": "db"}')
    code, d = explain(
        capsys,
        "--role",
        "sre-diagnostics",
        "--body",
        f"@{body}",
        "POST",
        "/services/services/restart",
    )
    assert code == 1
    assert (d["reason"], d["rule"], d["status"]) == ("body_invalid", "restart-service", 400)


def test_explain_bad_header_usage(capsys: pytest.CaptureFixture[str]) -> None:
    usage_error(
        capsys,
        "policy",
        "explain",
        "--policy",
        EXAMPLE,
        "--role",
        "r",
        "-H",
        "NoColon",
        "GET",
        "/metrics/x",
        contains="expected 'Name: value'",
    )


def test_explain_missing_body_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    usage_error(
        capsys,
        "policy",
        "explain",
        "--policy",
        EXAMPLE,
        "--role",
        "r",
        "-d",
        f"@{tmp_path / 'nope'}",
        "POST",
        "/services/services/restart",
        contains="--body @",
    )


def test_explain_with_a_bad_policy_exits_2_with_positions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = BAD / "unknown_upstream.yaml"
    code, out, err = run(
        capsys,
        "policy",
        "explain",
        "--policy",
        str(path),
        "--role",
        "sre",
        "GET",
        "/logs/logs/application",
    )
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0] == "capgate: error: policy has errors:"
    assert lines[1:] == [f"{path}:8:19: unknown upstream 'logs'; defined upstreams: ['metrics']"]


# --- audit verify -----------------------------------------------------------------------------


def test_audit_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A trail of format 1 (no signed checkpoints): its chain verifies, but its tail cannot be
    # proven, so it passes only with --open-tail, and says what was not verified.
    path = tmp_path / "audit.jsonl"
    trail = AuditTrail(path)
    trail.open()
    for i in range(4):
        trail.append({"n": i})
    trail.close()
    code, out, _ = run(capsys, "audit", "verify", str(path))
    assert code == 1 and "does not end with a shutdown checkpoint" in out
    code, out, _ = run(capsys, "audit", "verify", str(path), "--open-tail")
    assert code == 0
    assert (
        out.splitlines()[0]
        == f"{path}: ok, 4 lines, 0 signed checkpoints (keys: none), hash chain intact"
    )
    assert "not verified: the tail is open (no checkpoint at all)" in out
    lines = path.read_bytes().splitlines()
    code, out, _ = run(capsys, "audit", "verify", str(path), "--open-tail", "--json")
    assert code == 0 and isinstance(json.loads(out), dict)
    lines[1], lines[2] = lines[2], lines[1]
    path.write_bytes(b"\n".join(lines) + b"\n")
    code, out, _ = run(capsys, "audit", "verify", str(path), "--open-tail")
    assert code == 1
    assert out.splitlines()[0] == (
        f"{path}:2: hash chain broken: 'prev' does not match the line before (that line was "
        "changed, or lines were removed, inserted or reordered here) (1 lines verified before it)"
    )


# --- bad usage --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,contains",
    [
        ((), "required: command"),
        (("bogus",), "invalid choice: 'bogus'"),
        (("token",), "required: token_command"),
        (("token", "mint"), "required"),
        (("token", "mint", "--key", "k", "--agent", "a", "--role", "r", "--ttl", "soon"), "--ttl"),
        (("token", "mint", "--key", "k", "--agent", "a", "--role", "r", "--ttl", "-5s"), "--ttl"),
        (("keys", "generate"), "--dir"),
        (("keys", "generate", "--dir", "x", "--algorithm", "HS256"), "invalid choice: 'HS256'"),
        (("policy", "check"), "files"),
        (("policy", "explain", "--policy", "p.yaml", "GET", "/x"), "--role"),
        (("audit", "verify"), "file"),
        (("revoke",), "one of the arguments"),
        (("revoke", "--jti", "j", "--agent", "a"), "not allowed with"),
    ],
)
def test_bad_usage_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], contains: str
) -> None:
    usage_error(capsys, *argv, contains=contains)


def test_mint_with_missing_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    usage_error(
        capsys,
        "token",
        "mint",
        "--key",
        str(tmp_path / "none.pem"),
        "--agent",
        "a",
        "--role",
        "r",
        contains="cannot read signing key",
    )


def test_mint_with_bad_agent_id(
    keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    usage_error(
        capsys,
        "token",
        "mint",
        "--key",
        str(keys[0]),
        "--agent",
        "a/b",
        "--role",
        "r",
        contains="agent id 'a/b'",
    )


def test_inspect_with_missing_jwks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    usage_error(
        capsys,
        "token",
        "inspect",
        "a.b.c",
        "--jwks",
        str(tmp_path / "none.json"),
        contains="cannot read keyset",
    )


def test_keys_generate_into_a_file_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    usage_error(
        capsys, "keys", "generate", "--dir", str(blocker / "keys"), contains="cannot write keys"
    )


def _query_trail(tmp_path: Path) -> Path:
    """A signed trail: agent-7 reads /db/query twice (one allowed with its outcome, one
    denied), another agent once, agent-7 a metric once."""
    from gateway.audit_sign import CheckpointSigner
    from gateway.audit_trail import TrailOptions

    path = tmp_path / "audit.jsonl"
    signer = CheckpointSigner.load_or_create(tmp_path / "audit.jsonl.signing.pem")
    signer.publish(tmp_path / "audit.jsonl.jwks.json")
    trail = AuditTrail(path, TrailOptions(gateway_id="gw"), signer=signer)
    trail.open()

    def decision(n: int, agent: str, path: str, status: int | None, t: str) -> dict[str, Any]:
        allowed = status is None or status < 400
        return {
            "v": 2,
            "type": "decision",
            "time": f"2026-12-01T{t}.000Z",
            "request_id": f"r{n}",
            "agent": agent,
            "run": "run-1",
            "upstream": path.split("/")[1],
            "method": "POST",
            "path": path,
            "rule": "query-orders" if allowed else None,
            "decision": "allow" if allowed else "deny",
            "reason": "allowed" if allowed else "sql_denied",
            "status": status,
            "duration_ms": 1.0,
        }

    trail.append(decision(1, "agent-7", "/db/query", None, "09:10:00"))
    trail.append(
        {"v": 2, "type": "outcome", "request_id": "r1", "agent": "agent-7", "decision": "allow",
         "reason": "allowed", "status": 200, "duration_ms": 3.0}
    )  # fmt: skip
    trail.append(decision(2, "agent-7", "/db/query", 403, "09:20:00"))
    trail.append(decision(3, "agent-8", "/db/query", 403, "09:30:00"))
    trail.append(decision(4, "agent-7", "/metrics/cpu", 403, "09:40:00"))
    trail.append(decision(5, "agent-7", "/db/query", 403, "11:00:00"))
    trail.close()
    return path


def test_audit_query_answers_with_the_calls_and_what_was_verified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _query_trail(tmp_path)
    argv = ["audit", "query", str(path), "--agent", "agent-7", "--path-prefix", "/db/"]
    window = ["--since", "2026-12-01T09:00Z", "--until", "2026-12-01T10:00:00+00:00"]
    code, out, _ = run(capsys, *argv, *window, "--format", "json")
    assert code == 0
    answer = json.loads(out)
    assert [(m["request_id"], m["status"]) for m in answer["matches"]] == [("r1", 200), ("r2", 403)]
    verified = answer["verification"]
    assert verified["verified"] is True and verified["checkpoints"] == 2
    assert verified["files"] == [str(path)] and len(verified["signing_keys"]) == 1
    assert any("no anchor given" in n for n in verified["not_verified"])
    code, out, _ = run(capsys, *argv, *window, "--decision", "deny")
    assert code == 0
    table = out.splitlines()
    assert table[0].split()[:4] == ["time", "agent", "run", "decision"]
    assert len([x for x in table if " r2" in x]) == 1 and not [x for x in table if " r1" in x]
    assert "1 matching call(s) in 8 lines of 1 file(s); trail verified; 2 signed" in out
    # A tampered trail: the matches are still shown, the verdict says it, exit 1.
    lines = path.read_bytes().splitlines()
    lines[3] = lines[3].replace(b"agent-7", b"agent-6")
    path.write_bytes(b"".join(x + b"\n" for x in lines))
    code, out, _ = run(capsys, *argv, "--format", "json")
    assert code == 1 and json.loads(out)["verification"]["problem"].startswith(f"{path}:5:")


def test_audit_query_bad_input_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _query_trail(tmp_path)
    usage_error(capsys, "audit", "query", str(path), "--since", "yesterday", contains="--since")
    usage_error(capsys, "audit", "query", str(tmp_path / "nope.jsonl"), contains="No such file")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    usage_error(capsys, "audit", "verify", str(path), "--jwks", str(bad), contains="JWKS")


def test_audit_verify_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    usage_error(capsys, "audit", "verify", str(tmp_path / "nope.jsonl"), contains="No such file")


def test_revoke_needs_a_shared_store(capsys: pytest.CaptureFixture[str]) -> None:
    usage_error(capsys, "revoke", "--jti", "j1", contains="revoke needs a shared store")
    usage_error(capsys, "revoke", "--jti", "j1", "--state", "memory", contains="shared store")


def test_serve_with_bad_settings_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    usage_error(
        capsys,
        "serve",
        "--policy",
        "p.yaml",
        "--jwks",
        "j.json",
        "--port",
        "abc",
        contains="--port has value 'abc'; expected an integer 0-65535",
    )
    usage_error(capsys, "serve", "--jwks", "j.json", contains="setting 'policy' is required")


def test_explain_with_an_agent_checks_its_declaration(capsys: pytest.CaptureFixture[str]) -> None:
    target = "http://127.0.0.1:8787/metrics/metrics/cpu?window=5m"
    code, d = explain(capsys, "--agent", "sre-bot", "--role", "sre-diagnostics", "GET", target)
    assert code == 0 and d["decision"] == "allow"
    code, d = explain(capsys, "--agent", "intruder", "--role", "sre-diagnostics", "GET", target)
    assert code == 1 and d["reason"] == "agent_unknown" and d["status"] == 403
    code, d = explain(capsys, "--agent", "analyst-bot", "--role", "sre-diagnostics", "GET", target)
    assert code == 1 and d["reason"] == "role_not_granted"


def test_revoke_with_redis_down_fails_fast_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A revocation issued while the store is down fails loudly and fast, never silently."""
    import time

    from tests.redis_server import free_port

    started = time.monotonic()
    code, out, err = run(
        capsys, "revoke", "--agent", "x", "--state", f"redis://127.0.0.1:{free_port()}/0"
    )
    assert code == 2 and out == ""
    assert time.monotonic() - started < 4.0
    [line] = err.strip().splitlines()
    assert line.startswith("capgate: error: could not load revocations from redis at")


def test_a_reader_that_goes_away_gets_no_traceback() -> None:
    """``capgate policy schema | head -1``: the reader leaves before the output is written;
    one quiet exit with 141 (128 + SIGPIPE), no traceback."""
    import os
    import subprocess
    import sys

    probe = (
        "import os, sys\n"
        "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"  # a pipe nobody reads
        "from gateway.cli import main\n"
        "sys.exit(main(['policy', 'schema']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""
