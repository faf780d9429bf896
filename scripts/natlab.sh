#!/usr/bin/env bash
# NAT labs in network namespaces: hosts behind NAT routers and firewalls, and a
# "public" segment where a relay can live. Needs root, iproute2, iptables.
#
#   scripts/natlab.sh up [drop|accept] [--random-fully]   two hosts (below); replaces an old lab
#   scripts/natlab.sh matrix                              the preset matrix (below); replaces an old lab
#   scripts/natlab.sh down                                kill its processes, delete it (either lab)
#   scripts/natlab.sh check                               exit 1 if anything of it is left
#
# up:
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
# matrix: two hosts (1 and 2) per preset, each behind routers of its own, all
# on one bridge in P (203.0.113.1/24, the relay's address). Every router keeps
# state: what comes in unsolicited is dropped, replies come back only from the
# address and port that were sent to.
#
#   preset      host (namespace)   path out                                   public address
#   home        ho1 ho2  10.1.N.2  hoNr: MASQUERADE (keeps ports)             203.0.113.1N
#   cgnat       cg1 cg2  10.2.N.2  cgNr: MASQUERADE to 100.64.N.2,
#                                  cgNc: carrier MASQUERADE                   203.0.113.2N
#   blocked-in  bl1 bl2  203.0.113.3N on the segment itself, a stateful
#                                  firewall on the host (no NAT)              203.0.113.3N
#   symmetric   sy1 sy2  10.4.N.2  syNr: MASQUERADE --random-fully            203.0.113.4N
#   corporate   co1 co2  10.5.N.2  coNr: NAT, only TCP 80/443 and DNS out     203.0.113.5N
#   captive     ca1 ca2  10.6.N.2  caNr: NAT, TCP out, UDP only to port 53    203.0.113.6N
#
# home, cgnat, blocked-in, corporate and captive map a host's port the same
# whatever the destination (so peers that punch learn it from the relay);
# symmetric maps each destination to a new port. `matrix` prints one line per
# host: preset, number, namespace, address, public address.
#
# Namespaces are named ${GPUMESH_NATLAB_PREFIX:-gmx} followed by the names above
# (up: A B RA RB P; matrix: P and ho1 ho1r ... ca2r).
set -euo pipefail

P=${GPUMESH_NATLAB_PREFIX:-gmx}
MATRIX_PRESETS="home:ho:1 cgnat:cg:2 blocked-in:bl:3 symmetric:sy:4 corporate:co:5 captive:ca:6"
PAIR_NAMESPACES="A B RA RB P"
MATRIX_NAMESPACES="ho1 ho1r ho2 ho2r cg1 cg1r cg1c cg2 cg2r cg2c bl1 bl2
  sy1 sy1r sy2 sy2r co1 co1r co2 co2r ca1 ca1r ca2 ca2r"
# What down and check remove: either lab.
# shellcheck disable=SC2086
NAMESPACES=$(echo $PAIR_NAMESPACES $MATRIX_NAMESPACES)
ns() { ip netns exec "$@"; }
ns_add() {
  ip netns add "$P$1"
  ns "$P$1" ip link set lo up
}

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
  for link in $(root_links); do
    ip link del "$link" 2>/dev/null || true
  done
}

# This lab's names, exactly: another lab whose prefix begins with this one's is not ours.
# shellcheck disable=SC2086
NAMESPACES_RE=$(echo $NAMESPACES | tr ' ' '|')
LINKS_RE="p?wR[AB]|lr?[AB]|[vV][0-9]+" # what up and matrix name veths before moving them
lab_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -Ex "$P($NAMESPACES_RE)" || true; }
root_links() {
  ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -Ex "$P($LINKS_RE)" || true
}

check() {
  left=$(lab_namespaces; root_links)
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
  for n in $PAIR_NAMESPACES; do ns_add "$n"; done
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

# ---- matrix ----

LINKS=0
# link NS1 IF1 NS2 IF2: a veth pair between two namespaces of the lab, up. IF2 "br0"
# means a port of P's bridge (named after NS1).
link() {
  local a="${P}v$LINKS" b="${P}V$LINKS"
  LINKS=$((LINKS + 1))
  ip link add "$a" type veth peer name "$b"
  ip link set "$a" netns "$P$1"
  ip link set "$b" netns "$P$3"
  ns "$P$1" ip link set "$a" name "$2"
  ns "$P$1" ip link set "$2" up
  if [ "$4" = br0 ]; then
    ns "$P$3" ip link set "$b" name "$1"
    ns "$P$3" ip link set "$1" master br0
    ns "$P$3" ip link set "$1" up
  else
    ns "$P$3" ip link set "$b" name "$4"
    ns "$P$3" ip link set "$4" up
  fi
}

# router NS KIND [--random-fully]: NAT from lan to wan, stateful both ways: replies
# come back (conntrack), nothing unsolicited reaches the router or its hosts. KIND
# says what may leave: all, corporate (TCP 80/443 and DNS), captive (TCP and DNS).
router() {
  local r=$P$1 kind=$2 random=${3:-}
  ns "$r" sysctl -qw net.ipv4.ip_forward=1
  # shellcheck disable=SC2086
  ns "$r" iptables -t nat -A POSTROUTING -o wan -j MASQUERADE $random
  ns "$r" iptables -P FORWARD DROP
  ns "$r" iptables -A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
  case "$kind" in
    all) ns "$r" iptables -A FORWARD -i lan -o wan -j ACCEPT ;;
    corporate)
      ns "$r" iptables -A FORWARD -i lan -o wan -p tcp -m multiport --dports 80,443 -j ACCEPT
      ns "$r" iptables -A FORWARD -i lan -o wan -p tcp --dport 53 -j ACCEPT
      ns "$r" iptables -A FORWARD -i lan -o wan -p udp --dport 53 -j ACCEPT
      ;;
    captive)
      ns "$r" iptables -A FORWARD -i lan -o wan -p tcp -j ACCEPT
      ns "$r" iptables -A FORWARD -i lan -o wan -p udp --dport 53 -j ACCEPT
      ;;
  esac
  # Dropped before conntrack confirms them, unsolicited packets leave no state behind
  # (a router that took them would remap its host's port: see `up accept`).
  ns "$r" iptables -A INPUT -i wan -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
  ns "$r" iptables -A INPUT -i wan -j DROP
}

# Each of the three below builds one host and sets HOST and PUBLIC to its addresses.

# natted CODE N INDEX KIND [--random-fully]: host CODE+N behind router CODE+N+r.
natted() {
  local h=$1$2 lan=10.$3.$2
  link "$h" eth0 "${h}r" lan
  link "${h}r" wan P br0
  ns "$P$h" ip addr add "$lan.2/24" dev eth0
  ns "$P$h" ip route add default via "$lan.1"
  ns "$P${h}r" ip addr add "$lan.1/24" dev lan
  ns "$P${h}r" ip addr add "203.0.113.$3$2/24" dev wan
  ns "$P${h}r" ip route add default via 203.0.113.1
  router "${h}r" "$4" "${5:-}"
  HOST=$lan.2 PUBLIC=203.0.113.$3$2
}

# carrier N: cgnat host N, its home router and the carrier's NAT in front of it.
carrier() {
  local h=cg$1 lan=10.2.$1 cgn=100.64.$1
  link "$h" eth0 "${h}r" lan
  link "${h}r" wan "${h}c" lan
  link "${h}c" wan P br0
  ns "$P$h" ip addr add "$lan.2/24" dev eth0
  ns "$P$h" ip route add default via "$lan.1"
  ns "$P${h}r" ip addr add "$lan.1/24" dev lan
  ns "$P${h}r" ip addr add "$cgn.2/24" dev wan
  ns "$P${h}r" ip route add default via "$cgn.1"
  ns "$P${h}c" ip addr add "$cgn.1/24" dev lan
  ns "$P${h}c" ip addr add "203.0.113.2$1/24" dev wan
  ns "$P${h}c" ip route add default via 203.0.113.1
  router "${h}r" all
  router "${h}c" all
  HOST=$lan.2 PUBLIC=203.0.113.2$1
}

# exposed N: blocked-in host N, on the segment with a firewall of its own.
exposed() {
  local h=bl$1 address=203.0.113.3$1
  link "$h" eth0 P br0
  ns "$P$h" ip addr add "$address/24" dev eth0
  ns "$P$h" ip route add default via 203.0.113.1
  ns "$P$h" iptables -A INPUT -i lo -j ACCEPT
  ns "$P$h" iptables -A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
  ns "$P$h" iptables -A INPUT -j DROP
  HOST=$address PUBLIC=$address
}

matrix() {
  for tool in ip iptables; do
    command -v "$tool" >/dev/null || { echo "error: $tool is not installed" >&2; exit 1; }
  done
  down
  local n
  for n in P $MATRIX_NAMESPACES; do ns_add "$n"; done
  # A bridge takes the lowest address of its ports unless given one: routers that
  # learned it before the last port joined would send to an address gone.
  ns "${P}P" ip link add br0 address 02:00:cb:00:71:01 type bridge
  ns "${P}P" ip link set br0 up
  ns "${P}P" ip addr add 203.0.113.1/24 dev br0
  # The public segment routes nothing: hosts meet only through what their routers let by.
  ns "${P}P" sysctl -qw net.ipv4.ip_forward=0
  local entry preset code index
  for entry in $MATRIX_PRESETS; do
    IFS=: read -r preset code index <<<"$entry"
    for n in 1 2; do
      case "$preset" in
        home) natted "$code" "$n" "$index" all ;;
        cgnat) carrier "$n" ;;
        blocked-in) exposed "$n" ;;
        symmetric) natted "$code" "$n" "$index" all --random-fully ;;
        corporate) natted "$code" "$n" "$index" corporate ;;
        captive) natted "$code" "$n" "$index" captive ;;
      esac
      echo "$preset $n $P$code$n $HOST $PUBLIC"
    done
  done
}

case "${1:-}" in
  up) shift; up "$@" ;;
  matrix) matrix ;;
  down) down ;;
  check) check ;;
  *) echo "usage: $0 up [drop|accept] [--random-fully] | matrix | down | check" >&2; exit 2 ;;
esac
