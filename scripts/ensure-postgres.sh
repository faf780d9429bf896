#!/usr/bin/env bash
# Make sure a PostgreSQL server runs here for the registry's tests, and print its URL.
#
#   scripts/ensure-postgres.sh [DBNAME]   -> postgresql://DBNAME:DBNAME@127.0.0.1:PORT/DBNAME
#
# Debian's `postgresql` package, installed when missing; its cluster started
# with pg_ctlcluster (no systemd needed); a role and a database for the tests,
# created when missing. Idempotent and quiet; needs root the first time.
set -euo pipefail
# Everything but the URL goes to stderr: callers read the one line on stdout.
exec 3>&1 1>&2
db=${1:-gpumesh_test}
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "error: PostgreSQL is not installed (Debian/Ubuntu, as root: apt-get install postgresql)" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
ver=$(ls /usr/lib/postgresql | sort -n | tail -1)
if ! pg_lsclusters -h | awk '{print $1, $2}' | grep -q "^$ver main$"; then
  pg_createcluster "$ver" main >/dev/null
fi
if ! pg_ctlcluster "$ver" main status >/dev/null 2>&1; then
  pg_ctlcluster "$ver" main start 3>&-   # may say "Removed stale pid file."; the server must not hold the URL pipe
fi
as_postgres() { if [ "$(id -u)" = 0 ]; then su postgres -c "$1"; else sh -c "$1"; fi; }
for _ in $(seq 100); do
  as_postgres "pg_isready -q" && break
  sleep 0.1
done
if ! as_postgres "psql -qtAc \"SELECT 1 FROM pg_roles WHERE rolname='$db'\"" | grep -q 1; then
  as_postgres "psql -qc \"CREATE ROLE $db LOGIN PASSWORD '$db'\"" >/dev/null
fi
if ! as_postgres "psql -qtAc \"SELECT 1 FROM pg_database WHERE datname='$db'\"" | grep -q 1; then
  as_postgres "createdb -O $db $db"
fi
port=$(pg_lsclusters -h | awk -v v="$ver" '$1==v && $2=="main" {print $3}')
echo "postgresql://$db:$db@127.0.0.1:$port/$db" >&3
