"""Instructions per request, counted by callgrind: a repeatable A/B figure for one call's cost.

    python -m bench.instructions [--scenarios capgate,capgate+sql-unique] [--seconds 20]
                                 [--connections 8]

``bench.run`` measures req/s and CPU time, which on a shared or virtual machine vary by 10-30%
between two runs of the same build, more than most single changes save. This counts
instructions instead: the bare proxy and each chosen scenario of ``bench.run`` are started
under ``valgrind --tool=callgrind`` with instrumentation off (start-up is not counted), warmed
up, then counted over ``--seconds`` of load from the load generator (wrk, or the Python
fallback); the figure is the instructions the server executed (every thread) divided by the
requests it answered in that time. The same build gives the same figure within a few percent
whatever else the machine runs (the load generator's batching still varies a little), so two
builds can be compared on a busy machine.

Instructions are not time: a system call or a cache miss costs more than its instructions
say, so this complements ``bench.run``, it does not replace it. The ratio printed (bare proxy
instructions as % of the scenario's) is the req/s ratio if time followed instructions.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.run import (
    SCENARIOS,
    UPSTREAM_PATH,
    BenchError,
    BodySequence,
    Context,
    LoadGenerator,
    Pinning,
    Processes,
    Scenario,
    Target,
    _start_upstream,
    check_once,
)

READY_TIMEOUT = 300.0  # a Python start under valgrind, on a busy machine
WARMUP_SECONDS = 3  # under valgrind, the first calls still translate new code


@dataclass(frozen=True)
class Count:
    name: str
    requests: int
    instructions: int

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests if self.requests else float("nan")


def _valgrind(out: Path) -> list[str]:
    tool = shutil.which("valgrind")
    if tool is None:
        raise BenchError("valgrind is not installed (apt-get install valgrind)")
    return [
        tool,
        "--tool=callgrind",
        "--instr-atstart=no",  # start-up runs uninstrumented; counting starts on demand
        f"--callgrind-out-file={out}",
    ]


def _control(pid: int, *args: str) -> None:
    proc = subprocess.run(
        ["callgrind_control", *args, str(pid)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise BenchError(f"callgrind_control {' '.join(args)} failed: {proc.stderr.strip()}")


def _dumped_instructions(out: Path, before: set[str]) -> int:
    """The instruction total of the dump callgrind wrote since ``before`` (file names)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = sorted(set(glob.glob(f"{out}*")) - before)
        for name in new:
            for line in Path(name).read_text(errors="replace").splitlines():
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
        time.sleep(0.2)
    raise BenchError(f"no callgrind dump appeared beside {out}")


def count(
    ctx: Context,
    gen: LoadGenerator,
    name: str,
    argv: Sequence[str],
    make_target: Callable[[dict[str, object], int], Target],
    *,
    seconds: int,
    connections: int,
    env: dict[str, str] | None = None,
) -> Count:
    """Start ``argv`` under callgrind, warm it up, count ``seconds`` of load, stop it."""
    out = ctx.tmp / f"{name}.{time.monotonic_ns()}.callgrind"  # one per process
    proc, ready = ctx.procs.start(
        name,
        [*_valgrind(out), *argv],
        env={"PYTHONHASHSEED": "0", **(env or {})},
        prefix=ctx.pinning.prefix(ctx.pinning.server_cpu),
        ready=ready_word(name),
        timeout=READY_TIMEOUT,
    )
    pid = int(str(ready.get("pid", proc.pid)))
    target = make_target(ready, pid)
    try:
        check_once(target)
        _control(pid, "--instr=on")
        gen.run(target, connections, WARMUP_SECONDS)
        _control(pid, "--zero")
        data = gen.run(target, connections, seconds)
        before = set(glob.glob(f"{out}*"))
        _control(pid, "--dump")
        total = _dumped_instructions(out, before)
    finally:
        ctx.procs.stop(proc, grace=30)
    if data["non2xx"]:
        raise BenchError(f"{name}: {data['non2xx']} non-2xx answers while counting")
    return Count(name, int(data["requests"]), total)


def ready_word(name: str) -> str:
    return "bench-bare-proxy" if name == "bare-proxy" else "capgate"


def count_bare(ctx: Context, gen: LoadGenerator, seconds: int, connections: int) -> Count:
    argv = [sys.executable, "-m", "bench.bare_proxy", "--upstream", ctx.upstream_url]
    return count(
        ctx,
        gen,
        "bare-proxy",
        [*argv, "--port", "0"],
        lambda ready, pid: Target(
            "bare-proxy",
            "bare",
            str(ready["url"]) + UPSTREAM_PATH,
            (f"Bearer {ctx.ws.metrics_token}",),
            pid,
        ),
        seconds=seconds,
        connections=connections,
    )


def count_scenario(
    ctx: Context, gen: LoadGenerator, sc: Scenario, seconds: int, connections: int
) -> Count:
    if sc.setup is not None:
        sc.setup(ctx)
    sdir = ctx.tmp / sc.name
    sdir.mkdir()
    policy = sdir / "policy.yaml"
    policy.write_text(sc.policy(ctx))
    sws = dataclasses.replace(ctx.ws, policy=policy)
    argv = [
        sys.executable,
        "-m",
        "gateway",
        "serve",
        *sws.serve_args(0, sdir / "audit.jsonl"),
        *sc.serve_args(ctx),
    ]
    tokens = tuple(
        f"Bearer {sws.token(agent, list(sc.roles), ttl=1800, run='bench')}" for agent in sc.agents
    )

    def target(ready: dict[str, object], pid: int) -> Target:
        return Target(
            sc.name,
            "capgate",
            str(ready["url"]) + sc.path,
            tokens,
            pid,
            method=sc.method,
            body=sc.body,
            body_seq=(
                BodySequence.from_template(sc.body_template)
                if sc.body_template is not None
                else None
            ),
            content_type=sc.content_type,
            expect_body=sc.expect_body,
        )

    return count(
        ctx,
        gen,
        sc.name,
        argv,
        target,
        seconds=seconds,
        connections=connections,
        env={**ctx.ws.environ(), **sc.env(ctx)},
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    p.add_argument("--scenarios", default="capgate", help="comma-separated bench.run scenarios")
    p.add_argument("--seconds", type=int, default=20, help="seconds of counted load each")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--no-bare", action="store_true", help="skip the bare proxy")
    args = p.parse_args(argv)
    by_name = {sc.name: sc for sc in SCENARIOS}
    wanted = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in wanted if s not in by_name]
    if unknown:
        print(f"unknown scenario(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    counts: list[Count] = []
    try:
        with _session() as (ctx, gen):
            if not args.no_bare:
                counts.append(count_bare(ctx, gen, args.seconds, args.connections))
                print(_line(counts[-1], None), flush=True)
            for name in wanted:
                counts.append(
                    count_scenario(ctx, gen, by_name[name], args.seconds, args.connections)
                )
                print(_line(counts[-1], counts[0] if not args.no_bare else None), flush=True)
    except BenchError as exc:
        print(f"bench.instructions: {exc}", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _session() -> Iterator[tuple[Context, LoadGenerator]]:
    """The bench's upstream and load generator, stopped and cleaned up at the end."""
    tool = shutil.which("wrk") or "python"
    tmp = Path(tempfile.mkdtemp(prefix="capgate-instr-"))
    procs = Processes(tmp)
    pinning = Pinning.detect()
    try:
        ctx, _ = _start_upstream(tmp, procs, pinning, lambda line: print(line, flush=True))
        yield ctx, LoadGenerator(tool, pinning, tmp)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def gateway_counts(names: Sequence[str], seconds: int, connections: int = 8) -> dict[str, float]:
    """Instructions per request of each named ``bench.run`` scenario."""
    by_name = {sc.name: sc for sc in SCENARIOS}
    with _session() as (ctx, gen):
        return {
            name: count_scenario(ctx, gen, by_name[name], seconds, connections).per_request
            for name in names
        }


def _line(c: Count, bare: Count | None) -> str:
    text = f"{c.name:<24} {c.per_request:>12,.0f} instructions/request ({c.requests} requests)"
    if bare is not None and c is not bare:
        text += f"  bare proxy = {100 * bare.per_request / c.per_request:.1f}% of it"
    return text


if __name__ == "__main__":
    raise SystemExit(main())
