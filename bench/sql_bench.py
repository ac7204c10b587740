"""Cost of the SQL check per call: parse + policy, uncached and cached, compiled and pure.

    python -m bench.sql_bench            # the active sqlglot build, then pure Python in a child
    python -m bench.sql_bench --no-pure  # the active build only
    python -m bench.sql_bench --sizes    # uncached check time by text length (the offload size)

"new shape" gives every call a new text whose tree differs too (a new column alias), so each
one is read and checked from scratch; "new literal" gives every call a new text that differs
only in a literal (PostgreSQL remembers an allowed tree by its shape, without literal values,
and only parses such a text; the other dialects check it from scratch); "cached" repeats one
text, which the policy's verdict cache answers.
The pure-Python figures come from a child process that loads sqlglot's ``.py`` sources instead
of the ``sqlglotc`` extension modules installed over them (sqlglot has no switch for this).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

SMALL = "SELECT id, name FROM customers WHERE country = 'DE' AND id > {n} LIMIT 10"
MEDIUM = (
    "WITH spend AS (SELECT o.customer_id, sum(o.total_cents) AS total FROM orders o "
    "WHERE o.status = 'paid' AND o.id > {n} GROUP BY o.customer_id) "
    "SELECT c.id, c.name, s.total FROM spend s JOIN customers c ON c.id = s.customer_id "
    "WHERE c.country = 'DE' ORDER BY s.total DESC LIMIT 100"
)
# The same queries with a column alias that changes with n: a new tree every call.
SMALL_SHAPE = SMALL.replace("SELECT id,", "SELECT id AS id_{n},", 1)
MEDIUM_SHAPE = MEDIUM.replace("SELECT c.id,", "SELECT c.id AS id_{n},", 1)
assert SMALL_SHAPE != SMALL and MEDIUM_SHAPE != MEDIUM


class _PureSqlglot(importlib.abc.MetaPathFinder):
    """Load sqlglot's Python sources even where a compiled module sits beside them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "sqlglot" and not fullname.startswith("sqlglot."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return spec
        source = Path(str(spec.origin)).parent / (fullname.rsplit(".", 1)[-1] + ".py")
        if not source.exists():
            return spec
        return importlib.util.spec_from_file_location(fullname, source)


_CPU: dict[int, float] = {}


def _per_call(fn: Callable[[int], object], calls: int) -> float:
    """Best of three runs of ``calls`` calls, in microseconds per call (wall clock); the best
    CPU time per call of the same runs is left in ``_CPU[id(fn)]`` (steadier on a machine
    shared with other work, where the wall clock also counts the time others had the CPU)."""
    best = best_cpu = float("inf")
    offset = 0
    for _ in range(3):
        started, cpu = time.perf_counter(), time.process_time()
        for i in range(calls):
            fn(offset + i)
        best = min(best, (time.perf_counter() - started) / calls)
        best_cpu = min(best_cpu, (time.process_time() - cpu) / calls)
        offset += calls
    _CPU[id(fn)] = best_cpu * 1e6
    return best * 1e6


SCHEMA = {
    "customers": ["id", "name", "email", "ssn", "country"],
    "orders": ["id", "customer_id", "total_cents", "status", "created_at"],
}


def measure(
    calls: int, dialects: Sequence[str] = ("postgres", "sqlite", "mysql"), small: bool = True
) -> dict[str, Any]:
    import sqlglot
    from pglast import parser as pg_parser

    from gateway.checks.sql import SQLGLOT_COMPILED, SQLGLOT_VERSION, SqlPolicy

    policies = {
        dialect: SqlPolicy.create(
            dialect,
            tables=["orders", "customers"],
            schema=SCHEMA,
            deny_columns=["customers.ssn"],
            max_limit=1000,
            server_version=15 if dialect == "postgres" else None,
        )
        for dialect in dialects
    }
    results: dict[str, Any] = {
        "compiled": SQLGLOT_COMPILED,
        "sqlglot": SQLGLOT_VERSION,
        "queries": {},
    }
    readers: dict[str, Callable[[str], object]] = {
        "postgres": pg_parser.parse_sql_json,  # PostgreSQL's parser, the authority
        "sqlite": lambda text: None,  # SQLite compiles inside the check (no separate parse)
        "mysql": lambda text: sqlglot.parse(text, read="mysql"),
    }
    for dialect, policy in policies.items():
        for name, template, shaped in (
            *((("small", SMALL, SMALL_SHAPE),) if small else ()),
            ("medium", MEDIUM, MEDIUM_SHAPE),
        ):
            results["queries"][f"{dialect}:{name}"] = _measure_one(
                policy, template, shaped, readers[dialect], calls
            )
    return results


from gateway.errors import SqlDenied  # noqa: E402 (after the pure-Python import hook)


def _measure_one(
    policy: Any, template: str, shaped: str, reader: Callable[[str], object], calls: int
) -> dict[str, Any]:
    policy.check(template.format(n=0))  # warm up imports and dialect tables
    text = template.format(n=42)
    policy.check(text)

    def parse_only(n: int, template: str = template) -> object:
        return reader(template.format(n=n))

    def checker(template: str, offset: int) -> Callable[[int], object]:
        def check(n: int) -> object:
            try:
                return policy.check(template.format(n=n + offset))
            except SqlDenied:  # the backstop, on a machine busy with other work
                return None

        return check

    def check_same_text(n: int, text: str = text) -> object:
        return policy.check(text)

    new_shape, new_literal = checker(shaped, 10**6), checker(template, 10**6)
    results = {
        "chars": len(text),
        "parse_us": _per_call(parse_only, calls),
        "check_uncached_us": _per_call(new_shape, calls),
        "check_uncached_cpu_us": _CPU[id(new_shape)],
        "check_new_literal_us": _per_call(new_literal, calls),
        "check_new_literal_cpu_us": _CPU[id(new_literal)],
        "check_cached_us": _per_call(check_same_text, calls * 20),
    }
    results["check_cached_cpu_us"] = _CPU[id(check_same_text)]
    return results


def report(results: dict[str, Any]) -> None:
    build = "sqlglotc (compiled)" if results["compiled"] else "pure Python"
    print(f"sqlglot {results['sqlglot']}, {build}")
    print(
        f"  {'':<22}{'':>6}{'':>12}{'check, new shape':>22}{'check, new literal':>22}{'cached':>22}"
    )
    print(
        f"  {'query':<22}{'chars':>6}{'parse':>12}" + f"{'wall':>12}{'cpu':>10}" * 3,
    )
    for name, q in results["queries"].items():
        print(
            f"  {name:<22}{q['chars']:>6}{q['parse_us']:>10.0f}µs"
            f"{q['check_uncached_us']:>10.0f}µs{q['check_uncached_cpu_us']:>8.0f}µs"
            f"{q['check_new_literal_us']:>10.0f}µs{q['check_new_literal_cpu_us']:>8.0f}µs"
            f"{q['check_cached_us']:>10.2f}µs{q['check_cached_cpu_us']:>8.2f}µs"
        )


def _or_chain(terms: int, n: int) -> str:
    """A text of ``terms`` conditions; a new tree for each ``n`` (its column alias)."""
    conds = " OR ".join(f"(o.total_cents > {n + i} AND o.status = 'p{i}')" for i in range(terms))
    return f"SELECT o.id AS id_{n}, o.status FROM orders o WHERE {conds} LIMIT 10"


def sizes(calls: int) -> None:
    """Uncached check time by text length, per dialect: where ``OFFLOAD_MIN_CHARS`` (the
    length from which a check runs in a worker thread) comes from."""
    import asyncio

    from gateway.check_workers import CheckWorkers
    from gateway.checks.sql import SqlPolicy
    from gateway.errors import SqlDenied

    policies = {
        d: SqlPolicy.create(
            d,
            tables=["orders", "customers"],
            schema=SCHEMA,
            deny_columns=["customers.ssn"],
            max_limit=1000,
            server_version=15 if d == "postgres" else None,
        )
        for d in ("postgres", "sqlite", "mysql")
    }
    calls = max(calls // 10, 10)
    print(f"  {'chars':>6}" + "".join(f"{d:>12}" for d in policies))
    for terms in (1, 10, 30, 60, 120, 250):
        row = []
        for policy in policies.values():
            offset = 10**6 * terms

            def check(n: int, policy: Any = policy, terms: int = terms, at: int = offset) -> object:
                try:
                    return policy.check(_or_chain(terms, at + 1000 * n))
                except SqlDenied:  # past the backstop on a busy machine: timed all the same
                    return None

            row.append(_per_call(check, calls) / 1000)
        print(f"  {len(_or_chain(terms, 0)):>6}" + "".join(f"{ms:>10.2f}ms" for ms in row))

    async def handoff() -> float:
        workers = CheckWorkers()
        await workers.run("a", lambda: None)
        started = time.perf_counter()
        for _ in range(500):
            await workers.run("a", lambda: None)
        workers.close()
        return (time.perf_counter() - started) / 500 * 1e6

    print(f"  a worker thread and back: {asyncio.run(handoff()):.0f}µs")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed run")
    parser.add_argument("--no-pure", action="store_true", help="skip the pure-Python child")
    parser.add_argument("--child-pure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", action="store_true", help="uncached check time by length")
    args = parser.parse_args(argv)
    if args.sizes:
        sizes(args.calls)
        return 0
    if args.child_pure:
        sys.meta_path.insert(0, _PureSqlglot())
        print(json.dumps(measure(max(args.calls // 4, 20))))
        return 0
    print("parse = the dialect's reader alone (PostgreSQL: pglast's parser; SQLite: compiled")
    print("inside the check; MySQL: sqlglot); check = SqlPolicy.check (read + all checks);")
    print("new shape / new literal: see the top of bench/sql_bench.py; cached = the same text")
    print("again (verdict cache). Per call, best of 3 runs; cpu = the")
    print("process's CPU time per call (steadier than the wall clock on a shared machine).\n")
    report(measure(args.calls))
    if args.no_pure:
        return 0
    child = subprocess.run(
        [sys.executable, "-m", "bench.sql_bench", "--child-pure", "--calls", str(args.calls)],
        capture_output=True,
        text=True,
        check=False,
    )
    if child.returncode != 0:
        print(f"\npure-Python run failed:\n{child.stderr.strip()[-2000:]}")
        return 1
    print()
    report(json.loads(child.stdout.strip().splitlines()[-1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
