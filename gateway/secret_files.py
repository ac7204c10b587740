"""Secret files (credentials, the admin token, the audit key): only capgate may read them.

A secret file is accepted when it is a regular file (a symbolic link is followed: Kubernetes
mounts each key of a secret volume as a link into a timestamped directory) and either

- only its owner may read or write it (``chmod 600``, ``400``), or
- **group-readable, as Kubernetes mounts a secret volume** (``defaultMode: 0440`` with the
  pod's ``fsGroup``): the mode is exactly ``440`` or ``640``-like with no write bit for the
  group and no bit at all for others, the file's group is the process's effective group or
  one of its supplementary groups, and the file's owner is root or the process's own user
  (so nobody else can change its mode later).

The second rule trusts the group: every member of it can read the secret. In a pod, the
``fsGroup`` is given to every container, which is safe only because the secret volume is
mounted in capgate's container alone (the agent container cannot see the file). On a host,
use a group that only capgate's user is in, or ``chmod 600``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gateway.errors import ConfigError

GROUP_READ_ONLY = 0o040
"""The only group bit the group rule allows."""


def _process_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def check_secret_file(path: Path) -> None:
    """Refuse a secret that is not a regular file, that others may touch, or that its group
    may write; a group-readable one only passes the group rule in the module's docstring."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"secret {str(path)!r} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o077:
        return
    if mode & 0o077 != GROUP_READ_ONLY:
        raise ConfigError(
            f"secret file {str(path)!r} is readable or writable by group or others "
            f"(mode {mode:o}); chmod 600 it (or 440 with a group only capgate is in)"
        )
    if st.st_gid not in _process_groups():
        raise ConfigError(
            f"secret file {str(path)!r} is readable by group {st.st_gid} (mode {mode:o}), "
            "which is not one of capgate's groups; chmod 600 it, or give it capgate's group "
            "(in Kubernetes: the pod's fsGroup)"
        )
    if st.st_uid not in (0, os.geteuid()):
        raise ConfigError(
            f"secret file {str(path)!r} is group-readable (mode {mode:o}) and owned by user "
            f"{st.st_uid}, neither root nor capgate's user; chmod 600 it"
        )
