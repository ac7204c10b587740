"""The official MCP conformance suite's server scenarios, run against
``mocks/conformance_server.py`` directly and through ``capgate serve``: ``make conformance``.

    python -m mocks.conformance [--scenario NAME ...] [--no-restrictive]
                                [--json REPORT.json] [--keep DIR]

The suite is ``@modelcontextprotocol/conformance`` 0.1.9, installed from ``conformance/``
(``package.json`` + ``package-lock.json``) by ``make conformance-deps``. It runs as
``conformance server --url URL --suite all`` (every server scenario, pending ones included;
one Node process per pass, or one per scenario with ``--scenario``), in three passes:

1. **direct**: against the conformance server's ``/mcp``;
2. **through capgate**: ``python -m gateway serve`` in front of it, with a workspace from
   ``mocks.demo.prepare_workspace``, ``conformance/policies/permissive.yaml`` and a token
   minted for the agent ``conformance-bot`` (role ``conformance``);
3. **restrictive** (unless ``--no-restrictive``): the same with
   ``conformance/policies/restrictive.yaml``, a subset of the tools.

The suite's CLI takes no headers and no token, so the token is added by
``conformance/capgate-fetch.mjs``, loaded into the suite's Node process with ``--import``: it
wraps the global ``fetch`` (which the suite's MCP client and its raw requests both use) to add
``Authorization: Bearer ...`` to requests for capgate's origin, and writes one line per HTTP
exchange (scenario; JSON-RPC methods sent; status; ``X-Capgate-Reason``; JSON-RPC error codes
and ``error.data.reason``), which is how each failure is traced to the methods capgate refused.

A scenario **passes** when the suite recorded checks for it and none is a FAILURE (the suite's
own verdict; WARNINGs, SHOULDs, are reported but do not fail it). Through capgate a scenario
passes when, in addition, its graded checks (SUCCESS/WARNING/FAILURE with their ids; INFO
lines left out) are the same as direct: a refusal the suite grades only INFO (its SSE polling
scenario takes a JSON answer as "not applicable") still counts as a difference.

The last line printed is ``mcp-conformance: direct D/N, through capgate C/N``. Exit status 2
when the suite cannot run at all (no Node, suite not installed, a server that does not start,
no scenario that produced results); 0 otherwise: the comparison is asserted by
``tests/e2e/test_conformance.py``. Every child process (servers, capgate, Node) runs in its
own process group and is stopped on the way out, SIGTERM included; a pass has 60 s at most.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ruamel.yaml import YAML

from mocks.demo import Workspace, prepare_workspace, rewrite_policy_urls

ROOT: Final = Path(__file__).resolve().parent.parent
CONFORMANCE_DIR: Final = ROOT / "conformance"
SUITE_PACKAGE: Final = "@modelcontextprotocol/conformance"
SUITE_VERSION: Final = "0.1.9"
SUITE_MAIN: Final = CONFORMANCE_DIR / "node_modules" / SUITE_PACKAGE / "dist" / "index.js"
FETCH_HOOK: Final = CONFORMANCE_DIR / "capgate-fetch.mjs"
PERMISSIVE_POLICY: Final = CONFORMANCE_DIR / "policies" / "permissive.yaml"
RESTRICTIVE_POLICY: Final = CONFORMANCE_DIR / "policies" / "restrictive.yaml"
UPSTREAM: Final = "conformance"
AGENT: Final = "conformance-bot"
ROLE: Final = "conformance"

START_TIMEOUT: Final = 30.0  # a server's ready line
PASS_TIMEOUT: Final = 60.0  # one pass over every scenario (about 3 s when all is well)
JSONRPC_DENIED: Final = -32001  # capgate's JSON-RPC error code for a refused message
GRADED: Final = frozenset({"SUCCESS", "FAILURE", "WARNING"})


class SuiteUnavailable(Exception):
    """The suite cannot run at all (exit status 2)."""


# --------------------------------------------------------------------------- processes


@contextlib.contextmanager
def child(
    args: Sequence[str], log: Path, *, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """A child process in its own process group, stopped (TERM, then KILL) on the way out.

    Its stderr goes to `log`; its stdout is read by `ready_line`, then copied to `log` too, so
    no pipe fills up while it runs.
    """
    with log.open("a", encoding="utf-8") as sink:
        proc = subprocess.Popen(
            list(args),
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def ready_line(
    proc: subprocess.Popen[str], log: Path, accept: Callable[[str], bool], what: str
) -> str:
    """The first stdout line that `accept`s, within START_TIMEOUT; SuiteUnavailable otherwise.

    What the process writes to stdout after that is copied to `log` by a daemon thread.
    """
    stdout = proc.stdout
    assert stdout is not None
    deadline = time.monotonic() + START_TIMEOUT
    seen: list[str] = []
    with selectors.DefaultSelector() as sel:
        sel.register(stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(timeout=left):
                continue
            line = stdout.readline()
            if not line:
                break
            if accept(line):

                def drain() -> None:
                    with log.open("a", encoding="utf-8") as sink:
                        for rest in stdout:
                            sink.write(rest)

                threading.Thread(target=drain, daemon=True).start()
                return line
            seen.append(line)
    stop(proc)
    err = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    raise SuiteUnavailable(f"{what} did not start: {''.join(seen)[-500:]}{err[-2000:]}")


@contextlib.contextmanager
def conformance_server(log: Path) -> Iterator[str]:
    """The conformance server on a free port; yields its MCP endpoint URL."""
    with child([sys.executable, "-m", "mocks.conformance_server"], log) as proc:
        line = ready_line(proc, log, lambda s: s.startswith("{"), "the conformance server")
        yield str(json.loads(line)["url"])


# --------------------------------------------------------------------------- the suite


def suite_command() -> list[str]:
    node = shutil.which("node")
    if node is None:
        raise SuiteUnavailable("node is not installed (Debian: apt-get install nodejs npm)")
    if not SUITE_MAIN.is_file():
        raise SuiteUnavailable(
            f"{SUITE_PACKAGE} is not installed in {CONFORMANCE_DIR}: run `make conformance-deps`"
        )
    manifest = json.loads((SUITE_MAIN.parent.parent / "package.json").read_text())
    if manifest.get("version") != SUITE_VERSION:
        raise SuiteUnavailable(
            f"{SUITE_PACKAGE} {manifest.get('version')} is installed, {SUITE_VERSION} is pinned:"
            " run `make conformance-deps`"
        )
    return [node, str(SUITE_MAIN)]


def list_scenarios(command: list[str]) -> list[str]:
    out = subprocess.run(
        [*command, "list", "--server"], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    names = [line.strip()[2:] for line in out.stdout.splitlines() if line.startswith("  - ")]
    if out.returncode != 0 or not names:
        raise SuiteUnavailable(f"the suite lists no server scenarios: {out.stdout}{out.stderr}")
    return names


@dataclass
class Exchange:
    """One HTTP exchange of the suite's client, as capgate-fetch.mjs wrote it."""

    scenario: str | None
    http_method: str
    rpc: list[str]  # JSON-RPC methods sent ("tools/call NAME"; "(answer)" for a response)
    status: int | None
    content_type: str | None
    capgate_reason: str | None
    errors: list[dict[str, Any]]
    problem_reason: str | None  # an HTTP error answered as problem+json

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Exchange:
        return cls(
            scenario=value.get("scenario"),
            http_method=value.get("httpMethod", "?"),
            rpc=list(value.get("rpc", [])),
            status=value.get("status"),
            content_type=value.get("contentType"),
            capgate_reason=value.get("capgateReason"),
            errors=list(value.get("errors", [])),
            problem_reason=value.get("problemReason"),
        )

    @property
    def refused(self) -> bool:
        return bool(self.capgate_reason or self.problem_reason) or any(
            e.get("code") == JSONRPC_DENIED for e in self.errors
        )

    @property
    def clean_refusal(self) -> bool:
        """An HTTP 200 JSON-RPC error answer with capgate's code and ``error.data.reason``."""
        return (
            self.status == 200
            and "json" in (self.content_type or "")
            and bool(self.errors)
            and all(e.get("code") == JSONRPC_DENIED and e.get("reason") for e in self.errors)
        )

    def describe(self) -> str:
        """``METHOD (reason: detail)``, e.g. ``prompts/list (tool_denied: the MCP method ...)``."""
        sent = ", ".join(self.rpc) or self.http_method
        why: list[str] = []
        for error in self.errors:
            reason, message = error.get("reason"), str(error.get("message") or "")
            if reason:
                detail = message.removeprefix(f"capgate: {reason}: ")
                why.append(f"{reason}: {detail}" if detail else str(reason))
        if not why and (self.capgate_reason or self.problem_reason):
            why.append(f"{self.capgate_reason or self.problem_reason}, HTTP {self.status}")
        return f"{sent} ({'; '.join(dict.fromkeys(why)) or f'HTTP {self.status}'})"


@dataclass
class ScenarioResult:
    name: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    error: str | None = None  # the suite produced no results for it

    @property
    def passed(self) -> bool:
        """The suite's verdict: checks were recorded and none is a FAILURE."""
        return self.error is None and bool(self.checks) and self.count("FAILURE") == 0

    def count(self, status: str) -> int:
        return sum(1 for c in self.checks if c.get("status") == status)

    @property
    def graded(self) -> list[tuple[str, str]]:
        """(check id, status) of the checks that grade (INFO lines left out)."""
        return sorted(
            (str(c.get("id")), str(c.get("status")))
            for c in self.checks
            if c.get("status") in GRADED
        )

    def messages(self, status: str) -> list[str]:
        return [
            f"{c.get('id')}: {c.get('errorMessage')}"
            for c in self.checks
            if c.get("status") == status
        ]

    @property
    def methods_sent(self) -> list[str]:
        """The JSON-RPC methods the scenario sent, in first-sent order."""
        return list(dict.fromkeys(m for x in self.exchanges for m in x.rpc))

    @property
    def refusals(self) -> list[Exchange]:
        return [x for x in self.exchanges if x.refused]

    @property
    def refused_methods(self) -> list[str]:
        return list(dict.fromkeys(m for x in self.refusals for m in (x.rpc or [x.http_method])))

    def as_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "error": self.error,
            "success": self.count("SUCCESS"),
            "failure": self.count("FAILURE"),
            "warning": self.count("WARNING"),
            "graded": self.graded,
            "failures": self.messages("FAILURE"),
            "warnings": self.messages("WARNING"),
            "methods_sent": self.methods_sent,
            "refused_methods": self.refused_methods,
            "refusals": [x.describe() for x in self.refusals],
            "refusal_errors": [e for x in self.refusals for e in x.errors],
            "clean_refusals": all(x.clean_refusal for x in self.refusals),
        }


@dataclass
class Pass:
    """One run of the suite (every scenario) against one URL."""

    label: str
    url: str
    results: dict[str, ScenarioResult]
    seconds: float
    exit_status: int | None

    def passed(self, name: str, reference: Pass | None = None) -> bool:
        """The suite's verdict; and with a `reference`, the same graded checks as it."""
        result = self.results[name]
        if reference is None:
            return result.passed
        return result.passed and result.graded == reference.results[name].graded

    def count(self, reference: Pass | None = None) -> int:
        return sum(self.passed(name, reference) for name in self.results)

    def as_json(self, reference: Pass | None = None) -> dict[str, Any]:
        return {
            "url": self.url,
            "seconds": round(self.seconds, 2),
            "exit_status": self.exit_status,
            "passed": self.count(reference),
            "total": len(self.results),
            "scenarios": {
                name: {**r.as_json(), "passed": self.passed(name, reference)}
                for name, r in self.results.items()
            },
        }


_RESULT_DIR = re.compile(r"server-(?P<name>.+)-\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d-\d{3}Z")


def read_results(workdir: Path, names: Sequence[str], note: str) -> dict[str, ScenarioResult]:
    """Each scenario's checks (``results/server-NAME-TIME/checks.json``) and exchanges."""
    results = {name: ScenarioResult(name) for name in names}
    for path in sorted((workdir / "results").glob("*/checks.json")):
        match = _RESULT_DIR.fullmatch(path.parent.name)
        if match and match["name"] in results:
            results[match["name"]].checks = json.loads(path.read_text(encoding="utf-8"))
    log = workdir / "exchanges.jsonl"
    if log.exists():
        for line in log.read_text(encoding="utf-8").splitlines():
            exchange = Exchange.from_json(json.loads(line))
            if exchange.scenario in results:
                results[exchange.scenario].exchanges.append(exchange)
    for result in results.values():
        if not result.checks:
            result.error = f"no results from the suite ({note})"
    return results


def run_pass(
    label: str,
    command: list[str],
    url: str,
    names: Sequence[str],
    workdir: Path,
    *,
    token: str | None = None,
    all_scenarios: bool = True,
) -> Pass:
    """The suite against `url`: one Node process for every scenario (``--suite all``), or one
    per scenario in `names` when that is a subset; within PASS_TIMEOUT in all."""
    workdir.mkdir(parents=True)
    env = dict(os.environ)
    hook = f"--import={FETCH_HOOK.as_uri()}"
    env["NODE_OPTIONS"] = f"{env['NODE_OPTIONS']} {hook}" if env.get("NODE_OPTIONS") else hook
    env["CAPGATE_CONFORMANCE_LOG"] = str(workdir / "exchanges.jsonl")
    if token is not None:
        env["CAPGATE_CONFORMANCE_TOKEN"] = token
        env["CAPGATE_CONFORMANCE_ORIGIN"] = "/".join(url.split("/", 3)[:3])
    runs = [["--suite", "all"]] if all_scenarios else [["--scenario", name] for name in names]
    started = time.monotonic()
    status: int | None = 0
    note = "the suite ran"
    with (workdir / "output.txt").open("w", encoding="utf-8") as output:
        for run in runs:
            left = started + PASS_TIMEOUT - time.monotonic()
            if left <= 0:
                status, note = None, f"the pass ran out of its {PASS_TIMEOUT:.0f} s"
                break
            if not all_scenarios:
                env["CAPGATE_CONFORMANCE_SCENARIO"] = run[1]
            args = [*command, "server", "--url", url, *run]
            try:
                done = subprocess.run(
                    args,
                    cwd=workdir,
                    env=env,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    timeout=left,
                )
                status = done.returncode if status == 0 else status
            except subprocess.TimeoutExpired:  # subprocess.run has killed it
                status, note = None, f"the suite timed out after {PASS_TIMEOUT:.0f} s"
                break
    results = read_results(workdir, names, note)
    return Pass(label, url, results, time.monotonic() - started, status)


# --------------------------------------------------------------------------- the comparison


@contextlib.contextmanager
def capgate(ws: Workspace, policy: Path, audit: Path) -> Iterator[str]:
    """``python -m gateway serve`` with the workspace and `policy`; yields its base URL."""
    env = {**os.environ, **ws.environ()}
    args = [
        *(sys.executable, "-m", "gateway", "serve"),
        *ws.serve_args(0, audit, policy),
        *("--shutdown-grace", "1s"),
    ]
    log = audit.with_suffix(".log")
    with child(args, log, env=env) as proc:
        line = ready_line(proc, log, lambda s: s.startswith("capgate "), "capgate")
        yield str(json.loads(line.split(" listening ", 1)[1])["url"])


def through_capgate(
    label: str,
    command: list[str],
    ws: Workspace,
    server_url: str,
    policy_source: Path,
    names: Sequence[str],
    workdir: Path,
    all_scenarios: bool,
) -> Pass:
    policy = ws.root / f"{label}.yaml"
    policy.write_text(rewrite_policy_urls(policy_source.read_text(), {"mcp": server_url}))
    token = ws.token(AGENT, [ROLE], ttl=900, run=f"conformance-{label}")
    with capgate(ws, policy, ws.root / f"audit-{label}.jsonl") as gateway_url:
        url = f"{gateway_url}/{UPSTREAM}/mcp"
        return run_pass(
            label, command, url, names, workdir / label, token=token, all_scenarios=all_scenarios
        )


@dataclass
class Comparison:
    names: list[str]
    direct: Pass
    capgate: Pass
    restrictive: Pass | None

    def passes(self) -> list[Pass]:
        return [p for p in (self.direct, self.capgate, self.restrictive) if p is not None]

    def reference(self, run: Pass) -> Pass | None:
        return None if run is self.direct else self.direct


def compare(workdir: Path, only: Sequence[str] | None, restrictive: bool) -> Comparison:
    command = suite_command()
    everything = list_scenarios(command)
    unknown = sorted(set(only or ()) - set(everything))
    if unknown:
        raise SuiteUnavailable(f"unknown scenarios {unknown}; the suite has {everything}")
    names = [n for n in everything if n in set(only)] if only else everything
    whole = names == everything
    with conformance_server(workdir / "conformance-server.log") as server_url:
        direct = run_pass(
            "direct", command, server_url, names, workdir / "direct", all_scenarios=whole
        )
        if not any(r.checks for r in direct.results.values()):
            raise SuiteUnavailable(
                f"the suite produced no results; see {workdir / 'direct' / 'output.txt'}:\n"
                + (workdir / "direct" / "output.txt").read_text(encoding="utf-8")[-2000:]
            )
        ws = prepare_workspace(workdir / "workspace")
        gated = through_capgate(
            "capgate", command, ws, server_url, PERMISSIVE_POLICY, names, workdir, whole
        )
        strict = None
        if restrictive:
            strict = through_capgate(
                "restrictive", command, ws, server_url, RESTRICTIVE_POLICY, names, workdir, whole
            )
    return Comparison(names, direct, gated, strict)


# --------------------------------------------------------------------------- the report


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def explain(result: ScenarioResult) -> str:
    """Why a scenario failed (or differs from direct), in one line."""
    if result.error:
        return result.error
    if result.refusals:
        clean = "" if all(x.clean_refusal for x in result.refusals) else " [NOT a clean refusal]"
        refused = "; ".join(dict.fromkeys(x.describe() for x in result.refusals))
        return f"refused by capgate: {refused}{clean}"
    failures = result.messages("FAILURE")
    if failures:
        return "no refusal by capgate: " + " | ".join(failures)[:300]
    return "graded checks differ from direct: " + json.dumps(result.graded)[:300]


def report(c: Comparison) -> list[str]:
    width = max(len(n) for n in c.names)
    head = f"{'scenario':<{width}}  direct  capgate"
    head += "  restrictive" if c.restrictive is not None else ""
    lines = [head, "-" * len(head)]
    for name in c.names:
        row = [f"{name:<{width}}", f"{_verdict(c.direct.passed(name)):<6}"]
        row.append(f"{_verdict(c.capgate.passed(name, c.direct)):<7}")
        if c.restrictive is not None:
            row.append(_verdict(c.restrictive.passed(name, c.direct)))
        lines.append("  ".join(row).rstrip())
        warnings = c.direct.results[name].messages("WARNING")
        if warnings:
            lines.append(f"    direct warnings: {' | '.join(warnings)}"[:300])
        for run in c.passes():
            if not run.passed(name, c.reference(run)):
                lines.append(f"    {run.label}: {explain(run.results[name])}")
    return lines


def to_govern(c: Comparison) -> dict[str, list[str]]:
    """For each JSON-RPC method that scenarios failing through capgate send (directly) and
    that capgate never let through in that pass: the scenarios that send it."""
    passed_through = {
        m for r in c.capgate.results.values() for x in r.exchanges if not x.refused for m in x.rpc
    }
    allowed = {f"tools/call {tool}" for tool in policy_tools(PERMISSIVE_POLICY)}
    methods: dict[str, list[str]] = {}
    for name in c.names:
        if c.capgate.passed(name, c.direct):
            continue
        for method in c.direct.results[name].methods_sent:
            if method not in passed_through and method not in allowed:
                methods.setdefault(method, []).append(name)
    return methods


def policy_tools(path: Path) -> set[str]:
    """The tools a policy file's rules name."""
    policy = YAML(typ="safe").load(path.read_text(encoding="utf-8"))
    return {
        str(rule["tool"])
        for role in policy.get("roles", {}).values()
        for rule in role.get("rules", [])
        if "tool" in rule
    }


def write_json(path: Path, c: Comparison) -> None:
    value = {
        "suite": f"{SUITE_PACKAGE}@{SUITE_VERSION}",
        "scenarios": c.names,
        "direct": c.direct.as_json(),
        "capgate": c.capgate.as_json(c.direct),
        "restrictive": None if c.restrictive is None else c.restrictive.as_json(c.direct),
        "to_govern": to_govern(c),  # method -> scenarios
    }
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mocks.conformance", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--scenario", action="append", help="only this scenario (repeatable)")
    parser.add_argument("--no-restrictive", action="store_true", help="skip the restrictive pass")
    parser.add_argument("--json", type=Path, help="write the whole comparison there as JSON")
    parser.add_argument("--keep", type=Path, help="keep the work directory (results, logs) there")
    return parser.parse_args(argv)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the context managers, which stop the children


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    with contextlib.ExitStack() as stack:
        if args.keep is not None:
            workdir = args.keep.resolve()
            if workdir.exists() and any(workdir.iterdir()):
                print(f"mcp-conformance: --keep {workdir} is not empty", file=sys.stderr)
                return 2
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mcp-conf-")))
        try:
            c = compare(workdir, args.scenario, not args.no_restrictive)
        except SuiteUnavailable as exc:
            print(f"mcp-conformance: the suite cannot run: {exc}", file=sys.stderr)
            return 2
        for line in report(c):
            print(line)
        total = len(c.names)
        print(f"\nsuite: {SUITE_PACKAGE}@{SUITE_VERSION}, {total} server scenarios")
        for run in c.passes():
            count = run.count(c.reference(run))
            print(f"{run.label}: {count}/{total} in {run.seconds:.1f} s ({run.url})")
        governed = to_govern(c)
        if governed:
            print("\nJSON-RPC methods that the scenarios failing through capgate send, and that")
            print("capgate let through in none of its exchanges (scenarios that send each):")
            for method, scenarios in governed.items():
                print(f"  {method}: {', '.join(scenarios)}")
        if args.json is not None:
            write_json(args.json, c)
        direct, gated = c.direct.count(), c.capgate.count(c.direct)
        print(f"mcp-conformance: direct {direct}/{total}, through capgate {gated}/{total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
