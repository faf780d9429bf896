#!/usr/bin/env bash
# A throwaway OpenSSH server on loopback, so benchmarks can compare against
# plain ssh/scp on the same machine.
#
#   bench/sshd.sh start DIR PORT   start sshd on 127.0.0.1:PORT, state in DIR
#   bench/sshd.sh stop DIR         stop it
#
# `start` prints the options for ssh/scp on stdout, e.g.
#   OPTS=$(bench/sshd.sh start /tmp/bench-ssh 2222)
#   ssh $OPTS bench true
#   scp $OPTS file bench:/tmp/x
# (keep DIR free of spaces if you use $OPTS unquoted like this)
# SSHD_ADDRESS=10.77.0.1 listens (and points the client config) there
# instead of 127.0.0.1, e.g. inside a network namespace of scripts/wanlab.sh.
# Everything lives in DIR (host and client keys, configs, known_hosts, pidfile,
# log); the system's ssh configuration is not touched. Logs in as the current
# user. Needs bash, OpenSSH client, and /usr/sbin/sshd (installed via apt-get
# when missing and run as root).
set -euo pipefail

die() { echo "sshd.sh: $*" >&2; exit 1; }
usage() { die "usage: $0 start DIR PORT | stop DIR"; }

SSHD=/usr/sbin/sshd
ADDRESS=${SSHD_ADDRESS:-127.0.0.1}

running() { [ -f "$1/sshd.pid" ] && kill -0 "$(cat "$1/sshd.pid")" 2>/dev/null; }

start() {
  local dir=$1 port=$2 user
  [[ $port =~ ^[0-9]+$ ]] || die "PORT must be a number: $port"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)   # sshd wants absolute paths
  user=$(id -un)

  if running "$dir"; then
    echo "sshd.sh: already running (pid $(cat "$dir/sshd.pid"))" >&2
    echo "-F $dir/ssh_config"
    return
  fi

  # sshd would fail to bind, yet a login could then reach whoever holds the port.
  if (exec 3<>"/dev/tcp/$ADDRESS/$port") 2>/dev/null; then
    die "port $port on $ADDRESS is already in use"
  fi

  if [ ! -x "$SSHD" ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
      die "$SSHD missing; install openssh-server"
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      openssh-server >/dev/null 2> >(grep -v '^debconf: delaying' >&2)
  fi
  # A root sshd insists on its privilege-separation directory.
  [ "$(id -u)" != 0 ] || mkdir -p /run/sshd

  # Fresh keys each time: nothing here is meant to outlive the benchmark.
  rm -f "$dir"/host_key* "$dir"/id "$dir"/id.pub
  ssh-keygen -q -t ed25519 -N '' -C bench-host -f "$dir/host_key"
  ssh-keygen -q -t ed25519 -N '' -C bench-client -f "$dir/id"
  cp "$dir/id.pub" "$dir/authorized_keys"
  # Pin our own host key: ssh then talks only to this server, without prompts.
  echo "bench $(cat "$dir/host_key.pub")" >"$dir/known_hosts"

  # Key auth only, no PAM; StrictModes off so DIR may live anywhere (e.g. /tmp).
  cat >"$dir/sshd_config" <<CONF
ListenAddress $ADDRESS
Port $port
HostKey $dir/host_key
PidFile $dir/sshd.pid
AuthorizedKeysFile $dir/authorized_keys
AllowUsers $user
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
# scp uses the SFTP protocol by default since OpenSSH 9.0.
Subsystem sftp internal-sftp
LogLevel ERROR
CONF

  cat >"$dir/ssh_config" <<CONF
Host bench
  HostName $ADDRESS
  Port $port
  User $user
  IdentityFile $dir/id
  IdentitiesOnly yes
  HostKeyAlias bench
  UserKnownHostsFile $dir/known_hosts
  StrictHostKeyChecking yes
  BatchMode yes
  LogLevel ERROR
CONF

  # sshd forks into the background itself; -E keeps its log out of syslog and
  # out of our caller's output.
  : >"$dir/sshd.log"
  "$SSHD" -f "$dir/sshd_config" -E "$dir/sshd.log"

  # Wait (up to 10 s) until a real login works, so callers can start at once.
  # sshd may exit 0 and only then fail (e.g. to bind), so its log tells why.
  local ok=
  for _ in $(seq 50); do
    if ssh -F "$dir/ssh_config" bench true 2>/dev/null; then ok=1; break; fi
    sleep 0.2
  done
  if [ -z "$ok" ]; then
    running "$dir" && kill "$(cat "$dir/sshd.pid")"
    die "sshd did not accept a login; $dir/sshd.log says: $(tail -n 5 "$dir/sshd.log")"
  fi

  echo "sshd.sh: sshd on $ADDRESS:$port (pid $(cat "$dir/sshd.pid")); use:" >&2
  echo "  ssh -F $dir/ssh_config bench CMD  /  scp -F $dir/ssh_config FILE bench:PATH" >&2
  echo "-F $dir/ssh_config"
}

stop() {
  local dir=$1 pid
  if ! running "$dir"; then
    echo "sshd.sh: not running" >&2
    rm -f "$dir/sshd.pid"
    return
  fi
  pid=$(cat "$dir/sshd.pid")
  kill "$pid"
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$dir/sshd.pid"
  echo "sshd.sh: stopped (pid $pid)" >&2
}

case "${1:-}" in
  start) [ $# -eq 3 ] || usage; start "$2" "$3" ;;
  stop) [ $# -eq 2 ] || usage; stop "$2" ;;
  *) usage ;;
esac
