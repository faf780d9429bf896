"""The home's lock where there is no ``flock`` (Windows: ``msvcrt.locking`` of one
byte), taken on Linux under ``GPUMESH_TEST_PLATFORM=windows``, where a POSIX
record lock of the same byte stands in for ``msvcrt``. Real processes: one holds
the home, others look and try to take it, and the holder is killed."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HOLD = textwrap.dedent(
    """
    import os
    import sys
    from pathlib import Path
    from gpumesh.daemon.record import HomeLock, NodeRecord
    lock = HomeLock(Path(sys.argv[1]))
    assert lock.acquire()
    lock.write(NodeRecord(os.getpid(), "9.9", 0.0, ["http://127.0.0.1:1"]))
    print("held", flush=True)
    sys.stdin.read()
    """
)
LOOK = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from gpumesh.daemon.record import HomeLock, holder
    home = Path(sys.argv[1])
    record = holder(home)
    print(None if record is None else record.pid, HomeLock(home).acquire())
    """
)


def _env(report: Path, platform: str = "windows") -> dict[str, str]:
    return dict(
        os.environ, GPUMESH_TEST_PLATFORM=platform, GPUMESH_TEST_PLATFORM_REPORT=str(report)
    )


def _look(home: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", LOOK, str(home)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("platform", ["windows", "linux"])
def test_one_process_holds_a_home_until_it_dies(tmp_path: Path, platform: str) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    report = tmp_path / "report"
    env = _env(report, platform)
    assert _look(home, env) == "None True"  # free: the look holds nothing after it
    held = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(home)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert held.stdout is not None and held.stdout.readline() == "held\n"
        # Another process sees the holder's record and cannot take the home.
        assert _look(home, env) == f"{held.pid} False"
        assert _look(home, env) == f"{held.pid} False"  # a look left it as it was
        fd = os.open(home / "node.lock", os.O_RDONLY)
        try:
            # Which lock it is: under the simulated Windows not an flock (that one
            # is free), on Linux exactly that.
            if platform == "windows":
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            else:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        held.send_signal(signal.SIGKILL)
        held.wait(timeout=30)
        for pipe in (held.stdin, held.stdout):
            if pipe is not None:
                pipe.close()
    # Killed: the system dropped its lock; the stale record is not believed.
    assert (home / "node.json").exists()
    assert _look(home, env) == "None True"
    lines = report.read_text().splitlines() if report.exists() else []
    # Each simulated process took the byte lock, and none used a call Windows lacks.
    assert any(line.endswith(" took fcntl") for line in lines) == (platform == "windows")
    assert not [line for line in lines if " used " in line], lines
