#!/usr/bin/env bash
# Check GPUMesh against this machine's real NVIDIA GPU: NVML, the CUDA driver path
# of `gpumesh cuda`, and the GPU tests. Says what it ran and what it skipped.
#
#   scripts/gpu-check.sh [--wheels DIR]
#
#   --wheels DIR   install the optional cuda extra (cuda-bindings) from wheels in
#                  DIR first, without a network (a GPU machine may have none)
#
# Two throwaway nodes on 127.0.0.1 (alice-pc shares, bob-laptop uses it) live in a
# temporary folder that is removed on exit; nothing in ~/.gpumesh is touched.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    *) echo "usage: scripts/gpu-check.sh [--wheels DIR]" >&2; exit 2 ;;
  esac
done

ran=() skipped=() failed=()
step() { printf '\n==> %s\n' "$*"; }
gm() { "$PY" -m gpumesh "$@"; }
check() {  # NAME COMMAND...: run it, note whether it passed
  local name=$1; shift
  if "$@"; then ran+=("$name"); else failed+=("$name"); fi
}

if [ -n "$WHEELS" ]; then
  step "Installing cuda-bindings from $WHEELS"
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" cuda-bindings ||
    failed+=("install cuda-bindings from $WHEELS")
fi

step "gpumesh gpu (NVML)"
check "gpumesh gpu" gm gpu

driver=no
if "$PY" -c 'from gpumesh.gpu.cudadriver import load_driver; load_driver()' 2>/dev/null; then
  driver=yes
else
  why=$("$PY" -c 'from gpumesh.gpu.cudadriver import load_driver, DriverUnavailable
try:
    load_driver()
except DriverUnavailable as exc:
    print(exc)' 2>&1)
  skipped+=("the CUDA driver path: $why (demo and bench run on the host-memory fallback)")
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpumesh-gpu-check.XXXXXX")
cleanup() {  # both homes' node processes outlive the commands: stop them before the homes go
  for home in "$WORK/a" "$WORK/b"; do
    [ -d "$home" ] && GPUMESH_HOME=$home "$PY" -m gpumesh daemon stop >/dev/null 2>&1
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

step "Two nodes on 127.0.0.1"
PORT=$("$PY" -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export GPUMESH_HOME=$WORK/a
gm init --name alice-pc >/dev/null && gm config set listen_host 127.0.0.1 >/dev/null &&
  gm config set listen_port "$PORT" >/dev/null &&
  gm config set job_network none >/dev/null  # no jobs run here, and iptables may be missing
gm share --detach >"$WORK/share.log" 2>&1  # returns once alice shares
ALICE_CODE=$(gm pair-code)
GPUMESH_HOME=$WORK/b gm init --name bob-laptop >/dev/null
GPUMESH_HOME=$WORK/b gm pair "$ALICE_CODE" >/dev/null
gm pair "$(GPUMESH_HOME=$WORK/b gm pair-code)" >/dev/null
gm cuda share && gm cuda allow bob-laptop

step "gpumesh share: what it says about this machine's GPUs"
sed -n '1,3p' "$WORK/share.log"
step "gpumesh doctor (informative: Docker may be missing here)"
gm doctor || true

step "gpumesh cuda doctor"
check "cuda doctor" gm cuda doctor
step "gpumesh cuda demo --peer alice-pc"
check "cuda demo" env GPUMESH_HOME="$WORK/b" "$PY" -m gpumesh cuda demo --peer alice-pc
step "gpumesh cuda bench --peer alice-pc"
check "cuda bench" env GPUMESH_HOME="$WORK/b" "$PY" -m gpumesh cuda bench --peer alice-pc

step "GPU tests (tests/gpu)"
if [ "$driver" = yes ] && "$PY" -c 'import pytest' 2>/dev/null && [ -d tests/gpu ]; then
  check "GPU tests" env GPUMESH_TEST_GPU=1 "$PY" -m pytest -q -p no:cacheprovider tests/gpu
else
  skipped+=("the GPU tests (need the driver path and pytest)")
fi

step "Docker with the NVIDIA runtime"
if ! command -v docker >/dev/null || ! docker info >/dev/null 2>&1; then
  skipped+=("GPU jobs: no Docker here")
elif ! docker info 2>/dev/null | grep -qi nvidia; then
  skipped+=("GPU jobs: Docker has no NVIDIA runtime (nvidia-container-toolkit)")
else
  ran+=("Docker with the NVIDIA runtime found (GPU jobs: run the Docker tests)")
fi

step "Summary"
for item in "${ran[@]}"; do echo "ran:     $item"; done
for item in "${skipped[@]}"; do echo "skipped: $item"; done
for item in "${failed[@]}"; do echo "FAILED:  $item"; done
[ ${#failed[@]} = 0 ]
