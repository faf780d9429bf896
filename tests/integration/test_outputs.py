"""A job's outputs coming home (`run --outputs`): streamed while it runs, never
half-written, hostile entries refused as `cp` refuses them, bounded by
`outputs_limit`, and waiting on the provider while the submitter is away.

The jobs wait on marker files the test puts into their outputs folder on the
provider's disk, so every step is awaited, never timed.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh, until

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

LINK_REFUSED = "a symlink is on that path, and links in your folder are never followed"


def _outputs_folder(alice: Path, bob: Path, job_id: str) -> Path:
    node_id = json.loads(gpumesh(bob, "status", "--json").stdout)["node_id"]
    return alice / "files" / str(node_id) / "gpumesh-outputs" / job_id


def _submit(bob: Path, script: str, *extra: str) -> str:
    started = gpumesh(
        bob, "run", "--peer", "alice-pc", "-d", "--outputs", "/out", *extra, "--",
        "sh", "-c", script, timeout=90,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    return started.stdout.strip()


def _job(home: Path, job_id: str) -> dict[str, object]:
    listed = gpumesh(home, "jobs", "--json", "--offline")
    assert listed.returncode == 0, listed.stderr
    return next(j for j in json.loads(listed.stdout) if j["job_id"] == job_id)


def _recorded(alice: Path, job_id: str, path: str) -> bool:
    """Whether alice's agent recorded ``path`` of the job's outputs as finished."""
    db = sqlite3.connect(f"file:{alice / 'gpumesh.db'}?mode=ro", uri=True)
    try:
        row = db.execute(
            "SELECT 1 FROM job_outputs WHERE job_id = ? AND path = ?", (job_id, path)
        ).fetchone()
    finally:
        db.close()
    return row is not None


def _no_links(root: Path) -> None:
    for path in root.rglob("*"):
        assert not path.is_symlink(), path
        if path.is_file():
            assert "root:" not in path.read_text(errors="replace"), path


def test_files_come_home_while_the_job_runs_whole_and_links_never(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    alice, bob = pair
    dest = tmp_path / "results"
    # A file a second, each written then renamed, in a folder made a moment before
    # (what is finished in a folder before its watch exists waits for the job's
    # end); one written slowly through one descriptor; a link; until told to stop.
    script = (
        "cd $GPUMESH_OUTPUTS && ln -s /etc/passwd link && mkdir sub && "
        "(echo begin; while [ ! -e stop ]; do sleep 0.2; done; echo end) > slow & "
        "sleep 1; i=0; while [ ! -e $GPUMESH_OUTPUTS/stop ]; do i=$((i+1)); "
        "echo $i > $GPUMESH_OUTPUTS/sub/.t; mv $GPUMESH_OUTPUTS/sub/.t $GPUMESH_OUTPUTS/sub/n$i; "
        "sleep 1; done; wait"
    )
    job_id = _submit(bob, script, "--outputs-to", str(dest))
    until((dest / "sub" / "n2").is_file, "the second file to come home", within=90)
    # The job runs until told to stop: these came while it ran, and the slow file,
    # still open for writing, did not.
    assert (dest / "sub" / "n1").read_text() == "1\n"
    assert not (dest / "slow").exists()
    assert _job(bob, job_id)["outputs"]["state"] == "receiving"  # type: ignore[index]
    (_outputs_folder(alice, bob, job_id) / "stop").write_text("")

    def complete() -> dict[str, object] | None:
        outputs = _job(bob, job_id)["outputs"]
        assert isinstance(outputs, dict)
        return outputs if outputs["state"] == "complete" else None

    outputs = until(complete, "the outputs to be complete", within=90)
    assert (dest / "slow").read_text() == "begin\nend\n"
    assert outputs["dir"] == str(dest)
    assert outputs["files"] == len([p for p in dest.rglob("*") if p.is_file()])
    assert not (dest / "link").exists() and not (dest / "link").is_symlink()
    _no_links(dest)
    # Released: the provider's copy no longer counts in bob's quota there.
    assert not _outputs_folder(alice, bob, job_id).exists()


def test_outputs_wait_for_a_submitter_away_and_a_file_swapped_for_a_link_is_refused(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    alice, bob = pair
    dest = tmp_path / "back"
    wait_for = "while [ ! -e $GPUMESH_OUTPUTS/{0} ]; do sleep 0.2; done"
    script = " && ".join(
        [
            "cd $GPUMESH_OUTPUTS",
            "echo 1 > first",
            wait_for.format("go"),
            "echo data > swap.t && mv swap.t swap",
            wait_for.format("swapnow"),
            "ln -s /etc/passwd swap.l && mv swap.l swap",
            "echo 2 > second.t && mv second.t second",
            wait_for.format("end"),
        ]
    )
    job_id = _submit(bob, script, "--outputs-to", str(dest))
    folder = _outputs_folder(alice, bob, job_id)
    until((dest / "first").is_file, "the first file to come home", within=90)

    # The submitter's node process goes away (a laptop asleep); the job goes on.
    assert gpumesh(bob, "daemon", "stop").returncode == 0
    (folder / "go").write_text("")
    until(lambda: _recorded(alice, job_id, "swap"), "alice to record swap")
    (folder / "swapnow").write_text("")
    until(lambda: _recorded(alice, job_id, "second"), "alice to record second")
    (folder / "end").write_text("")
    until(lambda: _job(alice, job_id)["state"] == "succeeded", "the job to end", within=60)

    # Back: the next command starts the node process, which fetches what waited.
    def done() -> dict[str, object] | None:
        outputs = _job(bob, job_id)["outputs"]
        assert isinstance(outputs, dict)
        return outputs if outputs["state"] == "complete" else None

    outputs = until(done, "the outputs that waited to come home", within=90)
    assert (dest / "second").read_text() == "2\n"
    assert not (dest / "swap").exists()
    assert LINK_REFUSED in str(outputs["note"]), outputs
    _no_links(dest)


def _one_line(result: subprocess.CompletedProcess[str], text: str) -> None:
    assert result.returncode != 0, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and text in lines[0], lines[0]


def test_bad_outputs_are_one_line_and_outputs_limit_stops_the_stream(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, bob = pair
    monkeypatch.chdir(tmp_path)  # the default destination is ./gpumesh-outputs
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for args, text in [
        (("--outputs", "out"), "must be a plain absolute path"),
        (("--outputs", "/"), "must name a folder below /"),
        (("--outputs", "/proc"), "overlaps /proc"),
        (("--outputs", "/sys/x"), "overlaps /sys"),
        (("--outputs", "/dev"), "overlaps /dev"),
        (("--outputs", "/out", "--outputs-to", str(a_file)), "is a file: name a folder"),
        (("--outputs", "/out", "--outputs-to", "/dev/null/x"), "cannot be written here"),
    ]:
        refused = gpumesh(bob, "run", "--peer", "alice-pc", *args, "--", "true")
        _one_line(refused, text)
    assert json.loads(gpumesh(bob, "jobs", "--json", "--offline").stdout) == []

    assert gpumesh(bob, "config", "set", "outputs_limit", "3KB").returncode == 0
    script = "cd $GPUMESH_OUTPUTS && echo small > a && head -c 4000 /dev/zero > b.t && mv b.t b"
    ran = gpumesh(
        bob, "run", "--peer", "alice-pc", "--outputs", "/out", "--", "sh", "-c", script,
        timeout=120,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    here = Path.cwd() / "gpumesh-outputs"
    stopped = [line for line in ran.stderr.splitlines() if "outputs stopped at b" in line]
    assert len(stopped) == 1, ran.stderr
    assert (
        "over outputs_limit 3KB" in stopped[0] and "gpumesh config set outputs_limit" in stopped[0]
    )
    job = json.loads(gpumesh(bob, "jobs", "--json", "--offline").stdout)[0]
    assert job["outputs"]["state"] == "stopped"
    assert job["outputs"]["dir"] == str(here / job["job_id"])
    assert (here / job["job_id"] / "a").read_text() == "small\n"
    assert not (here / job["job_id"] / "b").exists()
    # What did not come stays on the provider, for `gpumesh cp`.
    assert (_outputs_folder(alice, bob, job["job_id"]) / "b").stat().st_size == 4000
