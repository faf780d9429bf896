"""Shell completion through the real ``gpumesh`` and click's completion protocol.

Each test runs the CLI in a subprocess with the variables a shell's completion
script sets at a Tab press, on homes made by the real CLI (init, pair, group),
and checks that the names of peers, groups and jobs come back; bash also runs
its script for real.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumesh.store.db import Store
from gpumesh.store.jobs import JobRecord
from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _init

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

SUBMITTED_ID = "a1b2c3d4e5f6"
HOSTED_ID = "0f9e8d7c6b5a"


@pytest.fixture
def bob(tmp_path: Path) -> Path:
    """bob-laptop, paired with alice-pc and carol-box, in group research with
    alice, with a job submitted to alice and one hosted for carol."""
    homes = {name: tmp_path / name for name in ("alice-pc", "bob-laptop", "carol-box")}
    for name, home in homes.items():
        _init(home, name)
    bob = homes["bob-laptop"]
    for peer in ("alice-pc", "carol-box"):
        code = gpumesh(homes[peer], "pair-code").stdout.strip()
        assert gpumesh(bob, "pair", code).returncode == 0
    assert gpumesh(bob, "group", "create", "research").returncode == 0
    assert gpumesh(bob, "group", "add", "research", "alice-pc").returncode == 0
    # Completion reads the store itself: no node process holds it here (one test
    # locks it against everyone).
    assert gpumesh(bob, "daemon", "stop").returncode == 0
    store = Store(bob / "gpumesh.db")
    try:
        peers = {p.name: p.node_id for p in store.peers()}
        for role, job_id, peer, state in (
            ("submitted", SUBMITTED_ID, "alice-pc", "running"),
            ("hosted", HOSTED_ID, "carol-box", "succeeded"),
        ):
            store.add_job(
                JobRecord(
                    role=role,
                    job_id=job_id,
                    peer_id=peers[peer],
                    peer_name=peer,
                    image="busybox",
                    command=["true"],
                    env={},
                    gpu_memory=0,
                    gpus=[],
                    retries=0,
                    timeout=0,
                    workdir="",
                    created_at=time.time(),
                    state=state,
                )
            )
    finally:
        store.close()
    return bob


def _complete(home: Path, shell: str, **variables: str) -> subprocess.CompletedProcess[str]:
    """One Tab press: gpumesh run the way the shell's script runs it."""
    env = dict(os.environ, GPUMESH_HOME=str(home), _GPUMESH_COMPLETE=f"{shell}_complete")
    env.pop("GPUMESH_LOG", None)
    env.update(variables)
    result = subprocess.run(
        [sys.executable, "-m", "gpumesh"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    return result


def _bash(home: Path, line: str) -> list[str]:
    """bash's and zsh's protocol: the words, and the index of the one completed."""
    words = line.split(" ")
    result = _complete(home, "bash", COMP_WORDS=line, COMP_CWORD=str(len(words) - 1))
    return [answer for answer in result.stdout.splitlines() if answer]


def test_bash_completes_peer_names_for_every_command_that_takes_one(bob: Path) -> None:
    for line in (
        "gpumesh connect ",
        "gpumesh exec ",
        "gpumesh deny ",
        "gpumesh allow ",
        "gpumesh run --peer ",
        "gpumesh cancel --peer ",
        "gpumesh app sync --peer ",
        "gpumesh group add research ",
    ):
        assert _bash(bob, line) == ["plain,alice-pc", "plain,carol-box"], line
    assert _bash(bob, "gpumesh connect car") == ["plain,carol-box"]
    assert _bash(bob, "gpumesh connect zed") == []
    # Commands and options are completed as before.
    assert "plain,connect" in _bash(bob, "gpumesh con")
    assert "plain,--peer" in _bash(bob, "gpumesh run --pe")


def test_bash_completes_job_ids_and_group_names(bob: Path) -> None:
    # Newest first: the hosted job was recorded last.
    assert _bash(bob, "gpumesh logs ") == [f"plain,{HOSTED_ID}", f"plain,{SUBMITTED_ID}"]
    assert _bash(bob, "gpumesh logs a1") == [f"plain,{SUBMITTED_ID}"]
    # Only jobs submitted from here can be cancelled from here.
    assert _bash(bob, "gpumesh cancel ") == [f"plain,{SUBMITTED_ID}"]
    assert _bash(bob, "gpumesh app pull --job ") == [f"plain,{SUBMITTED_ID}"]
    for line in (
        "gpumesh run --group ",
        "gpumesh group members ",
        "gpumesh group invite re",
        "gpumesh group add ",
    ):
        assert _bash(bob, line) == ["plain,research"], line


def test_zsh_shows_what_each_name_is(bob: Path) -> None:
    assert gpumesh(bob, "deny", "carol-box").returncode == 0
    line = "gpumesh logs "
    result = _complete(bob, "zsh", COMP_WORDS=line, COMP_CWORD="2")
    # zsh's protocol: type, value and help on three lines each.
    triples = result.stdout.splitlines()
    items = {triples[i + 1]: triples[i + 2] for i in range(0, len(triples), 3)}
    assert items == {
        SUBMITTED_ID: "running on alice-pc",
        HOSTED_ID: "succeeded for carol-box",
    }
    result = _complete(bob, "zsh", COMP_WORDS="gpumesh connect ", COMP_CWORD="2")
    assert result.stdout.splitlines() == ["plain", "alice-pc", "_", "plain", "carol-box", "denied"]
    result = _complete(bob, "zsh", COMP_WORDS="gpumesh run --group ", COMP_CWORD="3")
    assert result.stdout.splitlines() == ["plain", "research", "2 members"]


def test_fish_completes_peers_in_cp_and_groups(bob: Path) -> None:
    # fish's protocol: the line up to the cursor and the token being completed.
    result = _complete(bob, "fish", COMP_WORDS="gpumesh cp ./data.bin a", COMP_CWORD="a")
    assert result.stdout.splitlines() == ["file,a", "plain,alice-pc:"]
    result = _complete(bob, "fish", COMP_WORDS="gpumesh cp ", COMP_CWORD="")
    assert result.stdout.splitlines()[1:3] == ["plain,alice-pc:", "plain,carol-box:"]
    # A local path is left to the shell's own file completion.
    result = _complete(bob, "fish", COMP_WORDS="gpumesh cp ./d", COMP_CWORD="./d")
    assert result.stdout.splitlines() == ["file,./d"]
    # After PEER: nothing is offered (listing the peer's folder would take a connection).
    result = _complete(bob, "fish", COMP_WORDS="gpumesh cp alice-pc:/d", COMP_CWORD="alice-pc:/d")
    assert result.stdout == "\n"
    result = _complete(bob, "fish", COMP_WORDS="gpumesh exec c", COMP_CWORD="c")
    assert result.stdout.splitlines() == ["plain,carol-box"]


def test_completion_without_a_usable_store_offers_nothing_and_never_fails(
    bob: Path, tmp_path: Path
) -> None:
    line = "gpumesh connect "
    # No home at all, and a folder that holds no node.
    for home in (tmp_path / "nowhere", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        result = _complete(home, "bash", COMP_WORDS=line, COMP_CWORD="2")
        assert result.stdout.strip() == ""
        assert not home.joinpath("gpumesh.db").exists()  # completion never creates state
    # A store held by a writer that keeps everyone else out.
    holder = sqlite3.connect(bob / "gpumesh.db", isolation_level=None)
    try:
        holder.execute("PRAGMA locking_mode=EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        result = _complete(bob, "bash", COMP_WORDS=line, COMP_CWORD="2")
        assert result.stdout.strip() == ""
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert _bash(bob, line) == ["plain,alice-pc", "plain,carol-box"]
    # A file that is not a database.
    broken = tmp_path / "broken"
    shutil.copytree(bob, broken, ignore=shutil.ignore_patterns("gpumesh.db*"))
    (broken / "gpumesh.db").write_bytes(b"not a database" * 100)
    result = _complete(broken, "bash", COMP_WORDS=line, COMP_CWORD="2")
    assert result.stdout.strip() == ""


def _powershell_script(home: Path) -> str:
    result = gpumesh(home, "completion", "powershell")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_powershell_script_and_its_callback_protocol(bob: Path) -> None:
    script = _powershell_script(bob)
    assert script.startswith("Register-ArgumentCompleter -Native -CommandName gpumesh ")
    # What the script sets before it runs gpumesh: the protocol the CLI must answer.
    table = re.search(r"\$vars = @\{(.*?)\n    \}", script, re.S)
    assert table is not None
    set_vars = dict(re.findall(r"'(\w+)' = (\S+)", table.group(1)))
    assert set_vars == {
        "_GPUMESH_COMPLETE": "'powershell_complete'",
        "COMP_WORDS": "$line",
        "COMP_CWORD": '"$wordToComplete"',
    }
    assert "[Environment]::SetEnvironmentVariable($name, $saved[$name])" in script

    def press_tab(line: str, word: str) -> list[list[str]]:
        result = _complete(bob, "powershell", COMP_WORDS=line, COMP_CWORD=word)
        return [answer.split("\t") for answer in result.stdout.splitlines() if answer]

    # PowerShell hands over the command up to the cursor (no trailing blank) and the word.
    assert press_tab("gpumesh connect", "") == [
        ["plain", "alice-pc", ""],
        ["plain", "carol-box", ""],
    ]
    assert press_tab("gpumesh connect al", "al") == [["plain", "alice-pc", ""]]
    assert press_tab("gpumesh logs a1", "a1") == [["plain", SUBMITTED_ID, "running on alice-pc"]]
    assert press_tab("gpumesh run --group", "") == [["plain", "research", "2 members"]]
    assert ["plain", "completion", "Print the completion script for SHELL."] in press_tab(
        "gpumesh comp", "comp"
    )


def _wrapper(tmp_path: Path) -> Path:
    """A ``gpumesh`` on PATH that runs this checkout with this interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "gpumesh"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gpumesh "$@"\n')
    wrapper.chmod(0o755)
    return bin_dir


# PowerShell is not packaged by Debian, so the machines this suite runs on have no
# pwsh: there the script's protocol is checked by test_powershell_script_and_its_callback_protocol
# (the same environment the script sets); where pwsh exists, it runs for real.
if shutil.which("pwsh") is not None:

    def test_powershell_completes_through_its_script(bob: Path, tmp_path: Path) -> None:
        script_path = tmp_path / "gpumesh.ps1"
        script_path.write_text(_powershell_script(bob))
        line = "gpumesh connect al"
        command = (
            f". '{script_path}'; "
            f"(TabExpansion2 -inputScript '{line}' -cursorColumn {len(line)}).CompletionMatches"
            " | ForEach-Object { $_.CompletionText }"
        )
        env = dict(os.environ, GPUMESH_HOME=str(bob))
        env["PATH"] = f"{_wrapper(tmp_path)}{os.pathsep}{env['PATH']}"
        result = subprocess.run(
            ["pwsh", "-NoProfile", "-NonInteractive", "-Command", command],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["alice-pc"]


def test_bash_completes_through_its_script(bob: Path, tmp_path: Path) -> None:
    script = gpumesh(bob, "completion", "bash")
    assert script.returncode == 0, script.stderr
    script_path = tmp_path / "gpumesh.bash"
    script_path.write_text(script.stdout)
    env = dict(os.environ, GPUMESH_HOME=str(bob))
    env["PATH"] = f"{_wrapper(tmp_path)}{os.pathsep}{env['PATH']}"
    env.pop("GPUMESH_LOG", None)
    probe = (
        f"source '{script_path}'; "
        "COMP_WORDS=(gpumesh logs ''); COMP_CWORD=2; _gpumesh_completion gpumesh; "
        'printf "%s\\n" "${COMPREPLY[@]}"; '
        "COMPREPLY=(); COMP_WORDS=(gpumesh run --peer ca); COMP_CWORD=3; "
        "_gpumesh_completion gpumesh; "
        'printf "%s\\n" "${COMPREPLY[@]}"; '
        # cp's PEER: beside local files (the script's `file` entry wiped the peers).
        "COMPREPLY=(); COMP_WORDS=(gpumesh cp ./data.bin al); COMP_CWORD=3; "
        "_gpumesh_completion gpumesh; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    result = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", probe],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == sorted(
        [SUBMITTED_ID, HOSTED_ID, "carol-box", "alice-pc:"]
    )


def test_completion_scripts_for_every_shell(bob: Path) -> None:
    for shell in ("bash", "zsh", "fish", "powershell"):
        result = gpumesh(bob, "completion", shell)
        assert result.returncode == 0, result.stderr
        assert "_GPUMESH_COMPLETE" in result.stdout, shell
    help_text = gpumesh(bob, "completion", "--help").stdout
    assert "bash|zsh|fish|powershell" in help_text
    assert "job ids" in help_text
