"""receive: the call's canonical target (or a refusal of an ambiguous one)."""

from __future__ import annotations

from gateway.call import Call
from gateway.target import parse_target


class Receive:
    def __call__(self, call: Call) -> None:
        call.target = parse_target(call.raw_target)
