"""jsonschema's format libraries stand in for themselves until a policy uses their format
(``gateway/checks/format_libraries.py``): every format checks every value as jsonschema with the
real libraries does, whether the library was loaded by the policy, by the first check, or never
stood in for."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import Any

import pytest

from gateway.checks.format_libraries import FORMAT_LIBRARIES
from tests.checks.test_json_schema import HEAD
from tests.conftest import ROOT

EDGES = [
    "", " ", "P", "PT", "P1D", "PT1H", "P1Y2M3DT4H5M6S", "P1W", "PT0.5S", "P1DT", "-P1D", "P1M",
    "2024-01-01T00:00:00Z", "2024-02-30T00:00:00Z", "2024-01-01t00:00:00z", "23:59:60Z",
    "12:00:00+01:00", "12:00:00", "1990-12-31T23:59:60Z", "http://a/b?c#d", "a:b", "//x",
    "http://[::1]/", "http://a b/", "mailto:x@y", "../x", "#frag", "http://ex.com/%zz", "{var}",
    "{", "http://x/{a,b}", "{+path}/x", "example.com", "-a.com", "a..b", "xn--nxasmq6b",
    "é.com", "a" * 64 + ".com", "localhost", "red", "#fff", "#ffffff", "transparent",
    "http://例え.テスト/", "urn:isbn:0451450523", "x\ny", "\u0000", "P\u0661D",
]  # fmt: skip
ALPHABET = "PTDHMSYWZ0123456789:-.+/?#[]@!$&'()*,;=%{}ab xé例\n"


def corpus() -> list[Any]:
    """Edge cases, 600 seeded random strings, and values that are not strings."""
    rng = random.Random(20260601)
    texts = ["".join(rng.choices(ALPHABET, k=rng.randint(0, 14))) for _ in range(600)]
    return [*EDGES, *texts, 1, None, [], {"a": 1}]


# Prints, for every format and value, what jsonschema's Draft 2020-12 format checker says.
PROBE = """\
import json, sys
mode = sys.argv[1]
if mode != "real":
    import gateway.checks  # the stand-ins, before jsonschema
from jsonschema import Draft202012Validator
if mode == "loaded":
    from gateway.checks.format_libraries import load_format
    for fmt in Draft202012Validator.FORMAT_CHECKER.checkers:
        load_format(fmt)
checker = Draft202012Validator.FORMAT_CHECKER
values = json.loads(sys.stdin.read())
out = {}
for fmt in sorted(checker.checkers):
    row = []
    for value in values:
        try:
            row.append(checker.conforms(value, fmt))
        except Exception as exc:
            row.append("raised " + type(exc).__name__)
    out[fmt] = row
print(json.dumps(out))
"""


def verdicts(mode: str) -> dict[str, list[Any]]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        input=json.dumps(corpus()),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, list[Any]] = json.loads(done.stdout)
    return result


def test_every_format_checks_as_with_the_real_libraries() -> None:
    real = verdicts("real")
    assert set(FORMAT_LIBRARIES) - {"color"} <= set(real)  # the libraries are installed
    assert verdicts("lazy") == real  # loaded by the first check
    assert verdicts("loaded") == real  # loaded as a policy that names the format loads


PROBE_POLICY = """\
import sys
import gateway.app
from gateway.testing import policy_from_text
libraries = sys.argv[1:]
stand_in = lambda: [getattr(sys.modules[m], "__capgate_stand_in__", 0) for m in libraries]
print(stand_in())
policy_from_text(sys.stdin.read())
print(stand_in())
"""


@pytest.mark.parametrize("fmt", ["duration", "uri", "date-time", "hostname", "uri-template"])
def test_a_format_library_is_loaded_by_the_policy_that_uses_it(fmt: str) -> None:
    library = FORMAT_LIBRARIES[fmt]
    text = HEAD + f"            properties: {{a: {{type: string, format: {fmt}}}}}\n"
    done = subprocess.run(
        [sys.executable, "-c", PROBE_POLICY, library, "isoduration"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.splitlines()
    assert before == "[True, True]"
    # Its own library is loaded while the policy loads; another format's is not.
    assert after == ("[0, 0]" if library == "isoduration" else "[0, True]")
