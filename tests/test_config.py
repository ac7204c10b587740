"""Settings: defaults < config file < CAPGATE_* environment < flags; loud, named errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config import FIELDS, Settings, load_settings
from gateway.errors import ConfigError
from gateway.tokens import TokenSettings

REQUIRED = {"policy": "p.yaml", "jwks": "j.json"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "capgate.yaml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load_settings(REQUIRED, {})
    assert isinstance(s, Settings)
    assert s.policy == Path("p.yaml") and s.jwks == Path("j.json")
    assert s.host == "127.0.0.1" and s.port == 8787
    assert s.tokens == TokenSettings()
    assert s.tokens.algorithm == "EdDSA" and s.tokens.max_lifetime == 3600
    assert s.tokens.leeway == 30 and s.tokens.max_size == 8192
    assert s.tokens.issuers == ("capgate",) and s.tokens.audience == "capgate"
    assert s.audit == Path("capgate-audit.jsonl")
    assert s.state == "memory" and s.shutdown_grace == 10 and s.reload_interval == 1
    assert s.log_level == "info" and s.upstream_key is None and s.secrets_dir is None


def test_settings_are_frozen() -> None:
    s = load_settings(REQUIRED, {})
    with pytest.raises(AttributeError):
        s.port = 1  # type: ignore[misc]


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        "port: 1001\nhost: 10.0.0.1\nlog_level: debug\nleeway: 5s\n"
        "policy: file.yaml\njwks: file.json\n",
    )
    s = load_settings({}, {}, cfg)
    assert (s.port, s.host, s.log_level, s.tokens.leeway) == (1001, "10.0.0.1", "debug", 5)
    assert s.policy == tmp_path / "file.yaml"  # relative to the config file
    env = {"CAPGATE_PORT": "1002", "CAPGATE_HOST": "10.0.0.2"}
    s = load_settings({}, env, cfg)
    assert (s.port, s.host, s.log_level) == (1002, "10.0.0.2", "debug")
    s = load_settings({"port": "1003", "host": None}, env, cfg)
    assert (s.port, s.host) == (1003, "10.0.0.2")  # a None flag is "not given"
    assert s.tokens.leeway == 5  # untouched keys keep the file's value


def test_env_overrides_file_for_token_settings(tmp_path: Path) -> None:
    cfg = write(tmp_path, "algorithm: ES256\nissuers: [a, b]\nmax_token_lifetime: 10m\n")
    s = load_settings(REQUIRED, {"CAPGATE_ISSUERS": "c, d ,"}, cfg)
    assert s.tokens.algorithm == "ES256"
    assert s.tokens.issuers == ("c", "d")
    assert s.tokens.max_lifetime == 600


def test_unrelated_environment_is_ignored() -> None:
    s = load_settings(REQUIRED, {"PORT": "1", "CAPGATE_port": "2", "capgate_PORT": "3"})
    assert s.port == 8787


def test_pause_hold_defaults_to_five_minutes() -> None:
    assert load_settings(REQUIRED, {}).pause_hold == 300.0
    assert load_settings({**REQUIRED, "pause_hold": "90s"}, {}).pause_hold == 90.0


@pytest.mark.parametrize(
    "env,value,expected",
    [
        ("CAPGATE_PORT", "abc", "expected an integer 0-65535"),
        ("CAPGATE_PORT", "70000", "expected an integer 0-65535"),
        ("CAPGATE_PORT", "-1", "expected an integer 0-65535"),
        ("CAPGATE_PORT", "80.5", "expected an integer 0-65535"),
        ("CAPGATE_PORT", "8_080", "expected an integer 0-65535"),
        ("CAPGATE_PORT", "+80", "expected an integer 0-65535"),
        ("CAPGATE_PORT", " 80", "expected an integer 0-65535"),
        ("CAPGATE_PORT", "", "expected an integer 0-65535"),
        ("CAPGATE_ALGORITHM", "HS256", "expected one of ['EdDSA', 'ES256']"),
        ("CAPGATE_ALGORITHM", "none", "expected one of"),
        ("CAPGATE_LOG_LEVEL", "loud", "expected one of"),
        ("CAPGATE_STATE", "postgres://x", "expected 'memory' or a redis://"),
        ("CAPGATE_LEEWAY", "-5s", "expected a duration"),
        ("CAPGATE_SHUTDOWN_GRACE", "-1", "expected a duration"),
        ("CAPGATE_LEEWAY", "soon", "expected a duration"),
        ("CAPGATE_MAX_TOKEN_LIFETIME", "0s", "positive"),
        ("CAPGATE_RELOAD_INTERVAL", "0", "positive"),
        ("CAPGATE_PAUSE_HOLD", "0s", "positive"),
        ("CAPGATE_PAUSE_HOLD", "forever", "expected a duration"),
        ("CAPGATE_MAX_TOKEN_SIZE", "big", "expected a size"),
        ("CAPGATE_ISSUERS", " , ", "at least one"),
        ("CAPGATE_HOST", "", "non-empty"),
        ("CAPGATE_AUDIENCE", "", "non-empty"),
    ],
)
def test_bad_env_value_names_the_key_and_the_value(env: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(REQUIRED, {env: value})
    message = str(info.value)
    assert message.startswith(f"{env} has value {value!r}; "), message
    assert expected in message


def test_bad_flag_names_the_flag() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({**REQUIRED, "shutdown_grace": "forever"}, {})
    assert str(info.value).startswith("--shutdown-grace has value 'forever'; ")


@pytest.mark.parametrize(
    "text,key,expected",
    [
        ("port: 80.9\n", "port", "expected an integer"),
        ("port: true\n", "port", "expected an integer"),
        ("port: [1]\n", "port", "expected an integer"),
        ("audience: 5\n", "audience", "non-empty string"),
        ("leeway: true\n", "leeway", "duration"),
        ("max_token_size: -1\n", "max_token_size", "negative"),
    ],
)
def test_bad_file_value_names_the_file_and_key(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    cfg = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(REQUIRED, {}, cfg)
    message = str(info.value)
    assert message.startswith(f"{cfg}: {key} has value "), message
    assert expected in message


def test_port_accepts_plain_integers(tmp_path: Path) -> None:
    assert load_settings({**REQUIRED, "port": "0"}, {}).port == 0
    assert load_settings({**REQUIRED, "port": 65535}, {}).port == 65535
    assert load_settings(REQUIRED, {}, write(tmp_path, "port: 9000\n")).port == 9000


def test_unknown_key_in_file(tmp_path: Path) -> None:
    cfg = write(tmp_path, "port: 1\nlisten_port: 2\n")
    with pytest.raises(ConfigError) as info:
        load_settings(REQUIRED, {}, cfg)
    assert "unknown setting 'listen_port'" in str(info.value)
    assert str(cfg) in str(info.value)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("- a\n- b\n", "must be a mapping"),
        ("port: [\n", "not valid YAML"),
        ("a: 1\na: 2\n", "not valid YAML"),
    ],
)
def test_bad_config_file(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_settings(REQUIRED, {}, write(tmp_path, text))


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_settings(REQUIRED, {}, tmp_path / "nope.yaml")


def test_empty_config_file_is_all_defaults(tmp_path: Path) -> None:
    assert load_settings(REQUIRED, {}, write(tmp_path, "# nothing\n")).port == 8787


@pytest.mark.parametrize("missing", ["policy", "jwks"])
def test_policy_and_jwks_are_required(missing: str) -> None:
    flags = {k: v for k, v in REQUIRED.items() if k != missing}
    with pytest.raises(ConfigError) as info:
        load_settings(flags, {})
    assert f"setting {missing!r} is required" in str(info.value)
    assert f"--{missing}" in str(info.value) and f"CAPGATE_{missing.upper()}" in str(info.value)


def test_required_settings_from_env() -> None:
    s = load_settings({}, {"CAPGATE_POLICY": "/etc/p.yaml", "CAPGATE_JWKS": "/etc/j.json"})
    assert s.policy == Path("/etc/p.yaml") and s.jwks == Path("/etc/j.json")


@pytest.mark.parametrize("value", ["-", ""])
def test_audit_can_be_turned_off(value: str) -> None:
    assert load_settings({**REQUIRED, "audit": value}, {}).audit is None


def test_paths_and_state() -> None:
    s = load_settings(
        {
            **REQUIRED,
            "audit": "/var/log/a.jsonl",
            "upstream_key": "k.pem",
            "secrets_dir": "/s",
            "state": "redis://127.0.0.1:6379/0",
        },
        {},
    )
    assert s.audit == Path("/var/log/a.jsonl") and s.upstream_key == Path("k.pem")
    assert s.secrets_dir == Path("/s") and s.state == "redis://127.0.0.1:6379/0"


def test_sizes_and_durations_parse() -> None:
    s = load_settings(
        {
            **REQUIRED,
            "max_token_size": "16KiB",
            "max_token_lifetime": "15m",
            "shutdown_grace": "0s",
        },
        {},
    )
    assert s.tokens.max_size == 16384 and s.tokens.max_lifetime == 900
    assert s.shutdown_grace == 0


def test_unknown_flags_are_ignored_not_applied() -> None:
    # The CLI passes its whole namespace; keys that are not settings are not settings.
    flags: dict[str, Any] = {**REQUIRED, "command": "serve", "config": None, "evil": "x"}
    s = load_settings(flags, {})
    assert not hasattr(s, "evil") and not hasattr(s, "command")


def test_every_field_has_an_env_name_that_works() -> None:
    samples = {
        "host": "0.0.0.0",
        "port": "1",
        "policy": "p",
        "jwks": "j",
        "algorithm": "ES256",
        "audience": "aud",
        "issuers": "a,b",
        "max_token_lifetime": "2m",
        "leeway": "1s",
        "max_token_size": "1KiB",
        "upstream_key": "k",
        "secrets_dir": "s",
        "audit": "a",
        "audit_key": "a.key",
        "state": "memory",
        "shutdown_grace": "3s",
        "reload_interval": "2s",
        "log_level": "error",
        "traces": "console",
        "admin_port": "8788",
        "admin_host": "10.1.2.3",
        "health_port": "8789",
        "health_host": "0.0.0.0",
        "admin_token_file": "admin.token",
        "operators_file": "operators.yaml",
        "approval_timeout": "90s",
        "approvals_per_agent": "3",
        "approval_webhook": "http://127.0.0.1:9/hook",
        "pause_hold": "45s",
        "max_connections": "100",
        "head_timeout": "5s",
        "idle_timeout": "30s",
        "mode": "record",
        "recordings": "rec",
        "replay_report": "report.json",
        "faults": "faults.yaml",
        "sample": "0.01",
        "traces_exporter": "otlp",
        "metrics_exporter": "otlp",
        "otlp_endpoint": "http://collector:4318",
        "otlp_traces_endpoint": "http://collector:4318/v1/traces",
        "otlp_metrics_endpoint": "http://collector:4318/v1/metrics",
        "otlp_headers": "api-key=k",
        "service_name": "sidecar-7",
        "metrics_interval": "15s",
        "audit_fsync": "always",
        "audit_mirror": "/mnt/keep/a.jsonl",
        "audit_signing_key": "sig.pem",
        "audit_jwks": "audit.jwks.json",
        "audit_anchor": "file:/mnt/anchor/a",
        "audit_checkpoint_lines": "50",
        "audit_checkpoint_interval": "3s",
        "audit_rotate_size": "10MB",
        "audit_rotate_interval": "1h",
        "audit_gateway_id": "gw-1",
        "revocations_file": "/var/lib/capgate/revocations",
        "jwks_overlap": "10m",
    }
    assert set(samples) == set(FIELDS)
    env = {"CAPGATE_" + k.upper(): v for k, v in samples.items()}
    s = load_settings({}, env)
    assert (s.host, s.port, s.tokens.algorithm, s.tokens.audience) == ("0.0.0.0", 1, "ES256", "aud")
    assert s.tokens.issuers == ("a", "b") and s.tokens.max_lifetime == 120
    assert (s.mode, s.recordings, s.sample) == ("record", Path("rec"), 0.01)
    assert s.faults == Path("faults.yaml")
    assert (s.approvals_per_agent, s.max_connections) == (3, 100)
    assert (s.head_timeout, s.idle_timeout) == (5.0, 30.0)
    assert (s.admin_port, s.approval_timeout) == (8788, 90.0)
    assert (s.admin_host, s.health_port, s.health_host) == ("10.1.2.3", 8789, "0.0.0.0")
    assert s.pause_hold == 45.0
    assert s.revocations_file == Path("/var/lib/capgate/revocations") and s.jwks_overlap == 600
    assert s.tokens.leeway == 1 and s.tokens.max_size == 1024
    assert s.shutdown_grace == 3 and s.reload_interval == 2 and s.log_level == "error"
    assert (s.traces_exporter, s.metrics_exporter) == ("otlp", ("otlp",))
    assert s.otlp_headers.pairs == (("api-key", "k"),) and s.service_name == "sidecar-7"
    assert s.metrics_interval == 15
    assert s.audit_fsync.always and s.audit_mirror == Path("/mnt/keep/a.jsonl")
    assert (s.audit_signing_key, s.audit_jwks) == (Path("sig.pem"), Path("audit.jwks.json"))
    assert s.audit_anchor is not None and (s.audit_anchor.kind, s.audit_anchor.target) == (
        "file",
        "/mnt/anchor/a",
    )
    assert (s.audit_checkpoint_lines, s.audit_checkpoint_interval) == (50, 3.0)
    assert (s.audit_rotate_size, s.audit_rotate_interval) == (10_000_000, 3600.0)
    assert s.audit_gateway_id == "gw-1"


def test_an_overridden_value_is_never_parsed(tmp_path: Path) -> None:
    # Only the winning value of each key is parsed: the flag wins, and the file's bad value
    # for the same key is not an error. Without the flag, the same file is refused.
    cfg = write(tmp_path, "policy: 5\n")
    assert load_settings(REQUIRED, {}, cfg).policy == Path("p.yaml")
    with pytest.raises(ConfigError, match=r"policy has value 5; expected a non-empty string"):
        load_settings({"jwks": "j.json"}, {}, cfg)


def test_recording_settings() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings({**REQUIRED, "mode": "replay"}, {})
    assert "needs a recordings directory" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_settings({**REQUIRED, "sample": "2"}, {})
    assert (
        str(err.value)
        == "--sample has value '2'; expected a fraction between 0 and 1, such as 0.01"
    )
    assert load_settings(REQUIRED, {"CI": "true"}).ci is True
    assert load_settings(REQUIRED, {}).ci is False


def test_admin_port_needs_a_token_file() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings({**REQUIRED, "admin_port": "8788"}, {})
    assert "--operators" in str(err.value) and "--admin-token-file" in str(err.value)


def test_otel_variables_sit_between_the_file_and_capgate_variables(tmp_path: Path) -> None:
    config = write(tmp_path, "service_name: from-file\notlp_endpoint: http://file:4318\n")
    assert load_settings(REQUIRED, {}, config).service_name == "from-file"
    env = {"OTEL_SERVICE_NAME": "from-otel", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"}
    s = load_settings(REQUIRED, env, config)
    assert (s.service_name, s.otlp_endpoint) == ("from-otel", "http://otel:4318")
    env["CAPGATE_SERVICE_NAME"] = "from-capgate"
    assert load_settings(REQUIRED, env, config).service_name == "from-capgate"
    flags = {**REQUIRED, "service_name": "from-flag", "otlp_endpoint": "http://flag:4318"}
    s = load_settings(flags, env, config)
    assert (s.service_name, s.otlp_endpoint) == ("from-flag", "http://flag:4318")
    # An empty OTEL_* variable is unset (the SDK's reading too).
    assert load_settings(REQUIRED, {"OTEL_SERVICE_NAME": " "}).service_name == "capgate"
    # The interval is in milliseconds, as the specification says.
    assert load_settings(REQUIRED, {"OTEL_METRIC_EXPORT_INTERVAL": "5000"}).metrics_interval == 5


def test_otel_values_are_checked_with_their_names() -> None:
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER has value 'jaeger'"):
        load_settings(REQUIRED, {"OTEL_TRACES_EXPORTER": "jaeger"})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_ENDPOINT has value 'collector:4318'"):
        load_settings(REQUIRED, {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"})
    with pytest.raises(ConfigError, match="none' cannot be combined"):
        load_settings(REQUIRED, {"OTEL_METRICS_EXPORTER": "otlp,none"})
    with pytest.raises(ConfigError, match="needs admin_port"):
        load_settings(REQUIRED, {"OTEL_METRICS_EXPORTER": "prometheus"})


def test_otlp_headers_are_masked_and_never_a_flag() -> None:
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20s3cret,x-team=sre"}
    s = load_settings({**REQUIRED, "otlp_headers": "ignored=1"}, env)
    assert s.otlp_headers.pairs == (("Authorization", "Bearer s3cret"), ("x-team", "sre"))
    assert "s3cret" not in repr(s)
    with pytest.raises(ConfigError) as err:
        load_settings(REQUIRED, {"OTEL_EXPORTER_OTLP_HEADERS": "novalue-s3cret"})
    assert "s3cret" not in str(err.value) and "(masked)" in str(err.value)


def test_audit_settings_precedence_and_errors(tmp_path: Path) -> None:
    cfg = write(tmp_path, "audit_fsync: never\naudit_anchor: file:/from/file\n")
    s = load_settings(REQUIRED, {"CAPGATE_AUDIT_FSYNC": "250ms"}, cfg)
    assert str(s.audit_fsync) == "0.25s" and s.audit_anchor is not None
    assert s.audit_anchor.target == "/from/file"
    s = load_settings({**REQUIRED, "audit_fsync": "always"}, {"CAPGATE_AUDIT_FSYNC": "2s"}, cfg)
    assert str(s.audit_fsync) == "always"
    assert str(load_settings(REQUIRED, {}).audit_fsync) == "1s"
    with pytest.raises(ConfigError, match="--audit-fsync has value 'sometimes'"):
        load_settings({**REQUIRED, "audit_fsync": "sometimes"}, {})
    with pytest.raises(ConfigError, match="'redis' needs a redis:// state URL"):
        load_settings({**REQUIRED, "audit_anchor": "redis"}, {})
    s = load_settings({**REQUIRED, "audit_anchor": "redis", "state": "redis://h:6379/0"}, {})
    assert s.audit_anchor is not None and s.audit_anchor.target == "redis://h:6379/0"
    with pytest.raises(ConfigError, match="expected file:PATH, exec:COMMAND"):
        load_settings({**REQUIRED, "audit_anchor": "ftp://x"}, {})
