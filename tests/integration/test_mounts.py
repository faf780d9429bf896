"""Folders of the submitter's sandbox mounted into its jobs (`run --mount`, `mounts:`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh

pytestmark = pytest.mark.usefixtures("docker_daemon")


def _sandbox(alice: Path, bob: Path) -> Path:
    node_id = json.loads(gpumesh(bob, "status", "--json").stdout)["node_id"]
    return alice / "files" / str(node_id)


def _refused(result: subprocess.CompletedProcess[str], text: str) -> None:
    assert result.returncode != 0, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and text in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def test_a_copied_folder_is_read_only_in_the_job_unless_rw(pair, tmp_path: Path) -> None:
    alice, bob = pair
    data = tmp_path / "datasets"
    data.mkdir()
    (data / "dataset.bin").write_bytes(b"rows of data\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("kept\n")
    for local in ("datasets", "out"):
        copied = gpumesh(bob, "cp", "-r", str(tmp_path / local), f"alice-pc:/{local}", timeout=60)
        assert copied.returncode == 0, copied.stderr

    read = gpumesh(
        bob, "run", "--peer", "alice-pc", "-q", "--mount", "/datasets:/data", "--",
        "cat", "/data/dataset.bin", timeout=90,
    )  # fmt: skip
    assert read.returncode == 0, read.stderr
    assert read.stdout == "rows of data\n"

    # Read-only by default: the job cannot change what was copied.
    write = gpumesh(
        bob, "run", "--peer", "alice-pc", "-q", "--mount", "/datasets:/data", "--",
        "sh", "-c", "echo x > /data/dataset.bin", timeout=90,
    )  # fmt: skip
    assert write.returncode != 0
    assert (_sandbox(alice, bob) / "datasets" / "dataset.bin").read_bytes() == b"rows of data\n"

    # :rw in a job file: what the job writes is there for cp afterwards.
    job = tmp_path / "job.yaml"
    job.write_text(
        "peer: alice-pc\n"
        "command: sh -c 'wc -c < /in/dataset.bin > /results/count.txt'\n"
        "mounts:\n  - /datasets:/in\n  - /out:/results:rw\n"
    )
    wrote = gpumesh(bob, "run", "-f", str(job), "-q", timeout=90)
    assert wrote.returncode == 0, wrote.stderr
    back = tmp_path / "count.txt"
    fetched = gpumesh(bob, "cp", "alice-pc:/out/count.txt", str(back), timeout=60)
    assert fetched.returncode == 0, fetched.stderr
    assert back.read_text().strip() == "13"


def test_folders_outside_the_sandbox_links_and_missing_ones_are_refused(
    pair, tmp_path: Path
) -> None:
    alice, bob = pair
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "key").write_text("host secret\n")
    assert gpumesh(bob, "cp", str(outside / "key"), "alice-pc:/real/key").returncode == 0
    sandbox = _sandbox(alice, bob)
    (sandbox / "linked").symlink_to(outside)
    (sandbox / "real" / "inner").symlink_to(outside)

    def run(mount: str) -> subprocess.CompletedProcess[str]:
        return gpumesh(
            bob, "run", "--peer", "alice-pc", "-q", "--mount", mount, "--", "cat", "/d/key",
            timeout=90,
        )  # fmt: skip

    _refused(run("/../secret:/d"), "alice-pc refused")
    _refused(run("/linked:/d"), "a symlink is on that path")
    _refused(run("/real/inner:/d"), "a symlink is on that path")
    _refused(run("/missing:/d"), "/missing is not a folder on alice-pc: copy it there first")
    _refused(run("/real/key:/d"), "is not a folder on alice-pc")
    _refused(run("/real:/proc"), "overlaps /proc")
    _refused(run("/real:/workspace/x"), "overlaps /workspace")
    _refused(run("/real:data"), "plain absolute path")
    # Nothing ran: no container of a refused job ever saw the host's folder.
    jobs = json.loads(gpumesh(alice, "jobs", "--json").stdout or "[]")
    assert jobs == [] or all(job.get("state") != "succeeded" for job in jobs)
