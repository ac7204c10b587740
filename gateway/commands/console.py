"""Operators' commands: they talk to a gateway's admin API with an operator's token.

    capgate approvals list | approve ID | deny ID [--reason TEXT] --admin URL --token-file FILE
    capgate watch --admin URL --token-file FILE [--agent A] [--run R] [--decision D] [--json]
    capgate operators add NAME --role ROLE --file FILE | remove NAME --file FILE | list --file FILE
    capgate pause|resume|stop (--agent A | --run R) [--reason TEXT] [--for 10m] --admin URL ...

Every failure is one line (``ConsoleError``); the CLI prints it and exits 2.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from gateway.admin import read_admin_token
from gateway.errors import ConfigError

APPROVAL_ID = re.compile(r"[0-9a-f]{16}")
WATCH_FILTERS = ("agent", "run", "decision", "type")


class ConsoleError(ConfigError):
    """A console command failed: one readable line."""


class AdminClient:
    """A small client of the admin API (the standard library's, no event loop needed)."""

    def __init__(self, url: str, token_file: Path) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConsoleError(f"--admin {url!r}: expected an http(s) URL")
        self.url = url.rstrip("/")
        self._token = read_admin_token(token_file).decode()

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None
    ) -> urllib.request.Request:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self._token}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        return urllib.request.Request(  # noqa: S310 (http(s) checked above)
            self.url + path, data=data, method=method, headers=headers
        )

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            with urllib.request.urlopen(self._request(method, path, body), timeout=10) as resp:  # noqa: S310
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raise self._refused(err) from None
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            raise ConsoleError(f"cannot reach the admin API at {self.url}: {exc}") from None

    def stream(self, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Server-sent events from ``path``: (event name, data) pairs, until the stream ends."""
        try:
            resp = urllib.request.urlopen(self._request("GET", path, None), timeout=60)  # noqa: S310
        except urllib.error.HTTPError as err:
            raise self._refused(err) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise ConsoleError(f"cannot reach the admin API at {self.url}: {exc}") from None
        with resp:
            name, data = "message", ""
            try:
                for raw in resp:
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data += line[5:].strip()
                    elif line == "" and data:
                        yield name, json.loads(data)
                        name, data = "message", ""
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise ConsoleError(f"the event stream from {self.url} broke: {exc}") from None

    @staticmethod
    def _refused(err: urllib.error.HTTPError) -> ConsoleError:
        with err:
            raw = err.read()
        try:
            detail = json.loads(raw).get("detail", err.reason)
        except (ValueError, AttributeError):
            detail = err.reason
        return ConsoleError(f"admin API answered {err.code}: {detail}")


def add_console_commands(sub: Any) -> None:
    """The console commands' parsers, under the ``capgate`` command's subparsers."""
    ap = sub.add_parser("approvals", help="calls held for approval (through the admin API)")
    ap.add_argument(
        "action", choices=["list", "approve", "deny"], help="list the held calls, or decide one"
    )
    ap.add_argument("id", nargs="?", help="the approval id (approve, deny)")
    ap.add_argument("--reason", default="", help="a note recorded with the decision")
    _admin_args(ap)

    wp = sub.add_parser("watch", help="every decision as it is made (the admin API's stream)")
    _admin_args(wp)
    wp.add_argument("--agent", help="only this agent's calls")
    wp.add_argument("--run", help="only this run's calls")
    wp.add_argument("--decision", choices=["allow", "deny"], help="only allowed or denied calls")
    wp.add_argument(
        "--type", choices=["call", "approval", "operator", "taint"], help="only this kind"
    )
    wp.add_argument("--json", action="store_true", help="one JSON object per line")

    for verb, text in (
        ("pause", "hold an agent's or a run's new calls until resumed"),
        ("resume", "let a paused agent's or run's calls go on"),
        ("stop", "revoke an agent or a run and cut its calls in flight"),
    ):
        vp = sub.add_parser(verb, help=text + " (through the admin API)")
        who = vp.add_mutually_exclusive_group(required=True)
        who.add_argument("--agent", help="the agent")
        who.add_argument("--run", help="the run")
        if verb != "resume":
            vp.add_argument("--reason", default="", help="why (recorded with your name)")
        if verb == "pause":
            vp.add_argument("--for", dest="for_", help="an end to the pause, e.g. 10m")
        _admin_args(vp)

    op = sub.add_parser("operators", help="who may use the admin API, with which role")
    op.add_argument(
        "action", choices=["add", "remove", "list"], help="add or remove an operator, or list them"
    )
    op.add_argument("name", nargs="?", help="the operator's name (add, remove)")
    op.add_argument("--role", choices=["viewer", "approver", "admin"], help="(add)")
    op.add_argument("--file", required=True, type=Path, help="the operators file")


def _admin_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin", required=True, help="admin API URL, e.g. http://127.0.0.1:8788")
    parser.add_argument("--token-file", required=True, type=Path, help="operator token file (0600)")


def cmd_approvals(args: argparse.Namespace) -> int:
    if args.action != "list" and not args.id:
        raise ConsoleError(f"approvals {args.action} needs the approval id")
    if args.action != "list" and not APPROVAL_ID.fullmatch(args.id):
        raise ConsoleError(
            f"approval id {args.id!r}: expected 16 hex digits, as `capgate approvals list` shows"
        )
    client = AdminClient(args.admin, args.token_file)
    if args.action == "list":
        answer = client.call("GET", "/approvals")
    else:
        body = {"reason": args.reason} if args.reason else None
        answer = client.call("POST", f"/approvals/{args.id}/{args.action}", body)
    print(json.dumps(answer, indent=2))
    return 0


def cmd_watch(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    client = AdminClient(args.admin, args.token_file)
    query = {k: getattr(args, k) for k in WATCH_FILTERS if getattr(args, k)}
    path = "/events" + ("?" + urllib.parse.urlencode(query) if query else "")
    for name, event in client.stream(path):
        if name == "lagged":
            raise ConsoleError("this terminal fell behind the event stream; run watch again")
        out.write((json.dumps(event) if args.json else describe(event)) + "\n")
        out.flush()
    return 0


def _printable(value: object) -> str:
    """Agent-chosen text, shown without control characters (a terminal must not obey them)."""
    text = "-" if value is None else str(value)
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in text)[:200]


def describe(event: dict[str, Any]) -> str:
    """One terminal line for an event."""
    p = _printable
    if event.get("type") == "call":
        status = event.get("status")
        return (
            f"{p(event.get('time'))} {p(event.get('decision')):5} {p(status):>3} "
            f"{p(event.get('agent'))} run={p(event.get('run'))} {p(event.get('method'))} "
            f"{p(event.get('path'))} rule={p(event.get('rule'))} reason={p(event.get('reason'))}"
        )
    if event.get("type") == "approval":
        by = f" by {p(event['operator'])}" if "operator" in event else ""
        return (
            f"approval {p(event.get('id'))} {p(event.get('state'))}{by}: {p(event.get('agent'))} "
            f"{p(event.get('method'))} {p(event.get('path'))} rule={p(event.get('rule'))}"
        )
    return " ".join(f"{p(k)}={p(v)}" for k, v in event.items() if k != "seq")


def cmd_operators(args: argparse.Namespace) -> int:
    from gateway.operators import add_operator, read_operators, remove_operator

    if args.action == "list":
        for _, operator in read_operators(args.file):
            print(f"{operator.name}\t{operator.role}")
        return 0
    if not args.name:
        raise ConsoleError(f"operators {args.action} needs the operator's name")
    if args.action == "remove":
        remove_operator(args.file, args.name)
        print(f"removed operator {args.name!r}", file=sys.stderr)
        return 0
    if not args.role:
        raise ConsoleError("operators add needs --role viewer|approver|admin")
    token = add_operator(args.file, args.name, args.role)
    print(
        f"operator {args.name!r} ({args.role}) added to {args.file}; their token, shown once "
        "(keep it in a 0600 file):",
        file=sys.stderr,
    )
    print(token)
    return 0


def cmd_act(args: argparse.Namespace) -> int:
    """``capgate pause|resume|stop``."""
    from gateway.policy_file import parse_duration

    kind, name = ("agents", args.agent) if args.agent else ("runs", args.run)
    if not name:
        raise ConsoleError(f"{args.command}: --agent or --run must name someone")
    body: dict[str, Any] = {}
    if getattr(args, "reason", ""):
        body["reason"] = args.reason
    if getattr(args, "for_", None):
        try:
            body["for_s"] = parse_duration(args.for_)
        except ValueError as exc:
            raise ConsoleError(f"--for {args.for_!r}: {exc}") from None
    client = AdminClient(args.admin, args.token_file)
    path = f"/{kind}/{urllib.parse.quote(name, safe='')}/{args.command}"
    print(json.dumps(client.call("POST", path, body or None), indent=2))
    return 0
