"""SQL in a call: read by the database's own code, checked against the rule's ``sql:`` policy,
fail closed. PostgreSQL's parser (``postgres``, pglast) and SQLite's compiler (``sqlite``) are
the authorities for their dialects; sqlglot reads MySQL under a strict lexical allow-list.

A rule that forwards SQL to a database names where the SQL is and what it may do::

    sql:
      dialect: postgres            # postgres | sqlite | mysql (required)
      server_version: 15           # postgres: the server's major (must match the parser)
      standard_conforming_strings: on  # postgres: stated, or backslashes in strings refused
      # sql_mode: "ANSI_QUOTES"    # mysql: the server's sql_mode, or what depends on it refused
      # parameters: ["?"]          # mysql: the parameter forms allowed (default: none)
      max_joins: 3                 # joins per statement (default 3)
      field: sql                   # dotted path of the JSON body field holding the SQL
      # body: raw                  # ... or: the whole request body is the SQL (UTF-8)
      # argument: sql              # ... or, for an MCP tool rule: the tool argument
      statements: [select]         # statement kinds allowed (default [select])
      max_statements: 1            # statements per call (default 1)
      tables: [orders, customers]  # the only tables that may be named (required)
      default_schema: public       # optional: 'orders' and 'public.orders' are the same table
      schema:                      # columns per table (required for sqlite)
        customers: [id, name, email, ssn, country]
      # schema_file: schema.yaml   # ... or the same mapping in a YAML/JSON file next to the policy
      deny_columns: [customers.ssn]
      functions: [md5]             # allowed on top of DEFAULT_FUNCTIONS
      max_limit: 1000              # the outermost query needs a literal LIMIT <= 1000 ...
      add_limit: true              # ... or, when it has none, gets 'LIMIT 1000' appended
      allow: [locking]             # opt-ins: locking, into, system_catalogs, variables, recursive
      max_length: 100000           # characters (default and ceiling 100000)

``SqlPolicy.check(text)`` returns a ``SqlVerdict`` (the SQL to forward: the original text,
unless a LIMIT was appended) or raises ``SqlDenied``. ``errors[0]["kind"]`` of a denial is one
of the stable ``Denial`` categories; each entry also says what was ``found`` and, when known,
its ``line`` and ``col``.

Why each check exists is written in the module that does it (see /work/shared/PITFALLS.md,
"sqlglot"). The package reads like sqlglot itself, text to tokens to trees to rules:

``reading``     ``Reading``: what an authority's reading of a text says, for the policy
``postgres``    PostgreSQL: pglast's parser tree walked for every check (the authority)
``sqlite``      SQLite: the statement compiled in a schema-only database, its authorizer's list
``sqlite_tokens`` SQLite's tokens: the joins, NATURAL/USING, the LIMIT (``sqlite3_complete``)
``limits``      the bounds on one call's work and on the caches
``options``     dialects, statement kinds, opt-in families, default functions
``names``       table, column and function names, normalised per dialect (PostgreSQL and
                SQLite: plain names read without sqlglot, equal to its reading)
``violations``  denial categories, violations, and the ``SqlDenied`` they become
``cache``       the bounded LRU map behind the parse and verdict caches
``lexing``      (MySQL) the raw text and sqlglot's tokens: measured, refused where MySQL lexes
                otherwise
``parsing``     (MySQL) tokens to sqlglot trees, once per (dialect, text), in a shared cache
``settings``    ``SqlSettings``: the one validator of a policy's settings, every problem named;
                it resolves them to ``SqlRules``, what the rules read
``statement``   ``Statement``: one statement under check, what the rules read and record
``rules/``      one module per rule family: statements, functions, tables, columns, limit
``driver``      (MySQL) sqlglot's reading of a text: each statement checked, ``rules/`` in order
``policy``      ``SqlPolicy`` (``SqlRules`` with ``check`` and the verdict cache), ``SqlVerdict``
``adapter``     ``SqlBodyCheck``: where the SQL is in a call
``config``      the ``sql:`` key of a policy file: reads it into ``SqlSettings`` and points at
                the FILE:LINE:COL of each problem (registers itself with the policy loader)

Any unexpected error while checking denies the call (``Denial.UNCHECKED``). Parses are cached
per (dialect, text) and verdicts per (policy, text); allowed PostgreSQL readings also per
(policy, shape of the parse tree: ``postgres.shape``), so a text that differs only in its
literals is parsed but not walked. All are bounded LRU caches.

This check is defence in depth: the database role behind a read tool should be read-only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.checks.sql.adapter import SqlBodyCheck
    from gateway.checks.sql.config import compile_sql_check
    from gateway.checks.sql.limits import MAX_NESTING, MAX_SUBSCRIPTS, MAX_TOKENS
    from gateway.checks.sql.names import TableName, parse_column_name, parse_table_name
    from gateway.checks.sql.options import DEFAULT_FUNCTIONS, SqlFamily, SqlKind
    from gateway.checks.sql.parsing import (
        SQLGLOT_COMPILED,
        SQLGLOT_VERSION,
        cache_info,
        clear_parse_cache,
        normalise_sql,
    )
    from gateway.checks.sql.policy import SqlPolicy, SqlVerdict
    from gateway.checks.sql.settings import SqlSettings, SqlSettingsError
    from gateway.checks.sql.violations import Denial

# Where each name lives: imported on first use, so importing a submodule (the policy loader
# imports ``config``) does not load sqlglot, which only ``parsing`` (MySQL) needs.
_HOMES = {
    "SqlBodyCheck": "adapter",
    "compile_sql_check": "config",
    "MAX_NESTING": "limits",
    "MAX_SUBSCRIPTS": "limits",
    "MAX_TOKENS": "limits",
    "TableName": "names",
    "parse_column_name": "names",
    "parse_table_name": "names",
    "DEFAULT_FUNCTIONS": "options",
    "SqlFamily": "options",
    "SqlKind": "options",
    "SQLGLOT_COMPILED": "parsing",
    "SQLGLOT_VERSION": "parsing",
    "cache_info": "parsing",
    "clear_parse_cache": "parsing",
    "normalise_sql": "parsing",
    "SqlPolicy": "policy",
    "SqlVerdict": "policy",
    "SqlSettings": "settings",
    "SqlSettingsError": "settings",
    "Denial": "violations",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


__all__ = [
    "DEFAULT_FUNCTIONS",
    "MAX_NESTING",
    "MAX_SUBSCRIPTS",
    "MAX_TOKENS",
    "SQLGLOT_COMPILED",
    "SQLGLOT_VERSION",
    "Denial",
    "SqlBodyCheck",
    "SqlFamily",
    "SqlKind",
    "SqlPolicy",
    "SqlSettings",
    "SqlSettingsError",
    "SqlVerdict",
    "TableName",
    "cache_info",
    "clear_parse_cache",
    "compile_sql_check",
    "normalise_sql",
    "parse_column_name",
    "parse_table_name",
]
