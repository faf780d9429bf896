#!/usr/bin/env bash
# Install GPUMesh (editable, into the .venv that scripts/test.sh also uses) and show its
# main flow end to end on this one machine: two nodes with separate homes pair mutually,
# one shares, the other runs a real Docker job on it and sees its output.
# Docker: started if needed (as root it is installed when missing); when no registry is
# reachable, a small busybox image is built offline and used as the job image.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -e .
GPUMESH=.venv/bin/gpumesh
scripts/ensure-docker.sh
IMAGE=${GPUMESH_TEST_DOCKER_IMAGE:-gpumesh-test/busybox:1}

work=$(mktemp -d "${TMPDIR:-/tmp}/gpumesh-demo.XXXXXX")
A="$work/alice" B="$work/bob"
cleanup() {
  # The node processes (alice's shares until stopped) go with the demo's homes.
  for home in "$A" "$B"; do
    [ -S "$home/control.sock" ] && GPUMESH_HOME=$home $GPUMESH daemon stop >/dev/null 2>&1 || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

# A free UDP port, so the demo never collides with a real `gpumesh share` on 47000.
port=$(.venv/bin/python -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }

step "GPUMESH_HOME=alice gpumesh init --name alice-pc"
GPUMESH_HOME=$A $GPUMESH init --name alice-pc
step "GPUMESH_HOME=bob gpumesh init --name bob-laptop"
GPUMESH_HOME=$B $GPUMESH init --name bob-laptop
GPUMESH_HOME=$A $GPUMESH config set listen_port "$port" >/dev/null
# Both nodes are on this machine: alice listens on loopback only, not 0.0.0.0.
GPUMESH_HOME=$A $GPUMESH config set listen_host 127.0.0.1 >/dev/null
for home in "$A" "$B"; do GPUMESH_HOME=$home $GPUMESH config set image "$IMAGE" >/dev/null; done
# Filtering what jobs reach (job_network internet, the default) takes root; as
# another user the demo's jobs use Docker's plain bridge instead.
if [ "$(id -u)" != 0 ]; then
  step "GPUMESH_HOME=alice gpumesh config set job_network bridge"
  GPUMESH_HOME=$A $GPUMESH config set job_network bridge
fi

step "GPUMESH_HOME=alice gpumesh share --detach   # alice's node process shares"
GPUMESH_HOME=$A $GPUMESH share --detach >"$work/share.log" 2>&1 || { cat "$work/share.log"; exit 1; }
sed -n 1,2p "$work/share.log"

step "GPUMESH_HOME=bob gpumesh pair \"\$(GPUMESH_HOME=alice gpumesh pair-code)\""
GPUMESH_HOME=$B $GPUMESH pair "$(GPUMESH_HOME=$A $GPUMESH pair-code)"
step "GPUMESH_HOME=alice gpumesh pair \"\$(GPUMESH_HOME=bob gpumesh pair-code)\""
GPUMESH_HOME=$A $GPUMESH pair "$(GPUMESH_HOME=$B $GPUMESH pair-code)"

step "GPUMESH_HOME=bob gpumesh connect alice-pc"
GPUMESH_HOME=$B $GPUMESH connect alice-pc
step "GPUMESH_HOME=bob gpumesh peers"
GPUMESH_HOME=$B $GPUMESH peers

step "GPUMESH_HOME=bob gpumesh run --peer alice-pc -- sh -c '...'"
GPUMESH_HOME=$B $GPUMESH run --peer alice-pc -- sh -c \
  'echo "hello from a locked-down container on alice-pc"; id; echo "to stderr" >&2; exit 3' \
  || echo "(exit code $?: the job's own exit code)"
step "GPUMESH_HOME=bob gpumesh jobs"
GPUMESH_HOME=$B $GPUMESH jobs

step "GPUMESH_HOME=alice gpumesh deny bob-laptop   # default-deny from now on"
GPUMESH_HOME=$A $GPUMESH deny bob-laptop
step "GPUMESH_HOME=bob gpumesh connect alice-pc"
GPUMESH_HOME=$B $GPUMESH connect alice-pc || echo "(exit code $?: refused, as it should be)"

step "GPUMESH_HOME=alice gpumesh share stop"
GPUMESH_HOME=$A $GPUMESH share stop
