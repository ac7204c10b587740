"""Which PostgreSQL parser capgate has installed: pglast's version and the PostgreSQL major
whose parser it embeds (pglast 5: 15, ..., 8: 18). A rule states its server's major, and
``settings.py`` refuses one this parser is not (it reads this module, not the checks)."""

from __future__ import annotations

import importlib.metadata

from pglast import parser as pg_parser

PGLAST_VERSION: str = importlib.metadata.version("pglast")
PARSER_MAJOR: int = int(pg_parser.get_postgresql_version()[0])
"""The PostgreSQL major version whose parser pglast embeds (pglast 5: 15; 8: 18)."""
