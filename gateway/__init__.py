"""capgate: a capability-gated tool proxy gateway for sandboxed AI agents."""

__version__ = "0.1.0"
__all__ = ["__version__"]
