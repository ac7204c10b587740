"""Pure payload checks, listed once: the key a rule uses -> its compiler and its schema.

``policy/load.py`` and ``policy/spec.py`` read this table; a check module knows nothing of
the loader. To add a check, write its module (a compiler ``(node, CheckContext) -> check |
None``, a check with ``check(payload)``, and the JSON Schema of its key) and add one line
here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import gateway.checks.iri_formats  # noqa: F401 (first: before any check imports jsonschema)
from gateway.checks.arguments import ARGUMENTS_KEY_SCHEMA, compile_arguments
from gateway.checks.body import BODY_KEY_SCHEMA, compile_body
from gateway.checks.sql.config import SQL_KEY_SCHEMA, compile_sql_check
from gateway.payload import CheckContext, PayloadCheck
from gateway.policy_file import Node

PayloadCompiler = Callable[[Node, CheckContext], PayloadCheck | None]


class CheckKind(NamedTuple):
    compile: PayloadCompiler
    schema: Mapping[str, Any]  # JSON Schema of the rule key's value


# In the order a rule's checks run: the body's shape first, then what it says.
PAYLOAD_CHECKS: Mapping[str, CheckKind] = MappingProxyType(
    {
        "body": CheckKind(compile_body, BODY_KEY_SCHEMA),
        "arguments": CheckKind(compile_arguments, ARGUMENTS_KEY_SCHEMA),
        "sql": CheckKind(compile_sql_check, SQL_KEY_SCHEMA),
    }
)

__all__ = ["PAYLOAD_CHECKS", "CheckContext", "CheckKind", "PayloadCheck", "PayloadCompiler"]
