"""Pure payload checks; importing this package registers each with the policy loader."""

from gateway.checks import (
    body,  # noqa: F401
    mcp,  # noqa: F401
)
