"""Every `gpumesh` command in the README's examples, run as a user would type it.

Two homes on this machine stand in for the README's two machines: alice-pc shares
(a real `gpumesh share` on loopback, a real Docker engine) and bob-laptop uses
her. Each example line (from a fenced code block, its comment cut off) has an
entry in :data:`STEPS` saying where it runs and with which placeholder filled in
(a pairing code, a job id, a file the README assumes), or why it cannot run here
(a GPU, an image from Docker Hub, a registry, a second real machine, a command
that serves until Ctrl-C). A README example without an entry fails the test, as
does an entry for a line the README no longer has: the two are kept together.
The skipped lines and their reasons are printed (`pytest -s` shows them).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.test_cli import _free_udp_port, _init, running_share

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

README = Path(__file__).resolve().parents[2] / "README.md"
IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
GPU = "needs an NVIDIA GPU"
HUB = "needs an image from Docker Hub (no registry is reachable here)"
PYTHON = "runs Python, which the offline test image (busybox) lacks"
FOREGROUND = "serves in the foreground until Ctrl-C (its own tests run it)"


@dataclass(frozen=True)
class Step:
    """How one README line runs here: ``skip`` says why it does not."""

    home: str = "b"
    """``a`` (alice-pc), ``b`` (bob-laptop) or ``c`` (a third home)."""
    args: tuple[str, ...] = ()
    """What to run instead of the line as written (placeholders filled in)."""
    skip: str = ""
    stdin: str = ""
    codes: tuple[int, ...] = (0,)
    """Exit codes that are right here (doctor fails a check Docker's setup lacks)."""
    node: bool = False
    """Through the node process (the commands that need one), not in-process."""
    env: dict[str, str] = field(default_factory=dict)
    to_file: str = ""
    """The line redirects its output to a file: written here (under the work folder)."""
    says: str = ""
    """Text its output must hold."""


STEPS: dict[str, Step] = {
    "gpumesh init --name alice-pc": Step(skip="made by the test's set-up, like this"),
    "gpumesh share": Step(skip="runs for the whole test as alice-pc's provider"),
    "gpumesh init --name bob-laptop": Step(skip="made by the test's set-up, like this"),
    "gpumesh pair 'gpm1_...alice code...'": Step(args=("pair", "{alice_code}")),
    "gpumesh pair-code": Step(),
    "gpumesh connect alice-pc": Step(says="alice-pc is reachable"),
    "gpumesh run --peer alice-pc -- nvidia-smi": Step(skip=GPU),
    "gpumesh run --peer alice-pc --image pytorch/pytorch -- python -c 'import torch; "
    "print(torch.cuda.is_available())'": Step(skip=HUB),
    "gpumesh run --peer alice-pc --workdir ./train --env WANDB_MODE=offline "
    "--gpu-memory 8GB -- python train.py": Step(skip=GPU),
    "gpumesh run -f job.yaml --retries 2": Step(says="from job.yaml"),
    "gpumesh run --peer alice-pc --detach -- ./long.sh": Step(
        args=("run", "--peer", "alice-pc", "--detach", "--", "sleep", "600")
    ),
    "gpumesh jobs": Step(),
    "gpumesh jobs --offline": Step(),
    "gpumesh logs -f 3f9a": Step(args=("logs", "-f", "{done_prefix}")),
    "gpumesh cancel 3f9a": Step(args=("cancel", "{detached_prefix}")),
    "gpumesh pause --grace 10s": Step(home="a", says="Paused: "),
    "gpumesh resume": Step(home="a", says="Resumed: peers may use this machine again."),
    "gpumesh cp ./datasets alice-pc:/": Step(),
    "gpumesh run --peer alice-pc --mount /datasets:/data -- python train.py --data /data": Step(
        skip=PYTHON
    ),
    "gpumesh cp ./out alice-pc:/": Step(),
    "gpumesh run --peer alice-pc --mount /out:/out:rw -- sh -c 'date > /out/t'": Step(),
    "gpumesh cp alice-pc:/out/t ./t": Step(),
    "gpumesh run --peer alice-pc --outputs /workspace/out -- python train.py": Step(skip=PYTHON),
    (
        "gpumesh run --group lab --outputs /out --wait 30m -- sh -c 'python train.py "
        '--ckpt-dir "$GPUMESH_OUTPUTS"\''
    ): Step(skip=PYTHON),
    "gpumesh exec alice-pc": Step(stdin="echo hello from the shell\nexit\n", says="hello from"),
    "gpumesh exec --image python:3.12-slim -e DEBUG=1 alice-pc python": Step(skip=HUB),
    "gpumesh exec --gpu-memory 8GB alice-pc nvidia-smi": Step(skip=GPU),
    "gpumesh status": Step(home="a"),
    "gpumesh cancel shell-5d1e0b9a4c2f": Step(
        skip="needs the id of a shell open at that moment (test_exec.py ends one)"
    ),
    "gpumesh desktop doctor": Step(home="a"),
    "gpumesh desktop share --vnc": Step(home="a"),
    "gpumesh desktop allow bob-laptop": Step(home="a"),
    "gpumesh desktop deny bob-laptop": Step(home="a"),
    "gpumesh desktop share stop": Step(home="a"),
    "gpumesh desktop connect alice-pc": Step(skip=FOREGROUND),
    "gpumesh cuda doctor": Step(home="a"),
    "gpumesh cuda share": Step(home="a"),
    "gpumesh cuda allow bob-laptop": Step(home="a"),
    "gpumesh cuda demo --peer alice-pc": Step(says="correct"),
    "gpumesh cuda bench --peer alice-pc": Step(),
    "gpumesh cuda bridge --peer alice-pc --bind unix:$HOME/.gpumesh/cuda.sock": Step(
        skip=FOREGROUND
    ),
    "gpumesh cuda bridge --peer alice-pc --bind 127.0.0.1:17999": Step(skip=FOREGROUND),
    "gpumesh cp ./dataset.bin alice-pc:/dataset.bin": Step(),
    "gpumesh cp ./data alice-pc:/": Step(),
    "gpumesh cp alice-pc:/out.bin ./out.bin": Step(),
    "gpumesh cp alice-pc:/results ./": Step(),
    "gpumesh app sync --peer alice-pc --dir ./proj": Step(),
    "gpumesh app sync --peer alice-pc --dir ./proj --dry-run": Step(),
    "gpumesh app run --peer alice-pc --dir ./proj --out ./renders -- python render.py": Step(
        args=tuple(
            shlex.split(
                "app run --peer alice-pc --dir ./proj --out ./renders -- "
                "sh -c 'mkdir -p renders && echo frame > renders/1.txt'"
            )
        )
    ),
    "gpumesh app pull --peer alice-pc --job JOB_ID --dir ./job-out": Step(
        args=("app", "pull", "--peer", "alice-pc", "--job", "{app_job}", "--dir", "./job-out")
    ),
    "gpumesh group create research": Step(),
    "gpumesh group invite research": Step(),
    "gpumesh group join 'gpg1_...'": Step(home="a", args=("group", "join", "{invite}")),
    "gpumesh group add research alice-pc": Step(),
    "gpumesh group members research": Step(),
    "gpumesh run --group research --gpu-memory 8GB -- python train.py": Step(skip=GPU),
    "gpumesh config set rendezvous_url http://registry.example.org:47080": Step(home="c"),
    "gpumesh share --public --region us-west --contact 'matrix:@alice:example.org'": Step(
        skip="needs a registry (test_registry_share.py runs one)"
    ),
    "gpumesh search --gpu 4090 --vram 8GB --idle [--region us-west] [--json]": Step(
        skip="needs a registry (test_registry_share.py runs one)"
    ),
    "gpumesh sync": Step(),
    "gpumesh share --print-systemd-unit --max-vram 16GB > gpumesh-share.service": Step(
        home="a",
        args=("share", "--print-systemd-unit", "--max-vram", "16GB"),
        to_file="gpumesh-share.service",
    ),
    "gpumesh doctor": Step(codes=(0, 1)),  # 1: a check fails (no NVIDIA runtime, say)
    # No relay here (its own tests run one): the command says what to set, exit 2.
    "gpumesh netcheck": Step(codes=(2,), says="gpumesh config set relay HOST:PORT"),
    "gpumesh completion bash > ~/.local/share/bash-completion/completions/gpumesh": Step(
        args=("completion", "bash"), to_file="gpumesh.bash"
    ),
    'gpumesh completion zsh > "${fpath[1]}/_gpumesh"': Step(
        args=("completion", "zsh"), to_file="_gpumesh"
    ),
    "gpumesh completion fish > ~/.config/fish/completions/gpumesh.fish": Step(
        args=("completion", "fish"), to_file="gpumesh.fish"
    ),
    "gpumesh completion powershell >> $PROFILE": Step(
        args=("completion", "powershell"), to_file="profile.ps1"
    ),
    "gpumesh dashboard": Step(node=True),
    "gpumesh dashboard --open": Step(node=True, env={"BROWSER": "true"}),
    "gpumesh daemon stop": Step(node=True),
    "gpumesh daemon status": Step(node=True),
}


def readme_commands() -> list[str]:
    """Each `gpumesh ...` line of the README's code blocks, without its comment."""
    commands: list[str] = []
    fenced = False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith("gpumesh "):
            command = re.sub(r"\s+#(\s.*)?$", "", line).strip()
            if command not in commands:
                commands.append(command)
    return commands


def test_every_readme_command_has_a_step_and_every_step_a_line() -> None:
    commands = readme_commands()
    assert len(commands) > 40
    missing = [c for c in commands if c not in STEPS]
    assert not missing, f"README commands this test does not know (add them to STEPS): {missing}"
    stale = [c for c in STEPS if c not in commands]
    assert not stale, f"STEPS for lines the README no longer has: {stale}"


class Scene:
    """alice-pc sharing, bob-laptop paired both ways, a third home; a work folder
    with what the README's lines assume is there."""

    def __init__(self, tmp_path: Path) -> None:
        self.homes = {name: tmp_path / name for name in "abc"}
        self.work = tmp_path / "work"
        self.work.mkdir()
        self.values: dict[str, str] = {}

    def run(self, step: Step, args: list[str]) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, GPUMESH_HOME=str(self.homes[step.home]), **step.env)
        env.pop("GPUMESH_LOG", None)
        if step.node:
            env.pop("GPUMESH_NODE", None)  # as users get it
        return subprocess.run(
            [sys.executable, "-m", "gpumesh", *args],
            cwd=self.work,
            env=env,
            input=step.stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def ok(self, home: str, *args: str) -> str:
        done = self.run(Step(home=home), list(args))
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    def fill(self, arg: str) -> str:
        return re.sub(r"\{(\w+)\}", lambda m: self.value(m.group(1)), arg)

    def value(self, name: str) -> str:
        """A placeholder's value, found when the first line needs it."""
        if name not in self.values:
            jobs = json.loads(self.ok("b", "jobs", "--json", "--offline"))
            if name == "done_prefix":
                done = [j for j in jobs if j["state"] == "succeeded"]
                self.values[name] = done[0]["job_id"][:4]
            elif name == "detached_prefix":
                running = [j for j in jobs if j["command"] == ["sleep", "600"]]
                self.values[name] = running[0]["job_id"][:6]
            elif name == "app_job":
                [app] = [j for j in jobs if "renders/1.txt" in " ".join(j["command"])]
                self.values[name] = app["job_id"]
            elif name == "invite":
                self.values[name] = self.ok("b", "group", "invite", "research").split()[-1]
            else:
                raise KeyError(name)
        return self.values[name]


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    scene = Scene(tmp_path)
    alice, bob, carol = scene.homes.values()
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop")
    _init(carol, "carol")
    for name in "ab":
        scene.ok(name, "config", "set", "image", IMAGE)
    scene.values["alice_code"] = scene.ok("a", "pair-code").strip()
    work = scene.work
    (work / "datasets").mkdir()
    (work / "datasets" / "part-0.bin").write_bytes(os.urandom(4096))
    (work / "data").mkdir()
    (work / "data" / "x.txt").write_text("x\n")
    (work / "out").mkdir()
    (work / "results").mkdir()
    (work / "results" / "r.txt").write_text("result\n")
    (work / "proj").mkdir()
    (work / "proj" / "render.py").write_text("print('frame')\n")
    (work / "dataset.bin").write_bytes(os.urandom(64 * 1024))
    (work / "job.yaml").write_text(
        f"peer: alice-pc\nimage: {IMAGE}\ncommand: [echo, from job.yaml]\n"
    )
    try:
        with running_share(alice):
            yield scene
    finally:
        for home in scene.homes.values():
            scene.run(Step(home=home.name, node=True), ["daemon", "stop"])


@pytest.mark.usefixtures("docker_daemon")
def test_the_readme_commands_run_as_written(scene: Scene) -> None:
    skipped: list[str] = []
    for command in readme_commands():
        step = STEPS[command]
        if step.skip:
            skipped.append(f"{command}  -- {step.skip}")
            continue
        if command == "gpumesh pair-code":
            # The README's next step on alice's side: she pairs bob back.
            scene.ok("a", "pair", scene.ok("b", "pair-code").strip())
        if command == "gpumesh cp alice-pc:/out.bin ./out.bin":
            scene.ok("b", "cp", "./dataset.bin", "alice-pc:/out.bin")
        if command == "gpumesh cp alice-pc:/results ./":
            scene.ok("b", "cp", "./results", "alice-pc:/")
            (scene.work / "results").rename(scene.work / "results.local")
        args = [scene.fill(arg) for arg in step.args] or shlex.split(command)[1:]
        done = scene.run(step, args)
        assert done.returncode in step.codes, (command, done.returncode, done.stderr)
        assert "Traceback" not in done.stderr, (command, done.stderr)
        assert step.says in done.stdout, (command, done.stdout, done.stderr)
        if step.to_file:
            assert done.stdout.strip(), command
            (scene.work / step.to_file).write_text(done.stdout)
    # What the lines made is there.
    work = scene.work
    assert (work / "t").read_text().strip()  # the job's `date`, copied back
    assert (work / "out.bin").read_bytes() == (work / "dataset.bin").read_bytes()
    assert (work / "results" / "r.txt").read_text() == "result\n"
    assert (work / "renders" / "1.txt").read_text() == "frame\n"
    assert (work / "job-out" / "renders" / "1.txt").read_text() == "frame\n"
    assert "ExecStart=" in (work / "gpumesh-share.service").read_text()
    print("\nREADME commands not run here, and why:\n  " + "\n  ".join(skipped))
