"""Run inside ``capgate sandbox run``: tries every way out and prints what happened, as JSON.

    python sandbox_probe.py '{"direct": [["127.0.0.1", 9105]], "read": ["/path/key.pem"], ...}'

Standard library only (it runs on the sandbox's read-only view of the interpreter).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request
from typing import Any


def call(path: str, method: str = "GET") -> dict[str, Any]:
    url = os.environ["CAPGATE_URL"] + path
    req = urllib.request.Request(  # noqa: S310 (the gateway, on the sandbox's loopback)
        url, method=method, headers={"Authorization": "Bearer " + os.environ["CAPGATE_TOKEN"]}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
            return {"status": resp.status, "body": resp.read().decode("utf-8", "replace")}
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace")
        return {"status": exc.code, "reason": json.loads(body).get("reason")}
    except OSError as exc:
        return {"error": str(exc)}


def connect(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=3):
            return "connected"
    except OSError as exc:
        return type(exc).__name__ + ": " + (exc.strerror or str(exc))


def connect_abstract(name: str) -> str:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(3)
            s.connect("\0" + name)
            return "connected"
    except OSError as exc:
        return type(exc).__name__ + ": " + (exc.strerror or str(exc))


def resolve(name: str) -> str:
    try:
        return "resolved " + socket.getaddrinfo(name, 80)[0][4][0]
    except OSError as exc:
        return type(exc).__name__ + ": " + str(exc)


def read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        return type(exc).__name__ + ": " + (exc.strerror or str(exc))
    return "empty" if not data else f"read {len(data)} bytes"


def processes() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    out.append(fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip())
            except OSError:
                continue
    return out


def status() -> dict[str, str]:
    """Capabilities and no_new_privs, as the kernel reports them for this process."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs"):
                out[key] = value.strip()
    return out


def main() -> int:
    plan = json.loads(sys.argv[1])
    report: dict[str, Any] = {
        "uid": os.getuid(),
        "env": sorted(os.environ),
        "calls": {path: call(path, method) for method, path in plan.get("calls", [])},
        "direct": {f"{h}:{p}": connect(h, p) for h, p in plan.get("direct", [])},
        "abstract": {name: connect_abstract(name) for name in plan.get("abstract", [])},
        "dns": {name: resolve(name) for name in plan.get("dns", [])},
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "read": {path: read(path) for path in plan.get("read", [])},
        "processes": processes(),
        "tmp_writable": os.access("/tmp", os.W_OK),
        "status": status(),
    }
    print(json.dumps(report))
    return int(plan.get("exit", 0))


if __name__ == "__main__":
    sys.exit(main())
