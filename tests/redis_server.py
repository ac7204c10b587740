"""A throwaway ``redis-server`` for tests: own port, own directory, no persistence.

    server = RedisServer(tmp_path)
    server.start()          # waits until it answers PING
    server.url              # redis://127.0.0.1:<port>/0 (with the password, if any)
    server.pause(500)       # CLIENT PAUSE 500 ALL: commands hang for 500 ms
    server.kill()           # SIGKILL: connections drop, nothing is saved
    server.restart()        # a fresh, empty server on the same port
    server.close()

    cluster = RedisCluster(tmp_path, nodes=3)   # a Redis Cluster of three masters
    cluster.start()         # waits until every node says cluster_state:ok
    cluster.url             # redis+cluster://127.0.0.1:<port of the first node>
    cluster.flush()         # FLUSHALL on every node
    cluster.close()

It never touches the shared server on 6379, and talks to the server over a raw socket so
the client under test is not used to test itself.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def redis_server_available() -> bool:
    return Path(REDIS_SERVER).is_file()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _encode(*args: str | int) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class RedisServer:
    """One ``redis-server`` process on a free port of 127.0.0.1, in ``workdir``."""

    def __init__(self, workdir: Path, *, password: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 5.0) -> None:
        """Start the server (on ``self.port``) and wait until it answers PING."""
        if self.running:
            raise RuntimeError("redis-server is already running")
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "redis.log"),
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(  # noqa: S603 (fixed binary, our arguments)
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode} on port {self.port}; "
                    f"see {self.workdir / 'redis.log'}"
                )
            with contextlib.suppress(OSError):
                if self.command("PING", timeout=0.5) == b"+PONG":
                    return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL the server and wait for it to be gone (its port is then closed)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=5)
        self.process = None

    stop = kill

    def restart(self, timeout: float = 5.0) -> None:
        """Kill (if running) and start an empty server on the same port."""
        self.kill()
        self.start(timeout=timeout)

    def pause(self, ms: int) -> None:
        """``CLIENT PAUSE ms ALL``: every client's commands wait ``ms`` milliseconds."""
        reply = self.command("CLIENT", "PAUSE", ms, "ALL")
        if reply != b"+OK":
            raise RuntimeError(f"CLIENT PAUSE failed: {reply!r}")

    def command(self, *args: str | int, timeout: float = 2.0) -> bytes:
        """Send one command on a fresh connection; returns the first line of the reply."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            payload = _encode(*args)
            if self.password:
                payload = _encode("AUTH", self.password) + payload
            sock.sendall(payload)
            reader = sock.makefile("rb")
            line = reader.readline()
            if self.password:
                if line.rstrip(b"\r\n") != b"+OK":
                    return line.rstrip(b"\r\n")
                line = reader.readline()
            reader.close()
            return line.rstrip(b"\r\n")

    def close(self) -> None:
        self.kill()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _cluster_ports(count: int) -> list[int]:
    """Free ports whose cluster bus port (+10000) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


class RedisCluster:
    """A Redis Cluster of ``nodes`` masters (no replicas) on free ports of 127.0.0.1."""

    def __init__(self, workdir: Path, *, nodes: int = 3) -> None:
        self.workdir = Path(workdir)
        self.ports = _cluster_ports(nodes)
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self, timeout: float = 20.0) -> None:
        for port in self.ports:
            node = self.workdir / str(port)
            node.mkdir(parents=True, exist_ok=True)
            args = [
                REDIS_SERVER,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node / "nodes.conf"),
                "--save", "",
                "--appendonly", "no",
                "--dir", str(node),
                "--logfile", str(node / "redis.log"),
            ]  # fmt: skip
            self.processes.append(
                subprocess.Popen(  # noqa: S603 (fixed binary, our arguments)
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + timeout
        for port in self.ports:
            while self.command(port, "PING") != b"+PONG":
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"cluster node {port} did not answer PING")
                time.sleep(0.02)
        created = subprocess.run(  # noqa: S603 (fixed binary, our arguments)
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if created.returncode != 0:
            self.close()
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-500:]!r}")
        for port in self.ports:
            while b"cluster_state:ok" not in self.info(port):
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"cluster node {port} never reached cluster_state:ok")
                time.sleep(0.05)

    def info(self, port: int) -> bytes:
        with contextlib.suppress(OSError):
            with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
                sock.sendall(_encode("CLUSTER", "INFO"))
                sock.settimeout(2.0)
                data = b""
                while b"cluster_state" not in data or not data.endswith(b"\r\n\r\n"):
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                return data
        return b""

    def command(self, port: int, *args: str | int) -> bytes:
        with contextlib.suppress(OSError):
            with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
                sock.sendall(_encode(*args))
                reader = sock.makefile("rb")
                line = reader.readline().rstrip(b"\r\n")
                reader.close()
                return line
        return b""

    def flush(self) -> None:
        for port in self.ports:
            self.command(port, "FLUSHALL")

    def keys_by_node(self) -> dict[int, int]:
        """How many keys each node holds (DBSIZE)."""
        return {p: int(self.command(p, "DBSIZE").lstrip(b":") or 0) for p in self.ports}

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=5)
        self.processes = []
