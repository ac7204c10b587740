"""``capgate sandbox run``: a command that can reach nothing but the gateway.

The command runs in new network, mount, PID, IPC and UTS namespaces built by ``bwrap``
(bubblewrap), as an unprivileged user with no capabilities. The gateway runs *outside*, in
this process, with the host's network, so it reaches the upstreams; only its listening socket
is inside. That socket is made in the sandbox's network namespace before the command starts:

1. a short-lived thread unshares a new network namespace (``unshare(CLONE_NEWNET)`` affects
   only the calling thread), brings its loopback up, binds ``127.0.0.1:8787`` there, listens,
   and opens a handle to the namespace (``/proc/thread-self/ns/net``). A socket stays in the
   namespace it was created in: the gateway accepts on it from outside, and nothing else
   listens inside. The namespace has no other interface, no route and no resolver: no other
   local port, no outside address, no DNS.
2. the command is started as ``nsenter --net=<handle> -- bwrap ... -- setpriv --reuid=U
   --regid=G --clear-groups --no-new-privs --inh-caps=-all --bounding-set=-all -- COMMAND``:
   in that network namespace; bwrap (as root) builds the view, then the command runs as an
   unprivileged user (so a root-owned file that is visible stays unreadable: a user
   namespace mapped to root would own them), in a file system view built from read-only
   system directories, the working directory and what ``--expose``/``--writable`` name,
   with a fresh ``/tmp``,
   ``/run``, ``/proc`` and ``/dev``. Every file the gateway reads (keys, policy, credentials,
   audit, configuration) is masked where it would be visible; the environment is cleared
   (the gateway's credentials live in its own environment) and holds only what is listed in
   ``sandbox_environ``.
3. when the command ends, the gateway drains and stops, and the namespaces go with their
   last process and handle; ``bwrap --die-with-parent`` ends the command if capgate dies.

The command's exit status is capgate's (128 + N for a signal N), so CI reads it as it would
the command's own.

Needs Linux, root (to create the network namespace), and ``bwrap``, ``nsenter`` and
``setpriv`` (Debian: bubblewrap, util-linux); without them the command is refused with one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import signal
import socket
import struct
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.errors import ConfigError

log = logging.getLogger("capgate.sandbox")

SANDBOX_HOST = "127.0.0.1"
SANDBOX_PORT = 8787
NOBODY = 65534  # the user and group the command runs as, by default
TOOLS = ("bwrap", "nsenter", "setpriv")
# Read-only in every sandbox: what programs need to run. /etc is included (resolver files,
# users, certificates); what the gateway reads under it is masked like anywhere else.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
# The sandbox's own temporary directories: new, empty tmpfs mounts, never the host's.
SANDBOX_TMP = ("/tmp", "/var/tmp")  # noqa: S108
TERM_GRACE = 5.0  # seconds the command has to exit after SIGTERM before it is killed

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sh22x"  # struct ifreq: the name, then the flags in the 24-byte union


@dataclass
class Namespace:
    """A network namespace with the gateway's listening socket in it, and a handle to it."""

    sock: socket.socket
    fd: int

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def preflight() -> None:
    """Refuse, in one line, where a sandbox cannot be built."""
    if not sys.platform.startswith("linux"):
        raise ConfigError("capgate sandbox needs Linux (network, mount and PID namespaces)")
    if os.geteuid() != 0:
        raise ConfigError(
            "capgate sandbox needs root to create the sandbox's network namespace "
            "(run it as root, e.g. in the CI container)"
        )
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise ConfigError(
            f"capgate sandbox needs {', '.join(missing)} on PATH "
            "(Debian: apt-get install bubblewrap util-linux)"
        )


def open_namespace(host: str = SANDBOX_HOST, port: int = SANDBOX_PORT) -> Namespace:
    """A new network namespace holding only a loopback and a socket listening on it."""
    out: dict[str, object] = {}

    def work() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            if libc.unshare(_CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            _loopback_up()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                sock.listen(1024)
                sock.setblocking(False)
                fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            except BaseException:
                sock.close()
                raise
            out["namespace"] = Namespace(sock, fd)
        except OSError as exc:
            out["error"] = exc

    # The thread ends in the new namespace; the process's other threads never leave theirs.
    thread = threading.Thread(target=work, name="capgate-sandbox-netns")
    thread.start()
    thread.join()
    if "error" in out:
        exc = out["error"]
        assert isinstance(exc, OSError)
        raise ConfigError(
            f"cannot create the sandbox's network namespace: {exc.strerror or exc}"
        ) from exc
    namespace = out["namespace"]
    assert isinstance(namespace, Namespace)
    return namespace


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        raw = fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0))
        flags = struct.unpack(_IFREQ, raw)[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


@dataclass
class SandboxSpec:
    """What the command sees: its file system view, its user and its environment."""

    command: Sequence[str]
    cwd: Path
    expose: Sequence[Path] = ()  # visible read-only
    writable: Sequence[Path] = ()  # visible read-write
    hidden: Sequence[Path] = ()  # masked wherever they would be visible
    environ: Mapping[str, str] = field(default_factory=dict)
    uid: int = NOBODY
    gid: int = NOBODY


def _under(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _system_binds() -> Iterator[str]:
    for name in SYSTEM_DIRS:
        p = Path(name)
        if p.is_symlink():  # /bin -> usr/bin on merged-/usr systems
            yield from ("--symlink", os.readlink(p), name)
        elif p.is_dir():
            yield from ("--ro-bind", name, name)


def _parents(paths: Iterable[Path], system: Sequence[Path]) -> list[Path]:
    """The ancestors of ``paths`` that the sandbox's own root must provide, outermost first."""
    out: list[Path] = []
    for path in paths:
        for parent in reversed(path.parents):
            if parent == Path("/") or _under(parent, system) or parent in out:
                continue
            out.append(parent)
    return out


def bwrap_argv(spec: SandboxSpec, netns_fd: int) -> list[str]:
    """The command line that starts ``spec.command`` in the sandbox (see the module doc)."""
    visible = [Path(d).resolve() for d in SYSTEM_DIRS if Path(d).is_dir()]
    argv = [
        "nsenter",
        # The handle as this process holds it: the command inherits no descriptor of it.
        f"--net=/proc/{os.getpid()}/fd/{netns_fd}",
        "--",
        "bwrap",
        "--die-with-parent",
        "--new-session",  # no TIOCSTI into the caller's terminal
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "capgate-sandbox",
        *_system_binds(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        # Fresh, empty and private to the sandbox (the host's /tmp and /run hold sockets).
        *("--perms", "01777", "--tmpfs", SANDBOX_TMP[0], "--perms", "01777", "--tmpfs"),
        *(SANDBOX_TMP[1], "--tmpfs", "/run"),
    ]
    # The directories leading to what is bound are made open to walk (bwrap would copy the
    # real ones' modes, e.g. a 0700 /tmp/pytest-of-root, and the user could not reach them).
    for parent in _parents((*spec.expose, *spec.writable, spec.cwd), visible):
        argv += ["--perms", "0755", "--dir", str(parent)]
    for path in spec.expose:
        argv += ["--ro-bind", str(path), str(path)]
        visible.append(path)
    for path in (*spec.writable, spec.cwd):
        argv += ["--bind", str(path), str(path)]
        visible.append(path)
    for path in spec.hidden:
        if not _under(path, visible) or not path.exists():
            continue
        if path.is_dir():
            argv += ["--tmpfs", str(path)]
        else:
            argv += ["--ro-bind", "/dev/null", str(path)]
    argv += ["--chdir", str(spec.cwd), "--clearenv"]
    for name, value in spec.environ.items():
        argv += ["--setenv", name, value]
    # Root builds the view (it may expose what the user could not walk to, e.g. a Python
    # under /root); the command itself runs as the unprivileged user, with no capabilities
    # and no way to gain any (no setuid), so a visible root-owned file stays unreadable.
    drop = [
        "setpriv",
        f"--reuid={spec.uid}",
        f"--regid={spec.gid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ]
    return [*argv, "--", *drop, "--", *spec.command]


def sandbox_environ(
    environ: Mapping[str, str],
    token: str | None,
    extra: Mapping[str, str],
    *,
    token_env: str = "CAPGATE_TOKEN",  # noqa: S107 (a variable name, not a secret)
) -> dict[str, str]:
    """The command's whole environment: where the gateway is, its token, and ``extra``;
    never the gateway's own environment, which holds upstream credentials."""
    out = {
        "PATH": DEFAULT_PATH,
        "HOME": SANDBOX_TMP[0],
        "LANG": environ.get("LANG", "C.UTF-8"),
        "CAPGATE_URL": f"http://{SANDBOX_HOST}:{SANDBOX_PORT}",
    }
    if "TERM" in environ:
        out["TERM"] = environ["TERM"]
    if token is not None:
        out[token_env] = token
    out.update(extra)
    return out


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N for a signal N."""
    return 128 - returncode if returncode < 0 else returncode


async def run_command(spec: SandboxSpec, namespace: Namespace, stop: asyncio.Event) -> int:
    """Start the sandboxed command and wait for it; ``stop`` (SIGTERM/SIGINT to capgate)
    ends it with SIGTERM, then SIGKILL after ``TERM_GRACE``."""
    argv = bwrap_argv(spec, namespace.fd)
    try:
        proc = await asyncio.create_subprocess_exec(*argv)
    except OSError as exc:
        raise ConfigError(f"cannot start the sandbox: {exc.strerror or exc}") from exc
    waiting = asyncio.ensure_future(proc.wait())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            log.info("stopping the sandboxed command (SIGTERM)")
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(waiting), TERM_GRACE)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        return exit_status(await waiting)
    finally:
        stopping.cancel()
        if proc.returncode is None:  # capgate itself is being cancelled
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(OSError):
                await proc.wait()
