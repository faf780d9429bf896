#!/usr/bin/env bash
# Make sure the browser tests' tools are installed: Debian's chromium (driven by
# Playwright; never a downloaded browser) and zbar-tools (zbarimg decodes the
# dashboard's QR code from a screenshot).
#
# Idempotent and quiet: apt-get runs only when something is missing (as root).
set -euo pipefail

die() { echo "ensure-browser: $*" >&2; exit 1; }

missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v zbarimg >/dev/null 2>&1 || missing+=(zbar-tools)
[ "${#missing[@]}" = 0 ] && exit 0

[ "$(id -u)" = 0 ] || die "need root to install: ${missing[*]} (run: sudo apt-get install ${missing[*]})"
command -v apt-get >/dev/null || die "no apt-get; please install: ${missing[*]}"
apt-get update -qq -o DPkg::Lock::Timeout=600
echo "ensure-browser: installing ${missing[*]}" >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends "${missing[@]}" \
  >/dev/null 2> >(grep -v '^debconf: delaying' >&2)
[ -x /usr/bin/chromium ] || die "chromium did not install at /usr/bin/chromium"
command -v zbarimg >/dev/null 2>&1 || die "zbarimg did not install"
