#!/usr/bin/env bash
# Build a small test image with Python and pip, offline, from this machine's own
# Python: no registry is needed (test machines usually cannot pull images).
#
#   scripts/build-python-image.sh [IMAGE]     (default gpumesh-test/python:1)
#
# The image holds the interpreter, its standard library (without tests, Tk and
# IDLE), the shared libraries `ldd` lists for them, the busybox applets of the
# busybox test image, and pip on PYTHONPATH. Built once: an image already
# tagged IMAGE is left alone (`docker rmi IMAGE` to rebuild).
#
# Env:
#   PYTHON   the interpreter to copy, and where pip comes from (default python3;
#            a virtualenv's python works: its base interpreter is copied)
set -euo pipefail

IMAGE=${1:-${GPUMESH_TEST_PYTHON_IMAGE:-gpumesh-test/python:1}}
PYTHON=${PYTHON:-python3}
APPLETS="sh echo cat ls sleep id env head tail true false printf wc grep sed tr mkdir rm
touch pwd test expr dd find du df"

die() { echo "build-python-image: $*" >&2; exit 1; }

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  exit 0
fi
command -v ldd >/dev/null || die "ldd is needed to find the interpreter's libraries"
[ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1 ||
  die "/bin/busybox must be a static binary (apt-get install busybox-static)"

# binary, version, stdlib, lib-dynload, pip's package folder (empty without pip)
mapfile -t facts < <("$PYTHON" - <<'EOF'
import os, sys, sysconfig
print(os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable))
print(f"{sys.version_info[0]}.{sys.version_info[1]}")
print(sysconfig.get_path("stdlib"))
print(sysconfig.get_config_var("DESTSHARED") or "")
try:
    import pip
    print(os.path.dirname(pip.__file__))
except ImportError:
    print("")
EOF
)
binary=${facts[0]} version=${facts[1]} stdlib=${facts[2]} dynload=${facts[3]} pip=${facts[4]:-}
[ -x "$binary" ] && [ -f "$stdlib/os.py" ] || die "cannot find $PYTHON's interpreter and stdlib"
[ -n "$pip" ] || die "$PYTHON has no pip to copy (try PYTHON=path/to/venv/bin/python)"

rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
lib=$rootfs/usr/lib/python$version
mkdir -p "$rootfs/bin" "$rootfs/usr/bin" "$rootfs/etc" "$rootfs/tmp" "$lib/lib-dynload" \
  "$rootfs/opt/pip"
chmod 1777 "$rootfs/tmp"

# Python looks for its stdlib next to the binary (../lib/pythonX.Y/os.py), so
# /usr/bin/pythonX.Y finds /usr/lib/pythonX.Y wherever it was built for.
cp "$binary" "$rootfs/usr/bin/python$version"
ln -s "python$version" "$rootfs/usr/bin/python3"
# EXTERNALLY-MANAGED (a distribution's "use apt, not pip" marker) would make
# pip refuse even `pip install --user` in the image, which no apt manages.
tar -C "$stdlib" -c --exclude=./site-packages --exclude=./lib-dynload --exclude='./config-*' \
  --exclude=./idlelib --exclude=./tkinter --exclude=./turtledemo --exclude=./ensurepip \
  --exclude=./EXTERNALLY-MANAGED --exclude=test --exclude=tests --exclude=__pycache__ . |
  tar -C "$lib" -x
elves=("$binary")
if [ -d "$dynload" ]; then
  for module in "$dynload"/*.so; do
    case ${module##*/} in _tkinter*) continue ;; esac
    cp "$module" "$lib/lib-dynload/"
    elves+=("$module")
  done
fi
cp -r "$pip" "$rootfs/opt/pip/"
find "$rootfs/opt/pip" -name __pycache__ -prune -exec rm -rf {} +

# Each library at its own path (the loader's, too); there is no ld.so.cache
# in the image, so LD_LIBRARY_PATH names their folders.
libdirs=()
while read -r path; do
  [ -n "$path" ] || continue
  mkdir -p "$rootfs$(dirname "$path")"
  cp -L "$path" "$rootfs$path"
  libdirs+=("$(dirname "$path")")
done < <(for elf in "${elves[@]}"; do ldd "$elf"; done |
  awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | sort -u)
library_path=$(printf '%s\n' "${libdirs[@]}" | sort -u | paste -sd:)

cp /bin/busybox "$rootfs/bin/busybox"
for applet in $APPLETS; do ln -s busybox "$rootfs/bin/$applet"; done
printf 'root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$rootfs/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$rootfs/etc/group"

tar -C "$rootfs" --owner=0 --group=0 --numeric-owner -c . |
  docker import -c 'CMD ["python3"]' -c 'ENV PATH=/usr/bin:/bin' \
    -c "ENV LD_LIBRARY_PATH=$library_path" -c 'ENV PYTHONPATH=/opt/pip' - "$IMAGE" >/dev/null
docker run --rm --network none "$IMAGE" python3 -m pip --version >/dev/null ||
  { docker rmi "$IMAGE" >/dev/null; die "the built image cannot run python3 with pip"; }
echo "built $IMAGE (Python $version)"
