"""What a ``sql:`` policy can name: dialects, statement kinds, opt-in families, functions."""

from __future__ import annotations

from enum import StrEnum

DIALECTS = ("postgres", "sqlite", "mysql")


class SqlKind(StrEnum):
    """Statement kinds a rule may allow in ``statements``."""

    SELECT = "select"
    INSERT = "insert"
    UPDATE = "update"
    DELETE = "delete"
    MERGE = "merge"
    CREATE = "create"
    DROP = "drop"
    ALTER = "alter"
    TRUNCATE = "truncate"


class SqlFamily(StrEnum):
    """Constructs denied unless the rule opts in with ``allow``."""

    LOCKING = "locking"  # SELECT ... FOR UPDATE / FOR SHARE / LOCK IN SHARE MODE
    INTO = "into"  # SELECT ... INTO new_table / INTO @variable
    SYSTEM_CATALOGS = "system_catalogs"  # pg_catalog, information_schema, sqlite_master, mysql.*
    VARIABLES = "variables"  # MySQL @@system variables and @user := assignments
    RECURSIVE = "recursive"  # WITH RECURSIVE: a query that generates its own rows


DEFAULT_FUNCTIONS: frozenset[str] = frozenset(
    {
        # aggregates
        "count", "sum", "avg", "min", "max", "bool_and", "bool_or", "every", "stddev",
        "stddev_pop", "stddev_samp", "variance", "var_pop", "var_samp", "total",
        # window functions
        "row_number", "rank", "dense_rank", "percent_rank", "cume_dist", "ntile", "lag", "lead",
        "first_value", "last_value", "nth_value",
        # nulls and conditions
        "coalesce", "nullif", "ifnull", "greatest", "least", "iif", "if",
        # strings (no repeat/lpad/rpad: one call can allocate gigabytes)
        "lower", "upper", "length", "char_length", "character_length", "octet_length", "substr",
        "substring", "trim", "ltrim", "rtrim", "btrim", "replace", "concat", "concat_ws", "left",
        "right", "position", "strpos", "instr", "locate", "split_part", "initcap", "reverse",
        "starts_with",
        # numbers
        "abs", "round", "ceil", "ceiling", "floor", "trunc", "truncate", "mod", "sign", "power",
        "pow", "sqrt",
        # dates and times
        "now", "current_date", "current_time", "current_timestamp", "localtime",
        "localtimestamp", "date_trunc", "date_part", "extract", "date", "time", "datetime",
        "julianday", "strftime", "unixepoch", "to_char", "to_date", "to_timestamp", "age",
        "make_date", "date_add", "date_sub", "adddate", "subdate", "datediff", "timestampdiff",
        "date_format", "year", "month", "day", "hour", "minute", "second", "curdate", "curtime",
        "unix_timestamp", "from_unixtime",
        # constructors and casts
        "cast", "row", "array",
    }
)  # fmt: skip
"""Function names allowed by default (as written in the SQL, lower case)."""

ROW_PACKING: frozenset[str] = frozenset(
    {
        "string_agg", "array_agg", "group_concat", "json_agg", "jsonb_agg", "json_object_agg",
        "jsonb_object_agg", "xmlagg", "json_group_array", "json_group_object", "listagg",
        "json_arrayagg", "json_objectagg",
    }
)  # fmt: skip
"""Functions (and PostgreSQL's ARRAY(subquery), named ``array_agg`` here) that pack many rows
into one value, past any LIMIT: never in the default list; a rule lists the ones it allows."""
