#!/usr/bin/env bash
# Check GPUMesh against this machine's real NVIDIA GPU: NVML, the CUDA driver path
# of `gpumesh cuda`, the processes the inventory lists on each GPU (what
# reclaim_on_gpu_use sees), and the GPU tests. Says what it ran and what it skipped.
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

step "Processes on the GPUs (reclaim_on_gpu_use)"
# A compute process of our own (a CUDA context through cuda-bindings, 16 MB on GPU 0)
# must be listed by the inventory as compute on GPU 0; it ends when its stdin closes
# (or after 60 s), so nothing outlives the script.
if [ "$driver" = yes ]; then
  coproc HOLDER { "$PY" -c '
import sys, select
from gpumesh.gpu.cudadriver import DriverBackend, load_driver
backend = DriverBackend(load_driver(), 64 * 2**20, 0)
backend.alloc(16 * 2**20)
print("ready", flush=True)
select.select([sys.stdin], [], [], 60)
backend.close()
'; }
  holder_pid=$HOLDER_PID holder_out=${HOLDER[0]} holder_in=${HOLDER[1]}
  if read -r -t 30 line <&"$holder_out" && [ "$line" = ready ]; then
    check "a compute process listed on GPU 0" "$PY" -c '
import sys, time
from gpumesh.gpu.inventory import detect_inventory
pid, inventory = int(sys.argv[1]), detect_inventory()
for _ in range(50):
    found = [p for p in inventory.processes() if p.pid == pid]
    if found:
        break
    time.sleep(0.1)
print(f"{inventory.source}: {found}")
sys.exit(0 if any(p.gpu == 0 and p.kind == "compute" for p in found) else 1)
' "$holder_pid"
  else
    failed+=("a compute process listed on GPU 0: the CUDA process did not start")
  fi
  eval "exec ${holder_in}>&-"  # its stdin closes: it frees its memory and exits
  wait "$holder_pid" 2>/dev/null
else
  skipped+=("a compute process on the GPU: no CUDA driver path (see above)")
fi
# A graphics process needs a display server on the GPU; a headless machine has none.
if [ -n "${DISPLAY:-}" ] && command -v glxgears >/dev/null; then
  timeout 20 glxgears >/dev/null 2>&1 &
  gears=$!
  sleep 2
  check "a graphics process listed (glxgears)" "$PY" -c '
import sys
from gpumesh.gpu.inventory import detect_inventory
found = [p for p in detect_inventory().processes() if p.pid == int(sys.argv[1])]
print(found)
sys.exit(0 if any(p.kind == "graphics" for p in found) else 1)
' "$gears"
  kill "$gears" 2>/dev/null
  wait "$gears" 2>/dev/null
else
  skipped+=("a graphics process on the GPU: no display here (DISPLAY unset or no glxgears)")
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
