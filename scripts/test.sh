#!/usr/bin/env bash
# The project's test command: lint, format check, type check, then pytest.
#
#   scripts/test.sh [PYTEST ARGS...]     e.g. scripts/test.sh -k identity -x
#   scripts/test.sh --fast [PYTEST ARGS...]
#                                        the fast tier, to run while working: the
#                                        same checks, tests/unit and tests/fuzz,
#                                        and the tests not marked browser, desktop,
#                                        postgres, wan or subprocess, plus a smoke
#                                        slice (tests/tiers.py), in two test
#                                        processes (pytest-xdist: most of these
#                                        tests wait on sockets, engines and
#                                        timers, not the CPU); no browser,
#                                        desktop or PostgreSQL setup. CI runs all.
#
# Env:
#   GPUMESH_SKIP_INSTALL=1   do not (re)install the package into .venv
#   GPUMESH_TEST_NO_DOCKER=1 skip the Docker setup and the tests that need it
#   GPUMESH_TEST_NO_DESKTOP=1 skip installing Xvfb/x11vnc/FreeRDP and the tests
#                            that drive them
#   GPUMESH_TEST_NO_BROWSER=1 skip the chromium setup and the browser tests
#   GPUMESH_TEST_NO_POSTGRES=1 skip the PostgreSQL setup and the registry's
#                            PostgreSQL tests (they also run on SQLite)
#   CI=true                  a broken Docker, desktop, browser or PostgreSQL setup
#                            fails the run instead of skipping those tests
#   GPUMESH_TEST_WORKERS=N   the fast tier's test processes (default 2; 0: one)
#   PYTHON                   interpreter used to create .venv (default python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
started=$SECONDS

fast=0
if [ "${1:-}" = --fast ]; then
  fast=1
  shift
  # What the fast tier leaves out needs no setup; an installed .venv is kept.
  export GPUMESH_TEST_NO_DESKTOP=1 GPUMESH_TEST_NO_BROWSER=1 GPUMESH_TEST_NO_POSTGRES=1
  [ -x .venv/bin/gpumesh ] && export GPUMESH_SKIP_INSTALL=${GPUMESH_SKIP_INSTALL:-1}
fi

stage() { printf '\n==> %s\n' "$*"; }
is_ci() { case "${CI:-}" in "" | 0 | false | no) return 1 ;; *) return 0 ;; esac; }

# 1. Virtual environment. Debian ships venv support separately (python3-venv),
# so a fresh CI machine may need it installed first.
if [ ! -x .venv/bin/python ]; then
  stage "Creating .venv"
  if ! "${PYTHON:-python3}" -m venv .venv; then
    rm -rf .venv   # a half-made venv (no pip) would break every later run
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        python3-venv >/dev/null
      "${PYTHON:-python3}" -m venv .venv
    else
      echo "error: could not create .venv (on Debian/Ubuntu: apt-get install python3-venv)" >&2
      exit 1
    fi
  fi
fi
# Use the venv's tools (ruff, mypy, pytest) without needing `activate`.
export VIRTUAL_ENV=$PWD/.venv
export PATH=$VIRTUAL_ENV/bin:$PATH

if [ "${GPUMESH_SKIP_INSTALL:-}" = 1 ]; then
  stage "Install: skipped (GPUMESH_SKIP_INSTALL=1)"
else
  stage "Installing gpumesh[dev] into .venv"
  python -m pip install -q --disable-pip-version-check -e '.[dev]'
fi

# 2. Docker. Tests that need a daemon use this image, built offline.
export GPUMESH_TEST_DOCKER_IMAGE=gpumesh-test/busybox:1
if [ "${GPUMESH_TEST_NO_DOCKER:-}" = 1 ]; then
  stage "Docker: skipped (GPUMESH_TEST_NO_DOCKER=1)"
else
  stage "Docker"
  if ! scripts/ensure-docker.sh; then
    if is_ci; then
      echo "error: Docker setup failed in CI; refusing to skip the Docker tests" >&2
      exit 1
    fi
    # A developer laptop without root or Docker still gets the other tests.
    echo "warning: Docker is not available; Docker tests will be SKIPPED" >&2
    export GPUMESH_TEST_NO_DOCKER=1
  fi
fi

# 2b. The desktop tunnel's tests drive real VNC and RDP servers and clients.
if [ "${GPUMESH_TEST_NO_DESKTOP:-}" = 1 ]; then
  stage "Desktop programs: skipped (GPUMESH_TEST_NO_DESKTOP=1)"
else
  stage "Desktop programs (Xvfb, x11vnc, FreeRDP)"
  if ! scripts/ensure-desktop.sh; then
    if is_ci; then
      echo "error: desktop programs missing in CI; refusing to skip the desktop tests" >&2
      exit 1
    fi
    echo "warning: Xvfb/x11vnc/FreeRDP are not available; desktop tests will be SKIPPED" >&2
    export GPUMESH_TEST_NO_DESKTOP=1
  fi
fi

# 2c. A browser for the dashboard's tests: Debian's chromium, and zbar-tools.
if [ "${GPUMESH_TEST_NO_BROWSER:-}" = 1 ]; then
  stage "Browser: skipped (GPUMESH_TEST_NO_BROWSER=1)"
else
  stage "Browser"
  if ! scripts/ensure-browser.sh; then
    if is_ci; then
      echo "error: browser setup failed in CI; refusing to skip the browser tests" >&2
      exit 1
    fi
    echo "warning: chromium is not available; browser tests will be SKIPPED" >&2
    export GPUMESH_TEST_NO_BROWSER=1
  fi
fi

# 2d. PostgreSQL, for the registry's tests (they run on SQLite and PostgreSQL).
if [ "${GPUMESH_TEST_NO_POSTGRES:-}" = 1 ]; then
  stage "PostgreSQL: skipped (GPUMESH_TEST_NO_POSTGRES=1)"
else
  stage "PostgreSQL"
  if url=$(scripts/ensure-postgres.sh); then
    export GPUMESH_TEST_POSTGRES_URL=$url
  else
    if is_ci; then
      echo "error: PostgreSQL setup failed in CI; refusing to skip the PostgreSQL tests" >&2
      exit 1
    fi
    echo "warning: PostgreSQL is not available; PostgreSQL tests will be SKIPPED" >&2
    export GPUMESH_TEST_NO_POSTGRES=1
  fi
fi

# 3. Static checks, then the tests; the first failure stops the run.
stage "ruff check"
ruff check src tests bench

stage "ruff format --check"
ruff format --check src tests bench

stage "mypy"
mypy

stage "pytest"
rc=0
if [ "$fast" = 1 ]; then
  GPUMESH_TEST_FAST_SUMMARY=$(mktemp)
  export GPUMESH_TEST_FAST_SUMMARY
  pytest --fast -n "${GPUMESH_TEST_WORKERS:-2}" "$@" || rc=$?
else
  pytest "$@" || rc=$?
fi
if [ "$rc" = 5 ]; then
  # pytest's "no tests collected": a typo in -k or a broken layout, not a pass.
  echo "error: pytest collected no tests" >&2
fi
[ "$rc" = 0 ] || exit "$rc"

stage "All checks passed in $((SECONDS - started)) s"
if [ "$fast" = 1 ]; then
  cat "$GPUMESH_TEST_FAST_SUMMARY"   # the last line: what the fast tier left out
  rm -f "$GPUMESH_TEST_FAST_SUMMARY"
fi
