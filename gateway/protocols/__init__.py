"""How capgate reads the calls of each kind of upstream: one module per protocol.

``PROTOCOLS`` maps an upstream's ``kind`` (policy file) to its protocol; ``match_policy``
picks one per call. Stages call the protocol's hooks (``CallProtocol``, in ``call.py``
beside the ``Call`` it shapes) and import nothing protocol-specific. To add a protocol,
write a module with a class meeting ``CallProtocol`` and add it here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from gateway.call import CallProtocol, Refusal
from gateway.protocols.http import PlainHttp
from gateway.protocols.mcp import Mcp

PROTOCOLS: Mapping[str, CallProtocol] = MappingProxyType({"http": PlainHttp(), "mcp": Mcp()})

__all__ = ["PROTOCOLS", "CallProtocol", "Refusal"]
