"""The LIMIT of the outermost query: a literal integer no larger than ``max_limit``.

When ``add_limit`` is set and the query has none, the policy appends ``LIMIT n`` to the
checked text (never regenerating it) and checks the new text whole.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sqlglot import exp

from gateway.checks.sql.rules.statements import QUERY_ROOTS
from gateway.checks.sql.violations import Denial, Refusal

if TYPE_CHECKING:
    from gateway.checks.sql.statement import Statement

_DIGITS = re.compile(r"[0-9]+")


def check_limit(statement: Statement) -> bool:
    """True when the outermost query has no LIMIT and one is required."""
    maximum = statement.rules.max_limit
    node = statement.root
    if maximum is None or not isinstance(node, QUERY_ROOTS):
        return False
    limit = node.args.get("limit")
    while limit is None and isinstance(node, exp.Subquery):
        node = node.this
        limit = node.args.get("limit")
    if limit is None:
        return True
    where = statement.where(limit)
    count: exp.Expr | None
    if isinstance(limit, exp.Fetch):
        options = limit.args.get("limit_options")
        if options is not None and (options.args.get("percent") or options.args.get("with_ties")):
            raise Refusal.of(
                Denial.LIMIT,
                "FETCH ... PERCENT / WITH TIES can return more rows than the rule allows",
                "fetch",
                **where,
            )
        count = limit.args.get("count")
        if count is None:
            return False  # FETCH FIRST ROW ONLY: one row
    elif isinstance(limit, exp.Limit):
        count = limit.expression
    else:
        count = None
    if not (
        isinstance(count, exp.Literal)
        and not count.is_string
        and _DIGITS.fullmatch(str(count.this))
    ):
        shown = count.sql(dialect=statement.dialect)[:40] if count is not None else "?"
        raise Refusal.of(
            Denial.LIMIT,
            f"LIMIT {shown} is not a literal integer; the rule requires LIMIT <= {maximum}",
            shown,
            **where,
        )
    if int(str(count.this)) > maximum:
        raise Refusal.of(
            Denial.LIMIT,
            f"LIMIT {count.this} is above the rule's maximum of {maximum}",
            str(count.this),
            **where,
        )
    return False
