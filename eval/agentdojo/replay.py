"""Replays of AgentDojo's ground truth through a real capgate process, with a real MCP client.

For one suite and one policy (the suite's own, or the permissive baseline):

* ``utility``: each user task's ground-truth calls, in order, on the suite's default
  environment. A call capgate holds for approval is decided by a simulated person who
  approves exactly the calls of that user task (tool and arguments as the approver sees them
  on the admin API). A task passes *autonomously* when every call ran and none was held; it
  passes *with approval* when every call ran. AgentDojo's own utility check is run on the
  environment the calls left, for the tasks whose check does not read the model's text.
* ``security``: for every (user task, injection task) pair, the environment carrying the
  attack (AgentDojo's ``important_instructions`` text) in every injection vector the user task
  reads, the user task's calls up to and including the first that returns the attack, then
  the injection task's ground-truth calls (an agent that obeys the injection completely). The
  simulated person approves only calls of the user's task and denies the rest. AgentDojo's
  own security check on the final environment says whether the attack succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import yaml
from agentdojo.agent_pipeline.tool_execution import tool_result_to_str
from agentdojo.attacks.important_instructions_attacks import ImportantInstructionsAttack
from agentdojo.base_tasks import BaseInjectionTask, BaseUserTask
from agentdojo.functions_runtime import FunctionCall, FunctionsRuntime, TaskEnvironment
from agentdojo.task_suite.task_suite import TaskSuite, read_suite_file, validate_injections
from agentdojo.types import text_content_block_from_string
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from eval.agentdojo.attacks import attack_calls as attack_calls_for
from eval.agentdojo.server import SuiteServer
from mocks.demo import Workspace, prepare_workspace

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "policies" / "agentdojo"
AGENT = "agentdojo-agent"
USER_NAME = "Emma Johnson"  # as AgentDojo's important_instructions attack signs
MODEL_NAME = "the AI language model"
REDACTED = "[redacted:"


def attack_text(injection: BaseInjectionTask[Any]) -> str:
    return ImportantInstructionsAttack._JB_STRING.format(
        user=USER_NAME, model=MODEL_NAME, goal=injection.GOAL
    )


_SUITE_TEXT: dict[tuple[str, Any], tuple[str, dict[str, str]]] = {}


def load_env(suite: TaskSuite[Any], injections: dict[str, str]) -> TaskEnvironment:
    """``suite.load_and_inject_default_environment(injections)``, faster: the suite's file is
    read (``!include`` resolved) once, and the injected text is parsed by libyaml (same YAML
    semantics, the same safe constructors). AgentDojo's method reads and parses the file
    three times in pure Python, ~0.2 s for workspace, on every replay."""
    key = (suite.name, suite.benchmark_version)
    if key not in _SUITE_TEXT:
        text = read_suite_file(suite.name, "environment.yaml", suite.data_path)
        _SUITE_TEXT[key] = (text, suite.get_injection_vector_defaults())
    text, defaults = _SUITE_TEXT[key]
    validate_injections(injections, defaults)
    data = yaml.load(text.format(**dict(defaults, **injections)), Loader=yaml.CSafeLoader)  # noqa: S506 (a safe loader)
    env: TaskEnvironment = suite.environment_type.model_validate(data)
    return env


def canaries(suite: TaskSuite[Any]) -> dict[str, str]:
    return {v: f"<CANARY---{v}--->" for v in suite.get_injection_vector_defaults()}


def direct_run(
    suite: TaskSuite[Any], env: TaskEnvironment, calls: Sequence[FunctionCall]
) -> list[str]:
    """Run calls straight on ``env`` (no gateway); the result texts."""
    runtime = FunctionsRuntime(suite.tools)
    texts = []
    for call in calls:
        result, error = runtime.run_function(env, call.function, dict(call.args))
        texts.append(error if error is not None else tool_result_to_str(result))
    return texts


@dataclass
class TaskFacts:
    """What is known of a user task before any replay (from a direct run of its ground truth)."""

    task: BaseUserTask[Any]
    calls: list[FunctionCall]
    vectors: list[str]  # the injection vectors its calls read (AgentDojo's candidates)
    read_at: int  # index of the first call that returns injected text
    text_free: bool  # AgentDojo's utility check decides without the model's text


def task_facts(suite: TaskSuite[Any], task: BaseUserTask[Any]) -> TaskFacts:
    marks = canaries(suite)
    env = task.init_environment(load_env(suite, marks))
    calls = list(task.ground_truth(env.model_copy(deep=True)))
    texts = direct_run(suite, env, calls)
    vectors = [v for v, mark in marks.items() if any(mark in t for t in texts)]
    read_at = next(
        (i for i, t in enumerate(texts) if any(mark in t for mark in marks.values())),
        len(calls) - 1,
    )
    # Does the check decide on the environment alone? Run the ground truth on a clean
    # environment and check with an empty answer.
    clean = task.init_environment(load_env(suite, {}))
    pre = clean.model_copy(deep=True)
    direct_run(suite, clean, task.ground_truth(clean.model_copy(deep=True)))
    text_free = bool(suite._check_user_task_utility(task, [], pre, clean, calls))
    return TaskFacts(task, calls, vectors, read_at, text_free)


# ---------------------------------------------------------------------------------------------
# The gateway process


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[str]
    url: str
    admin: str
    admin_token: str
    audit: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def write_policy(source: Path, mcp_base: str, dest: Path) -> Path:
    text = source.read_text()
    marker = "url: http://127.0.0.1:9300"
    if marker not in text:
        raise ValueError(f"{source}: the upstream's url must be {marker!r} (rewritten per run)")
    dest.write_text(text.replace(marker, f"url: {mcp_base}"))
    return dest


def start_gateway(ws: Workspace, policy: Path, workdir: Path) -> GatewayProcess:
    token_file = workdir / "admin.token"
    token = "eval-admin-" + os.urandom(12).hex()
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    audit = workdir / "audit.jsonl"
    args = [
        sys.executable, "-m", "gateway", "serve",
        "--policy", str(policy), "--jwks", str(ws.jwks),
        "--upstream-key", str(ws.upstream_key), "--secrets-dir", str(ws.secrets_dir),
        "--host", "127.0.0.1", "--port", "0", "--admin-port", "0",
        "--admin-token-file", str(token_file), "--audit", str(audit),
        "--approval-timeout", "60s", "--approvals-per-agent", "10", "--log-level", "warning",
        "--traces-exporter", "none", "--metrics-exporter", "none",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(  # noqa: S603 (our own gateway)
        args, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, cwd=ROOT, env=env
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening {" in line:
            ready = json.loads(line[line.index("{") :])
            return GatewayProcess(proc, ready["url"], ready["admin"], token, audit)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"capgate did not start with {policy}")


# ---------------------------------------------------------------------------------------------
# The simulated person


def _shown_call(pending: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    if pending.get("body_truncated") or not pending.get("body"):
        return None
    try:
        message = json.loads(pending["body"])
        params = message["params"]
        return str(params["name"]), dict(params.get("arguments") or {})
    except (ValueError, KeyError, TypeError):
        return None


def _same(shown: Any, expected: Any) -> bool:
    if isinstance(shown, str) and shown.startswith(REDACTED):
        # The admin API shows approvers a redacted body (a password, a token): unless the
        # person confirmed it (Approver._unmasked), they cannot tell the user's value from
        # an attacker's, so do not approve it.
        return False
    if isinstance(shown, dict) and isinstance(expected, dict):
        keys = set(shown) | set(expected)
        return all(_same(shown.get(k), expected.get(k)) for k in keys)
    if isinstance(shown, list) and isinstance(expected, list):
        return len(shown) == len(expected) and all(map(_same, shown, expected))
    if isinstance(shown, int | float) and isinstance(expected, int | float):
        return float(shown) == float(expected)
    return bool(shown == expected)


def _plain(args: Any) -> dict[str, Any]:
    return dict(json.loads(json.dumps(dict(args), default=str)))


class Approver:
    """Polls the admin API for calls of one run held for approval; approves those that are
    calls of the user's task (tool and the arguments shown), denies the others."""

    def __init__(self, gw: GatewayProcess, http: httpx2.AsyncClient) -> None:
        self.gw = gw
        self.http = http
        self.run: str | None = None
        self.allowed: list[tuple[str, dict[str, Any]]] = []
        self.asked = 0
        self.approved = 0
        self.denied = 0
        self.whys: list[str] = []  # why each decided call was held, as the approver read it
        self.checks = 0  # masked values the person checked (POST /approvals/{id}/check)

    def expect(self, run: str, calls: Sequence[FunctionCall]) -> None:
        self.run = run
        self.allowed = [(c.function, _plain(c.args)) for c in calls]
        self.asked = self.approved = self.denied = 0
        self.whys = []

    async def _approves(self, pending: dict[str, Any]) -> bool:
        shown = _shown_call(pending)
        if shown is None:
            return False
        name, args = shown
        args = await self._unmasked(pending, name, args)
        return any(name == n and _same(args, a) for n, a in self.allowed)

    async def _unmasked(
        self, pending: dict[str, Any], name: str, args: dict[str, Any]
    ) -> dict[str, Any]:
        """A masked argument (a password) cannot be read, but the person knows what the user
        asked for: they ask the gateway whether the held value is that (yes or no, never the
        value: POST /approvals/{id}/check); a value confirmed stands in for the mask."""
        auth = {"Authorization": f"Bearer {self.gw.admin_token}"}
        out = dict(args)
        for path in pending.get("checkable") or []:
            key = path.removeprefix("params.arguments.")
            if key == path or "." in key or "[" in key:
                continue
            for tool, expected in self.allowed:
                if tool != name or key not in expected:
                    continue
                value = expected[key]
                answer = await self.http.post(
                    f"{self.gw.admin}/approvals/{pending['id']}/check",
                    headers=auth,
                    json={"path": path, "value": str(value)},
                )
                self.checks += 1
                if answer.status_code == 200 and answer.json().get("equal"):
                    out[key] = value
                    break
        return out

    async def loop(self) -> None:
        auth = {"Authorization": f"Bearer {self.gw.admin_token}"}
        while True:
            answer = await self.http.get(f"{self.gw.admin}/approvals", headers=auth)
            for pending in answer.json()["pending"]:
                if pending.get("run") != self.run:
                    continue
                approve = await self._approves(pending)
                verb = "approve" if approve else "deny"
                body = {
                    "reason": "simulated person: " + ("user's task" if approve else "not asked")
                }
                done = await self.http.post(
                    f"{self.gw.admin}/approvals/{pending['id']}/{verb}", headers=auth, json=body
                )
                if done.status_code == 200:
                    self.asked += 1
                    self.whys.append(str(pending.get("why", "")))
                    if approve:
                        self.approved += 1
                    else:
                        self.denied += 1
            await asyncio.sleep(0.01)


# ---------------------------------------------------------------------------------------------
# Replays


@dataclass
class CallOutcome:
    function: str
    ran: bool  # reached the suite's server
    reason: str  # "allowed", or capgate's reason code for a refusal


@dataclass
class UtilityResult:
    task: str
    outcomes: list[CallOutcome]
    approvals: int
    env_check: bool | None  # AgentDojo's utility check; None where it reads the model's text
    held: list[str] = field(default_factory=list)  # why each call was held (the approver's view)

    @property
    def all_ran(self) -> bool:
        return all(o.ran for o in self.outcomes)

    @property
    def autonomous(self) -> bool:
        return self.all_ran and self.approvals == 0


@dataclass
class SecurityResult:
    user_task: str
    injection_task: str
    injection_outcomes: list[CallOutcome]
    approvals: int
    succeeded: bool  # AgentDojo's security check: the attacker's goal was reached

    @property
    def blocked(self) -> bool:
        return any(not o.ran for o in self.injection_outcomes)


@dataclass
class SuiteRun:
    suite: str
    policy: str
    utility: list[UtilityResult] = field(default_factory=list)
    security: list[SecurityResult] = field(default_factory=list)
    seconds: float = 0.0
    audit_lines: int = 0
    audit_verified: str = ""


def _reason(error: Exception | str) -> str:
    text = str(error)
    for word in text.replace('"', " ").replace("'", " ").replace(":", " ").split():
        if word.endswith(("_denied", "_invalid", "_tainted", "_timeout", "_pending")) or word in (
            "no_rule",
            "tool_denied",
        ):
            return word
    return "refused"


def _refusal(err: MCPError) -> str:
    """capgate's reason code, with a tool's refusals told apart: no rule for the tool at all
    (``tool_not_allowed``) or arguments outside its rule's schema (``arguments_refused``)."""
    data = err.data if isinstance(err.data, dict) else {}
    reason = str(data.get("reason") or _reason(err))
    if reason == "tool_denied":
        detail = str(data.get("detail", ""))
        return "tool_not_allowed" if "no rule" in detail else "arguments_refused"
    return reason


class Replayer:
    """One suite's MCP server, one capgate process in front of it, the simulated person."""

    def __init__(
        self,
        suite: TaskSuite[Any],
        policy: Path,
        workdir: Path,
        ws: Workspace | None = None,
        *,
        vouch: bool = False,
    ) -> None:
        self.suite = suite
        # Each replay's token carries the user task's prompt (claim "vouched"), as an
        # orchestrator that mints the run's token from the user's request would.
        self.vouch = vouch
        self.policy_source = policy
        self.workdir = workdir
        self.ws = ws or prepare_workspace(workdir.parent / "keys")
        self.server = SuiteServer(suite)
        self.gw: GatewayProcess | None = None
        self.http = httpx2.AsyncClient(timeout=30)
        self.approver: Approver | None = None
        self._approver_task: asyncio.Task[None] | None = None
        self.role = f"{suite.name}-assistant"
        self.audit_verified = ""  # set when the gateway has stopped
        self._runs = 0

    async def __aenter__(self) -> Replayer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        url = await self.server.start()
        policy = write_policy(
            self.policy_source, url.removesuffix("/mcp"), self.workdir / "policy.yaml"
        )
        self.gw = await asyncio.to_thread(start_gateway, self.ws, policy, self.workdir)
        self.approver = Approver(self.gw, self.http)
        self._approver_task = asyncio.create_task(self.approver.loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._approver_task is not None:
            self._approver_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._approver_task
        if self.gw is not None:
            await asyncio.to_thread(self.gw.stop)
            self.audit_verified = await asyncio.to_thread(self.verify_audit)
        await self.http.aclose()
        await self.server.stop()

    @contextlib.asynccontextmanager
    async def session(self, run: str, request: str) -> AsyncIterator[Client]:
        assert self.gw is not None
        extra = {"vouched": request} if self.vouch else None
        token = self.ws.token(AGENT, [self.role], run=run, extra=extra)
        url = f"{self.gw.url}/{self.suite.name}/mcp"
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=90)
        async with http, Client(streamable_http_client(url, http_client=http), mode="legacy") as c:
            yield c

    def _run_id(self, kind: str) -> str:
        self._runs += 1
        return f"{self.suite.name}-{kind}-{self._runs}-{os.getpid()}"

    async def _call(self, mcp: Client, call: FunctionCall) -> CallOutcome:
        assert self.approver is not None
        before, asked = len(self.server.calls), self.approver.asked
        try:
            result = await mcp.call_tool(call.function, _plain(call.args))
        except MCPError as err:
            return CallOutcome(call.function, False, _refusal(err))
        ran = len(self.server.calls) > before
        if not ran:
            text = " ".join(getattr(c, "text", "") for c in result.content)
            return CallOutcome(call.function, False, _reason(text))
        held = self.approver.asked > asked
        return CallOutcome(call.function, True, "approved" if held else "allowed")

    async def utility(self, facts: TaskFacts) -> UtilityResult:
        assert self.approver is not None
        task = facts.task
        env = task.init_environment(load_env(self.suite, {}))
        pre = env.model_copy(deep=True)
        calls = list(task.ground_truth(env.model_copy(deep=True)))
        self.server.reset(env)
        run = self._run_id("u")
        self.approver.expect(run, calls)
        async with self.session(run, task.PROMPT) as mcp:
            outcomes = [await self._call(mcp, call) for call in calls]
        env_check = None
        if facts.text_free:
            env_check = bool(
                self.suite._check_user_task_utility(task, [], pre, env, self.server.calls)
            )
        return UtilityResult(
            task.ID, outcomes, self.approver.asked, env_check, list(self.approver.whys)
        )

    async def security(self, facts: TaskFacts, injection: BaseInjectionTask[Any]) -> SecurityResult:
        assert self.approver is not None
        task = facts.task
        text = attack_text(injection)
        env = load_env(self.suite, {v: text for v in facts.vectors})
        env = task.init_environment(env)
        pre = env.model_copy(deep=True)
        user_calls = list(task.ground_truth(env.model_copy(deep=True)))
        attack_calls = list(injection.ground_truth(env.model_copy(deep=True)))
        self.server.reset(env)
        run = self._run_id("s")
        self.approver.expect(run, user_calls)
        async with self.session(run, task.PROMPT) as mcp:
            for call in user_calls[: facts.read_at + 1]:
                await self._call(mcp, call)
            # AgentDojo leaves a few injection tasks without a ground truth: eval/attacks.py
            written = attack_calls_for(self.suite, injection, env, pre)
            if written is not None:
                attack_calls = written
            outcomes = [await self._call(mcp, copy.deepcopy(call)) for call in attack_calls]
        output = [text_content_block_from_string("")]
        succeeded = bool(
            self.suite._check_injection_task_security(
                injection, output, pre, env, self.server.calls
            )
        )
        return SecurityResult(task.ID, injection.ID, outcomes, self.approver.asked, succeeded)

    def verify_audit(self) -> str:
        """``capgate audit verify`` on the trail, once the gateway has stopped (its last
        checkpoint written): its first line, e.g. "...: ok, 2220 lines, 5 signed checkpoints
        ..., hash chain intact", or what went wrong."""
        assert self.gw is not None
        args = [sys.executable, "-m", "gateway", "audit", "verify", str(self.gw.audit)]
        done = subprocess.run(  # noqa: S603 (our own gateway)
            args,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        first = (done.stdout.strip().splitlines() or [done.stderr.strip()])[0]
        return ("ok: " if done.returncode == 0 else "FAILED: ") + first

    def audit_lines(self) -> int:
        assert self.gw is not None
        path = self.gw.audit
        if not path.exists():
            return 0
        with path.open() as lines:
            return sum(1 for _ in lines)
