"""receive: give the call its request id and its canonical target (or refuse it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.target import parse_target

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.call import Call


async def receive(call: Call, gw: Gateway) -> None:
    call.target = parse_target(call.raw_target)
