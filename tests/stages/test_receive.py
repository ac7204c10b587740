"""receive: refusals of framing and headers the upstream could read differently."""

from __future__ import annotations

import pytest

from gateway.errors import QueryInvalid, TargetAmbiguous, UnsupportedMediaType
from gateway.stages.receive import Receive
from gateway.testing import make_call


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "identity, gzip", "x-custom"])
def test_compressed_uploads_are_refused(coding: str) -> None:
    call = make_call("POST", "/svc/restart", headers={"Content-Encoding": coding})
    with pytest.raises(UnsupportedMediaType):
        Receive()(call)


def test_identity_coding_passes() -> None:
    call = make_call("POST", "/svc/restart", headers={"Content-Encoding": "identity"})
    Receive()(call)
    assert call.target is not None


@pytest.mark.parametrize(
    "named", ["X-Tenant", "Content-Type", "keep-alive, X-Env", "Authorization"]
)
def test_connection_naming_a_header_is_refused(named: str) -> None:
    call = make_call("GET", "/svc/status", headers={"Connection": named})
    with pytest.raises(QueryInvalid, match="Connection header names"):
        Receive()(call)


@pytest.mark.parametrize("value", ["keep-alive", "close", "Keep-Alive", "TE"])
def test_connection_options_pass(value: str) -> None:
    Receive()(make_call("GET", "/svc/status", headers={"Connection": value}))


def test_ambiguous_targets_are_refused() -> None:
    with pytest.raises(TargetAmbiguous):
        Receive()(make_call("GET", "/svc/%2e%2e/admin"))
