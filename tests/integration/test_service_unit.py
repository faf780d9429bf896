"""``gpumesh share --print-systemd-unit``: a unit systemd itself accepts, for this home.

Checked with ``systemd-analyze verify`` (systemd's own parser; it needs no running
systemd), which warns on stderr about every key it does not understand and fails
when ExecStart is not an executable.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpumesh.client.service import node_command, systemd_unit
from tests.integration.conftest import gpumesh
from tests.integration.node import shares

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            raise AssertionError(
                "CI must have systemd-analyze (scripts/ensure-docker.sh installs it)"
            )
        pytest.skip("no systemd-analyze on this machine")
    return subprocess.run(
        [tool, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )


def _unit_lines(text: str) -> dict[str, str]:
    keys: dict[str, str] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            keys[key] = value
    return keys


def test_the_printed_unit_runs_this_share_for_this_home_and_systemd_accepts_it(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home with space"
    assert gpumesh(home, "init", "--name", "svc-box").returncode == 0
    result = gpumesh(home, "share", "--print-systemd-unit", "--port", "47123", "--max-vram", "8GB")
    assert result.returncode == 0, result.stderr
    keys = _unit_lines(result.stdout)
    assert keys["User"] == getpass.getuser()
    assert keys["Environment"] == f"'GPUMESH_HOME={home.resolve()}'"
    # systemd tracks the home's node process, sharing with the same options.
    assert keys["ExecStart"].endswith(" daemon run --port 47123 --max-vram 8GB")
    assert keys["Restart"] == "on-failure"
    assert keys["WantedBy"] == "multi-user.target"
    unit = tmp_path / "gpumesh-share.service"
    unit.write_text(result.stdout)
    verified = _verify(unit)
    assert verified.returncode == 0, verified.stderr
    assert verified.stderr.strip() == ""  # systemd understood every line
    # Nothing was started: printing a unit is not sharing.
    assert not shares(home)


def test_verify_catches_a_unit_whose_command_is_not_there(tmp_path: Path) -> None:
    """The check above can fail: systemd refuses a unit naming a missing program."""
    text = systemd_unit(tmp_path, user=getpass.getuser(), command=[str(tmp_path / "nope"), "share"])
    unit = tmp_path / "gpumesh-share.service"
    unit.write_text(text)
    verified = _verify(unit)
    assert verified.returncode != 0
    assert "nope" in verified.stderr


def test_percent_and_dollar_in_a_path_reach_the_command_unchanged(tmp_path: Path) -> None:
    odd = tmp_path / "50%$HOME"
    text = systemd_unit(odd, user="someone", command=["/opt/g mesh/gpumesh", "share"])
    keys = _unit_lines(text)
    assert keys["ExecStart"] == "'/opt/g mesh/gpumesh' share"
    assert keys["Environment"] == f"'GPUMESH_HOME={tmp_path}/50%%$HOME'"


def test_the_node_command_is_this_installation(tmp_path: Path) -> None:
    script = tmp_path / "gpumesh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert node_command(str(script)) == [str(script.resolve()), "daemon", "run"]
    command = node_command(str(tmp_path / "not-a-script"))
    assert command[1:] == ["-m", "gpumesh", "daemon", "run"]
    assert os.access(command[0], os.X_OK)
