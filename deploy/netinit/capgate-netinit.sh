#!/bin/sh
# capgate-netinit: the network rules of an agent pod with capgate as a sidecar, set by an init
# container before any other container starts (as service meshes set theirs).
#
# A pod's containers share one network namespace, so the rules are by user (iptables' owner
# match on the socket's uid), in the OUTPUT chain of the pod's namespace:
#
#   - capgate's user (CAPGATE_GATEWAY_UID) may send anything: the upstreams, Redis, DNS, its
#     answers to the agent, to the kubelet's probes and to operators;
#   - nobody else may answer from capgate's ports (CAPGATE_GATEWAY_PORTS: the agents', admin and
#     health ports): an agent that binds one of them while capgate restarts (another address,
#     or the port left free) cannot pose as capgate to an operator (whose token it would get)
#     or to the kubelet;
#   - packets of connections already made (ESTABLISHED, RELATED) pass: both directions of
#     the allowed ones;
#   - anyone else (the agent, whatever its uid) may open one connection only: TCP to
#     127.0.0.1:CAPGATE_AGENT_PORT on loopback, capgate's agents' port;
#   - everything else is refused (TCP reset, ICMP unreachable otherwise): other loopback ports
#     (the admin listener, /metrics, the health listener), the pod IP, other pods, Services,
#     DNS, the cloud metadata address, the internet. IPv6 the same, with no exception at all.
#
# Fails (and so the pod never starts) when a rule cannot be set; IPv6 is skipped only when the
# kernel has no IPv6. Needs CAP_NET_ADMIN (and CAP_NET_RAW for some iptables builds) in the
# pod's namespace; nothing else of the pod runs with them.
set -eu

GATEWAY_UID="${CAPGATE_GATEWAY_UID:?set CAPGATE_GATEWAY_UID to capgate containers runAsUser}"
AGENT_PORT="${CAPGATE_AGENT_PORT:-8787}"
GATEWAY_PORTS="${CAPGATE_GATEWAY_PORTS:-$AGENT_PORT}"
IPTABLES="${IPTABLES:-iptables}"
IP6TABLES="${IP6TABLES:-ip6tables}"
CHAIN=CAPGATE_OUTPUT

case "$GATEWAY_UID" in '' | *[!0-9]*) echo "capgate-netinit: bad uid $GATEWAY_UID" >&2; exit 2 ;; esac
case "$AGENT_PORT" in '' | *[!0-9]*) echo "capgate-netinit: bad port $AGENT_PORT" >&2; exit 2 ;; esac
case "$GATEWAY_PORTS" in '' | *[!0-9,]* | ,* | *, | *,,*)
  echo "capgate-netinit: bad ports $GATEWAY_PORTS (e.g. 8787,8788,8789)" >&2; exit 2 ;;
esac
if [ "$GATEWAY_UID" = 0 ]; then
  echo "capgate-netinit: capgate must not run as root (uid 0 would let every root process out)" >&2
  exit 2
fi

rules() { # $1: iptables or ip6tables; $2: the loopback address of the agents' port, or ""
  ipt=$1
  "$ipt" -w -N "$CHAIN"
  "$ipt" -w -A "$CHAIN" -m owner --uid-owner "$GATEWAY_UID" -j ACCEPT
  "$ipt" -w -A "$CHAIN" -p tcp -m multiport --sports "$GATEWAY_PORTS" -m owner --socket-exists \
    -j REJECT --reject-with tcp-reset
  "$ipt" -w -A "$CHAIN" -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
  if [ -n "$2" ]; then
    "$ipt" -w -A "$CHAIN" -o lo -d "$2" -p tcp --dport "$AGENT_PORT" -j ACCEPT
  fi
  "$ipt" -w -A "$CHAIN" -p tcp -j REJECT --reject-with tcp-reset
  "$ipt" -w -A "$CHAIN" -j REJECT
  "$ipt" -w -I OUTPUT 1 -j "$CHAIN"
  "$ipt" -w -S "$CHAIN"
}

rules "$IPTABLES" 127.0.0.1
if [ -e /proc/net/if_inet6 ]; then
  rules "$IP6TABLES" ""
else
  echo "capgate-netinit: no IPv6 in this kernel; IPv6 rules not needed"
fi
echo "capgate-netinit: only uid $GATEWAY_UID may connect out; others reach 127.0.0.1:$AGENT_PORT only"
