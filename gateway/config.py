"""Settings: read once, validated loudly, then frozen.

Precedence, lowest first: defaults < config file (YAML) < ``CAPGATE_*`` environment < flags.
``load_settings`` is pure: the environment is an argument, so tests pass a dict. A bad value
raises ``ConfigError`` naming the key and the value, e.g.
``CAPGATE_PORT has value 'abc'; expected an integer 1-65535``.

=====================  ===================  ===========================================
key (flag / env)       default              meaning
=====================  ===================  ===========================================
host                   127.0.0.1            listen address (loopback unless told)
port                   8787                 listen port (0: any free port)
policy                 (required)           policy YAML file, reloaded when it changes
jwks                   (required)           public keys that may sign capability tokens
algorithm              EdDSA                pinned token algorithm: EdDSA or ES256
audience               capgate              required ``aud`` of capability tokens
issuers                capgate              accepted ``iss`` values (comma-separated)
max_token_lifetime     1h                   refuse tokens living longer
leeway                 30s                  clock skew allowed on exp/nbf/iat
max_token_size         8192                 refuse larger tokens (bytes)
upstream_key           (none)               private key for agent-jwt upstream credentials
secrets_dir            policy file's dir    where relative ``file:`` secret references live
audit                  capgate-audit.jsonl  audit file ("-" or "" for none)
audit_key              <audit file>.key     key of the audit's body digests (made 0600 if absent)
audit_fsync            1s                   ``always`` (before forwarding), a duration, ``never``
audit_mirror           (none)               a second copy of every line (another volume)
audit_signing_key      <audit>.signing.pem  Ed25519 key of the checkpoints (made 0600 if absent)
audit_jwks             <audit>.jwks.json    where its public key is published (keys kept)
audit_anchor           (none)               file:PATH, exec:COMMAND, redis or redis://...
audit_checkpoint_lines 1000                 a signed checkpoint at least every N lines, and
audit_checkpoint_      10s                  ... every T (when lines were written); the key
 interval                                   is ``audit_checkpoint_interval``
audit_rotate_size      (none)               rotate the audit file at this size (e.g. 100MB)
audit_rotate_interval  (none)               rotate the audit file this often (e.g. 24h)
audit_gateway_id       host name            this gateway's name in checkpoints and anchors
state                  memory               ``memory`` or ``redis://host:port/db``
mode                   live                 live, record, replay, replay-or-record, shadow
recordings             (none)               recordings directory (record/replay modes)
replay_report          (none)               where replay/shadow write their end-of-run report
sample                 (none: keep all)     record mode: fraction of uneventful runs kept
shutdown_grace         10s                  time calls in flight get on SIGTERM
reload_interval        1s                   how often the policy file is checked
log_level              info                 debug, info, warning, error
admin_port             (none: off)          admin API listener (approvals), on ``host``
admin_token_file       (none)               one admin token for the admin API (a 0600 file;
                                            acts as the operator ``admin``)
operators_file         (none)               named operators of the admin API, with roles
                                            (``capgate operators add``)
approval_timeout       5m                   how long a held call waits for a decision
approvals_per_agent    10                   calls of one agent held for approval at once
approval_webhook       (none)               http(s) URL told (JSON POST) when a call starts
                                            waiting for approval (chat, pager)
pause_hold             5m                   how long a paused agent's call is held (then 503)
max_connections        1024                 agent connections open at once (kept below the fd limit)
head_timeout           10s                  a request's head must arrive whole within this
idle_timeout           60s                  a connection with no complete request is closed
traces                 (none: off)          OpenTelemetry spans: ``console`` or a JSON-lines file
=====================  ===================  ===========================================
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.audit_anchor import AnchorSpec
from gateway.audit_trail import FsyncPolicy
from gateway.errors import ConfigError
from gateway.policy_file import parse_duration, parse_size
from gateway.tokens import ALGORITHMS, TokenSettings


@dataclass(frozen=True)
class Settings:
    policy: Path
    jwks: Path
    host: str = "127.0.0.1"
    port: int = 8787
    tokens: TokenSettings = field(default_factory=TokenSettings)
    upstream_key: Path | None = None
    secrets_dir: Path | None = None
    audit: Path | None = Path("capgate-audit.jsonl")
    audit_key: Path | None = None  # None: the audit file's name + ".key"
    audit_fsync: FsyncPolicy = FsyncPolicy()
    audit_mirror: Path | None = None
    audit_signing_key: Path | None = None  # None: the audit file's name + ".signing.pem"
    audit_jwks: Path | None = None  # None: the audit file's name + ".jwks.json"
    audit_anchor: AnchorSpec | None = None
    audit_checkpoint_lines: int = 1000
    audit_checkpoint_interval: float = 10.0
    audit_rotate_size: int | None = None
    audit_rotate_interval: float | None = None
    audit_gateway_id: str = field(default_factory=socket.gethostname)
    state: str = "memory"
    mode: str = "live"
    recordings: Path | None = None
    replay_report: Path | None = None
    sample: float | None = None
    ci: bool = False  # CI=true in the environment: replay-or-record is refused
    shutdown_grace: float = 10.0
    reload_interval: float = 1.0
    log_level: str = "info"
    traces: str | None = None
    admin_port: int | None = None
    admin_token_file: Path | None = None
    operators_file: Path | None = None
    approval_timeout: float = 300.0
    approvals_per_agent: int = 10
    approval_webhook: str | None = None
    pause_hold: float = 300.0
    max_connections: int = 1024
    head_timeout: float = 10.0
    idle_timeout: float = 60.0


def _port(value: Any) -> int:
    # Only plain digits: int() would also take 80.9 (as 80), "8_080", "+80" or " 80 ".
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, str) and value.isascii() and value.isdigit())
    ):
        raise ValueError("expected an integer 0-65535")
    port = int(value)
    if not 0 <= port <= 65535:
        raise ValueError("expected an integer 0-65535")
    return port


def _count(value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, str) and value.isascii() and value.isdigit())
    ):
        raise ValueError(f"expected an integer {lo}-{hi}")
    number = int(value)
    if not lo <= number <= hi:
        raise ValueError(f"expected an integer {lo}-{hi}")
    return number


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"expected one of {list(choices)}")
        return str(value)

    return parse


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty string")
    return value


def _path(value: Any) -> Path:
    return Path(_text(value))


def _optional_path(value: Any) -> Path | None:
    if value in ("", "-", None):
        return None
    return _path(value)


def _webhook_url(value: Any) -> str | None:
    if value in ("", None):
        return None
    text = _text(value)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http(s) URL")
    return text


def _csv(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    out = tuple(str(v).strip() for v in items if str(v).strip())
    if not out:
        raise ValueError("expected at least one value")
    return out


def _state(value: Any) -> str:
    text = _text(value)
    if text in ("memory", "memory://") or text.startswith(("redis://", "rediss://")):
        return text
    raise ValueError("expected 'memory' or a redis:// or rediss:// URL")


def _fraction(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError("expected a fraction between 0 and 1, such as 0.01") from None
    if isinstance(value, bool) or not 0.0 <= number <= 1.0:
        raise ValueError("expected a fraction between 0 and 1, such as 0.01")
    return number


def _size(value: Any) -> int:
    return parse_size(value)


def _positive_duration(value: Any) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError("expected a positive duration such as 30s")
    return seconds


FIELDS: dict[str, Callable[[Any], Any]] = {
    "host": _text,
    "port": _port,
    "policy": _path,
    "jwks": _path,
    "algorithm": _choice(*ALGORITHMS),
    "audience": _text,
    "issuers": _csv,
    "max_token_lifetime": _positive_duration,
    "leeway": parse_duration,
    "max_token_size": _size,
    "upstream_key": _optional_path,
    "secrets_dir": _optional_path,
    "audit": _optional_path,
    "audit_key": _optional_path,
    "audit_fsync": FsyncPolicy.parse,
    "audit_mirror": _optional_path,
    "audit_signing_key": _optional_path,
    "audit_jwks": _optional_path,
    "audit_anchor": _text,  # parsed once the state URL is known (``redis`` uses it)
    "audit_checkpoint_lines": lambda v: _count(v, 1, 10_000_000),
    "audit_checkpoint_interval": _positive_duration,
    "audit_rotate_size": _size,
    "audit_rotate_interval": _positive_duration,
    "audit_gateway_id": _text,
    "state": _state,
    "mode": _choice("live", "record", "replay", "replay-or-record", "shadow"),
    "recordings": _optional_path,
    "replay_report": _optional_path,
    "sample": _fraction,
    "shutdown_grace": parse_duration,
    "reload_interval": _positive_duration,
    "log_level": _choice("debug", "info", "warning", "error"),
    "traces": _text,
    "admin_port": _port,
    "admin_token_file": _optional_path,
    "operators_file": _optional_path,
    "approval_timeout": _positive_duration,
    "approvals_per_agent": lambda v: _count(v, 1, 1000),
    "approval_webhook": _webhook_url,
    "pause_hold": _positive_duration,
    "max_connections": lambda v: _count(v, 16, 1_000_000),
    "head_timeout": _positive_duration,
    "idle_timeout": _positive_duration,
}
TOKEN_FIELDS = {
    "algorithm": "algorithm",
    "audience": "audience",
    "issuers": "issuers",
    "max_token_lifetime": "max_lifetime",
    "leeway": "leeway",
    "max_token_size": "max_size",
}


def _read_config_file(path: Path) -> dict[str, Any]:
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    try:
        data = YAML(typ="safe").load(path.read_text("utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror}") from exc
    except YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must be a mapping of settings")
    return data


def _anchor(given: tuple[str, Any], state: str | None) -> AnchorSpec:
    """``audit_anchor`` once the state URL is known (``redis`` names the state's Redis)."""
    where, value = given
    try:
        return AnchorSpec.parse(_text(value), state)
    except ValueError as exc:
        raise ConfigError(f"{where} has value {value!r}; {exc}") from None


def process_environ() -> Mapping[str, str]:
    """The process's environment: read here and passed down, so nothing else reads it."""
    return os.environ


def load_settings(
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    config_file: Path | None = None,
) -> Settings:
    """Merge defaults, file, environment and flags into one frozen ``Settings``."""
    raw: dict[str, tuple[str, Any]] = {}  # key -> (where it came from, value)
    if config_file is not None:
        for key, value in _read_config_file(config_file).items():
            if key not in FIELDS:
                raise ConfigError(
                    f"config file {str(config_file)!r}: unknown setting {key!r}; "
                    f"expected one of {sorted(FIELDS)}"
                )
            raw[key] = (f"{config_file}: {key}", value)
    for key in FIELDS:
        env = "CAPGATE_" + key.upper()
        if env in environ:
            raw[key] = (env, environ[env])
    for key, value in flags.items():
        if value is not None and key in FIELDS:
            raw[key] = ("--" + key.replace("_", "-"), value)

    values: dict[str, Any] = {}
    for key, (where, value) in raw.items():
        try:
            values[key] = FIELDS[key](value)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where} has value {value!r}; {exc}") from None
    for key in ("policy", "jwks"):
        if key not in values:
            raise ConfigError(f"setting {key!r} is required (--{key} or CAPGATE_{key.upper()})")
    if values.get("admin_port") is not None and not (
        values.get("admin_token_file") or values.get("operators_file")
    ):
        raise ConfigError(
            "admin_port needs operators: --operators FILE (capgate operators add) "
            "or --admin-token-file"
        )
    if values.get("mode", "live") != "live" and values.get("recordings") is None:
        raise ConfigError(f"mode {values['mode']} needs a recordings directory (--recordings DIR)")
    if "audit_anchor" in values:
        values["audit_anchor"] = _anchor(raw["audit_anchor"], values.get("state"))
    token_args = {TOKEN_FIELDS[k]: v for k, v in values.items() if k in TOKEN_FIELDS}
    other = {k: v for k, v in values.items() if k not in TOKEN_FIELDS}
    ci = environ.get("CI", "").strip().lower() in ("true", "1", "yes")
    return Settings(tokens=TokenSettings(**token_args), ci=ci, **other)
