"""Command functions for ``capgate recording ...``, ``capgate policy test`` and ``capgate replay``.

``cli.py`` parses the arguments and calls these; each prints its result, prints one readable
line (``capgate: error: <command>: ...``) on failure, and returns the exit status:
0 ok, 1 a negative verdict (secrets found, a regression, misses, the command failed), 2 the
command could not run (bad input, no recording, the gateway did not start).

    capgate recording lint DIR
    capgate recording verify DIR [--repair]
    capgate recording export-har DIR [-o OUT.har]
    capgate recording import-har FILE.har DIR --map https://api.example.com=api [--agent A --role R]
    capgate policy test --policy NEW.yaml DIR [--allow-regressions]
    capgate replay DIR [--agent A --role R --token-key PEM] [serve flags] -- COMMAND ...
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from gateway.commands.ci_token import CiToken, mint_ci_token
from gateway.recording.format import RecordingError
from gateway.recording.har import export_har, import_har
from gateway.recording.lint import lint
from gateway.recording.matching import ReplayReport
from gateway.recording.reader import load_recording

EXIT_OK, EXIT_NEGATIVE, EXIT_USAGE = 0, 1, 2
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


def _error(command: str, message: str) -> int:
    print(f"capgate: error: {command}: {message}", file=sys.stderr)
    return EXIT_USAGE


def parse_upstream_map(items: Sequence[str]) -> dict[str, str]:
    """``["https://api.example.com=api"]`` -> ``{"https://api.example.com": "api"}``."""
    out: dict[str, str] = {}
    for item in items:
        prefix, sep, name = item.rpartition("=")
        if not sep or not prefix or not name or "://" not in prefix:
            raise ValueError(
                f"--map {item!r}: expected URL_PREFIX=UPSTREAM, e.g. https://api.example.com=api"
            )
        out[prefix] = name
    return out


def cmd_recording_lint(directory: Path, as_json: bool = False) -> int:
    """Exit 1 if anything secret-looking is left in the recording, 0 if clean; 2 if it is not
    a readable recording. ``as_json``: one object ``{ok, directory, findings, files, error}``."""
    directory = Path(directory)
    if not directory.is_dir():
        return _error("recording lint", f"{directory}: no such recording directory")
    findings = lint(directory)
    problem: str | None = None
    try:
        load_recording(directory)
    except RecordingError as exc:
        problem = str(exc)
    files = sum(1 for p in directory.rglob("*") if p.is_file())
    if as_json:
        found = [dataclasses.asdict(f) for f in findings]
        result = {"ok": not findings and problem is None, "directory": str(directory)}
        print(json.dumps({**result, "findings": found, "files": files, "error": problem}))
    else:
        for f in findings:
            print(f)
    if problem is not None:
        return _error("recording lint", problem)
    if findings:
        if not as_json:
            print(f"{directory}: {len(findings)} finding(s); redact or re-record before sharing")
        return EXIT_NEGATIVE
    if not as_json:
        print(f"{directory}: ok, {files} files scanned, nothing secret-looking found")
    return EXIT_OK


def cmd_recording_verify(directory: Path, *, repair: bool = False) -> int:
    """Exit 1 if the manifest does not match the records (after ``--repair``: if it still
    does not), 0 if it does; 2 if the recording cannot be read."""
    from gateway.recording import verify as checks

    directory = Path(directory)
    try:
        report = checks.verify(directory)
        if repair and not report.ok:
            print(report.text())
            report = checks.repair(directory)
            print(f"{directory}: repaired")
    except RecordingError as exc:
        return _error("recording verify", str(exc))
    except OSError as exc:
        return _error("recording verify", f"{directory}: {exc.strerror or exc}")
    print(report.text())
    return EXIT_OK if report.ok else EXIT_NEGATIVE


def cmd_export_har(directory: Path, out: Path | None) -> int:
    """Write the recording as HAR 1.2 to ``out`` (stdout when None or '-')."""
    try:
        har = export_har(directory)
    except RecordingError as exc:
        return _error("recording export-har", str(exc))
    text = json.dumps(har, indent=2, ensure_ascii=False) + "\n"
    if out is None or str(out) == "-":
        sys.stdout.write(text)
        return EXIT_OK
    try:
        Path(out).write_text(text, encoding="utf-8")
    except OSError as exc:
        return _error("recording export-har", f"{out}: {exc.strerror}")
    print(f"wrote {out} ({len(har['log']['entries'])} entries)")
    return EXIT_OK


def cmd_import_har(
    har_file: Path,
    directory: Path,
    upstream_map: Mapping[str, str],
    *,
    agent: str | None = None,
    roles: Sequence[str] = (),
) -> int:
    """Import a HAR file (from any tool) into a recording; redacted like any recording.
    Exit 1 when no entry was imported (nothing written): an empty import proves nothing."""
    if not upstream_map:
        return _error("recording import-har", "give at least one --map URL_PREFIX=UPSTREAM")
    try:
        har = json.loads(Path(har_file).read_text(encoding="utf-8"))
    except OSError as exc:
        return _error("recording import-har", f"{har_file}: {exc.strerror}")
    except (ValueError, UnicodeDecodeError) as exc:
        return _error("recording import-har", f"{har_file}: not JSON: {exc}")
    try:
        result = import_har(har, directory, upstream_map, agent=agent, roles=roles)
    except RecordingError as exc:
        return _error("recording import-har", f"{har_file}: {exc}")
    skipped = ", ".join(f"{o} ({n})" for o, n in sorted(result.skipped.items()))
    if result.imported == 0:
        why = f"entries of unmapped origins: {skipped}" if skipped else "the HAR has no entries"
        _error(
            "recording import-har",
            f"{har_file}: 0 entries imported ({why}); nothing written; give --map ORIGIN=UPSTREAM "
            "for the origins to keep",
        )
        return EXIT_NEGATIVE
    print(
        f"imported {result.imported} entries into {directory} "
        f"(runs: {', '.join(sorted(result.runs)) or 'none'})"
        + (f"; skipped entries of unmapped origins: {skipped}" if skipped else "")
    )
    left = lint(directory)
    if left:
        print(
            f"warning: {len(left)} secret-looking value(s) remain; see "
            f"'capgate recording lint {directory}'",
            file=sys.stderr,
        )
    return EXIT_OK


def cmd_policy_test(policy_file: Path, directory: Path, allow_regressions: bool = False) -> int:
    """Recorded traffic through a new policy; exit 1 when an allowed call becomes denied or
    when no call could be checked."""
    return regression_report(policy_file, directory, allow_regressions)[0]


def regression_report(
    policy_file: Path, directory: Path, allow_regressions: bool = False, as_json: bool = False
) -> tuple[int, dict[str, Any] | None]:
    """The exit status of a regression run, and its report as data (printed as text unless
    ``as_json``). A run that checked no call fails (exit 1): it proved nothing."""
    from gateway.commands.regression import policy_test
    from gateway.policy.load import load_policy
    from gateway.policy_file import PolicyError

    try:
        policy = load_policy(policy_file)
    except PolicyError as exc:
        return _error("policy test", f"policy {policy_file} has errors:\n{exc}"), None
    except OSError as exc:
        return _error("policy test", f"{policy_file}: {exc.strerror}"), None
    try:
        report = asyncio.run(policy_test(policy, directory))
    except RecordingError as exc:
        return _error("policy test", str(exc)), None
    code = report.exit_code(allow_regressions)
    if not as_json:
        print(report.text())
        if report.regressions and allow_regressions:
            print(
                f"{len(report.regressions)} allowed call(s) would be denied (allowed by "
                "--allow-regressions)"
            )
    if report.checked == 0:
        print(
            f"capgate: error: policy test: {directory}: 0 calls checked "
            f"({len(report.skipped)} skipped: {report.skip_summary()}); nothing was compared",
            file=sys.stderr,
        )
    return code, report.as_dict()


# --- capgate replay DIR -- COMMAND ------------------------------------------------------------


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _wait_ready(
    proc: subprocess.Popen[str], lines: queue.Queue[str | None], timeout: float
) -> tuple[str | None, list[str]]:
    """The gateway's URL from its ready line, or None; the lines seen before it."""
    seen: list[str] = []
    try:
        while True:
            line = lines.get(timeout=timeout)
            if line is None:
                return None, seen
            if line.startswith("capgate ") and " listening " in line:
                try:
                    ready = json.loads(line.split(" listening ", 1)[1])
                    return str(ready["url"]), seen
                except (ValueError, KeyError, TypeError):
                    return None, [*seen, line]
            seen.append(line)
    except queue.Empty:
        return None, seen


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def replay_command(
    directory: Path,
    command: list[str],
    serve_args: list[str],
    environ: Mapping[str, str],
    *,
    ready_timeout: float = READY_TIMEOUT,
    token: CiToken | None = None,
) -> int:
    """Run ``command`` against a gateway replaying ``directory``; stop it; print the report.

    The gateway is ``python -m gateway serve --mode replay --recordings DIR --replay-report
    <tmp>/replay-report.json --port 0 <serve_args>``; the command gets ``CAPGATE_URL`` in its
    environment, and with ``token``, a freshly minted capability token in ``token.env``.
    Exit status: the command's own when it failed, else 1 if any call missed, else 0; 2 when
    the gateway did not start, wrote no report, or the token could not be minted.
    """
    name = "replay"
    if not command:
        return _error(name, "no command to run; usage: capgate replay DIR -- COMMAND ...")
    extra: dict[str, str] = {}
    if token is not None:
        try:
            extra[token.env] = mint_ci_token(token, serve_args)
        except ValueError as exc:
            return _error(name, str(exc))
        print(
            f"capgate replay: a token for agent {token.agent!r} (roles "
            f"{', '.join(token.roles)}), valid {token.ttl:g}s, is in ${token.env}",
            file=sys.stderr,
        )
    try:
        load_recording(directory)  # fail early, with the recording's own error
    except RecordingError as exc:
        return _error(name, str(exc))
    with tempfile.TemporaryDirectory(prefix="capgate-replay-") as tmp:
        report_path = Path(tmp) / "replay-report.json"
        argv = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--mode",
            "replay",
            "--recordings",
            str(directory),
            "--replay-report",
            str(report_path),
            "--port",
            "0",
            *serve_args,
        ]
        try:
            # S603: the argv is the gateway's own command line, built here, not from input.
            proc = subprocess.Popen(  # noqa: S603
                argv, stdout=subprocess.PIPE, text=True, env=dict(environ)
            )
        except OSError as exc:
            return _error(name, f"cannot start the gateway: {exc.strerror}")
        assert proc.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        pump = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
        pump.start()
        try:
            url, seen = _wait_ready(proc, lines, ready_timeout)
            if url is None:
                _stop(proc)
                said = " ".join(s.strip() for s in seen[-3:])
                return _error(
                    name,
                    "the gateway did not start"
                    + (f" (exit status {proc.returncode})" if proc.returncode else "")
                    + (f": {said}" if said else "; see its log above"),
                )
            env = {**environ, **extra, "CAPGATE_URL": url}
            try:
                # S603: running the user's own command is what 'capgate replay' is for.
                status = subprocess.call(command, env=env)  # noqa: S603
            except OSError as exc:
                _stop(proc)
                return _error(name, f"cannot run {command[0]!r}: {exc.strerror}")
        finally:
            _stop(proc)
            pump.join(timeout=STOP_TIMEOUT)
            proc.stdout.close()
        try:
            report = ReplayReport.from_dict(json.loads(report_path.read_text("utf-8")))
        except (OSError, ValueError) as exc:
            return _error(name, f"the gateway wrote no replay report ({exc})")
    print(report.text())
    if status != 0:
        print(f"capgate replay: the command exited with status {status}", file=sys.stderr)
        return status if status > 0 else EXIT_NEGATIVE
    if report.misses:
        print(f"capgate replay: {len(report.misses)} call(s) had no recording", file=sys.stderr)
        return EXIT_NEGATIVE
    return EXIT_OK
