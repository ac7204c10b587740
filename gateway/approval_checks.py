"""Checking a masked value of a held call without showing it (``POST /approvals/{id}/check``).

Approvers see a held call's body with secret-looking values masked (a password reads
``[redacted:key]``): they cannot tell the user's new password from an attacker's. The person
knows what the user asked for, so capgate lets them ask "is the value at this path X?" and
answers yes or no, never the value:

* When a call is held, the strings the approvers' view masks (JSON bodies, up to
  ``MAX_CHECKABLE``) are noted by path (``masked_values``); the approvers' listing names the
  paths (``checkable``), never the values. The gateway holding the call compares an offered
  value with the held one in constant time.
* With a shared approval board (Redis), the holding gateway also attaches, once the call is
  published, a random salt and an scrypt digest of each masked value (``digests``, off the
  event loop), so a console attached to any gateway of the fleet can check (``matches``).
  scrypt (2^14, 8, 1) makes each guess cost ~50 ms and 16 MiB: the board is no cheap oracle
  for weak passwords. The values themselves never leave the holding gateway.
* The admin API allows ``CHECKS_PER_APPROVAL`` checks per approval, counted in the state
  store (the fleet shares the count), and publishes each as an operator event with the
  operator's name, the path and the answer (never the value offered).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Sequence
from typing import Any

CHECKS_PER_APPROVAL = 5
MAX_CHECKABLE = 16
MAX_VALUE = 4096  # characters of a value offered to a check
_SCRYPT: dict[str, int] = {"n": 2**14, "r": 8, "p": 1, "dklen": 32, "maxmem": 64 * 1024 * 1024}


def masked_values(body: bytes, shown: bytes) -> dict[str, str]:
    """``path -> value`` of the strings of a JSON ``body`` that its approvers' view
    (``shown``) masks; empty when either is not JSON."""
    try:
        original, masked = json.loads(body), json.loads(shown)
    except (ValueError, UnicodeDecodeError):
        return {}
    out: dict[str, str] = {}
    # SECURITY: a key may hold '.' or '[': {"a.b": x} and {"a": {"b": y}} both read "a.b".
    # A path that names more than one value is never checkable, or a sender could have the
    # person confirm one value while the call carries another under the same name.
    seen: set[str] = set()
    ambiguous: set[str] = set()
    stack: list[tuple[str, Any, Any]] = [("", original, masked)]
    while stack:
        path, value, view = stack.pop()
        if path in seen:
            ambiguous.add(path)
        seen.add(path)
        if isinstance(value, dict) and isinstance(view, dict):
            stack.extend(
                (f"{path}.{k}" if path else str(k), v, view.get(k)) for k, v in value.items()
            )
        elif isinstance(value, list) and isinstance(view, list) and len(value) == len(view):
            stack.extend(
                (f"{path}[{i}]", v, w) for i, (v, w) in enumerate(zip(value, view, strict=True))
            )
        elif isinstance(value, str) and value != view:
            out[path] = value
    checkable = [p for p in out if p not in ambiguous]
    return {p: out[p] for p in checkable[:MAX_CHECKABLE]}


def _digest(value: str, salt: bytes) -> bytes:
    return hashlib.scrypt(value.encode("utf-8", "surrogatepass"), salt=salt, **_SCRYPT)


def digests(values: dict[str, str]) -> dict[str, list[str]]:
    """``path -> [salt, digest]`` (hex) of each masked value: CPU-bound, run off the loop."""
    out: dict[str, list[str]] = {}
    for path, value in values.items():
        salt = os.urandom(16)
        out[path] = [salt.hex(), _digest(value, salt).hex()]
    return out


def matches(value: str, entry: Sequence[str]) -> bool:
    """Whether ``value`` is the masked value ``entry`` digests (constant-time compare)."""
    salt, digest = entry
    return hmac.compare_digest(_digest(value, bytes.fromhex(salt)), bytes.fromhex(digest))
