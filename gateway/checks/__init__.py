"""Pure payload checks, listed once: the key a rule uses -> its compiler and its schema.

``policy/load.py`` and ``policy/spec.py`` read this table; a check module knows nothing of
the loader. To add a check, write its module (a compiler ``(node, CheckContext) -> check |
None``, a check with ``check(payload)``, and the JSON Schema of its key) and add one line
here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import gateway.checks.format_libraries  # noqa: F401 (first: before any check imports jsonschema)
from gateway.payload import CheckContext, PayloadCheck
from gateway.policy_file import Node

PayloadCompiler = Callable[[Node, CheckContext], PayloadCheck | None]


class CheckKind:
    """One payload check, by the module it lives in: the module (and what it imports, such
    as sqlglot and pglast for ``sql`` or jsonschema for ``body``) is imported when a policy
    first uses the key or its schema is asked for, so a gateway loads what its policy uses
    and nothing else."""

    __slots__ = ("module", "_compile_name", "_schema_name")

    def __init__(self, module: str, compile_name: str, schema_name: str) -> None:
        self.module = module
        self._compile_name = compile_name
        self._schema_name = schema_name

    @property
    def compile(self) -> PayloadCompiler:
        compiler: PayloadCompiler = getattr(
            importlib.import_module(self.module), self._compile_name
        )
        return compiler

    @property
    def schema(self) -> Mapping[str, Any]:
        """JSON Schema of the rule key's value."""
        schema: Mapping[str, Any] = getattr(importlib.import_module(self.module), self._schema_name)
        return schema


# In the order a rule's checks run: the body's shape first, then what it says.
PAYLOAD_CHECKS: Mapping[str, CheckKind] = MappingProxyType(
    {
        "body": CheckKind("gateway.checks.body", "compile_body", "BODY_KEY_SCHEMA"),
        "arguments": CheckKind(
            "gateway.checks.arguments", "compile_arguments", "ARGUMENTS_KEY_SCHEMA"
        ),
        "sql": CheckKind("gateway.checks.sql.config", "compile_sql_check", "SQL_KEY_SCHEMA"),
    }
)

__all__ = ["PAYLOAD_CHECKS", "CheckContext", "CheckKind", "PayloadCheck", "PayloadCompiler"]
