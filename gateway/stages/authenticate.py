"""authenticate: the Bearer capability token to verified ``Claims``, and revocation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.errors import StateUnavailable, TokenInvalid, TokenMissing, TokenRevoked

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.call import Call


async def authenticate(call: Call, gw: Gateway) -> None:
    values = call.headers.getall("Authorization", ())
    if not values:
        raise TokenMissing("the call carries no 'Authorization: Bearer <token>' header")
    if len(values) > 1:
        raise TokenInvalid("the call carries more than one Authorization header")
    scheme, _, token = values[0].partition(" ")
    if scheme.lower() != "bearer":
        raise TokenMissing("the Authorization header must use the Bearer scheme")
    token = token.strip(" ")
    if not token or " " in token:
        raise TokenInvalid("the Bearer token is empty or contains spaces")
    call.claims = gw.verifier.verify(token)
    check_revoked(call, gw)


def check_revoked(call: Call, gw: Gateway) -> None:
    """Revocation, on every call (cached verdicts too): a local mirror, no round trip.

    When the store cannot vouch for its mirror, the error is kept on the call, not raised:
    ``match_policy`` raises it unless the matched rule says ``on_state_error: allow``.
    """
    claims = call.claims
    assert claims is not None
    try:
        kind = gw.state.is_revoked(claims.jti, claims.agent, claims.run)
    except StateUnavailable as exc:
        call.state_error = exc
        return
    if kind is not None:
        raise TokenRevoked(f"this token's {kind} has been revoked")
