#!/usr/bin/env bash
# Make sure a Docker daemon answers and the offline test image exists.
#
# Idempotent: safe to run before every test run. On a fresh Debian machine (as
# root) it installs docker.io, iptables and busybox-static, starts dockerd in
# the background and builds the test image without any registry access, since
# test machines usually cannot pull images.
#
# Env:
#   GPUMESH_TEST_DOCKER_IMAGE  image to build/check (default gpumesh-test/busybox:1)
#   GPUMESH_TEST_STATE_DIR     where dockerd.log / dockerd.pid go
#                              (default ${TMPDIR:-/tmp}/gpumesh-test)
#   DOCKERD_ARGS               extra flags for a dockerd we start
set -euo pipefail

IMAGE=${GPUMESH_TEST_DOCKER_IMAGE:-gpumesh-test/busybox:1}
STATE_DIR=${GPUMESH_TEST_STATE_DIR:-${TMPDIR:-/tmp}/gpumesh-test}
LOG=$STATE_DIR/dockerd.log
PIDFILE=$STATE_DIR/dockerd.pid
# Applets the test image links to busybox; tests may rely on any of these.
APPLETS="sh echo cat ls sleep id env head tail true false printf wc grep sed tr yes seq
mkdir rm touch pwd date kill ps test expr dd sha256sum"

die() { echo "ensure-docker: $*" >&2; exit 1; }
log() { echo "ensure-docker: $*" >&2; }

# apt-get install, running `apt-get update` at most once per invocation.
APT_UPDATED=
apt_install() {
  [ "$(id -u)" = 0 ] || die "need root to install: $* (run: sudo apt-get install $*)"
  command -v apt-get >/dev/null || die "no apt-get; please install: $*"
  if [ -z "$APT_UPDATED" ]; then
    apt-get update -qq
    APT_UPDATED=1
  fi
  log "installing $*"
  # debconf's "delaying package configuration" chatter is harmless noise.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
    >/dev/null 2> >(grep -v '^debconf: delaying' >&2)
}

# ldd fails on a static binary; a dynamic busybox would not run in an empty rootfs.
static_busybox() { [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; }

docker_up() { docker info >/dev/null 2>&1; }

# Whether the pid in file $1 is a live process named $2. kill -0 alone is not
# enough: a killed daemon can linger as a zombie, and a pid can be reused.
pidfile_running() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  # Field 3 of /proc/PID/stat is the state; Z (zombie) and X (dead) do not count.
  case "$(sed 's/^.*) //' "/proc/$pid/stat" | cut -d' ' -f1)" in Z | X) return 1 ;; esac
}
ours_running() { pidfile_running "$PIDFILE" dockerd; }

mkdir -p "$STATE_DIR"

# 1. Packages. iptables is needed even when a daemon already runs: dockerd
# uses it for its bridge network, and the network tests (the NAT lab in
# network namespaces, with iproute2's `ip`) use it too.
missing=()
command -v iptables >/dev/null || missing+=(iptables)
command -v ip >/dev/null || missing+=(iproute2) # the NAT lab (scripts/natlab.sh)
# `gpumesh share --print-systemd-unit` is checked with `systemd-analyze verify`.
command -v systemd-analyze >/dev/null || missing+=(systemd)
if ! docker_up; then
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker >/dev/null || missing+=(docker.io)
  static_busybox || missing+=(busybox-static)
fi
# shellcheck disable=SC2046  # dedupe; package names have no spaces
[ ${#missing[@]} -eq 0 ] || apt_install $(printf '%s\n' "${missing[@]}" | sort -u)

# 2. The daemon. Installing docker.io may have started it through systemd;
# only start our own if nothing answers yet, and never start a second one of ours.
start_dockerd() {
  # A daemon killed earlier (e.g. when the previous session ended) leaves its
  # pid file behind, and dockerd refuses to start while that pid exists, even
  # as a zombie. Remove pid files whose process is not a running daemon.
  for stale in /var/run/docker.pid:dockerd /var/run/docker/containerd/containerd.pid:containerd; do
    file=${stale%%:*}
    if [ -f "$file" ] && ! pidfile_running "$file" "${stale##*:}"; then
      rm -f "$file"
    fi
  done
  log "starting dockerd (log: $LOG)"
  # setsid + nohup + </dev/null: the daemon outlives this script and a Ctrl-C
  # of the test run, and holds no pipe of the caller open (CI waits on those).
  # shellcheck disable=SC2086  # DOCKERD_ARGS is a list of flags
  setsid nohup dockerd ${DOCKERD_ARGS:-} </dev/null >"$LOG" 2>&1 &
  echo $! >"$PIDFILE"
}
wait_dockerd() {
  for _ in $(seq 480); do   # 480 x 0.25 s = 120 s (a loaded machine is slow to start it)
    docker_up && return 0
    ours_running || return 1   # daemon died: stop waiting
    sleep 0.25
  done
  return 1
}
if ! docker_up; then
  if ours_running; then
    log "dockerd (pid $(cat "$PIDFILE")) already starting; waiting"
    wait_dockerd || true
  else
    [ "$(id -u)" = 0 ] || die "docker daemon not reachable and not root, cannot start dockerd"
    # dockerd gives its containerd 15 s to answer. After a machine stopped with
    # containers running, containerd first cleans up every dead one's shim
    # (~30 ms each on a slow machine) and can miss that; each try cleans up
    # more, so try again while that is why dockerd gave up.
    for try in 1 2 3 4 5 6 7 8; do
      start_dockerd
      wait_dockerd && break
      grep -q "timeout waiting for containerd to start" "$LOG" 2>/dev/null || break
      log "containerd was still cleaning up after earlier containers (try $try of 8); starting dockerd again"
      cp "$LOG" "$LOG.$try"
    done
  fi
  if ! docker_up; then
    echo "ensure-docker: dockerd did not come up; last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2 || true
    exit 1
  fi
fi

# 3. The offline test image: static busybox in an otherwise empty rootfs.
if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  static_busybox || apt_install busybox-static
  static_busybox || die "/bin/busybox is not a static binary (install busybox-static)"
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  mkdir -p "$rootfs/bin" "$rootfs/etc" "$rootfs/tmp"
  chmod 1777 "$rootfs/tmp"
  cp /bin/busybox "$rootfs/bin/busybox"
  have=$(/bin/busybox --list)
  for a in $APPLETS; do
    grep -qx "$a" <<<"$have" || die "busybox lacks applet '$a'"
    ln -s busybox "$rootfs/bin/$a"
  done
  # Minimal user database so `id` and --user 65534 have names.
  printf 'root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$rootfs/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$rootfs/etc/group"
  tar -C "$rootfs" --owner=0 --group=0 --numeric-owner -c . |
    docker import -c 'CMD ["/bin/sh"]' -c 'ENV PATH=/bin' - "$IMAGE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  log "built $IMAGE"
fi

# 4. Smoke test: a container really runs, with no network.
out=$(docker run --rm --network none "$IMAGE" sh -c 'echo hi' 2>&1) || true
[ "$out" = hi ] || die "test container did not print 'hi' (got: $out); try: docker rmi $IMAGE"

server=$(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?')
echo "docker ready (server $server, image $IMAGE)"
