"""Run inside a new network namespace (``unshare --net``), as root: lay out a pod's network
(loopback, a pod IP on a veth interface), listen where capgate's listeners and a neighbour
would, run capgate-netinit.sh with the given environment, then try every connection as the
agent's uid and as capgate's, and print what happened as JSON.

    unshare --net -- python deploy_netns_probe.py SCRIPT ENV_JSON AGENT_UID GATEWAY_UID
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys

POD_IP = "10.89.0.2"
ELSEWHERE = "10.89.0.77"  # another pod, an upstream: routed out of eth0

# name -> (family, address, port, owner): where something listens in the pod, and as whom
# ("gateway": capgate's uid; "root": a neighbour such as Redis beside capgate)
LISTENERS = {
    "agents_port": (socket.AF_INET, "127.0.0.1", 8787, "gateway"),
    "admin_on_pod_ip": (socket.AF_INET, POD_IP, 8788, "gateway"),
    "health_on_pod_ip": (socket.AF_INET, POD_IP, 8789, "gateway"),
    "other_loopback_port": (socket.AF_INET, "127.0.0.1", 6379, "root"),
    "other_port_on_pod_ip": (socket.AF_INET, POD_IP, 9090, "root"),
    "ipv6_loopback": (socket.AF_INET6, "::1", 8787, "gateway"),
}
# Where the agent squats (binds and listens itself): one of capgate's ports on an address capgate
# does not use (as if capgate were restarting), and a port of no concern.
SQUATS = {
    "squat_admin_port_on_loopback": ("127.0.0.1", 8788),
    "squat_other_port": ("127.0.0.1", 9999),
}


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def try_tcp(family: int, host: str, port: int) -> str:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(1.5)
    try:
        s.connect((host, port))
        return "connected"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error:{exc.errno}"
    finally:
        s.close()


def attempts(uid: int, udp_port: int) -> dict[str, str]:
    """Every attempt, in a child running as ``uid`` (no capabilities, like the container)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        out: dict[str, str] = {}
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for name, (family, host, port, _) in LISTENERS.items():
                out[name] = try_tcp(family, host, port)
            for name, (host, port) in SQUATS.items():
                out[name] = try_tcp(socket.AF_INET, host, port)
            out["elsewhere_443"] = try_tcp(socket.AF_INET, ELSEWHERE, 443)
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                u.sendto(b"dns?", ("127.0.0.1", udp_port))
                out["udp_sent"] = "sent"
            except OSError as exc:
                out["udp_sent"] = f"error:{exc.errno}"
            finally:
                u.close()
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            out["crash"] = repr(exc)
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.waitpid(pid, 0)
    return dict(json.loads(b"".join(chunks)))


def main() -> int:
    script, env_json, agent_uid, gateway_uid = sys.argv[1:5]
    sh("ip", "link", "set", "lo", "up")
    # A veth pair stands for the pod's interface (dummy interfaces may not be built in).
    sh("ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth0-peer")
    sh("ip", "addr", "add", f"{POD_IP}/24", "dev", "eth0")
    sh("ip", "link", "set", "eth0", "up")
    sh("ip", "link", "set", "eth0-peer", "up")
    listeners = []
    owners = {"gateway": int(gateway_uid), "root": 0}

    def listen(family: int, host: str, port: int, uid: int) -> None:
        # a socket belongs to the (effective) user that made it: as capgate's listeners do
        os.seteuid(uid)
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind((host, port))
            s.listen(16)
            listeners.append(s)
        finally:
            os.seteuid(0)

    for family, host, port, owner in LISTENERS.values():
        listen(family, host, port, owners[owner])
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind(("127.0.0.1", 0))
    udp_port = dns.getsockname()[1]

    before = {"agent": attempts(int(agent_uid), udp_port)}
    got_before = bool(select.select([dns], [], [], 0.5)[0])
    if got_before:
        dns.recv(64)
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), **json.loads(env_json)}
    run = subprocess.run(["sh", script], env=env, capture_output=True, text=True)
    result: dict[str, object] = {
        "script_rc": run.returncode,
        "script_out": run.stdout + run.stderr,
        "before": before,
        "udp_received_before": got_before,
    }
    if run.returncode == 0:
        for host, port in SQUATS.values():  # bound by the agent, after the rules
            listen(socket.AF_INET, host, port, int(agent_uid))
        result["agent"] = attempts(int(agent_uid), udp_port)
        result["udp_received_from_agent"] = bool(select.select([dns], [], [], 0.5)[0])
        if result["udp_received_from_agent"]:
            dns.recv(64)
        result["gateway"] = attempts(int(gateway_uid), udp_port)
        result["udp_received_from_gateway"] = bool(select.select([dns], [], [], 0.5)[0])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
