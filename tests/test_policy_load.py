"""Loading policy YAML: every error as FILE:LINE:COL, all of them in one pass.

Data-driven: each ``fixtures/policies/bad/NAME.yaml`` has ``NAME.expected`` listing, in
order, every error the loader must report, one per line: ``NAME.yaml:LINE:COL: text``, where
``text`` must occur in the message. ``#`` lines are comments. The count must match exactly:
no error missing, none extra (a spurious follow-on error is a bug too).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.policy.load import load_policy
from gateway.policy.model import Constraint, Policy
from gateway.policy_file import Issue, PolicyError, parse_duration, parse_size
from tests.helpers_core import FIXTURES, REPO

BAD = FIXTURES / "policies" / "bad"
GOOD = FIXTURES / "policies" / "good"
EXPECTED_LINE = re.compile(r"(?P<file>[^:\s]+\.yaml):(?P<line>\d+):(?P<col>\d+): (?P<text>.+)")

BAD_FILES = sorted(BAD.glob("*.yaml"))


def _expected(path: Path) -> list[tuple[str, int, int, str]]:
    out = []
    for raw in path.with_suffix(".expected").read_text("utf-8").splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        m = EXPECTED_LINE.fullmatch(raw)
        assert m, f"{path.with_suffix('.expected')}: malformed line {raw!r}"
        out.append((m["file"], int(m["line"]), int(m["col"]), m["text"]))
    return out


def test_every_bad_fixture_has_an_expected_file() -> None:
    assert len(BAD_FILES) >= 20
    for path in BAD_FILES:
        assert path.with_suffix(".expected").exists(), path
        assert _expected(path), f"{path}: no expected lines"
    for exp in BAD.glob("*.expected"):
        assert exp.with_suffix(".yaml").exists(), exp


@pytest.mark.parametrize("path", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_bad_policy_reports_exactly_the_expected_errors(path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    issues = info.value.issues
    expected = _expected(path)
    shown = "\n".join(str(i) for i in issues)
    assert len(issues) == len(expected), f"got:\n{shown}"
    for issue, (file, line, col, text) in zip(issues, expected, strict=True):
        assert issue.path == str(path)  # the path as given, so editors can jump to it
        assert Path(issue.path).name == file
        assert (issue.line, issue.col) == (line, col), f"{issue} vs {file}:{line}:{col}"
        assert text in issue.message, f"{text!r} not in {issue.message!r}"
        assert str(issue) == f"{path}:{line}:{col}: {issue.message}"
    # str(PolicyError) is the list, one FILE:LINE:COL line per issue, sorted by position.
    assert str(info.value) == shown
    assert [(i.line, i.col) for i in issues] == sorted((i.line, i.col) for i in issues)


@pytest.mark.parametrize("path", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_bad_policy_from_text_reports_the_same(path: Path) -> None:
    # load_policy(path, text) uses the text given, and names the path given.
    with pytest.raises(PolicyError) as from_disk:
        load_policy(path)
    with pytest.raises(PolicyError) as from_text:
        load_policy("elsewhere/x.yaml", path.read_text("utf-8"))
    assert [(i.line, i.col, i.message) for i in from_text.value.issues] == [
        (i.line, i.col, i.message) for i in from_disk.value.issues
    ]
    assert all(i.path == "elsewhere/x.yaml" for i in from_text.value.issues)


def test_issue_and_error_formatting() -> None:
    a = Issue("p.yaml", 3, 7, "second")
    b = Issue("p.yaml", 1, 2, "first")
    err = PolicyError([a, b])
    assert str(a) == "p.yaml:3:7: second"
    assert err.issues == [b, a]
    assert str(err) == "p.yaml:1:2: first\np.yaml:3:7: second"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    (issue,) = info.value.issues
    assert (issue.path, issue.line, issue.col) == (str(path), 1, 1)
    assert "cannot read file" in issue.message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read file"):
        load_policy(tmp_path)


def test_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("version: 1\ndescription: caf\xe9\n".encode("latin-1"))
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert [str(i) for i in info.value.issues] == [f"{path}:1:1: file is not valid UTF-8"]


def test_file_too_large(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (4 * 1024 * 1024 + 1))
    with pytest.raises(PolicyError, match="larger than 4 MiB"):
        load_policy(path)


# --- good policies ----------------------------------------------------------------------------


def test_example_policy_loads() -> None:
    policy = load_policy(REPO / "policies" / "example.yaml")
    assert isinstance(policy, Policy)
    assert set(policy.upstreams) == {"metrics", "logs", "services", "db", "tools"}
    assert set(policy.roles) == {"sre-diagnostics", "analyst", "order-support"}
    assert list(policy.rules_by_id) == [
        "read-cpu",
        "read-app-logs",
        "restart-service",
        "query-orders",
        "mcp-search-orders",
        "mcp-get-order",
        "mcp-run-sql",
    ]
    assert [c.kind for c in policy.rules_by_id["query-orders"].checks] == ["body", "sql"]
    cpu = policy.rules_by_id["read-cpu"]
    assert (cpu.method, cpu.upstream, cpu.path.text) == ("GET", "metrics", "/metrics/cpu")
    assert cpu.path.segments == ("metrics", "cpu")
    assert cpu.query["window"].enum == frozenset({"1m", "5m", "15m"})
    assert cpu.query["window"].required is True
    logs = policy.rules_by_id["read-app-logs"]
    assert logs.query["limit"].integer and logs.query["limit"].minimum == 1
    assert logs.query["limit"].maximum == 500
    restart = policy.rules_by_id["restart-service"]
    assert restart.method == "POST" and restart.rate is not None
    assert [c.kind for c in restart.checks] == ["body"]
    metrics = policy.upstreams["metrics"]
    assert metrics.connect_timeout == 2 and metrics.read_timeout == 10
    assert metrics.max_request_body == 64 * 1024 and metrics.max_response_body == 1024 * 1024
    assert metrics.credentials.type == "bearer"
    assert metrics.credentials.secret == "env:METRICS_TOKEN"
    assert metrics.credentials.prefix == "Bearer "
    services = policy.upstreams["services"].credentials
    assert (services.type, services.audience, services.ttl) == ("agent-jwt", "services", 300)
    assert policy.upstreams["logs"].credentials.type == "none"
    assert len(policy.digest) == 16


def test_policy_with_params_constraints_loads() -> None:
    policy = load_policy(GOOD / "params.yaml")
    rule = policy.rules_by_id["get-item"]
    assert rule.line == 17
    assert rule.path.text == "/items/{id}/{kind}"
    literal, id_param, kind_param = rule.path.segments
    assert literal == "items"
    assert isinstance(id_param, Constraint) and isinstance(kind_param, Constraint)
    assert (id_param.name, id_param.integer, id_param.minimum, id_param.maximum) == (
        "id",
        True,
        1,
        100,
    )
    assert kind_param.enum == frozenset({"summary", "full"})  # the list shorthand
    q = rule.query
    assert q["fields"].regex is not None and q["fields"].max_length == 64
    assert q["page"].integer and (q["page"].minimum, q["page"].maximum) == (1, 50)
    assert q["tag"].enum == frozenset({"a", "b", "3"}) and q["tag"].repeat
    assert q["trace"].required
    assert set(rule.headers) == {"x-env", "accept-language"}  # names lower-cased
    assert rule.headers["x-env"].required
    assert rule.allow_extra_query is False
    assert (
        rule.approval is False
        and rule.quota == 5
        and rule.volatile == ("query:date", "/request_id")
    )
    assert rule.on_state_error == "allow"
    assert policy.rules_by_id["list-items"].allow_extra_query is True
    assert policy.rules_by_id["list-items"].path.segments == ("items", "")
    role = policy.roles["reader"]
    assert role.run_quota == 1000 and role.rate is not None
    api = policy.upstreams["api"]
    assert api.base_path == "/base"
    assert (api.connect_timeout, api.read_timeout) == (0.25, 60)
    assert api.credentials.header == "X-Api-Key" and api.credentials.prefix == "Key "


def test_minimal_policy_loads_with_defaults() -> None:
    policy = load_policy(GOOD / "minimal.yaml")
    logs = policy.upstreams["logs"]
    assert (logs.connect_timeout, logs.read_timeout) == (5.0, 30.0)
    assert logs.max_request_body == 1024 * 1024
    assert logs.base_path == ""
    assert policy.roles["nobody"].rules == ()


def test_digest_follows_the_text() -> None:
    text = (GOOD / "minimal.yaml").read_text()
    a = load_policy("a.yaml", text)
    b = load_policy("b.yaml", text)
    c = load_policy("a.yaml", text + "# a comment changes the digest\n")
    assert a.digest == b.digest != c.digest


def test_text_argument_wins_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("this: is not a policy\n")
    policy = load_policy(path, (GOOD / "minimal.yaml").read_text())
    assert set(policy.upstreams) == {"logs"}
    assert policy.source == str(path)


def test_a_rule_naming_a_broken_upstream_is_not_reported_twice() -> None:
    text = """version: 1
upstreams:
  metrics: {url: "ftp://nope"}
roles:
  sre:
    rules:
      - id: read-cpu
        upstream: metrics
        allow: GET /metrics/cpu
agents: {"*": [sre]}
"""
    with pytest.raises(PolicyError) as info:
        load_policy("p.yaml", text)
    assert [str(i) for i in info.value.issues] == [
        "p.yaml:3:18: upstreams.metrics.url: expected an http(s) URL without query, "
        "fragment or credentials, got 'ftp://nope'"
    ]


def test_unknown_upstream_lists_the_defined_ones() -> None:
    text = (BAD / "unknown_upstream.yaml").read_text()
    with pytest.raises(PolicyError, match=r"defined upstreams: \['metrics'\]"):
        load_policy("p.yaml", text)


def test_enum_of_numbers_matches_their_text() -> None:
    text = """version: 1
upstreams: {m: {url: "http://x"}}
roles:
  r:
    rules:
      - {id: a, upstream: m, allow: GET /x, query: {n: {enum: [1, 2, "three"]}}}
agents: {"*": [r]}
"""
    rule = load_policy("p.yaml", text).rules_by_id["a"]
    assert rule.query["n"].enum == frozenset({"1", "2", "three"})


def test_enum_of_booleans_is_an_error() -> None:
    text = """version: 1
upstreams: {m: {url: "http://x"}}
roles:
  r:
    rules:
      - {id: a, upstream: m, allow: GET /x, query: {n: {enum: [true]}}}
agents: {"*": [r]}
"""
    with pytest.raises(PolicyError, match="expected a string, got true or false"):
        load_policy("p.yaml", text)


def test_tool_needs_an_mcp_upstream() -> None:
    text = """version: 1
upstreams: {m: {url: "http://x"}}
roles:
  r:
    rules:
      - {id: a, upstream: m, allow: POST /mcp, tool: search}
agents: {"*": [r]}
"""
    with pytest.raises(PolicyError) as info:
        load_policy("p.yaml", text)
    (issue,) = info.value.issues
    assert "needs an upstream of kind mcp" in issue.message and issue.line == 6


# --- durations and sizes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("30s", 30),
        ("5m", 300),
        ("1h", 3600),
        ("250ms", 0.25),
        ("2d", 172800),
        ("1.5s", 1.5),
        (10, 10),
        (0.5, 0.5),
        ("7", 7),
        ("0s", 0),
    ],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["soon", "-1s", "1 hour", "1y", "", "s", True, -3, "1e3s"])
def test_parse_duration_refuses(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text,size",
    [
        ("64KiB", 65536),
        ("1MiB", 1048576),
        ("1GiB", 1024**3),
        ("10KB", 10000),
        ("5MB", 5 * 10**6),
        ("12B", 12),
        ("100", 100),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["1TiB", "12 parsecs", "-1", "1.5MiB", "", True, -5, "1kib"])
def test_parse_size_refuses(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)  # type: ignore[arg-type]
