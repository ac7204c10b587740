"""Bounds on the work one call can cause, and on the caches that remember checks."""

from __future__ import annotations

# --- the SQL text and its tokens ----------------------------------------------------------------

MAX_SQL_LENGTH = 100_000
"""Characters; the ceiling and default of ``max_length``."""
MAX_TOKENS = 10_000
"""Parsing is roughly linear in tokens (~10 µs each compiled); this bounds one parse."""
MAX_NESTING = 32
"""Depth of ( [ { . sqlglot recurses per level; the compiled build can crash past ~5,000."""
MAX_SUBSCRIPTS = 32
"""``[`` tokens: sqlglot parses chained subscripts in super-linear time (a[1]x1000: ~3 s)."""
MAX_TREE_DEPTH = 600
"""Depth of the parsed tree (long AND/OR chains are left-deep)."""
MAX_NODES = 20_000
"""Nodes of the database parser's tree walked by one check (PostgreSQL)."""
DEFAULT_MAX_JOINS = 3
"""Joins per statement (FROM items beyond the first, in every query), unless max_joins says."""
MAX_JOINS = 64
"""Ceiling of ``max_joins`` (SQLite's own limit on tables in one join)."""
CHECK_BACKSTOP_SECONDS = 0.25
"""A check that takes longer is refused (sql_too_complex) and never cached, so a slow
machine's stall is not remembered as a verdict."""
OFFLOAD_MIN_CHARS = 1024
"""An uncached text at least this long is checked in a worker thread (``check_workers``),
off the event loop. Measured uncached (bench/sql_bench.py --sizes): ~90 characters 0.2 ms
(PostgreSQL) to 0.7 ms (MySQL), ~1.4 K 2-7 ms, ~11 K 21-126 ms; handing a check to a thread
and back costs ~0.1-0.4 ms (a loaded 2-core box), so shorter texts stay inline.
"""

# --- the settings of a policy -------------------------------------------------------------------

MAX_STATEMENTS = 50
"""Ceiling of ``max_statements``."""
MAX_LIMIT = 10**9
"""Ceiling of ``max_limit`` (far above any useful row count; keeps the number a plain int)."""

# --- reports ------------------------------------------------------------------------------------

MAX_ERRORS = 10
"""Entries kept in ``SqlDenied.errors``."""

# --- caches -------------------------------------------------------------------------------------

PARSE_CACHE_SIZE = 1024
PARSE_CACHE_CHARS = 1_000_000
"""Total text length of cached parses: a tree takes ~110 bytes per character (~110 MB)."""
VERDICT_CACHE_SIZE = 4096
VERDICT_CACHE_CHARS = 4_000_000
"""Total text length of one policy's cached verdicts (the texts are the keys)."""
CACHE_MAX_TEXT = 16_384
"""Texts longer than this are checked every time instead of being cached."""
SHAPE_CACHE_SIZE = 4096
"""Allowed PostgreSQL readings one policy remembers by the tree's shape (a 32-byte digest
each): texts that differ only in their literals are walked once."""
SHAPE_CACHE_CHARS = 4_000_000
"""Total text length of the readings one policy remembers by shape (a reading's names come
from its text, so this bounds their memory as ``VERDICT_CACHE_CHARS`` bounds the verdicts)."""
SHAPE_MAX_JSON = 200_000
"""Parse trees (JSON characters, ~11 per character of SQL) longer than this are not shaped:
cutting one costs ~3 µs per KB, more than the walk it would save on a rare long text."""
