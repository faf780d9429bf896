#!/usr/bin/env bash
# A WAN lab in network namespaces: two hosts joined by a user-space link with
# one-way delay and random loss (scripts/wanemu.py), for kernels without
# netem. Needs root, iproute2, /dev/net/tun and python3.
#
#   scripts/wanlab.sh up [LINK OPTIONS]     build it (replaces an old one), start the link
#   scripts/wanlab.sh link [LINK OPTIONS]   restart only the link with new options
#   scripts/wanlab.sh exec A|B CMD...       run CMD in host A's or B's namespace
#   scripts/wanlab.sh stats                 the link's packet counters so far
#   scripts/wanlab.sh down                  stop the link, kill the hosts' processes, delete it
#   scripts/wanlab.sh check                 exit 1 if anything of it is left
#
# LINK OPTIONS (scripts/wanemu.py --help): --delay MS (one way, each way),
# --loss PCT (each way), --delay-ba/--loss-ba (B->A only), --rate MBIT,
# --seed N. An RTT of 50 ms is --delay 25.
#
#   A  10.77.0.1 [tun "wan"] ==== wanemu.py (delay, loss) ==== [tun "wan"] 10.77.0.2  B
#
# The hosts' TCP uses BBR where the kernel has it (modprobe tcp_bbr is tried
# first); `up` prints the congestion control each namespace ends up with.
# GPUMESH_WANLAB_CC=cubic (or another) asks for that one instead.
#
# Namespaces are ${GPUMESH_WANLAB_PREFIX:-gmw}{A,B}; the link's pid file and
# log are in ${TMPDIR:-/tmp}/gpumesh-wanlab-<prefix>/.
set -euo pipefail

P=${GPUMESH_WANLAB_PREFIX:-gmw}
STATE=${TMPDIR:-/tmp}/gpumesh-wanlab-$P
EMU=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/wanemu.py
PYTHON=${PYTHON:-python3}
ADDR_A=10.77.0.1
ADDR_B=10.77.0.2
MTU=${GPUMESH_WANLAB_MTU:-1500}
# Packets a host's "wan" device holds for the link process. A TUN device drops
# what does not fit without telling the sender (no backpressure, unlike a NIC's
# queue), and the kernel's default (500) is a few ms of a bulk flow: on a loaded
# machine, where the link process waits for a CPU now and then, that made loss
# in bursts on top of the configured loss. `stats` shows what was dropped there.
TXQUEUE=${GPUMESH_WANLAB_TXQUEUE:-20000}
ns() { ip netns exec "$@"; }

link_running() { [ -f "$STATE/wanemu.pid" ] && kill -0 "$(cat "$STATE/wanemu.pid")" 2>/dev/null; }

stop_link() {
  link_running || { rm -f "$STATE/wanemu.pid"; return 0; }
  local pid
  pid=$(cat "$STATE/wanemu.pid")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$STATE/wanemu.pid"
}

start_link() {
  [ -e "/run/netns/${P}A" ] || { echo "error: no lab; run: $0 up" >&2; exit 1; }
  stop_link
  mkdir -p "$STATE"
  : >"$STATE/wanemu.log"
  # setsid: the link outlives this shell and is not in either namespace.
  setsid "$PYTHON" "$EMU" --netns-a "${P}A" --netns-b "${P}B" "$@" \
    </dev/null >>"$STATE/wanemu.log" 2>&1 &
  echo $! >"$STATE/wanemu.pid"
  for _ in $(seq 100); do
    if grep -q '^wanemu: ready' "$STATE/wanemu.log"; then
      grep '^wanemu: ready' "$STATE/wanemu.log" | sed 's/^wanemu: ready: /wanlab: link: /'
      return 0
    fi
    link_running || break
    sleep 0.05
  done
  echo "error: the link did not start: $(tail -n 3 "$STATE/wanemu.log")" >&2
  stop_link
  exit 1
}

down() {
  stop_link
  local n pids
  for n in A B; do
    pids=$(ip netns pids "$P$n" 2>/dev/null || true)
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill $pids 2>/dev/null || true
  done
  for n in A B; do
    for _ in $(seq 10); do
      pids=$(ip netns pids "$P$n" 2>/dev/null || true)
      [ -z "$pids" ] && break
      sleep 0.2
    done
    pids=$(ip netns pids "$P$n" 2>/dev/null || true)
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    ip netns del "$P$n" 2>/dev/null || true
  done
  rm -rf "$STATE"
}

check() {
  local left
  left=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$P(A|B)\$" || true)
  if [ -n "$left" ] || link_running; then
    echo "wanlab leftovers: $left $(link_running && echo "link pid $(cat "$STATE/wanemu.pid")")" >&2
    exit 1
  fi
}

congestion_control() {
  local want=${GPUMESH_WANLAB_CC:-bbr} n
  if ! grep -qw "$want" /proc/sys/net/ipv4/tcp_available_congestion_control; then
    if command -v modprobe >/dev/null; then modprobe "tcp_$want" 2>/dev/null || true; fi
  fi
  if grep -qw "$want" /proc/sys/net/ipv4/tcp_available_congestion_control; then
    for n in A B; do
      ns "$P$n" sysctl -qw "net.ipv4.tcp_congestion_control=$want" 2>/dev/null ||
        echo "wanlab: $want is available but not allowed in a namespace (tcp_allowed_congestion_control)" >&2
    done
  else
    echo "wanlab: tcp_$want is not available here; the hosts keep the default" >&2
  fi
  echo "wanlab: hosts' TCP congestion control: A $(ns "${P}A" cat /proc/sys/net/ipv4/tcp_congestion_control)," \
    "B $(ns "${P}B" cat /proc/sys/net/ipv4/tcp_congestion_control)"
}

up() {
  command -v ip >/dev/null || { echo "error: ip (iproute2) is not installed" >&2; exit 1; }
  [ -c /dev/net/tun ] || { echo "error: /dev/net/tun is missing" >&2; exit 1; }
  down
  local n self peer
  for n in A B; do
    if [ "$n" = A ]; then self=$ADDR_A peer=$ADDR_B; else self=$ADDR_B peer=$ADDR_A; fi
    ip netns add "$P$n"
    ns "$P$n" ip link set lo up
    # Persistent, so the link can be restarted with other options under running hosts.
    ns "$P$n" ip tuntap add dev wan mode tun
    ns "$P$n" ip link set wan mtu "$MTU" txqueuelen "$TXQUEUE" up
    ns "$P$n" ip addr add "$self/32" peer "$peer/32" dev wan
  done
  congestion_control
  start_link "$@"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  link) shift; start_link "$@" ;;
  exec)
    shift
    case "${1:-}" in A | B) ;; *) echo "usage: $0 exec A|B CMD..." >&2; exit 2 ;; esac
    n=$1; shift
    exec ip netns exec "$P$n" "$@"
    ;;
  stats)
    link_running || { echo "error: the link is not running" >&2; exit 1; }
    kill -USR1 "$(cat "$STATE/wanemu.pid")"
    sleep 0.2
    grep -E '^(A->B|B->A):' "$STATE/wanemu.log" | tail -n 2
    for n in A B; do
      echo "host $n: $(ns "$P$n" cat /sys/class/net/wan/statistics/tx_dropped) packets dropped by its wan device before the link took them"
    done
    ;;
  down) down ;;
  check) check ;;
  *) echo "usage: $0 up [LINK OPTIONS] | link [LINK OPTIONS] | exec A|B CMD... | stats | down | check" >&2; exit 2 ;;
esac
