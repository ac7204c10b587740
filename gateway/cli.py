"""The ``capgate`` command.

    capgate serve [--config FILE] --policy FILE --jwks FILE [--port N] [--state URL] ...
    capgate keys generate --dir DIR [--algorithm EdDSA|ES256]
    capgate token mint --key PEM --agent ID --role ROLE [--role ...] [--ttl 5m] [--run RUN]
    capgate token inspect TOKEN [--jwks FILE]
    capgate policy check FILE... [--json]
    capgate policy lint FILE... [--json] [--show-silenced]
    capgate policy explain --policy FILE --role ROLE [--agent A] METHOD URL
    capgate policy test [--policy FILE] [TESTS.yaml... | RECORDING_DIR...] [--json]
    capgate policy schema [--markdown] [-o FILE]
    capgate audit verify FILE... [--jwks FILE] [--anchor FILE|URL] [--open-tail] [--json]
    capgate audit query FILE... [--agent A] [--since T] [--until T] [--path-prefix P] ...
    capgate revoke (--jti J | --agent A | --run R) [--state URL]
    capgate recording lint DIR [--json] | verify DIR [--repair] | export-har DIR [-o FILE]
    capgate recording import-har HAR DIR --map URL=UP [--agent A --role R]
    capgate replay DIR [--agent A --role R --token-key PEM] [serve options] -- COMMAND ...
    capgate approvals list | approve ID | deny ID [--reason TEXT] --admin URL --token-file FILE
    capgate watch --admin URL --token-file FILE [--agent A] [--run R] [--decision D] [--json]
    capgate operators add NAME --role ROLE --file FILE | remove NAME --file FILE | list --file F
    capgate pause|resume|stop (--agent A | --run R) [--reason T] [--for 10m] --admin URL ...

Errors are one readable line on stderr and a non-zero exit: 1 for a negative verdict (a
policy with errors, a broken audit chain), 2 for bad usage or configuration. Never a
traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway import __version__
from gateway.commands.ci_token import duration_arg
from gateway.commands.console import (
    add_console_commands,
    cmd_act,
    cmd_approvals,
    cmd_operators,
    cmd_watch,
)
from gateway.errors import ConfigError, GatewayError

EXIT_OK, EXIT_NEGATIVE, EXIT_USAGE = 0, 1, 2


"""The form of an approval id (``Approvals.hold`` makes 8 random bytes in hex)."""


class CliError(Exception):
    """A message for the user; the CLI prints it as one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2 (argparse's own convention)
        # main() prints "capgate: error: "; the sub-command's name follows, not "capgate" again
        command = self.prog.removeprefix("capgate").strip()
        raise CliError(f"{command}: {message}" if command else message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="capgate", description="Capability-gated tool proxy for AI agents.")
    p.add_argument("--version", action="version", version=f"capgate {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("serve", help="run the gateway in the foreground")
    s.add_argument("--config", type=Path, help="YAML settings file")
    s.add_argument("--policy", help="policy YAML (reloaded on change)")
    s.add_argument("--jwks", help="JWKS of the keys that may sign capability tokens")
    s.add_argument("--host", help="listen address (default 127.0.0.1)")
    s.add_argument("--port", help="listen port (default 8787; 0 for any free port)")
    s.add_argument("--state", help="memory (default) or redis://host:port/db")
    s.add_argument(
        "--revocations-file",
        dest="revocations_file",
        help="where this gateway keeps every revocation it learns (default <audit>.revocations)",
    )
    s.add_argument("--audit", help="audit file (default capgate-audit.jsonl; '-' for none)")
    s.add_argument(
        "--audit-key",
        help="key file for the audit's keyed body digests (default: the audit file + '.key', "
        "created 0600 when absent)",
    )
    s.add_argument(
        "--audit-fsync", help="always (sync before forwarding), a duration (default 1s), never"
    )
    s.add_argument("--audit-mirror", help="a second copy of every audit line (another volume)")
    s.add_argument(
        "--audit-signing-key", help="Ed25519 key of the checkpoints (default <audit>.signing.pem)"
    )
    s.add_argument("--audit-jwks", help="where its public key is published (<audit>.jwks.json)")
    s.add_argument(
        "--audit-anchor", help="where checkpoints are kept: file:PATH, exec:COMMAND, redis"
    )
    s.add_argument("--audit-checkpoint-lines", help="a checkpoint every N lines (1000)")
    s.add_argument("--audit-checkpoint-interval", help="and every T (10s)")
    s.add_argument("--audit-rotate-size", help="rotate the audit file at this size, e.g. 100MB")
    s.add_argument("--audit-rotate-interval", help="rotate the audit file this often, e.g. 24h")
    s.add_argument("--audit-gateway-id", help="this gateway's name in checkpoints (host name)")
    s.add_argument(
        "--upstream-key", dest="upstream_key", help="key that signs agent-jwt credentials"
    )
    s.add_argument("--secrets-dir", dest="secrets_dir", help="base of relative file: secrets")
    s.add_argument("--algorithm", help="pinned token algorithm: EdDSA (default) or ES256")
    s.add_argument("--audience", help="required token audience (default capgate)")
    s.add_argument(
        "--jwks-overlap",
        dest="jwks_overlap",
        help="how long a key removed from the JWKS still verifies (default 0s: at once)",
    )
    s.add_argument("--issuers", help="accepted token issuers, comma-separated")
    s.add_argument("--shutdown-grace", dest="shutdown_grace", help="e.g. 10s")
    s.add_argument("--mode", help="live (default), record, replay, replay-or-record, shadow")
    s.add_argument("--recordings", help="recordings directory for the non-live modes")
    s.add_argument("--record", metavar="DIR", help="same as --mode record --recordings DIR")
    s.add_argument("--replay", metavar="DIR", help="same as --mode replay --recordings DIR")
    s.add_argument("--replay-report", dest="replay_report", help="end-of-run report (JSON)")
    s.add_argument(
        "--faults",
        help="chaos on demand: a fault file (latency, error status, reset, timeout per "
        "upstream or rule, by probability and seed)",
    )
    s.add_argument("--sample", help="record mode: fraction of uneventful runs kept, e.g. 0.01")
    s.add_argument("--log-level", dest="log_level", help="debug|info|warning|error")
    s.add_argument(
        "--traces",
        help="spans: 'console', a JSON-lines file, or an http(s):// OTLP endpoint (base URL)",
    )
    s.add_argument("--traces-exporter", dest="traces_exporter", help="otlp, console or none")
    s.add_argument(
        "--metrics-exporter",
        dest="metrics_exporter",
        help="otlp, prometheus (admin /metrics), otlp,prometheus or none",
    )
    s.add_argument("--otlp-endpoint", dest="otlp_endpoint", help="OTLP/HTTP base URL")
    s.add_argument("--service-name", dest="service_name", help="service.name (default capgate)")
    s.add_argument("--admin-port", dest="admin_port", help="admin API (approvals) port")
    s.add_argument(
        "--admin-host", dest="admin_host", help="admin listener address (default: --host)"
    )
    s.add_argument(
        "--health-port", dest="health_port", help="a listener serving only the health check"
    )
    s.add_argument(
        "--health-host", dest="health_host", help="health listener address (default: --host)"
    )
    s.add_argument("--admin-token-file", dest="admin_token_file", help="admin bearer token file")
    s.add_argument(
        "--operators", dest="operators_file", help="named operators file (capgate operators add)"
    )
    s.add_argument("--approval-timeout", dest="approval_timeout", help="e.g. 5m")
    s.add_argument(
        "--approvals-per-agent", dest="approvals_per_agent", help="held calls per agent (10)"
    )
    s.add_argument(
        "--approval-webhook", dest="approval_webhook", help="URL told when a call is held"
    )
    s.add_argument(
        "--pause-hold", dest="pause_hold", help="how long a paused agent's call is held (5m)"
    )
    s.add_argument(
        "--max-connections", dest="max_connections", help="agent connections at once (1024)"
    )
    s.add_argument("--head-timeout", dest="head_timeout", help="request head deadline (10s)")
    s.add_argument("--idle-timeout", dest="idle_timeout", help="idle connection close (60s)")

    k = sub.add_parser("keys", help="signing keys")
    ksub = k.add_subparsers(dest="keys_command", required=True, parser_class=_Parser)
    kg = ksub.add_parser("generate", help="write signing-key.pem (0600) and jwks.json")
    kg.add_argument("--dir", required=True, type=Path, help="directory to write the two files to")
    kg.add_argument(
        "--algorithm",
        default="EdDSA",
        choices=["EdDSA", "ES256"],
        help="EdDSA (Ed25519, default) or ES256 (P-256)",
    )

    t = sub.add_parser("token", help="capability tokens")
    tsub = t.add_subparsers(dest="token_command", required=True, parser_class=_Parser)
    tm = tsub.add_parser("mint", help="print a signed capability token")
    tm.add_argument("--key", required=True, type=Path, help="the signing key (PEM)")
    tm.add_argument("--agent", required=True, help="the agent (sub), declared in the policy")
    tm.add_argument(
        "--role", action="append", required=True, dest="roles", help="a role (repeatable)"
    )
    tm.add_argument("--cap", action="append", dest="caps", help="narrow to this rule id")
    tm.add_argument(
        "--ttl",
        type=duration_arg,
        default=300.0,
        help="lifetime (default 5m; gateways refuse above max_token_lifetime, 1h by default, "
        "24h at most)",
    )
    tm.add_argument("--run", help="the run id the token is for (quotas, audit, stop)")
    tm.add_argument("--audience", default="capgate", help="aud (default capgate)")
    tm.add_argument("--issuer", default="capgate", help="iss (default capgate)")
    ti = tsub.add_parser("inspect", help="print header, claims and the verification verdict")
    ti.add_argument("token", help="the token (header.payload.signature)")
    ti.add_argument("--jwks", type=Path, help="verify against these public keys")
    ti.add_argument(
        "--algorithm", default="EdDSA", choices=["EdDSA", "ES256"], help="the pinned algorithm"
    )
    ti.add_argument("--audience", default="capgate", help="the required aud (default capgate)")
    ti.add_argument(
        "--issuer", action="append", dest="issuers", help="an accepted iss (default capgate)"
    )

    pol = sub.add_parser("policy", help="check and explain policies")
    psub = pol.add_subparsers(dest="policy_command", required=True, parser_class=_Parser)
    pc = psub.add_parser("check", help="print FILE:LINE:COL errors; exit 1 if any")
    pc.add_argument("files", nargs="+", type=Path, help="policy files")
    pc.add_argument(
        "--json",
        action="store_true",
        help="print {ok, files: [{file, ok, errors: [{file, line, col, message}], counts}]}",
    )
    pl = psub.add_parser(
        "lint",
        help="warn about rules broader than they look (CG101...); exit 1 if any",
        description="Warn about what is legal but probably a mistake: CG101 a pattern that "
        "accepts anything, CG102 an unconstrained path parameter, CG103 a POST/PUT/PATCH "
        "rule without a body check, CG104 a rule shadowed by an earlier one, CG105 an unused "
        "upstream, CG106 a role no agent holds. Silence one on purpose with a comment on its "
        "line (or alone on the line above): '# capgate: allow CG102'. Exit 0 when nothing "
        "is left to say, 1 when there are warnings, 2 when a policy does not load.",
    )
    pl.add_argument("files", nargs="+", type=Path, help="policy files")
    pl.add_argument("--json", action="store_true", help="print the warnings as one JSON object")
    pl.add_argument("--show-silenced", action="store_true", help="list the silenced warnings too")
    pe = psub.add_parser("explain", help="print the decision for a call, as JSON")
    pe.add_argument("--policy", required=True, type=Path, help="the policy file")
    pe.add_argument(
        "--role", action="append", required=True, dest="roles", help="a role (repeatable)"
    )
    pe.add_argument("--agent", help="check that this agent is declared and may hold the roles")
    pe.add_argument("--cap", action="append", dest="caps", help="narrow to this rule id")
    pe.add_argument("--run", help="the run id")
    pe.add_argument("--header", "-H", action="append", default=[], help="'Name: value'")
    pe.add_argument("--body", "-d", help="request body, or @FILE")
    pe.add_argument("method", help="GET, POST, ...")
    pe.add_argument("url", help="the URL the agent calls, or /<upstream>/<path>?query")
    ps = psub.add_parser(
        "schema", help="print the JSON Schema of the policy file (for editors and linters)"
    )
    ps.add_argument(
        "--markdown",
        action="store_true",
        help="print the reference of every key (docs/policy-reference.md) instead",
    )
    ps.add_argument(
        "--tests",
        action="store_true",
        help="print the JSON Schema of policy test files (NAME.tests.yaml) instead",
    )
    ps.add_argument("-o", "--out", type=Path, help="write to this file instead of stdout")
    pg = psub.add_parser(
        "grants", help="print the database grants that mirror a rule's sql: policy"
    )
    pg.add_argument(
        "--dialect", required=True, choices=("postgres", "sqlite"), help="the database's kind"
    )
    pg.add_argument("--role", required=True, help="the database role that gets the grants")
    pg.add_argument("--rule", help="the rule (needed when several check SQL of the dialect)")
    pg.add_argument("--statement-timeout", default="5s", help="postgres: the role's timeout")
    pg.add_argument("--source", default="full.db", help="sqlite: the full database to copy")
    pg.add_argument(
        "policy", nargs="?", type=Path, default=Path("policy.yaml"), help="(policy.yaml)"
    )
    pt = psub.add_parser(
        "test",
        help="run policy test files (NAME.tests.yaml) and recordings through a policy",
        description="Run the cases of policy test files through the policy, as the gateway "
        "would decide them, and print a table; with a recording directory, replay its calls "
        "through the policy and list the decisions that change. Exit 0 when all passed, 1 "
        "when a case failed, a call regressed or nothing was checked, 2 on a malformed file.",
    )
    pt.add_argument(
        "--policy",
        type=Path,
        help="the policy to test (default: the one each test file names with policy:)",
    )
    pt.add_argument(
        "paths",
        nargs="*",
        type=Path,
        metavar="TESTS.yaml|RECORDING_DIR",
        help="test files, or recording directories (default: POLICY's NAME.tests.yaml and "
        "NAME.tests/*.yaml)",
    )
    pt.add_argument("--json", action="store_true", help="print the results as one JSON object")
    pt.add_argument(
        "--allow-regressions",
        action="store_true",
        help="exit 0 even if allowed calls become denied",
    )

    rec = sub.add_parser("recording", help="recordings: lint, verify, HAR export and import")
    rsub = rec.add_subparsers(dest="recording_command", required=True, parser_class=_Parser)
    rl = rsub.add_parser("lint", help="fail on anything secret-looking left in a recording")
    rl.add_argument("directory", type=Path, help="the recording directory")
    rl.add_argument(
        "--json", action="store_true", help="print {ok, findings: [...], files} as JSON"
    )
    rv = rsub.add_parser("verify", help="check the manifest's counts against the records")
    rv.add_argument("directory", type=Path, help="the recording directory")
    rv.add_argument(
        "--repair", action="store_true", help="mend the manifest from the records (and torn lines)"
    )
    rx = rsub.add_parser("export-har", help="write a recording as HAR 1.2")
    rx.add_argument("directory", type=Path, help="the recording directory")
    rx.add_argument("-o", "--out", type=Path, help="file to write (default: stdout)")
    ri = rsub.add_parser("import-har", help="seed a recording from a HAR file")
    ri.add_argument("har", type=Path, help="the HAR file")
    ri.add_argument("directory", type=Path, help="the recording directory (created if absent)")
    ri.add_argument(
        "--map",
        action="append",
        default=[],
        required=True,
        help="URL_PREFIX=UPSTREAM, e.g. https://api.example.com=api",
    )
    ri.add_argument(
        "--agent", help="the agent the calls were made as (for policy test on the recording)"
    )
    ri.add_argument(
        "--role", action="append", dest="roles", default=[], help="a role it held (repeatable)"
    )

    add_console_commands(sub)

    rp = sub.add_parser(
        "replay",
        help="run COMMAND against a gateway replaying DIR",
        description="Start a gateway replaying DIR, run COMMAND with CAPGATE_URL set, stop "
        "the gateway and print the replay report. With --agent, --role and --token-key "
        "(options may also follow DIR), a short-lived capability token is minted here and "
        "given to COMMAND in $CAPGATE_TOKEN; the gateway itself never holds the key.",
    )
    from gateway.commands.ci_token import add_token_options

    add_token_options(rp)
    rp.add_argument("directory", type=Path, help="the recording to replay")
    rp.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help="serve options (--policy, --jwks, ...), then -- COMMAND ...",
    )

    from gateway.commands.audit import add_audit_parsers
    from gateway.commands.sandbox import add_sandbox_parser

    add_audit_parsers(sub, _Parser)
    add_sandbox_parser(sub, _Parser, serve=s)

    r = sub.add_parser("revoke", help="revoke a token, an agent or a run everywhere")
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--jti", help="one token, by its jti")
    g.add_argument("--agent", help="every token of this agent")
    g.add_argument("--run", help="every token of this run")
    r.add_argument("--state", default=None, help="redis://host:port/db (default: $CAPGATE_STATE)")
    r.add_argument("--until", type=float, help="unix time after which it may be forgotten")
    return p


# --- commands -------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from gateway.app import configure_logging, serve
    from gateway.config import load_settings, serve_flags

    settings = load_settings(serve_flags(args), environ, args.config)
    configure_logging(settings.log_level)
    asyncio.run(serve(settings, environ))
    return EXIT_OK


def cmd_keys(args: argparse.Namespace) -> int:
    from gateway.tokens import generate_keys

    key, jwks = generate_keys(args.dir, args.algorithm)
    print(f"wrote {key} (mode 0600) and {jwks}")
    return EXIT_OK


def cmd_token(args: argparse.Namespace) -> int:
    from gateway import tokens

    if args.token_command == "mint":  # noqa: S105 (a subcommand name, not a secret)
        if args.ttl > tokens.MAX_LIFETIME_CEILING:
            raise CliError(
                f"--ttl {args.ttl:g}s: every gateway refuses a token living longer than 24h "
                "(max_token_lifetime is at most 24h)"
            )
        if args.ttl > tokens.DEFAULT_MAX_LIFETIME:
            print(
                f"capgate: warning: --ttl {args.ttl:g}s is above the default "
                "max_token_lifetime (1h): a gateway keeping the default refuses this token",
                file=sys.stderr,
            )
        key = tokens.load_private_key(args.key)
        try:
            token = tokens.mint_token(
                key,
                agent=args.agent,
                roles=args.roles,
                ttl=args.ttl,
                run=args.run,
                caps=args.caps,
                audience=args.audience,
                issuer=args.issuer,
            )
        except ValueError as exc:
            raise CliError(str(exc)) from None
        print(token)
        return EXIT_OK
    header, payload = tokens.inspect_token(args.token)
    report: dict[str, Any] = {"header": header, "claims": payload}
    code = EXIT_OK
    if args.jwks is not None:
        keyset = tokens.Keyset.from_file(args.jwks, args.algorithm)
        settings = tokens.TokenSettings(
            algorithm=args.algorithm,
            audience=args.audience,
            issuers=tuple(args.issuers or ["capgate"]),
        )
        try:
            claims = tokens.TokenVerifier(keyset, settings).verify(args.token)
            report["verdict"] = {
                "valid": True,
                "agent": claims.agent,
                "expires_in_s": round(claims.expires_at - time.time()),
            }
        except GatewayError as exc:
            report["verdict"] = {"valid": False, "reason": exc.reason.value, "detail": exc.detail}
            code = EXIT_NEGATIVE
    else:
        report["verdict"] = {"valid": None, "detail": "not verified: pass --jwks to verify"}
    print(json.dumps(report, indent=2))
    return code


def cmd_policy(args: argparse.Namespace) -> int:
    from gateway.policy.load import load_policy
    from gateway.policy_file import PolicyError

    if args.policy_command == "schema":
        from gateway.policy.reference import reference_markdown, schema_text

        if args.tests:
            from gateway.commands.policy_tests import tests_schema_text

            return _write_out(tests_schema_text(), args.out)
        return _write_out(reference_markdown() if args.markdown else schema_text(), args.out)
    if args.policy_command == "test":
        from gateway.commands.policy_tests import cmd_policy_test

        return cmd_policy_test(
            args.policy,
            args.paths,
            allow_regressions=args.allow_regressions,
            as_json=args.json,
        )
    if args.policy_command == "lint":
        return _cmd_policy_lint(args)
    if args.policy_command == "grants":
        return _cmd_policy_grants(args)
    if args.policy_command == "check":
        return _cmd_policy_check(args.files, args.json)

    from gateway.commands.explain import explain

    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        raise CliError(f"policy has errors:\n{exc}") from None
    headers = []
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise CliError(f"--header {h!r}: expected 'Name: value'")
        headers.append((name.strip(), value.strip()))
    body = None
    if args.body is not None:
        if args.body.startswith("@"):
            try:
                body = Path(args.body[1:]).read_bytes()
            except OSError as exc:
                raise CliError(f"--body {args.body}: {exc.strerror}") from None
        else:
            body = args.body.encode()
    decision = asyncio.run(
        explain(
            policy,
            roles=args.roles,
            agent=args.agent,
            method=args.method,
            url=args.url,
            caps=args.caps,
            run=args.run,
            headers=headers,
            body=body,
        )
    )
    print(json.dumps(decision, indent=2, default=str))
    return EXIT_OK if decision["decision"] == "allow" else EXIT_NEGATIVE


def _cmd_policy_check(files: list[Path], as_json: bool) -> int:
    """Every error of every file as FILE:LINE:COL; exit 1 if any file has one."""
    from gateway.policy.load import load_policy
    from gateway.policy_file import PolicyError

    results: list[dict[str, Any]] = []
    for path in files:
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            errors = [
                {"file": i.path, "line": i.line, "col": i.col, "message": i.message}
                for i in exc.issues
            ]
            results.append({"file": str(path), "ok": False, "errors": errors})
            if not as_json:
                for issue in exc.issues:
                    print(issue)
            continue
        rules = sum(len(r.rules) for r in policy.roles.values())
        counts = {"upstreams": len(policy.upstreams), "roles": len(policy.roles), "rules": rules}
        results.append({"file": str(path), "ok": True, "errors": [], "counts": counts})
        if not as_json:
            shown = f"{len(policy.upstreams)} upstreams, {len(policy.roles)} roles, {rules} rules"
            print(f"{path}: ok ({shown})")
    ok = all(r["ok"] for r in results)
    if as_json:
        print(json.dumps({"ok": ok, "files": results}, indent=2))
    return EXIT_OK if ok else EXIT_NEGATIVE


def _cmd_policy_lint(args: argparse.Namespace) -> int:
    from gateway.policy.lint import lint_file
    from gateway.policy_file import PolicyError

    warnings: list[Any] = []
    errors: list[str] = []
    for path in args.files:
        try:
            warnings.extend(lint_file(path))
        except PolicyError as exc:
            errors.extend(str(i) for i in exc.issues)
    active = [w for w in warnings if not w.silenced]
    if args.json:
        shown = warnings if args.show_silenced else active
        print(
            json.dumps(
                {
                    "ok": not active and not errors,
                    "warnings": [w.as_json() for w in shown],
                    "silenced": len(warnings) - len(active),
                    "errors": errors,
                },
                indent=2,
            )
        )
    else:
        for line in errors:
            print(line)
        for w in warnings if args.show_silenced else active:
            print(f"{w} (silenced)" if w.silenced else w)
        if not errors:
            quiet = len(warnings) - len(active)
            print(
                f"{len(active)} warning(s)"
                + (f", {quiet} silenced with '# capgate: allow'" if quiet else "")
                + f" in {len(args.files)} file(s)"
            )
    if errors:
        return EXIT_USAGE
    return EXIT_NEGATIVE if active else EXIT_OK


def _write_out(text: str, out: Path | None) -> int:
    """``text`` to stdout, or to ``out`` (``-``: stdout)."""
    if out is None or str(out) == "-":
        sys.stdout.write(text)
        return EXIT_OK
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CliError(f"{out}: {exc.strerror}") from None
    return EXIT_OK


def _cmd_policy_grants(args: argparse.Namespace) -> int:
    from gateway.commands.grants import GrantsError, print_grants
    from gateway.policy.load import load_policy
    from gateway.policy_file import PolicyError

    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        raise CliError(f"policy has errors:\n{exc}") from None
    try:
        grants = print_grants(
            policy,
            dialect=args.dialect,
            role=args.role,
            rule_id=args.rule,
            statement_timeout=args.statement_timeout,
            source=args.source,
        )
    except GrantsError as exc:
        raise CliError(str(exc)) from None
    sys.stdout.write(grants.text())
    return EXIT_OK if grants.complete else EXIT_NEGATIVE


def cmd_audit(args: argparse.Namespace) -> int:
    from gateway.commands.audit import AuditCliError, cmd_audit_query, cmd_audit_verify

    try:
        if args.audit_command == "query":
            return cmd_audit_query(args)
        return cmd_audit_verify(args)
    except AuditCliError as exc:
        raise CliError(str(exc)) from None


def cmd_recording(args: argparse.Namespace) -> int:
    from gateway.commands import recording as commands

    if args.recording_command == "lint":
        return commands.cmd_recording_lint(args.directory, as_json=args.json)
    if args.recording_command == "verify":
        return commands.cmd_recording_verify(args.directory, repair=args.repair)
    if args.recording_command == "export-har":
        return commands.cmd_export_har(args.directory, args.out)
    try:
        upstream_map = commands.parse_upstream_map(args.map)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return commands.cmd_import_har(
        args.har, args.directory, upstream_map, agent=args.agent, roles=args.roles
    )


def _ci_token(args: argparse.Namespace, before: list[str]) -> tuple[Any, list[str]]:
    """The token to mint (options before or after DIR), and the serve options left."""
    from gateway.commands.ci_token import CiToken, add_token_options

    p = _Parser(prog="capgate replay", add_help=False, allow_abbrev=False)
    add_token_options(p)
    # Options after DIR: parsed into the same namespace (argparse keeps what is set there).
    _, serve = p.parse_known_args(before, namespace=args)
    try:
        return CiToken.from_args(args), serve
    except ValueError as exc:
        raise CliError(str(exc)) from None


def cmd_replay(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from gateway.commands.recording import replay_command

    rest = list(args.serve_args)
    if "--" not in rest:
        raise CliError("usage: capgate replay DIR [serve options] -- COMMAND ...")
    cut = rest.index("--")
    token, serve = _ci_token(args, rest[:cut])
    return replay_command(args.directory, rest[cut + 1 :], serve, environ, token=token)


def cmd_sandbox(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from gateway.commands.sandbox import sandbox_command

    return sandbox_command(args, environ)


REVOKE_TIMEOUT = 2.0  # seconds ``capgate revoke`` waits for Redis before it fails


def cmd_revoke(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    import logging

    from gateway.state import open_store
    from gateway.state.base import REDIS_URLS

    # The store's own reconnect warnings would repeat the one line this command prints.
    logging.getLogger("gateway.state").setLevel(logging.CRITICAL)
    from gateway.state.base import REVOCATION_KINDS

    url = args.state or environ.get("CAPGATE_STATE")
    if not url or not url.startswith(REDIS_URLS):
        raise CliError(
            "revoke needs a shared store: --state redis://host:port/db (or CAPGATE_STATE)"
        )
    kind, value = next((k, getattr(args, k)) for k in REVOCATION_KINDS if getattr(args, k))

    async def go() -> None:
        # Fails fast and loudly when Redis cannot take it (never a silent success): one line,
        # exit 2, within about two seconds.
        store = open_store(url, start_timeout_s=REVOKE_TIMEOUT)
        await store.start()
        try:
            await store.revoke(kind, value, until=args.until)
        finally:
            await store.close()

    asyncio.run(go())
    print(f"revoked {kind} {value!r}")
    return EXIT_OK


# The commands that need the environment, and those that need only their arguments.
_WITH_ENV: dict[str, Callable[[argparse.Namespace, Mapping[str, str]], int]] = {
    "serve": cmd_serve,
    "revoke": cmd_revoke,
    "replay": cmd_replay,
    "sandbox": cmd_sandbox,
}
_PLAIN: dict[str, Callable[[argparse.Namespace], int]] = {
    "keys": cmd_keys,
    "token": cmd_token,
    "policy": cmd_policy,
    "audit": cmd_audit,
    "approvals": cmd_approvals,
    "watch": cmd_watch,
    "operators": cmd_operators,
    "pause": cmd_act,
    "resume": cmd_act,
    "stop": cmd_act,
    "recording": cmd_recording,
}


def _run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    if args.command in _WITH_ENV:
        return _WITH_ENV[args.command](args, env)
    if args.command in _PLAIN:
        return _PLAIN[args.command](args)
    raise CliError(f"unknown command {args.command!r}")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    from gateway.config import process_environ

    env = process_environ() if environ is None else environ
    try:
        args = build_parser().parse_args(argv)
        return _run(args, env)
    except (CliError, ConfigError, GatewayError) as exc:
        message = exc.detail if isinstance(exc, GatewayError) else str(exc)
        print(f"capgate: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``capgate ... | head``): no traceback, and no second error
        # when the interpreter flushes standard output at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
