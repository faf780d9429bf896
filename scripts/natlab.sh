#!/usr/bin/env bash
# A NAT lab in network namespaces: two hosts, each behind its own NAT router,
# and a "public" segment where a relay can live. Needs root, iproute2, iptables.
#
#   scripts/natlab.sh up [drop|accept] [--random-fully]   build it (replaces an old one)
#   scripts/natlab.sh down                                kill its processes, delete it
#   scripts/natlab.sh check                               exit 1 if anything of it is left
#
#   A  10.0.1.2 --- RA [MASQUERADE] 203.0.113.2 --+
#                                                 +-- bridge in P: 203.0.113.1 (the relay)
#   B  10.0.2.2 --- RB [MASQUERADE] 203.0.113.3 --+
#
# drop:           routers drop unsolicited inbound packets; MASQUERADE keeps
#                 source ports, so UDP hole punching between A and B works.
# accept:         routers take unsolicited inbound packets themselves; the
#                 first probe that arrives makes the router remap its own
#                 host's port, so punching fails and traffic needs the relay.
# --random-fully: a random public port per flow ("symmetric NAT"): punching
#                 fails, traffic needs the relay.
#
# Namespaces are named ${GPUMESH_NATLAB_PREFIX:-gmx}{A,B,RA,RB,P}.
set -euo pipefail

P=${GPUMESH_NATLAB_PREFIX:-gmx}
NAMESPACES="A B RA RB P"
ns() { ip netns exec "$@"; }

down() {
  for n in $NAMESPACES; do
    pids=$(ip netns pids "$P$n" 2>/dev/null || true)
    if [ -n "$pids" ]; then
      # shellcheck disable=SC2086
      kill $pids 2>/dev/null || true
    fi
  done
  for n in $NAMESPACES; do
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      pids=$(ip netns pids "$P$n" 2>/dev/null || true)
      [ -z "$pids" ] && break
      sleep 0.2
    done
    pids=$(ip netns pids "$P$n" 2>/dev/null || true)
    if [ -n "$pids" ]; then
      # shellcheck disable=SC2086
      kill -9 $pids 2>/dev/null || true
    fi
    ip netns del "$P$n" 2>/dev/null || true
  done
  # veths die with their namespaces; a half-built lab may leave one in the root namespace
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$P" || true); do
    ip link del "$link" 2>/dev/null || true
  done
}

check() {
  left=$( (ip netns list 2>/dev/null | awk '{print $1}' | grep "^$P" || true; \
           ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$P" || true) )
  if [ -n "$left" ]; then
    echo "natlab leftovers: $left" >&2
    exit 1
  fi
}

up() {
  local filter=${1:-drop} random=${2:-}
  case "$filter" in drop | accept) ;; *) echo "error: mode must be drop or accept" >&2; exit 2 ;; esac
  case "$random" in "" | --random-fully) ;; *) echo "error: unknown option $random" >&2; exit 2 ;; esac
  for tool in ip iptables; do
    command -v "$tool" >/dev/null || { echo "error: $tool is not installed" >&2; exit 1; }
  done
  down
  for n in $NAMESPACES; do ip netns add "$P$n"; ns "$P$n" ip link set lo up; done
  ns "${P}P" ip link add br0 type bridge
  ns "${P}P" ip link set br0 up
  ns "${P}P" ip addr add 203.0.113.1/24 dev br0
  local i=2 r
  for r in RA RB; do
    ip link add "${P}w$r" type veth peer name "${P}pw$r"
    ip link set "${P}w$r" netns "$P$r"
    ip link set "${P}pw$r" netns "${P}P"
    ns "$P$r" ip link set "${P}w$r" name wan
    ns "${P}P" ip link set "${P}pw$r" master br0
    ns "$P$r" ip addr add "203.0.113.$i/24" dev wan
    ns "$P$r" ip link set wan up
    ns "${P}P" ip link set "${P}pw$r" up
    i=$((i + 1))
  done
  local h s
  for h in A B; do
    s=$([ "$h" = A ] && echo 1 || echo 2)
    r=R$h
    ip link add "${P}l$h" type veth peer name "${P}lr$h"
    ip link set "${P}l$h" netns "$P$h"
    ip link set "${P}lr$h" netns "$P$r"
    ns "$P$h" ip link set "${P}l$h" name eth0
    ns "$P$r" ip link set "${P}lr$h" name lan
    ns "$P$h" ip addr add "10.0.$s.2/24" dev eth0
    ns "$P$h" ip link set eth0 up
    ns "$P$r" ip addr add "10.0.$s.1/24" dev lan
    ns "$P$r" ip link set lan up
    ns "$P$h" ip route add default via "10.0.$s.1"
    ns "$P$r" sysctl -qw net.ipv4.ip_forward=1
    ns "$P$r" ip route add default via 203.0.113.1
    # shellcheck disable=SC2086
    ns "$P$r" iptables -t nat -A POSTROUTING -o wan -j MASQUERADE $random
    ns "$P$r" iptables -P FORWARD DROP
    ns "$P$r" iptables -A FORWARD -i lan -o wan -j ACCEPT
    ns "$P$r" iptables -A FORWARD -i wan -o lan -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
    if [ "$filter" = drop ]; then
      ns "$P$r" iptables -A INPUT -i wan -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
      ns "$P$r" iptables -A INPUT -i wan -j DROP
    fi
  done
  # The public segment does not route between the two private networks.
  ns "${P}P" sysctl -qw net.ipv4.ip_forward=0
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  check) check ;;
  *) echo "usage: $0 up [drop|accept] [--random-fully] | down | check" >&2; exit 2 ;;
esac
