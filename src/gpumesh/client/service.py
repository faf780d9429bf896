"""Keeping a home shared across reboots: a systemd unit for this home.

The unit runs the home's node process in the foreground, sharing with the
options the user gave ``gpumesh share`` (``gpumesh daemon run [share options]``),
as the user who asked for it, with ``GPUMESH_HOME`` pinned to the home it was
printed for: systemd then tracks the process that owns the home. On systemd's
SIGTERM it stops sharing cleanly (running jobs keep their containers and are
picked up on the next start); ``Restart=on-failure`` brings sharing back after a
crash. Nothing here installs anything: the user decides where the unit goes.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

__all__ = ["UNIT_NAME", "node_command", "systemd_unit"]

UNIT_NAME = "gpumesh-share.service"


def node_command(argv0: str | None = None) -> list[str]:
    """The command line that runs the node process in the foreground with this
    installation (``gpumesh daemon run``).

    The ``gpumesh`` script that is running now when there is one (a virtual
    environment's stays valid as long as the environment does), else this
    interpreter with ``-m gpumesh``."""
    script = Path(argv0 if argv0 is not None else sys.argv[0])
    if script.name == "gpumesh" and script.is_file() and os.access(script, os.X_OK):
        return [str(script.resolve()), "daemon", "run"]
    return [str(Path(sys.executable).resolve()), "-m", "gpumesh", "daemon", "run"]


def _quote(arg: str, *, command: bool = False) -> str:
    # systemd splits words like a shell for quoting; '%' is its specifier escape
    # everywhere, and '$' starts a variable on command lines only.
    quoted = shlex.quote(arg).replace("%", "%%")
    return quoted.replace("$", "$$") if command else quoted


def systemd_unit(
    home: Path, *, user: str, command: list[str], extra_args: list[str] | None = None
) -> str:
    """The text of a system unit that shares this machine from ``home`` as ``user``."""
    exec_start = " ".join(_quote(a, command=True) for a in [*command, *(extra_args or [])])
    return f"""\
# GPUMesh: share this machine's GPUs with paired peers.
# Install: sudo cp {UNIT_NAME} /etc/systemd/system/ && sudo systemctl enable --now {UNIT_NAME}
# Logs:    journalctl -u {UNIT_NAME}   (and {home}/logs)
[Unit]
Description=GPUMesh share ({home})
Wants=network-online.target
After=network-online.target docker.service

[Service]
Type=simple
User={user}
Environment={_quote("GPUMESH_HOME=" + str(home))}
ExecStart={exec_start}
Restart=on-failure
RestartSec=5
# On SIGTERM the node process stops sharing: links close, jobs' containers keep running.
KillSignal=SIGTERM
TimeoutStopSec=30

[Install]
WantedBy=multi-user.target
"""
