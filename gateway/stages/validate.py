"""validate: run each operation's rule checks on its payload (JSON Schema, SQL, arguments).

A plain request's payload is its body, read whole (up to the upstream's limit) only when its
rule has checks. A body the rule does not take (no ``body:``, ``sql:`` or ``arguments:``) is
refused, so nothing unchecked rides along. Checks may rewrite a payload; the body that will
be forwarded is made from the checked payloads, so what was checked is what is sent.

A check that says its payload is ``costly`` (a long SQL text never seen before) runs in a
worker thread (``CheckWorkers``, a share per agent) so that it never holds up other agents'
calls; the call waits for it as for any other check.
"""

from __future__ import annotations

from collections.abc import Awaitable
from functools import partial

from gateway.call import Call
from gateway.check_workers import CheckWorkers
from gateway.errors import BodyInvalid
from gateway.payload import BodyPayload


class Validate:
    def __init__(self, workers: CheckWorkers | None = None) -> None:
        self.workers = workers

    def __call__(self, call: Call) -> Awaitable[None] | None:
        for op in call.operations:
            if op.governed and op.match is not None and op.match.rule.checks:
                return self._check(call)
        if call.body is None and call.request is not None and call.request.body_exists:
            # SECURITY: a body no check reads (a GET with a chunked body, a POST to a rule
            # without body:) would be forwarded unchecked.
            raise BodyInvalid(
                "this call carries a body that its rule does not take (a rule says 'body:' "
                "to take one)",
                rule=call.rule_id,
            )
        return None  # nothing to check: the body is neither read nor changed

    async def _check(self, call: Call) -> None:
        assert call.upstream is not None and call.protocol is not None
        for op in call.operations:
            assert op.match is not None
            checks = op.match.rule.checks
            if not checks or not op.governed:
                continue
            payload = op.payload
            if payload is None:
                body = await call.read_body(call.upstream.max_request_body)
                payload = op.payload = BodyPayload(
                    body, call.headers.get("Content-Type", ""), call.findings
                )
            for check in checks:
                costly = getattr(check, "costly", None)
                if self.workers is not None and costly is not None and costly(payload):
                    assert call.claims is not None
                    await self.workers.run(call.claims.agent, partial(check.check, payload))
                else:
                    check.check(payload)
            if isinstance(payload, BodyPayload):
                call.content_type = payload.forwarded_content_type
                if payload.rewritten:
                    call.body = payload.raw
        call.protocol.finish(call)
