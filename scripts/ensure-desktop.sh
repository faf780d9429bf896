#!/usr/bin/env bash
# Make sure the programs the desktop tunnel's tests drive are installed: an X
# server without a screen (Xvfb), a VNC server on it (x11vnc), an RDP server on it
# (freerdp-shadow-cli) and an RDP client (xfreerdp), xdotool, and xev/xmessage
# (x11-utils) to put something on the screen and see the keys that arrive. The
# scripted VNC client (vncdotool) is a Python dev dependency.
#
# Idempotent and quiet: apt-get runs only when something is missing (as root on
# Debian/Ubuntu). Starts nothing: each test starts its own X display and servers
# and stops them.
set -euo pipefail

die() { echo "ensure-desktop: $*" >&2; exit 1; }

missing=()
command -v Xvfb >/dev/null || missing+=(xvfb)
command -v x11vnc >/dev/null || missing+=(x11vnc)
command -v xdotool >/dev/null || missing+=(xdotool)
command -v xev >/dev/null || missing+=(x11-utils)
command -v xmessage >/dev/null || missing+=(x11-utils)
command -v xfreerdp >/dev/null || missing+=(freerdp2-x11)
command -v freerdp-shadow-cli >/dev/null || missing+=(freerdp2-shadow-x11)
command -v setpriv >/dev/null || missing+=(util-linux)
[ ${#missing[@]} -eq 0 ] && exit 0

[ "$(id -u)" = 0 ] || die "need root to install: ${missing[*]} (run: sudo apt-get install ${missing[*]})"
command -v apt-get >/dev/null || die "no apt-get; please install: ${missing[*]}"
echo "ensure-desktop: installing ${missing[*]}" >&2
apt-get update -qq
# shellcheck disable=SC2046  # dedupe; package names have no spaces
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null 2> >(grep -v '^debconf: delaying' >&2)
for program in Xvfb x11vnc xdotool xev xmessage xfreerdp freerdp-shadow-cli; do
  command -v "$program" >/dev/null || die "$program is still missing after the install"
done
