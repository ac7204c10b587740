"""authenticate: the Bearer capability token to verified ``Claims``, and revocation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.errors import TokenInvalid, TokenMissing, TokenRevoked

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
    claims = gw.verifier.verify(token)
    # Checked on every call, also for cached verdicts: a local mirror, no round trip.
    kind = gw.state.is_revoked(claims.jti, claims.agent, claims.run)
    if kind is not None:
        raise TokenRevoked(f"this token's {kind} has been revoked")
    call.claims = claims
