"""Settings: read once, validated loudly, then frozen.

Precedence, lowest first: defaults < config file (YAML) < ``CAPGATE_*`` environment < flags.
A relative path in the config file is relative to the file's directory; in a flag or the
environment, to the current directory.
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
max_token_lifetime     1h                   refuse tokens living longer (at most 24h)
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
jwks_overlap           0s                   how long a key removed from the JWKS still verifies
                                            tokens (the JWKS is read again when it changes)
state                  memory               ``memory`` or ``redis://host:port/db``
revocations_file       <audit>.revocations  every revocation this gateway learns, kept on its
                                            disk (survives Redis and gateway restarts);
                                            none when the audit is off and this is unset
mode                   live                 live, record, replay, replay-or-record, shadow
recordings             (none)               recordings directory (record/replay modes)
replay_report          (none)               where replay/shadow write their end-of-run report
faults                 (none: off)          chaos on demand: a fault file (latency, error, reset,
                                            timeout by probability and seed; gateway/chaos.py)
sample                 (none: keep all)     record mode: fraction of uneventful runs kept
shutdown_grace         10s                  time calls in flight get on SIGTERM
reload_interval        1s                   how often the policy file is checked
log_level              info                 debug, info, warning, error
admin_port             (none: off)          admin API listener (approvals), on ``admin_host``
admin_host             ``host``             the admin listener's address (a sidecar: the pod
                                            IP, never the loopback the agent shares)
health_port            (none: off)          a listener answering only ``GET /_capgate/health``
                                            (for the kubelet's probes, on the pod IP)
health_host            ``host``             the health listener's address
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
traces                 (none: off)          spans: ``console``, a JSON-lines file, an
                                            ``http(s)://`` OTLP endpoint, ``none`` or
                                            ``discard`` (recorded, exported nowhere)
traces_exporter        (none: off)          ``otlp``, ``console`` or ``none``
metrics_exporter       (none: off)          ``otlp``, ``prometheus`` (admin listener's
                                            ``/metrics``), both (``otlp,prometheus``), ``none``
otlp_endpoint          (none)               OTLP/HTTP base URL (``/v1/traces``, ``/v1/metrics``
                                            are appended); setting it turns OTLP export on
otlp_traces_endpoint   (none)               OTLP/HTTP URL for spans, used as it is
otlp_metrics_endpoint  (none)               OTLP/HTTP URL for metrics, used as it is
otlp_headers           (none)               ``k=v,k2=v2`` (values URL-encoded): sent with every
                                            export; no flag (it often holds a key)
service_name           capgate              the ``service.name`` resource attribute
metrics_interval       60s                  how often metrics are pushed by OTLP
=====================  ===================  ===========================================

The standard OpenTelemetry variables are read here too, like every other setting, and sit
between the file and the ``CAPGATE_*`` variables (``OTEL_ENV``): defaults < file < ``OTEL_*``
< ``CAPGATE_*`` < flags. Unlike the SDK's own default, nothing is exported unless asked for
(an exporter or an endpoint set): a sidecar must not start sending to ``localhost:4318``
because a variable was left unset.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.audit_anchor import AnchorSpec
from gateway.audit_trail import FsyncPolicy
from gateway.errors import ConfigError
from gateway.policy_file import parse_duration, parse_size
from gateway.state.base import REDIS_URLS
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
    jwks_overlap: float = 0.0  # seconds a key removed from the JWKS still verifies
    state: str = "memory"
    revocations_file: Path | None = None  # None: beside the audit file (none without one)
    mode: str = "live"
    recordings: Path | None = None
    replay_report: Path | None = None
    faults: Path | None = None  # chaos on demand: a fault file (gateway/chaos.py)
    sample: float | None = None
    ci: bool = False  # CI=true in the environment: replay-or-record is refused
    shutdown_grace: float = 10.0
    reload_interval: float = 1.0
    log_level: str = "info"
    traces: str | None = None
    admin_port: int | None = None
    admin_host: str | None = None  # None: ``host``
    health_port: int | None = None
    health_host: str | None = None  # None: ``host``
    admin_token_file: Path | None = None
    operators_file: Path | None = None
    approval_timeout: float = 300.0
    approvals_per_agent: int = 10
    approval_webhook: str | None = None
    pause_hold: float = 300.0
    max_connections: int = 1024
    head_timeout: float = 10.0
    idle_timeout: float = 60.0
    traces_exporter: str | None = None
    metrics_exporter: tuple[str, ...] | None = None  # None: unset (an endpoint turns on otlp)
    otlp_endpoint: str | None = None
    otlp_traces_endpoint: str | None = None
    otlp_metrics_endpoint: str | None = None
    otlp_headers: OtlpHeaders = field(default_factory=lambda: OtlpHeaders(()))
    service_name: str = "capgate"
    metrics_interval: float = 60.0


@dataclass(frozen=True)
class OtlpHeaders:
    """Headers sent with every OTLP export; often an API key, so never shown in a repr."""

    pairs: tuple[tuple[str, str], ...]

    def __repr__(self) -> str:
        return f"OtlpHeaders({[name for name, _ in self.pairs]}, values masked)"


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


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def _http_url(value: Any) -> str:
    """An OTLP/HTTP URL: http or https, with a host."""
    text = _text(value).strip()
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL with a host")
    return text


def _traces(value: Any) -> str:
    """``console``, ``none``, ``discard``, an http(s) OTLP endpoint, or a file path.

    A value that looks like a URL but is not an http(s) one with a host (``grpc://...``,
    ``http:/x``, ``http:``) is refused rather than taken as a file name: a directory named
    ``http:`` is never what was meant."""
    text = _text(value)
    if _SCHEME.match(text) and not text.startswith(("./", "/")):
        scheme = text.split(":", 1)[0].lower()
        if scheme in ("http", "https"):
            try:
                return _http_url(text)
            except ValueError:
                pass
        raise ValueError(
            "expected 'console', 'none', a file path or an http(s):// OTLP endpoint "
            "(write ./NAME for a file whose name holds a colon)"
        )
    return text


def _exporters(*choices: str) -> Callable[[Any], tuple[str, ...]]:
    def parse(value: Any) -> tuple[str, ...]:
        items = _csv(value)
        unknown = [i for i in items if i not in choices]
        if unknown:
            raise ValueError(f"expected one or more of {list(choices)}")
        if "none" in items:
            if len(items) > 1:
                raise ValueError("'none' cannot be combined with an exporter")
            return ()
        return tuple(dict.fromkeys(items))

    return parse


def _traces_exporter(value: Any) -> str:
    items = _exporters("otlp", "console", "none")(value)
    if len(items) > 1:
        raise ValueError("expected one of ['otlp', 'console', 'none']")
    return items[0] if items else "none"


def _otlp_headers(value: Any) -> OtlpHeaders:
    """``k=v,k2=v2`` with URL-encoded values (the OTEL_EXPORTER_OTLP_HEADERS format), or a
    mapping in the config file."""
    if isinstance(value, dict):
        items = [(str(k), str(v)) for k, v in value.items()]
    else:
        items = []
        for part in str(value).split(","):
            if not part.strip():
                continue
            name, eq, raw = part.partition("=")
            if not eq or not name.strip():
                raise ValueError("expected name=value pairs separated by commas")
            items.append((name.strip(), urllib.parse.unquote(raw.strip())))
    for name, val in items:
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name) or any(
            c in val for c in "\r\n\0"
        ):
            raise ValueError("expected header names and values without line breaks")
    return OtlpHeaders(tuple(items))


def _state(value: Any) -> str:
    text = _text(value)
    if text in ("memory", "memory://") or text.startswith(REDIS_URLS):
        return text
    raise ValueError(
        "expected 'memory' or a redis://, rediss://, redis+cluster:// or rediss+cluster:// URL"
    )


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


def _token_lifetime(value: Any) -> float:
    from gateway.tokens import MAX_LIFETIME_CEILING

    seconds = _positive_duration(value)
    if seconds > MAX_LIFETIME_CEILING:
        raise ValueError("expected at most 24h: a capability token should not outlive a day")
    return seconds


FIELDS: dict[str, Callable[[Any], Any]] = {
    "host": _text,
    "port": _port,
    "policy": _path,
    "jwks": _path,
    "algorithm": _choice(*ALGORITHMS),
    "audience": _text,
    "issuers": _csv,
    "max_token_lifetime": _token_lifetime,
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
    "jwks_overlap": parse_duration,
    "state": _state,
    "revocations_file": _optional_path,
    "mode": _choice("live", "record", "replay", "replay-or-record", "shadow"),
    "recordings": _optional_path,
    "replay_report": _optional_path,
    "faults": _optional_path,
    "sample": _fraction,
    "shutdown_grace": parse_duration,
    "reload_interval": _positive_duration,
    "log_level": _choice("debug", "info", "warning", "error"),
    "traces": _traces,
    "admin_port": _port,
    "admin_host": _text,
    "health_port": _port,
    "health_host": _text,
    "admin_token_file": _optional_path,
    "operators_file": _optional_path,
    "approval_timeout": _positive_duration,
    "approvals_per_agent": lambda v: _count(v, 1, 1000),
    "approval_webhook": _webhook_url,
    "pause_hold": _positive_duration,
    "max_connections": lambda v: _count(v, 16, 1_000_000),
    "head_timeout": _positive_duration,
    "idle_timeout": _positive_duration,
    "traces_exporter": _traces_exporter,
    "metrics_exporter": _exporters("otlp", "prometheus", "none"),
    "otlp_endpoint": _http_url,
    "otlp_traces_endpoint": _http_url,
    "otlp_metrics_endpoint": _http_url,
    "otlp_headers": _otlp_headers,
    "service_name": _text,
    "metrics_interval": _positive_duration,
}
# Settings that are never taken from a flag: a flag is visible to every user of the machine.
NO_FLAG = frozenset({"otlp_headers"})
# The standard OpenTelemetry variables, read like every other setting (below CAPGATE_*).
OTEL_ENV = {
    "OTEL_TRACES_EXPORTER": "traces_exporter",
    "OTEL_METRICS_EXPORTER": "metrics_exporter",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "otlp_endpoint",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "otlp_traces_endpoint",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "otlp_metrics_endpoint",
    "OTEL_EXPORTER_OTLP_HEADERS": "otlp_headers",
    "OTEL_SERVICE_NAME": "service_name",
    "OTEL_METRIC_EXPORT_INTERVAL": "metrics_interval",  # milliseconds (converted below)
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


def _read_environ(raw: dict[str, tuple[str, Any]], environ: Mapping[str, str]) -> None:
    """``OTEL_*`` (standard names) then ``CAPGATE_*`` over what the file said."""
    for env, key in OTEL_ENV.items():
        if environ.get(env, "").strip():
            value = environ[env]
            if env == "OTEL_METRIC_EXPORT_INTERVAL" and value.strip().isdigit():
                value = f"{int(value)}ms"
            raw[key] = (env, value)
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        raw["traces_exporter"] = ("OTEL_SDK_DISABLED", "none")
        raw["metrics_exporter"] = ("OTEL_SDK_DISABLED", "none")
    for key in FIELDS:
        env = "CAPGATE_" + key.upper()
        if env in environ:
            raw[key] = (env, environ[env])


def _check_ports(values: dict[str, Any]) -> None:
    """The listeners' addresses: none twice (port 0, any free port, never clashes)."""
    host = values.get("host", "127.0.0.1")
    seen: dict[tuple[str, int], str] = {}
    for name, port_key, host_key in (
        ("agent", "port", "host"),
        ("admin", "admin_port", "admin_host"),
        ("health", "health_port", "health_host"),
    ):
        port = values.get(port_key, 8787 if port_key == "port" else None)
        if port is None or port == 0:
            if host_key != "host" and host_key in values and port is None:
                raise ConfigError(f"{host_key} is set but {port_key} is not")
            continue
        where = (values.get(host_key, host), port)
        if where in seen:
            raise ConfigError(
                f"the {name} listener and the {seen[where]} listener are both set to "
                f"{where[0]}:{where[1]}"
            )
        seen[where] = name


def _check_together(values: dict[str, Any]) -> None:
    """Settings that need each other."""
    for key in ("policy", "jwks"):
        if key not in values:
            raise ConfigError(f"setting {key!r} is required (--{key} or CAPGATE_{key.upper()})")
    if values.get("traces") == "none":
        values["traces"] = None
    if "prometheus" in (values.get("metrics_exporter") or ()) and values.get("admin_port") is None:
        raise ConfigError(
            "metrics_exporter prometheus is served on the admin listener's /metrics; "
            "it needs admin_port (--admin-port) and operators"
        )
    if values.get("admin_port") is not None and not (
        values.get("admin_token_file") or values.get("operators_file")
    ):
        raise ConfigError(
            "admin_port needs operators: --operators FILE (capgate operators add) "
            "or --admin-token-file"
        )
    _check_ports(values)
    if values.get("mode", "live") != "live" and values.get("recordings") is None:
        raise ConfigError(f"mode {values['mode']} needs a recordings directory (--recordings DIR)")


# Settings naming a file or a directory: relative in a config file, they are relative to it.
PATH_KEYS = frozenset(k for k, parse in FIELDS.items() if parse in (_path, _optional_path)) | {
    "traces",
    "audit_anchor",
}


def _beside(config_file: Path, key: str, value: Any) -> Any:
    """A relative path written in ``config_file``, made relative to the file's directory (as
    the policy's own ``agents:`` file and ``file:`` secrets are), not to the directory the
    gateway happens to be started from. Flags and the environment stay relative to the
    current directory, as on any command line."""
    if key not in PATH_KEYS or not isinstance(value, str) or value in ("", "-"):
        return value
    base = config_file.parent
    if key == "audit_anchor":
        if value.startswith("file:") and not Path(value[5:]).is_absolute():
            return f"file:{base / value[5:]}"
        return value
    if key == "traces" and (value in ("console", "none", "discard") or _SCHEME.match(value)):
        return value
    return str(base / value) if not Path(value).is_absolute() else value


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
            raw[key] = (f"{config_file}: {key}", _beside(config_file, key, value))
    _read_environ(raw, environ)
    for key, value in flags.items():
        if value is not None and key in FIELDS and key not in NO_FLAG:
            raw[key] = ("--" + key.replace("_", "-"), value)

    values: dict[str, Any] = {}
    for key, (where, value) in raw.items():
        try:
            values[key] = FIELDS[key](value)
        except (ValueError, TypeError) as exc:
            shown = "(masked)" if key in NO_FLAG else repr(value)
            raise ConfigError(f"{where} has value {shown}; {exc}") from None
    _check_together(values)
    if "audit_anchor" in values:
        values["audit_anchor"] = _anchor(raw["audit_anchor"], values.get("state"))
    token_args = {TOKEN_FIELDS[k]: v for k, v in values.items() if k in TOKEN_FIELDS}
    other = {k: v for k, v in values.items() if k not in TOKEN_FIELDS}
    ci = environ.get("CI", "").strip().lower() in ("true", "1", "yes")
    return Settings(tokens=TokenSettings(**token_args), ci=ci, **other)


def revocations_path(settings: Settings) -> Path | None:
    """Where the revocation journal is kept: as configured, else beside the audit file."""
    if settings.revocations_file is not None:
        return settings.revocations_file
    if settings.audit is None:
        return None
    return settings.audit.with_name(settings.audit.name + ".revocations")


def serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings ``serve``'s options give (``--record``/``--replay`` spelled out)."""
    flags = {
        k: v for k, v in vars(args).items() if k not in ("command", "config", "record", "replay")
    }
    for shorthand in ("record", "replay"):
        directory = getattr(args, shorthand)
        if directory is not None:
            if args.mode not in (None, shorthand) or args.recordings not in (None, directory):
                raise ConfigError(f"--{shorthand} DIR conflicts with --mode/--recordings")
            flags["mode"], flags["recordings"] = shorthand, directory
    return flags
