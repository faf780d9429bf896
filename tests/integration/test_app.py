"""`gpumesh app sync|run|pull` against a real `gpumesh share` process and real Docker,
and the sandbox checks of app names and job folders in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpumesh.client.apps import sync_app
from gpumesh.errors import AccessDeniedError, ConfigError
from gpumesh.protocol.messages import JobAccepted, JobSubmit
from tests.integration.conftest import arun, gpumesh, pair_both, sharing
from tests.integration.test_cli import _one_line_error
from tests.probe import probe

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")


def _node_id(home: Path) -> str:
    return str(json.loads(gpumesh(home, "status", "--json").stdout)["node_id"])


def _app_on(alice: Path, bob: Path, name: str) -> Path:
    return alice / "files" / _node_id(bob) / "apps" / name


def _sync(bob: Path, project: Path, *extra: str) -> dict[str, object]:
    result = gpumesh(
        bob, "app", "sync", "--peer", "alice-pc", "--dir", str(project), "--json", *extra
    )
    assert result.returncode == 0, result.stderr
    data: dict[str, object] = json.loads(result.stdout)
    return data


def _project(root: Path) -> Path:
    project = root / "proj"
    (project / "sub").mkdir(parents=True)
    (project / "a.txt").write_text("alpha\n")
    (project / "sub" / "big.bin").write_bytes(os.urandom(300_000))
    (project / "c.txt").write_text("charlie\n")
    return project


def test_sync_sends_only_changes_and_propagates_deletions(pair, tmp_path: Path) -> None:
    alice, bob = pair
    project = _project(tmp_path)
    first = _sync(bob, project)
    assert first["files_sent"] == 3 and first["files_unchanged"] == 0
    assert first["bytes_sent"] == 300_000 + len("alpha\n") + len("charlie\n")  # not the tar
    app = _app_on(alice, bob, "proj")
    assert (app / "sub" / "big.bin").read_bytes() == (project / "sub" / "big.bin").read_bytes()

    again = _sync(bob, project)
    assert (again["files_sent"], again["bytes_sent"], again["files_unchanged"]) == (0, 0, 3)

    (project / "c.txt").write_text("charlie, changed\n")
    changed = _sync(bob, project)
    assert changed["sent"] == ["c.txt"]
    assert changed["files_unchanged"] == 2
    assert changed["bytes_sent"] == len("charlie, changed\n")  # big.bin did not travel again
    assert (app / "c.txt").read_text() == "charlie, changed\n"

    (project / "sub" / "big.bin").unlink()
    (project / "new.txt").write_text("new\n")
    deleted = _sync(bob, project)
    assert deleted["deleted"] == ["sub/big.bin"] and deleted["sent"] == ["new.txt"]
    assert not (app / "sub" / "big.bin").exists()
    assert (app / "new.txt").read_text() == "new\n"


def test_dry_run_lists_skipped_files_with_their_rules_and_sends_nothing(
    pair, tmp_path: Path
) -> None:
    alice, bob = pair
    project = _project(tmp_path)
    (project / ".gpumeshignore").write_text("# logs stay here\n*.log\n")
    (project / "run.log").write_text("noise\n")
    (project / "__pycache__").mkdir()
    (project / "__pycache__" / "x.pyc").write_bytes(b"\0")
    data = _sync(bob, project, "--dry-run")
    assert data["bytes_sent"] == 0
    assert sorted(data["sent"]) == [".gpumeshignore", "a.txt", "c.txt", "sub/big.bin"]  # type: ignore[arg-type]
    skipped = {item["path"]: item["rule"] for item in data["skipped"]}  # type: ignore[attr-defined]
    assert skipped["run.log"] == ".gpumeshignore:2 '*.log'"
    assert skipped["__pycache__/"] == "default rule '__pycache__/'"
    app = _app_on(alice, bob, "proj")
    assert not app.exists()
    text = gpumesh(bob, "app", "sync", "--peer", "alice-pc", "--dir", str(project), "--dry-run")
    assert text.returncode == 0
    assert "skip    run.log  (.gpumeshignore:2 '*.log')" in text.stdout
    assert "nothing sent" in text.stdout


def test_app_run_pulls_the_output_folder_back_and_app_pull_fetches_it_later(
    pair, tmp_path: Path
) -> None:
    alice, bob = pair
    project = _project(tmp_path)
    out = tmp_path / "renders"
    script = (
        "mkdir -p renders && head -c 70000 /dev/urandom > renders/frame.bin "
        "&& cp a.txt renders/a-copy.txt && echo rendered && exit 3"
    )
    result = gpumesh(
        bob,
        "app",
        "run",
        "--peer",
        "alice-pc",
        "--dir",
        str(project),
        "--out",
        str(out),
        "--image",
        IMAGE,
        "--",
        "sh",
        "-c",
        script,
        timeout=60,
    )
    assert result.returncode == 3, result.stderr
    assert "rendered" in result.stdout
    remote = _app_on(alice, bob, "proj") / "renders"
    assert (out / "frame.bin").read_bytes() == (remote / "frame.bin").read_bytes()
    assert len((out / "frame.bin").read_bytes()) == 70000
    assert (out / "a-copy.txt").read_text() == "alpha\n"

    jobs = json.loads(gpumesh(bob, "jobs", "--json").stdout)
    job_id = next(job["job_id"] for job in jobs if job["role"] == "submitted")
    later = tmp_path / "later"
    # A prefix, as `logs` and `cancel` take, and no --peer: this node's record says.
    pulled = gpumesh(bob, "app", "pull", "--job", job_id[:4], "--dir", str(later))
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout == f"pulled alice-pc:/apps/proj -> {later}\n"
    assert (later / "renders" / "frame.bin").read_bytes() == (out / "frame.bin").read_bytes()
    assert (later / "a.txt").read_text() == "alpha\n"
    again = gpumesh(
        bob, "app", "pull", "--peer", "alice-pc", "--job", job_id[:8], "--dir", str(later), "--json"
    )
    assert again.returncode == 0, again.stderr
    view = json.loads(again.stdout)
    assert (view["peer"], view["job_id"], view["remote"]) == ("alice-pc", job_id, "/apps/proj")
    assert view["size"] > 70000


def test_app_run_json_prints_only_the_view_on_stdout(pair, tmp_path: Path) -> None:
    _alice, bob = pair
    project = _project(tmp_path)
    script = "echo to-stdout; echo to-stderr >&2; exit 3"
    ran = gpumesh(bob, "app", "run", "--peer", "alice-pc", "--dir", str(project), "--json",
                  "--image", IMAGE, "--", "sh", "-c", script, timeout=60)  # fmt: skip
    assert ran.returncode == 3, ran.stderr
    view = json.loads(ran.stdout)  # nothing else on stdout: the job's output is on stderr
    assert (view["job"]["state"], view["job"]["exit_code"]) == ("failed", 3)
    assert view["sync"]["remote"] == "/apps/proj" and view["pulled"] is False
    assert "to-stdout\n" in ran.stderr and "to-stderr\n" in ran.stderr


def test_app_pull_of_a_job_this_node_did_not_start_is_one_clear_error(pair, tmp_path: Path) -> None:
    _alice, bob = pair
    out = str(tmp_path / "out")
    unknown = gpumesh(bob, "app", "pull", "--job", "abcd", "--dir", out)
    _one_line_error(unknown, 2, "no job 'abcd' was started from here: give its full id and")
    # With a provider, a prefix is refused here, not sent for the peer to call malformed.
    short = gpumesh(bob, "app", "pull", "--peer", "alice-pc", "--job", "abcd", "--dir", out)
    _one_line_error(short, 2, "give the job's full id (a prefix works only for jobs started")
    assert not Path(out).exists()


def test_app_run_out_without_the_folder_is_one_clear_error(pair, tmp_path: Path) -> None:
    _alice, bob = pair
    project = _project(tmp_path)
    result = gpumesh(
        bob,
        "app",
        "run",
        "--peer",
        "alice-pc",
        "--dir",
        str(project),
        "--out",
        str(tmp_path / "renders"),
        "-q",
        "--",
        "true",
        timeout=60,
    )
    _one_line_error(result, 1, "the job produced no folder renders/")
    assert not (tmp_path / "renders").exists()


def test_app_run_mounts_a_dataset_copied_before(pair, tmp_path: Path) -> None:
    """A dataset copied once with `cp` is mounted read-only next to the app's folder."""
    _alice, bob = pair
    project = _project(tmp_path)
    data = tmp_path / "datasets"
    data.mkdir()
    (data / "rows.csv").write_text("a,b\n1,2\n")
    copied = gpumesh(bob, "cp", str(data), "alice-pc:/", timeout=60)
    assert copied.returncode == 0, copied.stderr
    script = "cat /data/rows.csv; touch /data/x 2>/dev/null || echo read-only"
    args = ["app", "run", "--peer", "alice-pc", "--dir", str(project), "-q"]
    result = gpumesh(bob, *args, "--mount", "/datasets:/data", "--", "sh", "-c", script, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "a,b\n1,2\nread-only\n"
    outside = gpumesh(bob, *args, "--mount", "/../etc:/data", "--", "true", timeout=60)
    assert outside.returncode != 0
    assert outside.stderr.startswith("error: ") and "Traceback" not in outside.stderr


def test_app_names_and_job_folders_stay_inside_the_sandbox(make_node, tmp_path: Path) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    pair_both(alice, bob)
    project = _project(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()

    async def scenario() -> None:
        async with sharing(alice) as agent:
            host, port = agent.address
            bob.home.store.touch_peer(bob.peer("alice").node_id, address=f"{host}:{port}")
            for name in ("..", "../escape", "a/b", ".hidden"):
                with pytest.raises((AccessDeniedError, ConfigError)):
                    await sync_app(bob, "alice", project, name=name)
            apps = alice.home.path / "files" / str(bob.info().node_id) / "apps"
            apps.mkdir(parents=True, exist_ok=True)
            (apps / "evil").symlink_to(outside)
            with pytest.raises(AccessDeniedError):
                await sync_app(bob, "alice", project, name="evil")
            assert not any(outside.iterdir())
            async with bob.session("alice") as session:
                for number, where in enumerate(("/apps/evil", "/../..", "/")):
                    stream = session.open_stream()
                    stream.send_message(
                        JobSubmit(
                            job_id=f"escape{number:04d}",
                            image=IMAGE,
                            command=["true"],
                            env={},
                            workdir_bytes=0,
                            gpu_memory=0,
                            retries=0,
                            timeout=0,
                            attach=False,
                            sandbox_dir=where,
                        ),
                        end=True,
                    )
                    with pytest.raises(AccessDeniedError):
                        await stream.expect(JobAccepted)
            assert not any(outside.iterdir())

    arun(scenario())


def test_a_resync_sends_a_delta_and_the_whole_list_when_the_provider_differs(
    pair, tmp_path: Path
) -> None:
    alice, bob = pair
    project = tmp_path / "big"
    for index in range(300):
        folder = project / f"d{index // 50}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{index}.txt").write_text(f"file {index}\n")
    app = _app_on(alice, bob, "big")

    first = _sync(bob, project)
    assert first["manifest"] == "full" and first["files_sent"] == 300
    full_list = int(str(first["manifest_bytes"]))

    (project / "d2" / "f100.txt").write_text("changed\n")
    (project / "d0" / "f1.txt").unlink()
    second = _sync(bob, project)
    assert second["manifest"] == "delta"
    assert second["sent"] == ["d2/f100.txt"] and second["deleted"] == ["d0/f1.txt"]
    assert int(str(second["manifest_bytes"])) * 20 < full_list  # a delta, not the list
    assert (app / "d2" / "f100.txt").read_text() == "changed\n"
    assert not (app / "d0" / "f1.txt").exists()

    # The provider holds another manifest than the consumer's base (here: none):
    # it refuses the delta, the whole list follows, and the result is the same.
    # (It writes its state after answering, under the app's lock: a dry run
    # takes that lock, so the state below is the one the second sync wrote.)
    assert _sync(bob, project, "--dry-run")["sent"] == []
    states = list((alice / "apps" / _node_id(bob)).glob("big.manifest"))
    assert len(states) == 1
    states[0].unlink()
    (project / "d3" / "f150.txt").write_text("changed again\n")
    third = _sync(bob, project)
    assert third["manifest"] == "full"
    assert int(str(third["manifest_bytes"])) > full_list * 0.9  # delta tried, then the list
    assert third["sent"] == ["d3/f150.txt"] and third["files_unchanged"] == 298
    assert (app / "d3" / "f150.txt").read_text() == "changed again\n"

    # Nothing changed: the delta is empty, and a file a job rewrote is still noticed.
    (app / "d4" / "f200.txt").write_text("rewritten there\n")
    fourth = _sync(bob, project)
    assert fourth["manifest"] == "delta" and int(str(fourth["manifest_bytes"])) < 100
    assert fourth["sent"] == ["d4/f200.txt"]
    assert (app / "d4" / "f200.txt").read_text() == "file 200\n"


def test_app_sync_json_through_the_node_process_prints_its_view(pair, tmp_path: Path) -> None:
    """`app sync --json` through the node process prints the sync's view as every
    `--json` prints (two-space indent, keys in order), and loads nothing heavy
    (no QUIC, cryptography, Docker SDK or SQLite: the node process syncs)."""
    _alice, bob = pair
    project = _project(tmp_path)
    env = dict(os.environ, GPUMESH_HOME=str(bob))
    env.pop("GPUMESH_LOG", None)
    check = (
        "import sys\n"
        "from gpumesh.cli.main import main\n"
        f"code = main(['app', 'sync', '--peer', 'alice-pc', '--dir', {str(project)!r}, '--json'])\n"
        "heavy = {'qh3', 'cryptography', 'docker', 'sqlite3', 'asyncio'}\n"
        "print(code, sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    try:
        result = probe(check, env)
    finally:
        stop = [sys.executable, "-m", "gpumesh", "daemon", "stop"]
        subprocess.run(stop, env=env, capture_output=True, check=False, timeout=60)
    *printed, last = result.stdout.splitlines()
    assert last == "0 []", result.stdout + result.stderr
    view = json.loads("\n".join(printed))
    assert (view["files_sent"], view["remote"], view["manifest"]) == (3, "/apps/proj", "full")
    assert "\n".join(printed) == json.dumps(view, indent=2)
