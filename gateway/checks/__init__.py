"""Pure payload checks, listed once: the key a rule uses -> the compiler of its check.

``policy/load.py`` reads this table; a check module knows nothing of the loader. To add a
check, write its module (a compiler ``(node, CheckContext) -> check | None`` and a check
with ``check(payload)``) and add one line here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gateway.checks.arguments import compile_arguments
from gateway.checks.body import compile_body
from gateway.checks.sql import compile_sql_check
from gateway.payload import CheckContext, PayloadCheck
from gateway.policy_file import Node

PayloadCompiler = Callable[[Node, CheckContext], PayloadCheck | None]

# In the order a rule's checks run: the body's shape first, then what it says.
PAYLOAD_CHECKS: Mapping[str, PayloadCompiler] = MappingProxyType(
    {
        "body": compile_body,
        "arguments": compile_arguments,
        "sql": compile_sql_check,
    }
)

__all__ = ["PAYLOAD_CHECKS", "CheckContext", "PayloadCheck", "PayloadCompiler"]
