"""``capgate audit verify`` and ``capgate audit query``.

Both read files of either format (1: one line per call; 2: typed lines, ``docs/audit.md``),
oldest first when a trail was rotated, and say what was verified and what could not be.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.audit_anchor import read_anchor
from gateway.audit_record import BodyMac
from gateway.audit_sign import load_verify_keys
from gateway.audit_trail import call_records, read_audit_key, with_audit_keys
from gateway.audit_verify import Report, verify_trail
from gateway.errors import ConfigError

EXIT_OK, EXIT_NEGATIVE = 0, 1

TABLE_COLUMNS = (
    "time",
    "agent",
    "run",
    "decision",
    "reason",
    "status",
    "method",
    "path",
    "rule",
    "request_id",
)


def add_audit_parsers(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    a = sub.add_parser("audit", help="the audit trail")
    asub = a.add_subparsers(dest="audit_command", required=True, parser_class=parser_class)
    av = asub.add_parser(
        "verify", help="check the chain, the signed checkpoints, the tail and the anchor"
    )
    av.add_argument("files", nargs="+", type=Path, help="the trail's files, oldest first")
    _trust_options(av)
    av.add_argument(
        "--format", choices=["text", "json"], default="text", help="text (default) or json"
    )
    av.add_argument(
        "--json",
        dest="format",
        action="store_const",
        const="json",
        help="the same as --format json: the verdict as one JSON object",
    )
    aq = asub.add_parser("query", help="the calls that match, and what was verified")
    aq.add_argument("files", nargs="+", type=Path, help="the trail's files, oldest first")
    aq.add_argument("--agent", help="only this agent's calls")
    aq.add_argument("--run", help="only this run's calls")
    aq.add_argument("--since", help="ISO 8601 time, e.g. 2026-12-01T09:00Z")
    aq.add_argument("--until", help="ISO 8601 time")
    aq.add_argument("--upstream", help="only calls to this upstream")
    aq.add_argument("--path-prefix", dest="path_prefix", help="e.g. /db/query")
    aq.add_argument("--decision", choices=["allow", "deny"], help="only allowed or denied calls")
    aq.add_argument("--reason", help="only calls with this reason code, e.g. sql_denied")
    aq.add_argument("--rule", help="only calls decided by this rule id")
    aq.add_argument(
        "--body",
        type=Path,
        help="only calls whose request or response body was this file's bytes (by its keyed "
        "digest: needs the audit key the trail names for those lines)",
    )
    aq.add_argument(
        "--audit-key",
        dest="audit_keys",
        type=Path,
        action="append",
        help="an audit key file for --body; repeat it for a trail whose key changed (default: "
        "FILE.key and the kept FILE.key.* beside the trail)",
    )
    aq.add_argument(
        "--format", choices=["table", "json"], default="table", help="table (default) or json"
    )
    aq.add_argument(
        "--json",
        dest="format",
        action="store_const",
        const="json",
        help="the same as --format json",
    )
    _trust_options(aq)


def _trust_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--jwks",
        type=Path,
        help="the audit's public keys (default: FILE.jwks.json beside the first file; a copy "
        "kept outside the sandbox proves more)",
    )
    p.add_argument("--anchor", help="the anchor's copy: a file (file:PATH) or a redis:// URL")
    p.add_argument(
        "--open-tail",
        dest="open_tail",
        action="store_true",
        help="accept a trail that does not end with a shutdown checkpoint (after a crash)",
    )


class AuditCliError(Exception):
    """Bad input for an audit command (one line, exit 2)."""


def _verify(args: argparse.Namespace) -> Report:
    files: Sequence[Path] = args.files
    jwks = args.jwks
    if jwks is None:
        # Beside the live file (the last given; a rotated file's name has a suffix).
        for f in reversed(files):
            beside = f.with_name(f.name.split(".jsonl")[0] + ".jsonl.jwks.json")
            for candidate in (f.with_name(f.name + ".jwks.json"), beside):
                if jwks is None and candidate.exists():
                    jwks = candidate
    keys = None
    if jwks is not None:
        try:
            keys = load_verify_keys(jwks)
        except ConfigError as exc:
            raise AuditCliError(str(exc)) from None
    anchor = None
    if args.anchor is not None:
        try:
            anchor = read_anchor(args.anchor)
        except (OSError, ValueError) as exc:
            raise AuditCliError(f"--anchor {args.anchor}: {exc}") from None
        except Exception as exc:  # redis errors: one line, not a traceback
            raise AuditCliError(f"--anchor {args.anchor}: {type(exc).__name__}: {exc}") from None
    try:
        report = verify_trail(files, keys, anchor=anchor, open_tail=args.open_tail)
    except OSError as exc:
        raise AuditCliError(f"{exc.filename}: {exc.strerror}") from None
    if jwks is not None and args.jwks is None:
        report.notes.append(
            f"signing keys read from beside the trail ({jwks}): they prove nothing against "
            "whoever could write both; pass --jwks with a copy kept elsewhere"
        )
    return report


def cmd_audit_verify(args: argparse.Namespace) -> int:
    report = _verify(args)
    if args.format == "json":
        print(json.dumps(report.statement(), indent=2))
        return EXIT_OK if report.ok else EXIT_NEGATIVE
    if report.problem is not None:
        print(f"{report.problem} ({report.lines} lines verified before it)")
    else:
        names = ", ".join(str(f) for f in args.files)
        keys = ", ".join(sorted(report.kids)) or "none"
        print(
            f"{names}: ok, {report.lines} lines, {report.checkpoints} signed checkpoints "
            f"(keys: {keys}), hash chain intact"
        )
    for note in report.notes:
        print(f"  not verified: {note}")
    return EXIT_OK if report.ok else EXIT_NEGATIVE


def _time(text: str, flag: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise AuditCliError(
            f"{flag} has value {text!r}; expected an ISO 8601 time such as 2026-12-01T09:00Z"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


class BodyFilter:
    """``--body``: the file's keyed digest under each audit key given, matched against a
    call's digests under the key the trail names for its lines (``with_audit_keys``)."""

    def __init__(self, body: bytes, keys: Sequence[bytes]) -> None:
        self.digests: dict[str, str] = {}
        for key in keys:
            mac = BodyMac(key)
            assert mac.kid is not None
            self.digests[mac.kid] = mac.of(body)["hmac"]
        self.missing: dict[str, int] = {}  # key ids the trail names that were not given

    def __call__(self, record: Mapping[str, Any]) -> bool:
        kid = record.get("audit_key")
        if kid is None:  # the trail does not say (format 1, or no key named): any given key
            wanted = set(self.digests.values())
        elif kid in self.digests:
            wanted = {self.digests[kid]}
        else:
            self.missing[kid] = self.missing.get(kid, 0) + 1
            return False
        for name in ("request_body", "response_body"):
            digest = record.get(name)
            if isinstance(digest, dict) and digest.get("hmac") in wanted:
                return True
        return False


def _body_filter(args: argparse.Namespace) -> BodyFilter | None:
    if args.body is None:
        return None
    paths = args.audit_keys
    if not paths:
        base = args.files[-1]
        base = base.with_name(base.name.split(".jsonl")[0] + ".jsonl")
        paths = sorted(base.parent.glob(base.name + ".key.*"))
        paths.insert(0, base.with_name(base.name + ".key"))
        paths = [p for p in paths if p.exists()]
        if not paths:
            raise AuditCliError("--body needs the audit key: pass --audit-key FILE")
    try:
        body = Path(args.body).read_bytes()
        keys = [read_audit_key(p) for p in paths]
    except OSError as exc:
        raise AuditCliError(f"{exc.filename}: {exc.strerror}") from None
    except ConfigError as exc:
        raise AuditCliError(str(exc)) from None
    return BodyFilter(body, keys)


def _matches(record: Mapping[str, Any], args: argparse.Namespace, window: Any) -> bool:
    for name in ("agent", "run", "upstream", "decision", "reason", "rule"):
        wanted = getattr(args, name)
        if wanted is not None and record.get(name) != wanted:
            return False
    if args.path_prefix is not None and not str(record.get("path", "")).startswith(
        args.path_prefix
    ):
        return False
    since, until = window
    if since is not None or until is not None:
        try:
            moment = datetime.fromisoformat(str(record.get("time")))
        except ValueError:
            return False
        if (since is not None and moment < since) or (until is not None and moment > until):
            return False
    return True


def cmd_audit_query(args: argparse.Namespace) -> int:
    window = (
        _time(args.since, "--since") if args.since else None,
        _time(args.until, "--until") if args.until else None,
    )
    report = _verify(args)
    lines: list[dict[str, Any]] = []
    for path in args.files:
        with Path(path).open("rb") as fh:
            for raw in fh:
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue  # verify names it
                if isinstance(record, dict):
                    lines.append(record)
    body = _body_filter(args)
    found = [
        r
        for r in call_records(with_audit_keys(lines))
        if _matches(r, args, window) and (body is None or body(r))
    ]
    if body is not None:
        for kid, n in sorted(body.missing.items()):
            report.notes.append(
                f"--body: {n} call(s) have digests under audit key {kid}, which was not "
                "given (--audit-key): they could not be compared"
            )
    statement = report.statement()
    if args.format == "json":
        print(json.dumps({"matches": found, "verification": statement}, indent=2))
    else:
        _table(found)
        print()
        verdict = "verified" if report.ok else f"NOT verified: {report.problem}"
        print(
            f"{len(found)} matching call(s) in {report.lines} lines of {len(args.files)} "
            f"file(s); trail {verdict}; {report.checkpoints} signed checkpoints, keys "
            f"{', '.join(sorted(report.kids)) or 'none'}"
        )
        for note in report.notes:
            print(f"  not verified: {note}")
    return EXIT_OK if report.ok else EXIT_NEGATIVE


def _table(records: Sequence[Mapping[str, Any]]) -> None:
    rows = [[_cell(r.get(c)) for c in TABLE_COLUMNS] for r in records]
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(TABLE_COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(TABLE_COLUMNS, widths, strict=True)).rstrip())
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)
