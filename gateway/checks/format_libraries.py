"""jsonschema's format libraries, loaded when a policy uses their format (imported before
jsonschema).

jsonschema imports, with itself, one library per format it checks: ``rfc3987_syntax`` (``iri``,
``iri-reference``: its import builds a grammar, ~1.6 s), ``isoduration`` (``duration``: with
arrow and dateutil, ~1.7 MiB), ``rfc3986_validator`` (``uri``, ``uri-reference``),
``rfc3339_validator`` (``date-time``, ``time``), ``fqdn`` (``hostname``), ``uri_template``
(``uri-template``) and ``webcolors`` (Draft 3's ``color``). Few policies use these formats, and
a gateway runs beside every agent, so until a policy uses one, a stand-in module takes each
library's place in ``sys.modules``. A stand-in has what jsonschema takes from its library when
jsonschema is imported (the functions its checkers call, the exception class a checker
catches), each calling through to the real library; any other attribute is the real library's.
``load_format`` imports the real library of a format: the schema compiler calls it for every
format a policy's schemas name, so no agent's call pays for an import. ``gateway/checks/
__init__.py`` imports this module first, so the stand-ins are in place before any check module
imports jsonschema.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

# The library jsonschema checks each format with (when ``rfc3987`` is not installed: then it
# checks uri and iri itself, and these stand-ins are never called).
FORMAT_LIBRARIES: dict[str, str] = {
    "iri": "rfc3987_syntax",
    "iri-reference": "rfc3987_syntax",
    "uri": "rfc3986_validator",
    "uri-reference": "rfc3986_validator",
    "date-time": "rfc3339_validator",
    "time": "rfc3339_validator",
    "hostname": "fqdn",
    "duration": "isoduration",
    "uri-template": "uri_template",
    "color": "webcolors",
}


class StandIn(types.ModuleType):
    """A library's place in ``sys.modules`` until a policy uses one of its formats."""

    __capgate_stand_in__ = True

    def __getattr__(self, name: str) -> Any:
        # Only what the stand-in does not define; dunders (``__file__``, ``__path__``...) stay
        # the stand-in's own, so tools that walk sys.modules load nothing.
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(load_library(self.__name__), name)
        setattr(self, name, value)  # the next access is a plain attribute
        return value


def load_library(name: str) -> Any:
    """The real library ``name`` (imported once, in place of its stand-in)."""
    module = sys.modules.get(name)
    if module is None or isinstance(module, StandIn):
        if module is not None:
            del sys.modules[name]
        try:
            module = importlib.import_module(name)
        except BaseException:
            if isinstance(module, StandIn):
                sys.modules[name] = module  # keep the stand-in; the caller sees the error
            raise
    return module


def load_format(fmt: str) -> None:
    """Import the library that checks ``fmt``, if it has one: while a policy loads, not on an
    agent's call."""
    library = FORMAT_LIBRARIES.get(fmt)
    if library is not None and isinstance(sys.modules.get(library), StandIn):
        load_library(library)


def _forward(library: str, attribute: str) -> Callable[..., Any]:
    """A function calling ``library.attribute`` (the real one, imported on the first call)."""
    target: Callable[..., Any] | None = None

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal target
        if target is None:
            target = getattr(load_library(library), attribute)
        return target(*args, **kwargs)

    call.__name__ = call.__qualname__ = attribute
    return call


class DurationParsingException(ValueError):
    """The exception jsonschema's ``duration`` checker catches (``isoduration``'s own is
    raised again as this one by the stand-in's ``parse_duration``)."""


def _parse_duration(text: str) -> Any:
    real = load_library("isoduration")
    try:
        return real.parse_duration(text)
    except real.DurationParsingException as exc:
        raise DurationParsingException(*exc.args) from exc


def _stand_ins() -> dict[str, dict[str, Any]]:
    """What jsonschema takes from each library at its import (the rest: ``__getattr__``)."""
    return {
        "rfc3987_syntax": {"is_valid_syntax": _forward("rfc3987_syntax", "is_valid_syntax")},
        "rfc3986_validator": {
            "validate_rfc3986": _forward("rfc3986_validator", "validate_rfc3986")
        },
        "rfc3339_validator": {
            "validate_rfc3339": _forward("rfc3339_validator", "validate_rfc3339")
        },
        "fqdn": {"FQDN": _forward("fqdn", "FQDN")},
        "isoduration": {
            "DurationParsingException": DurationParsingException,
            "parse_duration": _parse_duration,
        },
        "uri_template": {},
        "webcolors": {},
    }


def _defer_format_libraries() -> None:
    """Put a stand-in in the place of each installed format library not imported yet."""
    if "jsonschema._format" in sys.modules:
        return  # too late: jsonschema holds the real libraries already
    for name, attributes in _stand_ins().items():
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue
        stand_in = StandIn(name)
        for attribute, value in attributes.items():
            setattr(stand_in, attribute, value)
        sys.modules[name] = stand_in


_defer_format_libraries()
