"""authenticate: the Bearer capability token to verified ``Claims``, revocation, and the
policy's word on the agent (declared, holding only roles it may hold)."""

from __future__ import annotations

from gateway.call import Call
from gateway.errors import InternalError, StateUnavailable, TokenInvalid, TokenMissing, TokenRevoked
from gateway.state.base import StateStore
from gateway.tokens import TokenVerifier


class RevocationCheck:
    """Revocation, on every call (cached verdicts too): a local mirror, no round trip.

    When the store cannot vouch for its mirror, the error is kept on the call, not raised:
    ``match_policy`` raises it unless the matched rule says ``on_state_error: allow``.
    """

    def __init__(self, state: StateStore) -> None:
        self.state = state

    def __call__(self, call: Call) -> None:
        claims = call.claims
        assert claims is not None
        try:
            kind = self.state.is_revoked(claims.jti, claims.agent, claims.run)
        except StateUnavailable as exc:
            call.state_error = exc
            return
        if kind is not None:
            raise TokenRevoked(f"this token's {kind} has been revoked")


class Authenticate:
    def __init__(self, verifier: TokenVerifier, revocation: RevocationCheck) -> None:
        self.verifier = verifier
        self.revocation = revocation

    def __call__(self, call: Call) -> None:
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
        call.claims = self.verifier.verify(token)
        self.revocation(call)
        admit_agent(call)


def admit_agent(call: Call) -> None:
    """A valid signature is not enough: the policy in force must declare the agent and let it
    hold the token's roles (``route`` set the policy; without one, deny)."""
    assert call.claims is not None
    if call.policy is None:
        raise InternalError("no policy in force for this call")
    call.policy.agents.admit(call.claims.agent, call.claims.roles)
