"""jsonschema's ``iri`` formats, loaded when a policy uses one (imported before jsonschema).

jsonschema checks ``iri`` and ``iri-reference`` with ``rfc3987_syntax``, whose import builds a
grammar: ~1.6 s, most of the gateway's start-up, for formats few policies use. Until a policy
uses one of them, a stand-in module takes its place in ``sys.modules``; the checkers jsonschema
registers at its import call through it, and ``load_iri_grammar`` (called by the schema
compiler when it meets such a format, so no agent's call pays for the import) swaps the real
module in. ``gateway/checks/__init__.py`` imports this module first, so the stand-in is in place
before any check module imports jsonschema.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

IRI_FORMATS = frozenset({"iri", "iri-reference"})
_IRI_MODULE = "rfc3987_syntax"


def _defer_iri_grammar() -> None:
    """jsonschema checks the ``iri`` formats with ``rfc3987_syntax``, whose import builds a
    grammar (~1.6 s, most of the gateway's start-up, for a format few policies use). Until a
    policy uses one of them (``load_iri_grammar``), a stand-in module takes its place; the
    checkers jsonschema registers call through it."""
    if _IRI_MODULE in sys.modules or importlib.util.find_spec(_IRI_MODULE) is None:
        return
    stand_in = types.ModuleType(_IRI_MODULE)

    def is_valid_syntax(rule: str, value: str) -> bool:
        return bool(load_iri_grammar().is_valid_syntax(rule, value))

    stand_in.is_valid_syntax = is_valid_syntax  # type: ignore[attr-defined]
    stand_in.__capgate_stand_in__ = True  # type: ignore[attr-defined]
    sys.modules[_IRI_MODULE] = stand_in


def load_iri_grammar() -> Any:
    """The real ``rfc3987_syntax`` (imported once): when a policy that uses an ``iri``
    format loads, so no agent's call pays for it."""
    module = sys.modules.get(_IRI_MODULE)
    if module is not None and getattr(module, "__capgate_stand_in__", False):
        del sys.modules[_IRI_MODULE]
        try:
            module = importlib.import_module(_IRI_MODULE)
        except BaseException:
            sys.modules[_IRI_MODULE] = module  # keep the stand-in; the caller sees the error
            raise
    return module


_defer_iri_grammar()
