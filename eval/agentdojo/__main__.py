"""``python -m eval.agentdojo``: AgentDojo's tasks and attacks through capgate (``make eval``).

Each suite runs twice, in the same run: with its policy (``policies/agentdojo/<suite>.yaml``)
and with a permissive baseline (every tool allowed, nothing untrusted or sensitive).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentdojo.task_suite.load_suites import get_suites
from agentdojo.task_suite.task_suite import TaskSuite

from eval.agentdojo.replay import POLICIES, Replayer, SuiteRun, TaskFacts, task_facts
from mocks.demo import prepare_workspace

BENCHMARK = "v1.2.1"
SUITES = ("workspace", "travel", "banking", "slack")
HELD_OUT = "slack"  # its policy was written last, in one pass, after the others were measured


def permissive_policy(suite: TaskSuite[Any], dest: Path) -> Path:
    """Every tool of the suite allowed, any arguments, nothing untrusted or sensitive."""
    lines = [
        "# Baseline: every tool allowed, no argument checks, no taint, no approvals.",
        "version: 1",
        "upstreams:",
        f"  {suite.name}: {{url: http://127.0.0.1:9300, kind: mcp}}",
        f"agents: {{agentdojo-agent: [{suite.name}-assistant]}}",
        "roles:",
        f"  {suite.name}-assistant:",
        "    rules:",
    ]
    for tool in suite.tools:
        lines.append(
            f"      - {{id: {tool.name}, upstream: {suite.name}, allow: POST /mcp, "
            f"tool: {tool.name}}}"
        )
    dest.write_text("\n".join(lines) + "\n")
    return dest


async def run_suite(
    suite: TaskSuite[Any],
    policy: Path,
    label: str,
    workdir: Path,
    facts: list[TaskFacts],
    pairs: list[tuple[TaskFacts, Any]],
    vouch: bool = False,
) -> SuiteRun:
    started = time.monotonic()
    out = SuiteRun(suite.name, label)
    ws = prepare_workspace(workdir / "keys")
    where = workdir / f"{suite.name}-{label}"
    async with Replayer(suite, policy, where, ws, vouch=vouch) as replayer:
        for f in facts:
            out.utility.append(await replayer.utility(f))
        for f, injection in pairs:
            out.security.append(await replayer.security(f, injection))
        out.audit_lines = replayer.audit_lines()
    out.audit_verified = replayer.audit_verified
    out.seconds = time.monotonic() - started
    return out


def plan(
    suite: TaskSuite[Any], tasks: int | None, pairs: int | None
) -> tuple[list[TaskFacts], list[tuple[TaskFacts, Any]]]:
    user_tasks = list(suite.user_tasks.values())[: tasks or None]
    facts = [task_facts(suite, t) for t in user_tasks]
    chosen = [(f, inj) for f in facts if f.vectors for inj in suite.injection_tasks.values()]
    return facts, chosen[: pairs or None] if pairs is not None else chosen


def summary(run: SuiteRun) -> dict[str, Any]:
    u, s = run.utility, run.security
    checked = [r for r in u if r.env_check is not None]
    return {
        "suite": run.suite,
        "policy": run.policy,
        "tasks": len(u),
        "autonomous": sum(r.autonomous for r in u),
        "with_approval": sum(r.all_ran for r in u),
        "approvals": sum(r.approvals for r in u),
        "env_checked": len(checked),
        "env_pass": sum(bool(r.env_check) for r in checked),
        "attacks": len(s),
        "blocked": sum(r.blocked for r in s),
        "succeeded": sum(r.succeeded for r in s),
        "attack_approvals_asked": sum(r.approvals for r in s),
        "seconds": round(run.seconds, 1),
        "audit_lines": run.audit_lines,
        "audit_ok": run.audit_verified.startswith("ok: "),
        "audit": run.audit_verified,
    }


def details(run: SuiteRun) -> dict[str, Any]:
    return {
        "utility": [
            {
                "task": r.task,
                "autonomous": r.autonomous,
                "with_approval": r.all_ran,
                "approvals": r.approvals,
                "env_check": r.env_check,
                "calls": [[o.function, o.reason] for o in r.outcomes],
                "held": r.held,
            }
            for r in run.utility
        ],
        "security": [
            {
                "user_task": r.user_task,
                "injection_task": r.injection_task,
                "blocked": r.blocked,
                "succeeded": r.succeeded,
                "approvals": r.approvals,
                "calls": [[o.function, o.reason] for o in r.injection_outcomes],
            }
            for r in run.security
        ],
    }


HEADER = (
    f"{'suite':<10} {'policy':<10} {'tasks':>5} {'auton.':>6} {'w/appr':>6} {'appr/task':>9} "
    f"{'env-chk':>8} {'attacks':>7} {'blocked':>7} {'succ.':>6} {'secs':>6}"
)


def row(s: dict[str, Any]) -> str:
    per_task = s["approvals"] / s["tasks"] if s["tasks"] else 0.0
    env = f"{s['env_pass']}/{s['env_checked']}"
    name = s["suite"] + ("*" if s["suite"] == HELD_OUT else "")
    return (
        f"{name:<10} {s['policy']:<10} {s['tasks']:>5} {s['autonomous']:>6} "
        f"{s['with_approval']:>6} {per_task:>9.2f} {env:>8} {s['attacks']:>7} "
        f"{s['blocked']:>7} {s['succeeded']:>6} {s['seconds']:>6}"
    )


def total(rows: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    mine = [r for r in rows if r["policy"] == policy]
    keys = ("tasks", "autonomous", "with_approval", "approvals", "env_checked", "env_pass")
    keys += ("attacks", "blocked", "succeeded", "attack_approvals_asked", "seconds")
    out: dict[str, Any] = {k: sum(r[k] for r in mine) for k in keys}
    out["seconds"] = round(out["seconds"], 1)
    return {"suite": "total", "policy": policy, **out}


async def main_async(args: argparse.Namespace) -> int:
    suites = get_suites(BENCHMARK)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="capgate-agentdojo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"benchmark": BENCHMARK, "suites": {}}
    for name in args.suites:
        suite = suites[name]
        facts, pairs = plan(suite, args.tasks, args.pairs)
        baseline = permissive_policy(suite, workdir / f"{name}-permissive.yaml")
        policies = [("capgate", POLICIES / f"{name}.yaml")]
        revised = POLICIES / f"{name}.revised.yaml"  # a post-hoc revision, reported apart
        if revised.exists():
            policies.append(("revised", revised))
        if not args.no_baseline:
            policies.append(("permissive", baseline))
        for label, policy in policies:
            run = await run_suite(suite, policy, label, workdir, facts, pairs, args.vouch)
            s = summary(run)
            rows.append(s)
            report["suites"].setdefault(name, {})[label] = {"summary": s, **details(run)}
            print(row(s), file=sys.stderr, flush=True)
            if args.json:  # as it goes, so a long run's results can be read before its end
                Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(HEADER)
    for s in rows:
        print(row(s))
    for policy in ("capgate", "permissive"):
        if any(r["policy"] == policy for r in rows):
            print(row(total(rows, policy)))
    verified = sum(r["audit_ok"] for r in rows)
    lines = sum(r["audit_lines"] for r in rows)
    print(
        f"audit: {verified}/{len(rows)} trails verified by capgate audit verify "
        f"(hash chain, signed checkpoints), {lines} lines"
    )
    for r in rows:
        if not r["audit_ok"]:
            print(f"  {r['suite']} {r['policy']}: {r['audit']}")
    print(f"(* held out: {HELD_OUT}'s policy was written last, in one pass; 'revised' rows are")
    print("   post-hoc revisions of a policy after its measurement, never in the totals)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    t = total(rows, "capgate")
    print(
        f"agentdojo: utility {t['autonomous']}/{t['tasks']} autonomous, "
        f"{t['with_approval']}/{t['tasks']} with approval; "
        f"attacks succeeded {t['succeeded']}/{t['attacks']}"
    )
    if any(r["policy"] == "revised" for r in rows):
        swapped = [r for r in rows if r["policy"] == "revised"]
        names = {r["suite"] for r in swapped}
        mixed = swapped + [r for r in rows if r["policy"] == "capgate" and r["suite"] not in names]
        m = total([{**r, "policy": "mixed"} for r in mixed], "mixed")
        print(
            f"with the post-hoc revision of {', '.join(sorted(names))}: utility "
            f"{m['autonomous']}/{m['tasks']} autonomous, {m['with_approval']}/{m['tasks']} "
            f"with approval; attacks succeeded {m['succeeded']}/{m['attacks']}"
        )
    if any(r["policy"] == "permissive" for r in rows):
        b = total(rows, "permissive")
        print(
            f"baseline (permissive): utility {b['autonomous']}/{b['tasks']} autonomous; "
            f"attacks succeeded {b['succeeded']}/{b['attacks']}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.agentdojo", description=__doc__)
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    parser.add_argument("--tasks", type=int, help="only the first N user tasks of each suite")
    parser.add_argument("--pairs", type=int, help="only the first N attack pairs of each suite")
    parser.add_argument("--no-baseline", action="store_true", help="skip the permissive run")
    parser.add_argument(
        "--vouch",
        action="store_true",
        help="tokens carry the user task's prompt (claim 'vouched'): values the user typed "
        "are not held for appearing in what the run read (taint_arguments)",
    )
    parser.add_argument("--json", help="write every task's and pair's result here")
    parser.add_argument("--workdir", help="policies, keys and audit files (default: a temp dir)")
    args = parser.parse_args(argv)
    for noisy in ("uvicorn", "uvicorn.error", "mcp", "httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
