"""Secret files (credentials, the admin token, the audit key): only their owner may read them."""

from __future__ import annotations

import stat
from pathlib import Path

from gateway.errors import ConfigError


def check_secret_file(path: Path) -> None:
    """Refuse a secret that is not a regular file, or that group or others may read or write."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"secret {str(path)!r} is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(
            f"secret file {str(path)!r} is readable or writable by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it"
        )
