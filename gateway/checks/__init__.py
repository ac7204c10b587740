"""Pure payload checks; importing this package registers each with the policy loader."""

from gateway.checks import body, mcp, sql  # noqa: F401
