"""Migrations of recordings written by older versions, one version step at a time.

The reader (``reader.load_recording``) reads a recording's ``version`` and, while it is older
than ``CURRENT``, applies the step for that version to the manifest and to every record, so
each step only knows two adjacent versions (the mitmproxy ``io/compat.py`` pattern). A
recording newer than ``CURRENT`` is refused: fields this capgate does not know could change
what a replay means.

To add version 2: write ``_manifest_v1_to_v2`` and ``_record_v1_to_v2``, register them
under ``1`` below, bump ``CURRENT``, update ``docs/recording.md``, and add a fixture of a
version-1 recording to ``tests/recording/test_format.py``.

Version history:

- **0** (hypothetical, never released; kept as the worked example of a step): records had
  no ``kind`` and no ``decision``; every record was an allowed exchange whose rule id was a
  top-level ``rule`` field. The manifest had no ``capgate_version``.
- **1**: ``decision`` ``{allowed, reason, rule, status?}`` on every record; ``kind``
  ``exchange`` | ``denial``; ``roles`` and ``caps`` of the token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CURRENT = 1
"""The version this capgate writes."""

Step = Callable[[dict[str, Any]], dict[str, Any]]


class MigrationError(ValueError):
    """Raised when a recording's version cannot be brought to ``CURRENT``."""


def _manifest_v0_to_v1(manifest: dict[str, Any]) -> dict[str, Any]:
    out = dict(manifest)
    out.setdefault("capgate_version", "unknown")
    out["version"] = 1
    return out


def _record_v0_to_v1(record: dict[str, Any]) -> dict[str, Any]:
    out = dict(record)
    rule = out.pop("rule", None)
    out.setdefault("kind", "exchange")
    out.setdefault("decision", {"allowed": True, "reason": "allowed", "rule": rule})
    out.setdefault("roles", [])
    out.setdefault("caps", None)
    return out


MANIFEST_STEPS: dict[int, Step] = {0: _manifest_v0_to_v1}
RECORD_STEPS: dict[int, Step] = {0: _record_v0_to_v1}


def check_version(version: Any) -> int:
    """The version as an int this capgate can read, or ``MigrationError`` saying why not."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise MigrationError(f"'version' must be an integer, not {version!r}")
    if version > CURRENT:
        raise MigrationError(
            f"version {version} was written by a newer capgate; this one reads versions "
            f"up to {CURRENT}"
        )
    if version < 0 or any(v not in MANIFEST_STEPS for v in range(version, CURRENT)):
        raise MigrationError(f"version {version} is not a version capgate ever wrote")
    return version


def migrate_manifest(manifest: dict[str, Any], version: int) -> dict[str, Any]:
    for v in range(check_version(version), CURRENT):
        manifest = MANIFEST_STEPS[v](manifest)
    return manifest


def migrate_record(record: dict[str, Any], version: int) -> dict[str, Any]:
    for v in range(version, CURRENT):
        record = RECORD_STEPS[v](record)
    return record
