"""``capgate sandbox run``: from inside, the gateway is the only way out.

A real ``capgate sandbox run`` (bwrap, nsenter, setpriv; root) runs ``sandbox_probe.py``, which
calls through the gateway and tries every other way out: the upstream's port directly, other
loopback ports of the host, outside addresses, DNS, the gateway's key files, its environment
and its process. The gateway outside polices and audits the calls as ``serve`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from gateway.sandbox import NOBODY, TOOLS
from mocks.demo import Workspace
from tests.conftest import ROOT, Mocks

PROBE = Path(__file__).with_name("sandbox_probe.py")
_MISSING = [t for t in TOOLS if shutil.which(t) is None]
_WHY = (
    "needs Linux, root and " + ", ".join(TOOLS)
    if sys.platform.startswith("linux")
    else "needs Linux"
)
_CAN = sys.platform.startswith("linux") and os.geteuid() == 0 and not _MISSING
# CI installs the tools and runs as root (.ci/run): there a missing piece fails, never skips.
pytestmark = pytest.mark.skipif(not _CAN and not os.environ.get("CI"), reason=_WHY)


def _python() -> tuple[str, list[Path]]:
    """An interpreter the sandbox can run, and what must be exposed for it."""
    exe = Path(os.path.realpath(sys.executable))
    base = Path(sys.base_prefix).resolve()
    return str(exe), [] if str(base).startswith("/usr") else [base]


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o755)  # the command runs as nobody
    shutil.copy(PROBE, work / PROBE.name)
    return work


def sandbox(
    workspace: Workspace,
    policy: Path,
    audit: Path,
    cwd: Path,
    command: list[str],
    *extra: str,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    token = cwd.parent / "token"
    token.write_text(workspace.token("tester", ["tester"]))
    token.chmod(0o600)
    python, expose = _python()
    argv = [
        sys.executable,
        "-m",
        "gateway",
        "sandbox",
        "run",
        "--token-file",
        str(token),
        *[f"--expose={p}" for p in expose],
        *extra,
        *workspace.serve_args(0, audit, policy),
        "--shutdown-grace",
        "2s",
        "--",
        *[python if c == "PYTHON" else c for c in command],
    ]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **workspace.environ()},
    )


def probe(
    workspace: Workspace, policy: Path, audit: Path, cwd: Path, plan: dict[str, Any]
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = sandbox(workspace, policy, audit, cwd, ["PYTHON", PROBE.name, json.dumps(plan)])
    lines = done.stdout.strip().splitlines()
    assert lines, f"no report (exit {done.returncode}): {done.stderr[-2000:]}"
    return done, json.loads(lines[-1])


def test_inside_the_sandbox_the_gateway_is_the_only_way_out(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    work = _workdir(tmp_path)
    echo = urlsplit(mocks.urls["echo"])
    audit = tmp_path / "audit.jsonl"
    # A service on the host's abstract Unix socket name space (per network namespace).
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0capgate-sandbox-test-{os.getpid()}")
    abstract.listen(1)
    plan = {
        "abstract": [f"capgate-sandbox-test-{os.getpid()}"],
        "calls": [["GET", "/echo/echo/from-sandbox"], ["GET", "/echo/not-a-rule/x/y"]],
        "direct": [
            [echo.hostname, echo.port],  # the upstream the gateway reaches
            ["127.0.0.1", 6379],  # another service on the host's loopback
            ["127.0.0.1", 5432],
            ["10.255.255.1", 80],  # outside addresses
            ["1.1.1.1", 53],
        ],
        "dns": ["example.com", "localhost.localdomain"],
        "read": [
            str(workspace.token_key),
            str(workspace.upstream_key),
            str(workspace.secrets_dir / "echo-tester.key"),
            str(policy_file),
            str(tmp_path / "token"),
            "/etc/shadow",
        ],
    }
    with abstract:
        done, report = probe(workspace, policy_file, audit, work, plan)
    assert done.returncode == 0, done.stderr[-2000:]
    # Calls through the gateway are policed: allowed, and refused with a reason.
    allowed = report["calls"]["/echo/echo/from-sandbox"]
    assert allowed["status"] == 200
    assert "echo-key-for-tester" not in allowed["body"]  # the credential stays outside
    assert report["calls"]["/echo/not-a-rule/x/y"]["status"] == 403
    # The upstream got the call, with the credential the gateway injected.
    seen = [r for r in mocks.requests("echo") if r["path"] == "/echo/from-sandbox"]
    assert len(seen) == 1
    # Every other way out fails.
    for where, result in report["direct"].items():
        assert result != "connected", f"reached {where} from inside the sandbox"
    assert report["direct"][f"{echo.hostname}:{echo.port}"].startswith("ConnectionRefused")
    assert "unreachable" in report["direct"]["10.255.255.1:80"].lower()
    for name, result in report["abstract"].items():
        assert result.startswith("ConnectionRefused"), (name, result)
    assert report["fds"] == [0, 1, 2, 3]  # stdio, and the probe's own listing of them
    for name, result in report["dns"].items():
        assert not result.startswith("resolved"), f"{name}: {result}"
    for path, result in report["read"].items():
        assert result.split(":")[0] in ("FileNotFoundError", "PermissionError"), (path, result)
    # Not the gateway's environment (its credentials), not its process.
    assert "METRICS_TOKEN" not in report["env"]
    assert {"CAPGATE_URL", "CAPGATE_TOKEN"} <= set(report["env"])
    assert not [p for p in report["processes"] if "gateway" in p], report["processes"]
    assert report["uid"] == NOBODY
    # No capability, none to gain (the bounding set is empty), no setuid either.
    caps = report["status"]
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(caps[key], 16) == 0, (key, caps)
    assert caps["NoNewPrivs"] == "1"
    assert report["tmp_writable"]
    # The gateway audited both calls as the token's agent.
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    decisions = {x["path"]: x for x in lines if x.get("type") == "decision"}
    assert decisions["/echo/echo/from-sandbox"]["agent"] == "tester"
    assert decisions["/echo/not-a-rule/x/y"]["decision"] == "deny"
    # Its ready line went to standard error: standard output is the command's alone.
    assert "listening" in done.stderr
    assert done.stdout.count("\n") == 1


def test_the_gateways_files_in_the_working_directory_are_masked(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    """A policy file that is world-readable and inside the working directory (the command's
    own tree) is still not readable from the sandbox; nor is the audit file beside it."""
    work = _workdir(tmp_path)
    policy = work / "policy.yaml"
    shutil.copy(policy_file, policy)
    policy.chmod(0o644)
    audit = work / "audit.jsonl"
    plan = {"read": [str(policy), str(audit), str(work / PROBE.name)]}
    done, report = probe(workspace, policy, audit, work, plan)
    assert done.returncode == 0, done.stderr[-2000:]
    # Masked (a device node on a nodev mount): not readable though its mode says 0644.
    assert report["read"][str(policy)] == "PermissionError: Permission denied"
    assert not report["read"][str(audit)].startswith("read ")
    assert report["read"][str(work / PROBE.name)].startswith("read ")  # the rest is there


def test_the_commands_exit_status_is_capgates(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    work = _workdir(tmp_path)
    audit = tmp_path / "audit.jsonl"
    done = sandbox(workspace, policy_file, audit, work, ["sh", "-c", "exit 7"])
    assert done.returncode == 7, done.stderr[-2000:]
    done = sandbox(workspace, policy_file, audit, work, ["sh", "-c", "kill -TERM $$"])
    assert done.returncode == 128 + 15, done.stderr[-2000:]
    done = sandbox(workspace, policy_file, audit, work, ["no-such-command-here"])
    assert done.returncode != 0


def test_ci_mints_the_commands_token_and_the_gateway_never_holds_the_key(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    """``--agent --role --token-key``: a short-lived token signed by the CLI from a test key,
    checked against the gateway's JWKS, given to the command; the key stays outside."""
    work = _workdir(tmp_path)
    audit = tmp_path / "audit.jsonl"
    python, expose = _python()
    plan = {"calls": [["GET", "/echo/echo/minted"]], "read": [str(workspace.token_key)]}
    argv = [
        sys.executable,
        "-m",
        "gateway",
        "sandbox",
        "run",
        "--agent",
        "tester",
        "--role",
        "tester",
        "--run",
        "ci-42",
        "--token-key",
        str(workspace.token_key),
        *[f"--expose={p}" for p in expose],
        *workspace.serve_args(0, audit, policy_file),
        "--",
        python,
        PROBE.name,
        json.dumps(plan),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **workspace.environ()}
    done = subprocess.run(argv, capture_output=True, text=True, cwd=work, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["calls"]["/echo/echo/minted"]["status"] == 200
    assert report["read"][str(workspace.token_key)].startswith(("FileNotFound", "Permission"))
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    [decision] = [x for x in lines if x.get("path") == "/echo/echo/minted"]
    assert (decision["agent"], decision["run"]) == ("tester", "ci-42")
    # A key the gateway does not trust fails before the command runs, in one line.
    other, _ = __import__("gateway.tokens", fromlist=["generate_keys"]).generate_keys(
        tmp_path / "untrusted"
    )
    argv[argv.index(str(workspace.token_key))] = str(other)
    done = subprocess.run(argv, capture_output=True, text=True, cwd=work, timeout=60, env=env)
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert "the gateway would refuse the minted token" in line


def test_kill_9_of_capgate_ends_the_sandboxed_command_too(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    """No orphan keeps running with a namespace nobody polices: bwrap's --die-with-parent."""
    import signal
    import time

    work = _workdir(tmp_path)
    marker = f"capgate-orphan-check-{os.getpid()}"
    token = tmp_path / "token"
    token.write_text(workspace.token("tester", ["tester"]))
    token.chmod(0o600)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "sandbox",
            "run",
            "--token-file",
            str(token),
            *workspace.serve_args(0, tmp_path / "audit.jsonl", policy_file),
            "--",
            "sh",
            "-c",
            "sleep 300; true",  # the shell stays, waiting, with the marker as its $0
            marker,
        ],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT), **workspace.environ()},
    )

    def running() -> bool:  # the sandboxed shell itself, not capgate's own command line
        pattern = f"^sh -c sleep 300; true {marker}$"
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, check=False)
        return found.returncode == 0

    deadline = time.monotonic() + 30
    while not running():
        assert proc.poll() is None, "capgate sandbox run ended early"
        assert time.monotonic() < deadline, "the sandboxed command never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while running():
        assert time.monotonic() < deadline, "the sandboxed command outlived capgate"
        time.sleep(0.05)


def test_bad_invocations_get_one_line_and_exit_2(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    work = _workdir(tmp_path)
    audit = tmp_path / "audit.jsonl"
    cases = [
        ([], "usage: capgate sandbox run"),  # no command
        (["--user", "0:0"], "never runs as root"),
        (["--env", "NOEQUALS"], "expected NAME=VALUE"),
        (["--expose", str(tmp_path / "missing")], "no such file or directory"),
        (["--agent", "tester"], "give one or the other"),  # and --token-file
    ]
    for extra, said in cases:
        command = ["true"] if extra else []
        done = sandbox(workspace, policy_file, audit, work, command, *extra)
        assert done.returncode == 2, (extra, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("capgate: error:"), (extra, lines)
        assert said in lines[0], (extra, lines)


def test_without_root_the_sandbox_is_refused_in_one_line(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            "-m",
            "gateway",
            "sandbox",
            "run",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "capgate: error: capgate sandbox needs root to create the sandbox's network namespace "
        "(run it as root, e.g. in the CI container)"
    )
