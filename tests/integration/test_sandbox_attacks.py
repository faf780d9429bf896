"""A paired peer and its jobs stay inside their sandbox, whatever they swap and when.

Each test attacks one request that touches a peer's sandbox at the instant a
name-based implementation would have between its check and its use: the
sandbox module's pause points (``gpumesh.files.sandbox.pause_point``) call a
hook there, and the hook swaps a folder for a symlink to a host folder (or has
a real job of the peer do it, and waits until it did). Nothing here depends on
timing. Each test then asserts that nothing outside the sandbox was created,
changed or read, and runs twice: with ``openat2`` and with the component walk
older kernels get.

Real agents over loopback QUIC, real files, and for the headline attacks a real
Docker job doing the swap from inside its container.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpumesh.agent.server import Agent
from gpumesh.client.apps import pull_folder, sync_app
from gpumesh.client.files import CopyCallbacks, copy
from gpumesh.client.node import Node
from gpumesh.errors import LimitError
from gpumesh.files import sandbox
from gpumesh.protocol.messages import JobAccepted, JobSubmit
from tests.integration.conftest import arun, pair_both, remove_containers, sharing

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
MIB = 1024 * 1024


# --- fixtures ---------------------------------------------------------------------------------


class Seam:
    """Runs one action the first time a pause point with a given place and name is hit."""

    def __init__(self) -> None:
        self.actions: dict[tuple[str, str], Callable[[], None]] = {}
        self.fired: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def at(self, where: str, name: str, action: Callable[[], None]) -> None:
        self.actions[(where, name)] = action

    def __call__(self, where: str, name: str) -> None:
        with self.lock:
            action = self.actions.pop((where, name), None)
        if action is not None:
            self.fired.append((where, name))
            action()


@pytest.fixture
def seam() -> Iterator[Seam]:
    hook = Seam()
    sandbox._Seam.hook = hook
    try:
        yield hook
    finally:
        sandbox._Seam.hook = None


@pytest.fixture
def nodes(make_node, tmp_path: Path) -> tuple[Node, Node, Path]:
    """alice (provider) and bob paired both ways, and a host folder holding a secret."""
    alice, bob = make_node("alice"), make_node("bob")
    pair_both(alice, bob)
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "identity.key").write_text("HOST SECRET that no peer may read\n")
    (outside / "victim.txt").write_text("host file\n")
    (outside / "gone.txt").write_text("host file that must stay\n")
    return alice, bob, outside


@pytest.fixture
def containers(nodes) -> Iterator[None]:
    """Remove the job containers alice's agent leaves behind (it keeps them on stop)."""
    yield
    remove_containers(str(nodes[0].info().node_id))


def snapshot(folder: Path) -> dict[str, tuple[str, int, int, str]]:
    """Everything under ``folder``: kind, mode, owner, and content hash or link target."""
    found = {}
    for path in [folder, *sorted(folder.rglob("*"))]:
        st = path.lstat()
        if path.is_symlink():
            kind, body = "link", os.readlink(path)
        elif path.is_dir():
            kind, body = "dir", ""
        else:
            kind, body = "file", hashlib.sha256(path.read_bytes()).hexdigest()
        found[str(path.relative_to(folder))] = (kind, st.st_mode, st.st_uid, body)
    return found


def sandbox_of(alice: Node, bob: Node) -> Path:
    return alice.home.path / "files" / str(bob.info().node_id)


def swap_for_link(folder: Path, target: Path) -> Path:
    """What a hostile job does: move ``folder`` aside, put a symlink in its place."""
    moved = folder.with_name(folder.name + ".moved")
    folder.rename(moved)
    folder.symlink_to(target)
    return moved


def wait_for(path: Path, within: float = 60.0) -> None:
    """Until ``path`` exists (an event, with a generous ceiling; no verdict on speed)."""
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


async def until_exists(path: Path) -> None:
    """:func:`wait_for` from the event loop, which the in-process agent shares."""
    await asyncio.to_thread(wait_for, path)


def everything_received(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


async def _serving_to(alice: Node, bob: Node, agent: Agent) -> None:
    host, port = agent.address
    bob.home.store.touch_peer(bob.peer("alice").node_id, address=f"{host}:{port}")


async def _submit_in_sandbox(bob: Node, job_id: str, folder: str, script: str) -> None:
    """Start a job of bob's on a folder of his sandbox (as `gpumesh app run` does)."""
    async with bob.session("alice") as session:
        stream = session.open_stream()
        stream.send_message(
            JobSubmit(
                job_id=job_id,
                image=IMAGE,
                command=["sh", "-c", script],
                env={},
                workdir_bytes=0,
                gpu_memory=0,
                retries=0,
                timeout=0,
                attach=False,
                sandbox_dir=folder,
            ),
            end=True,
        )
        await stream.expect(JobAccepted)


def _swapping_job(name: str, target: Path, setup: str = "") -> str:
    """A job that, once told (``go``), swaps ``name`` for a link to ``target`` and says so."""
    return (
        f"set -e; cd /workspace; {setup} touch ready; "
        "while [ ! -e go ]; do sleep 0.05; done; "
        f"mv {name} {name}.moved; ln -s {target} {name}; touch swapped; sleep 120"
    )


def _tell_job(work: Path) -> Callable[[], None]:
    """The hook's action: tell the job to swap, and wait until it did."""

    def act() -> None:
        (work / "go").touch()
        wait_for(work / "swapped")

    return act


# --- the two attacks the issue reports, with a real job doing the swap -------------------------


@pytest.mark.parametrize("fast_path", [True, False], ids=["data-channel", "quic"])
def test_a_job_swapping_a_folder_mid_upload_cannot_place_the_file_outside(
    resolution: str, fast_path: bool, nodes, seam: Seam, containers, docker_daemon, tmp_path
) -> None:
    alice, bob, outside = nodes
    local = tmp_path / "w"
    (local / "d").mkdir(parents=True)
    (local / "d" / "keep").write_text("keep\n")
    payload = tmp_path / "payload"
    payload.write_bytes(b"* * * * * root echo owned\n")
    before = snapshot(outside)
    work = sandbox_of(alice, bob) / "w"

    async def scenario() -> None:
        async with sharing(alice) as agent:
            await _serving_to(alice, bob, agent)
            await copy(bob, str(local), "alice:/w")
            await _submit_in_sandbox(bob, "swapupload1", "/w", _swapping_job("d", outside))
            await until_exists(work / "ready")
            # The upload pauses right before its file is renamed into /w/d: the job
            # swaps /w/d for a link to the host folder at exactly that moment.
            seam.at("place", "x", _tell_job(work))
            await copy(bob, str(payload), "alice:/w/d/x", fast_path=fast_path)

    arun(scenario())
    assert seam.fired == [("place", "x")]
    assert (work / "d").is_symlink()  # the job did swap it
    assert snapshot(outside) == before  # nothing created, changed or removed there
    # The file went into the folder the provider had opened, which moved with the job's mv.
    assert (work / "d.moved" / "x").read_bytes() == payload.read_bytes()


def test_a_job_swapping_a_folder_mid_download_cannot_leak_the_providers_key(
    resolution: str, nodes, seam: Seam, containers, docker_daemon, tmp_path
) -> None:
    alice, bob, _outside = nodes
    real_key = (alice.home.path / "identity.key").read_bytes()
    work = sandbox_of(alice, bob) / "w"
    # A decoy of the real key's size, so a packer that opened the key by name
    # would find the size it announced and send it.
    staged = (
        "mkdir r; head -c 3000000 /dev/zero > r/big; "
        f"head -c {len(real_key)} /dev/zero > r/identity.key;"
    )
    received = tmp_path / "received"

    async def scenario() -> None:
        async with sharing(alice) as agent:
            await _serving_to(alice, bob, agent)
            (tmp_path / "w").mkdir()
            await copy(bob, str(tmp_path / "w"), "alice:/w")
            # The job learns where the provider's home is (from /proc/self/mountinfo
            # in a real attack) and will point r at it.
            script = _swapping_job("r", alice.home.path, staged)
            await _submit_in_sandbox(bob, "swapdownload", "/w", script)
            await until_exists(work / "ready")
            # The download is planned (r/big, r/identity.key) and under way; before the
            # key's turn comes, the job swaps r for a link to alice's home.
            seam.at("pack", "identity.key", _tell_job(work))
            await copy(bob, "alice:/w/r", str(received))

    arun(scenario())
    assert seam.fired == [("pack", "identity.key")]
    assert (work / "r").is_symlink()
    # Everything came from the folder the provider had opened: the decoy, never the key.
    assert real_key not in everything_received(received)
    assert (received / "identity.key").read_bytes() == bytes(len(real_key))


# --- every other request that touches a sandbox, swapped by a test thread ----------------------


def test_a_resumed_upload_lands_in_the_folder_it_opened(
    resolution: str, nodes, seam: Seam, tmp_path: Path
) -> None:
    alice, bob, outside = nodes
    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(6 * MIB))
    before = snapshot(outside)
    box = sandbox_of(alice, bob)

    async def scenario() -> object:
        async with sharing(alice) as agent:
            await _serving_to(alice, bob, agent)
            (box / "d").mkdir(parents=True)
            dropped = False

            def progress(done: int, _total: int) -> None:
                nonlocal dropped
                if not dropped and done >= 3 * MIB:  # drop the link: a partial is kept
                    dropped = True
                    assert agent.endpoint is not None
                    for link in list(agent.endpoint.links):
                        link.close()

            seam.at("place", "data.bin", lambda: swap_for_link(box / "d", outside))
            return await copy(
                bob,
                str(source),
                "alice:/d/data.bin",
                callbacks=CopyCallbacks(progress=progress),
                fast_path=False,
            )

    result = arun(scenario())
    assert result.attempts == 2 and result.offsets[1] > 0  # type: ignore[attr-defined]
    assert seam.fired == [("place", "data.bin")]
    assert snapshot(outside) == before
    assert (box / "d.moved" / "data.bin").read_bytes() == source.read_bytes()


def test_a_folder_upload_never_merges_through_a_swapped_folder(
    resolution: str, nodes, seam: Seam, tmp_path: Path
) -> None:
    alice, bob, outside = nodes
    local = tmp_path / "dest"
    (local / "sub").mkdir(parents=True)
    (local / "sub" / "victim.txt").write_text("overwritten?\n")
    (local / "sub" / "new.txt").write_text("new\n")
    before = snapshot(outside)
    box = sandbox_of(alice, bob)

    async def scenario() -> None:
        async with sharing(alice) as agent:
            await _serving_to(alice, bob, agent)
            (box / "dest" / "sub").mkdir(parents=True)
            seam.at("merge", "sub", lambda: swap_for_link(box / "dest" / "sub", outside))
            await copy(bob, str(local), "alice:/")  # into /dest, which exists: merged

    arun(scenario())
    assert ("merge", "sub") in seam.fired
    assert snapshot(outside) == before
    # The link the "job" put there was replaced by the folder, never written through.
    assert (box / "dest" / "sub" / "new.txt").read_text() == "new\n"
    assert (box / "dest" / "sub" / "victim.txt").read_text() == "overwritten?\n"


def test_app_sync_creates_replaces_and_deletes_only_inside(
    resolution: str, nodes, seam: Seam, tmp_path: Path
) -> None:
    alice, bob, outside = nodes
    project = tmp_path / "proj"
    (project / "a" / "b").mkdir(parents=True)
    (project / "old").mkdir()
    (project / "old" / "gone.txt").write_text("synced, then removed\n")
    (project / "replace.txt").write_text("v1\n")
    app = sandbox_of(alice, bob) / "apps" / "proj"

    async def scenario() -> None:
        async with sharing(alice) as agent:
            await _serving_to(alice, bob, agent)
            await sync_app(bob, "alice", project)
            (project / "old" / "gone.txt").unlink()
            (project / "replace.txt").write_text("v2\n")
            (project / "a" / "b" / "victim.txt").write_text("created through a link?\n")
            before = snapshot(outside)
            # create: the new file's folder becomes a link; replace: the file itself
            # becomes a link to a host file; delete: the deleted file's folder
            # becomes a link to a host folder with a file of the same name.
            seam.at("place", "victim.txt", lambda: swap_for_link(app / "a" / "b", outside))
            seam.at(
                "place",
                "replace.txt",
                lambda: swap_for_link(app / "replace.txt", outside / "victim.txt"),
            )
            seam.at("unlink", "gone.txt", lambda: swap_for_link(app / "old", outside))
            await sync_app(bob, "alice", project)
            assert snapshot(outside) == before

    arun(scenario())
    assert len(seam.fired) == 3
    # The replaced file is a file again (the link itself was replaced, not its target).
    assert not (app / "replace.txt").is_symlink()
    assert (app / "replace.txt").read_text() == "v2\n"
    assert (outside / "gone.txt").exists()


def test_pulling_a_job_folder_never_reads_through_a_swapped_folder(
    resolution: str, nodes, seam: Seam, tmp_path: Path
) -> None:
    alice, bob, outside = nodes
    secret = (outside / "identity.key").read_bytes()
    box = sandbox_of(alice, bob)

    async def scenario() -> None:
        async with sharing(alice) as agent:
            await _serving_to(alice, bob, agent)
            out = box / "apps" / "proj" / "out"
            out.mkdir(parents=True)
            (out / "big.bin").write_bytes(b"0" * MIB)
            (out / "identity.key").write_bytes(bytes(len(secret)))  # the size of the secret
            seam.at("pack", "identity.key", lambda: swap_for_link(out, outside))
            await pull_folder(bob, "alice", "/apps/proj/out", tmp_path / "pulled")

    arun(scenario())
    assert seam.fired == [("pack", "identity.key")]
    pulled = tmp_path / "pulled"
    assert secret not in everything_received(pulled)
    assert (pulled / "identity.key").read_bytes() == bytes(len(secret))


def test_the_quota_walk_never_counts_through_a_swapped_folder(
    resolution: str, nodes, seam: Seam, tmp_path: Path
) -> None:
    alice, bob, outside = nodes
    alice.home.config.set("file_quota", "2MB")
    alice.home.config.save()
    with (outside / "huge.bin").open("wb") as huge:
        huge.truncate(500 * MIB)  # sparse: counted by size were the walk to follow the link
    box = sandbox_of(alice, bob)
    small = tmp_path / "small.bin"
    small.write_bytes(b"s" * 500_000)

    async def scenario() -> None:
        async with sharing(alice) as agent:
            await _serving_to(alice, bob, agent)
            (box / "sub").mkdir(parents=True)
            (box / "big.bin").write_bytes(b"b" * 1_000_000)
            seam.at("walk", "sub", lambda: swap_for_link(box / "sub", outside))
            # 1.5 MB after the upload: within the quota, unless the host folder counted.
            await copy(bob, str(small), "alice:/small.bin", fast_path=False)
            # And what is really there counts: 1.5 MB + 0.7 MB is past the quota, refused.
            more = tmp_path / "more.bin"
            more.write_bytes(b"m" * 700_000)
            with pytest.raises(LimitError, match="file_quota"):
                await copy(bob, str(more), "alice:/more.bin", fast_path=False)

    arun(scenario())
    assert seam.fired == [("walk", "sub")]
    assert (box / "small.bin").stat().st_size == 500_000


def test_handing_a_folder_to_a_job_never_changes_owners_outside(
    resolution: str, nodes, seam: Seam
) -> None:
    if os.geteuid() != 0:
        pytest.skip("changing owners needs root (CI runs as root)")
    alice, bob, outside = nodes
    (outside / "sub").mkdir()
    (outside / "sub" / "file").write_text("host\n")
    before = snapshot(outside)
    box = sandbox_of(alice, bob)
    (box / "w" / "d").mkdir(parents=True)
    (box / "w" / "d" / "f").write_text("mine\n")
    (box / "w" / "e").mkdir()
    (box / "w" / "e" / "g").write_text("mine too\n")

    async def scenario() -> tuple[str, ...]:
        async with sharing(alice) as agent:
            agent.files.owner = (47000, 47000)
            seam.at("walk", "e", lambda: swap_for_link(box / "w" / "e", outside))
            peer = alice.peer("bob")
            return agent.files.resolve_sandbox_dir(peer, "/w")

    assert arun(scenario()) == ("w",)
    assert seam.fired == [("walk", "e")]
    assert snapshot(outside) == before
    assert (box / "w" / "d" / "f").stat().st_uid == 47000
    assert (box / "w").stat().st_uid == 47000
