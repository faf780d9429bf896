"""Folders, job workdirs and app syncs over the data channel, and back on QUIC.

Real nodes on loopback. Which path carried the bytes is read from what the
result reports (``channel``, ``no_channel``), never from timing. The tests
that block the channel's TCP port use iptables on a loopback address of their
own (127.x.y.z, unique to the test), so nothing else on the machine is
touched; they need root and are skipped without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.agent.server import Agent
from gpumesh.client.apps import sync_app
from gpumesh.client.bulk import NoChannel
from gpumesh.client.cpdownload import PART_SUFFIX
from gpumesh.client.files import CopyCallbacks, CopyResult, copy
from gpumesh.client.jobspec import JobSpec
from gpumesh.client.node import Node
from tests.conftest import _in_ci
from tests.integration.conftest import arun, job_nodes, pair_both
from tests.integration.test_cp import partials_of, sandbox_of, tree, write_random

MIB = 1024 * 1024


def _dataset(root: Path) -> Path:
    """A tree with nested folders, modes, an empty and a private folder, a link,
    long names and one file of several channel pieces."""
    for index in range(60):
        folder = root / f"part{index % 5}" / f"sub{index % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"f{index:03d}.bin"
        path.write_bytes(os.urandom(index * 997))
        path.chmod((0o600, 0o644, 0o755)[index % 3])
    (root / "empty").mkdir()
    (root / "private").mkdir(mode=0o700)
    (root / "private" / "key").write_text("k")
    (root / "link").symlink_to("part0/sub0/f000.bin")
    deep = root / ("long-name-" * 12) / "inner"
    deep.mkdir(parents=True)
    write_random(deep / "big.bin", 9 * MIB + 5)  # more than two 4 MiB pieces
    return root


@pytest.fixture
def pair(make_node) -> tuple[Node, Node]:
    alice, bob = make_node("alice"), make_node("bob")
    pair_both(alice, bob)
    return alice, bob


@contextlib.asynccontextmanager
async def _serving(alice: Node, bob: Node, host: str = "127.0.0.1") -> AsyncIterator[Agent]:
    """alice's agent on ``host`` (an ephemeral port), and bob pointed at it."""
    agent = Agent(alice.home, host=host, port=0)
    await agent.start()
    try:
        peer = bob.peer("alice")
        bob.home.store.touch_peer(peer.node_id, address=f"{host}:{agent.address[1]}")
        yield agent
    finally:
        agent.stop()


# --- folders --------------------------------------------------------------------------------


def test_folders_take_the_data_channel_both_ways_and_quic_when_it_is_off(
    pair, tmp_path: Path
) -> None:
    alice, bob = pair
    source = _dataset(tmp_path / "dataset")
    expected = tree(source)
    outs = [tmp_path / f"out{index}" for index in range(4)]
    for out in outs:
        out.mkdir()
    (tmp_path / "nothing").mkdir()

    async def scenario() -> list[CopyResult]:
        async with _serving(alice, bob):
            results = [
                await copy(bob, str(source), "alice:/"),
                await copy(bob, "alice:/dataset", str(outs[0])),
                await copy(bob, str(source), "alice:/quic/", fast_path=False),
                await copy(bob, "alice:/quic/dataset", str(outs[1]), fast_path=False),
            ]
            empty = [
                await copy(bob, str(tmp_path / "nothing"), "alice:/"),
                await copy(bob, "alice:/nothing", str(outs[3])),
            ]
            assert [(r.channel, r.size) for r in empty] == [("tls", 1024)] * 2
            alice.home.config.set("data_channel", "off")  # the provider offers none
            results.append(await copy(bob, "alice:/dataset", str(outs[2])))
            return results

    up, down, up_quic, down_quic, not_offered = arun(scenario())
    assert (outs[3] / "nothing").is_dir() and not any((outs[3] / "nothing").iterdir())
    assert (up.channel, down.channel) == ("tls", "tls")
    assert (up.no_channel, down.no_channel) == ("", "")
    assert (up_quic.channel, down_quic.channel) == ("quic", "quic")
    assert up_quic.no_channel == down_quic.no_channel == NoChannel.OFF
    assert (not_offered.channel, not_offered.no_channel) == ("quic", NoChannel.NOT_OFFERED)
    assert all(r.attempts == 1 for r in (up, down, up_quic, down_quic, not_offered))
    # The same tar either way it went (a download's folders carry the provider's mtimes).
    assert up.size == down.size == up_quic.size and (up.hash, up.digest) == (
        up_quic.hash,
        up_quic.digest,
    )
    assert up.transferred == up.size
    sandbox = sandbox_of(alice, bob)
    assert tree(sandbox / "dataset") == expected == tree(sandbox / "quic" / "dataset")
    for out in outs[:3]:
        assert tree(out / "dataset") == expected
        assert not list(out.glob(f"*{PART_SUFFIX}"))
    assert list(partials_of(alice, bob).iterdir()) == []


def test_the_quota_holds_for_folders_asking_for_the_data_channel(pair, tmp_path: Path) -> None:
    """A folder over the quota is refused before any channel is offered or byte sent."""
    alice, bob = pair
    source = tmp_path / "big"
    source.mkdir()
    write_random(source / "a.bin", 6 * MIB)
    alice.home.config.set("file_quota", "4MB")
    alice.home.config.save()

    async def scenario() -> BaseException:
        async with _serving(alice, bob):
            with pytest.raises(Exception) as caught:
                await copy(bob, str(source), "alice:/")
            return caught.value

    error = arun(scenario())
    assert "file_quota" in str(error)
    assert not (sandbox_of(alice, bob) / "big").exists()
    assert not partials_of(alice, bob).exists() or list(partials_of(alice, bob).iterdir()) == []


# --- app sync --------------------------------------------------------------------------------


def test_app_sync_takes_the_data_channel_and_quic_when_it_is_off(pair, tmp_path: Path) -> None:
    alice, bob = pair
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    write_random(project / "weights.bin", 5 * MIB)
    (project / "data").mkdir()
    (project / "data" / "x.csv").write_text("1,2\n")

    async def scenario() -> list[object]:
        async with _serving(alice, bob):
            first = await sync_app(bob, "alice", project)
            (project / "train.py").write_text("print('changed')\n")
            second = await sync_app(bob, "alice", project)
            unchanged = await sync_app(bob, "alice", project)
            bob.home.config.set("data_channel", "off")
            (project / "data" / "x.csv").write_text("3,4\n")
            off = await sync_app(bob, "alice", project)
            return [first, second, unchanged, off]

    first, second, unchanged, off = arun(scenario())
    assert first.channel == "tls"  # type: ignore[attr-defined]
    # One small file changed: its tar rides the session already open.
    assert (second.channel, second.no_channel) == ("quic", NoChannel.SMALL)  # type: ignore[attr-defined]
    assert first.sent == ["data/x.csv", "train.py", "weights.bin"]  # type: ignore[attr-defined]
    assert second.sent == ["train.py"]  # type: ignore[attr-defined]
    assert unchanged.channel == "" and unchanged.sent == []  # type: ignore[attr-defined]
    assert (off.channel, off.no_channel) == ("quic", NoChannel.OFF)  # type: ignore[attr-defined]
    app = sandbox_of(alice, bob) / "apps" / "proj"
    assert tree(app) == tree(project)
    assert list(partials_of(alice, bob).iterdir()) == []


# --- run --workdir ----------------------------------------------------------------------------


def job_spec(*command: str, workdir: Path) -> JobSpec:
    return JobSpec(
        image=None,
        command=list(command),
        env={},
        workdir=workdir,
        gpu_memory=0,
        retries=0,
        timeout=0.0,
        peer="alice",
        group=None,
    )


@pytest.fixture
def job_pair(make_node, docker_daemon) -> Iterator[tuple[Node, Node]]:
    with job_nodes(make_node, "256MB") as factory:
        alice, bob = factory("alice"), factory("bob")
        pair_both(alice, bob)
        yield alice, bob


def test_run_workdir_takes_the_data_channel_and_quic_when_it_is_off(
    job_pair, tmp_path: Path
) -> None:
    from gpumesh.client.jobs import JobCallbacks, JobResult, run_job

    alice, bob = job_pair
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.txt").write_text("from the workdir\n")
    write_random(work / "blob.bin", 6 * MIB)
    (work / "sub").mkdir()
    (work / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (work / "sub" / "run.sh").chmod(0o755)
    script = "cat hello.txt && sub/run.sh && wc -c < blob.bin"

    async def scenario() -> list[tuple[JobResult, bytes]]:
        outcomes = []
        async with _serving(alice, bob):
            for off in (False, True):
                if off:
                    bob.home.config.set("data_channel", "off")
                output: list[bytes] = []
                callbacks = JobCallbacks(stdout=output.append)
                spec = job_spec("sh", "-c", script, workdir=work)
                result = await run_job(bob, spec, callbacks=callbacks)
                outcomes.append((result, b"".join(output)))
        return outcomes

    (tls, tls_out), (quic, quic_out) = arun(scenario())
    assert (tls.workdir_channel, tls.workdir_no_channel) == ("tls", "")
    assert (quic.workdir_channel, quic.workdir_no_channel) == ("quic", NoChannel.OFF)
    for result, output in ((tls, tls_out), (quic, quic_out)):
        assert (result.state, result.exit_code) == ("succeeded", 0)
        assert output.split() == [b"from", b"the", b"workdir", b"ran", str(6 * MIB).encode()]


@pytest.mark.parametrize("hashes", [["blake3", "sha256"], []], ids=["current", "older"])
def test_a_workdir_over_the_channel_is_checked_with_the_hash_its_offer_names(
    job_pair, tmp_path: Path, hashes: list[str]
) -> None:
    """A consumer that lists hashes gets BLAKE3 named in the offer; one from before
    the list (none sent) gets no name and SHA-256. The provider checks with that
    one: the right digest is taken, the other algorithm's digest of the very same
    bytes is refused, and that job gets no workdir."""
    import io

    from blake3 import blake3

    from gpumesh.blocking import in_thread
    from gpumesh.client.jobs import new_job_id
    from gpumesh.errors import ProtocolError, error_from_code
    from gpumesh.files.pack import scan, tar_size, write_tar
    from gpumesh.protocol.framing import FrameKind
    from gpumesh.protocol.messages import (
        ChannelOffer,
        FileDone,
        JobAccepted,
        JobSubmit,
        Refusal,
        decode_message,
    )
    from gpumesh.transport.channel import dial

    alice, bob = job_pair
    work = tmp_path / "work"
    work.mkdir()
    write_random(work / "blob.bin", 5 * MIB)
    (work / "sub").mkdir()
    (work / "sub" / "hello.txt").write_text("hi\n")
    plan = scan(work)
    out = io.BytesIO()
    write_tar(plan, out)
    data = out.getvalue()
    assert len(data) == tar_size(plan)
    digests = {"blake3": blake3(data).digest(), "sha256": hashlib.sha256(data).digest()}
    named = "blake3" if hashes else "sha256"
    other = "sha256" if hashes else "blake3"

    async def submit(session, digest: bytes) -> tuple[str, str, ProtocolError | None]:
        peer = bob.peer("alice")
        job_id = new_job_id()
        stream = session.open_stream()
        stream.send_message(
            JobSubmit(
                job_id=job_id,
                image=str(alice.home.config.get("image")),
                command=["true"],
                env={},
                workdir_bytes=len(data),
                gpu_memory=0,
                retries=0,
                timeout=0.0,
                attach=False,
                channel=True,
                hashes=hashes,
            )
        )
        offer = await stream.expect(ChannelOffer)
        await stream.expect(JobAccepted)
        channel = await in_thread(
            dial, session.address[0], offer.port, peer.public_key, offer.ticket, 10.0
        )
        try:
            await in_thread(channel.sock.sendall, data)
        finally:
            channel.close()
        stream.send_message(FileDone(size=len(data), digest=digest), end=True)
        refused = None
        while (frame := await stream.read_frame()) is not None:
            if frame.kind is FrameKind.MESSAGE:
                message = decode_message(frame.body)
                if isinstance(message, Refusal):
                    error = error_from_code(message.code, message.message)
                    assert isinstance(error, ProtocolError)
                    refused = error
        return job_id, offer.hash, refused

    owners: list[tuple[int, int] | None] = []

    async def scenario() -> list[tuple[str, str, ProtocolError | None]]:
        async with _serving(alice, bob) as agent:
            async with bob.session(str(bob.peer("alice").node_id)) as session:
                done = [await submit(session, digests[name]) for name in (named, other)]
            owners.append(agent.files.owner)
            return done

    (good, good_named, good_refused), (bad, bad_named, bad_refused) = arun(scenario())
    assert good_named == bad_named == ("blake3" if hashes else "")
    assert good_refused is None
    assert bad_refused is not None and "does not match its hash" in str(bad_refused)
    jobs = {job.job_id: job for job in alice.home.store.jobs(role="hosted")}
    assert jobs[bad].state == "failed" and "did not complete" in jobs[bad].message
    assert jobs[good].state != "failed"
    assert not (alice.home.path / "jobs" / bad / "work").exists()
    # Unpacked as the job's user, every folder and file, the workdir itself included.
    work_there = alice.home.path / "jobs" / good / "work"
    made = [work_there, *work_there.rglob("*")]
    assert len(made) == 4 and owners[0] is not None
    assert {(p.lstat().st_uid, p.lstat().st_gid) for p in made} == {owners[0]}


def test_a_workdir_goes_over_the_channel_to_a_provider_from_before_the_hash_list(
    job_pair, tmp_path: Path
) -> None:
    """A provider that reads no ``hashes`` in JobSubmit names none in its offer and
    checks SHA-256: the consumer then sends SHA-256 (BLAKE3 would be refused)."""
    import msgspec

    from gpumesh.client.jobs import JobCallbacks, run_job
    from gpumesh.protocol.messages import ChannelOffer, JobSubmit

    alice, bob = job_pair
    work = tmp_path / "work"
    work.mkdir()
    write_random(work / "blob.bin", 3 * MIB)
    seen: list[list[str]] = []

    async def scenario() -> tuple[object, bytes]:
        async with _serving(alice, bob) as agent:
            real = agent.handlers[JobSubmit]

            async def older(ctx: Any, message: Any) -> None:
                seen.append(list(message.hashes))
                send = ctx.stream.send_message

                def as_older(reply: Any, *, end: bool = False) -> None:
                    if isinstance(reply, ChannelOffer):
                        reply = msgspec.structs.replace(reply, hash="")
                    send(reply, end=end)

                ctx.stream.send_message = as_older
                await real(ctx, msgspec.structs.replace(message, hashes=[]))

            agent.handlers[JobSubmit] = older
            output: list[bytes] = []
            spec = job_spec("sh", "-c", "wc -c < blob.bin", workdir=work)
            result = await run_job(bob, spec, callbacks=JobCallbacks(stdout=output.append))
            return result, b"".join(output)

    result, output = arun(scenario())
    assert seen == [["blake3", "sha256"]]
    assert (result.state, result.exit_code, result.workdir_channel) == ("succeeded", 0, "tls")
    assert output.strip() == str(3 * MIB).encode()


# --- a blocked or broken channel ---------------------------------------------------------------


@contextlib.contextmanager
def _firewalled(action: list[str]) -> Iterator[tuple[str, Callable[[], None]]]:
    """A loopback address of this test's own, and a way to make iptables apply
    ``action`` to TCP towards it (removed at the end)."""
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        if _in_ci():
            pytest.fail("needs root and iptables, which CI must have")
        pytest.skip("needs root and iptables")
    host = f"127.{random.randint(100, 250)}.{random.randint(1, 250)}.{random.randint(1, 250)}"
    rule = ["INPUT", "-d", host, "-p", "tcp", "-j", *action]
    added = False

    def block() -> None:
        nonlocal added
        subprocess.run(["iptables", "-w", "-I", *rule], check=True)
        added = True

    try:
        yield host, block
    finally:
        if added:
            subprocess.run(["iptables", "-w", "-D", *rule], check=False)


def test_a_blocked_channel_is_remembered_and_later_copies_go_straight_to_quic(
    pair, tmp_path: Path
) -> None:
    """A firewall drops the channel's TCP port: the first copy falls back after the
    connect times out and remembers it; the next ones do not try the channel."""
    alice, bob = pair
    source = _dataset(tmp_path / "dataset")
    single = tmp_path / "one.bin"
    write_random(single, MIB)
    out = tmp_path / "out"
    out.mkdir()

    async def scenario(host: str) -> list[CopyResult]:
        async with _serving(alice, bob, host):
            return [
                await copy(bob, str(source), "alice:/"),
                await copy(bob, "alice:/dataset", str(out)),
                await copy(bob, str(single), "alice:/one.bin"),
            ]

    with _firewalled(["DROP"]) as (host, block):
        alice.home.config.set("listen_host", host)
        alice.home.config.save()
        block()
        first, second, third = arun(scenario(host))
    assert (first.channel, first.no_channel) == ("quic", NoChannel.FAILED)
    assert (second.channel, second.no_channel) == ("quic", NoChannel.BLOCKED)
    assert (third.channel, third.no_channel) == ("quic", NoChannel.BLOCKED)
    assert all(r.attempts == 1 for r in (first, second, third))
    assert bob.peer("alice").channel_blocked_until > 0
    assert tree(out / "dataset") == tree(source) == tree(sandbox_of(alice, bob) / "dataset")


def test_a_channel_broken_mid_folder_falls_back_and_places_nothing_half(
    pair, tmp_path: Path
) -> None:
    """The channel is reset in the middle of a folder upload: the copy retries, the
    channel no longer opens, and QUIC carries it whole; nothing half-unpacked stays."""
    alice, bob = pair
    source = tmp_path / "dataset"
    source.mkdir()
    for index in range(6):
        write_random(source / f"f{index}.bin", 4 * MIB)
    retries: list[str] = []

    with _firewalled(["REJECT", "--reject-with", "tcp-reset"]) as (host, block):
        alice.home.config.set("listen_host", host)
        alice.home.config.save()

        def progress(done: int, _total: int) -> None:
            if done >= 8 * MIB and not retries and not blocked:
                blocked.append(True)
                block()

        blocked: list[bool] = []
        callbacks = CopyCallbacks(
            progress=progress, retrying=lambda error, _attempt: retries.append(str(error))
        )

        async def scenario() -> CopyResult:
            async with _serving(alice, bob, host):
                return await copy(bob, str(source), "alice:/", callbacks=callbacks)

        result = arun(scenario())
    assert blocked and len(retries) == 1
    assert result.attempts == 2
    assert (result.channel, result.no_channel) == ("quic", NoChannel.FAILED)
    assert tree(sandbox_of(alice, bob) / "dataset") == tree(source)
    assert list(partials_of(alice, bob).iterdir()) == []


def test_a_workdir_whose_channel_breaks_fails_the_job_in_one_line_and_leaves_no_workdir(
    job_pair, tmp_path: Path
) -> None:
    from gpumesh.client.jobs import JobCallbacks, run_job
    from gpumesh.errors import GPUMeshError

    alice, bob = job_pair
    work = tmp_path / "work"
    work.mkdir()
    for index in range(6):
        write_random(work / f"f{index}.bin", 4 * MIB)
    blocked: list[bool] = []

    with _firewalled(["REJECT", "--reject-with", "tcp-reset"]) as (host, block):
        alice.home.config.set("listen_host", host)
        alice.home.config.save()

        def upload(done: int, _total: int) -> None:
            if done >= 8 * MIB and not blocked:
                blocked.append(True)
                block()

        async def scenario() -> GPUMeshError:
            async with _serving(alice, bob, host):
                spec = job_spec("true", workdir=work)
                with pytest.raises(GPUMeshError) as caught:
                    await run_job(bob, spec, callbacks=JobCallbacks(upload=upload))
                return caught.value

        error = arun(scenario())
    assert blocked
    assert "\n" not in str(error) and "data channel" in str(error)
    jobs = alice.home.store.jobs(role="hosted")
    assert [job.state for job in jobs] == ["failed"]
    assert "did not complete" in jobs[0].message
    job_dir = alice.home.path / "jobs" / jobs[0].job_id
    assert not (job_dir / "work").exists() and not (job_dir / "incoming").exists()


def test_a_channels_buffers_count_in_its_connections_link_buffer(pair) -> None:
    """While one tar holds a channel, its pump's buffers count against link_buffer: a
    second tar on the same connection that would take it over gets no offer (it goes
    on QUIC), and once the first ends its share is given back."""
    from gpumesh.protocol.messages import ChannelOffer, DirPut, FileResume
    from gpumesh.transport.channel import HELD

    alice, bob = pair
    alice.home.config.set("link_buffer", str(HELD + HELD // 2))
    alice.home.config.save()

    async def answers(session: object, path: str) -> tuple[object, list[str]]:
        stream = session.open_stream()  # type: ignore[attr-defined]
        stream.send_message(DirPut(path=path, size=10 * MIB, channel=True))
        first = await stream.read_message()
        kinds = [type(first).__name__]
        if isinstance(first, ChannelOffer):
            kinds.append(type(await stream.expect(FileResume)).__name__)
        return stream, kinds

    async def scenario() -> tuple[list[str], list[str], list[str]]:
        peer_id = str(bob.peer("alice").node_id)
        async with _serving(alice, bob), bob.session(peer_id) as session:
            held, first = await answers(session, "/a")
            waiting, second = await answers(session, "/b")
            waiting.abort()  # type: ignore[attr-defined]
            held.abort()  # type: ignore[attr-defined]
            # The first request's end gives its share back (soon; generous ceiling).
            for _ in range(100):
                stream, third = await answers(session, "/c")
                stream.abort()  # type: ignore[attr-defined]
                if third[0] == "ChannelOffer":
                    break
                await asyncio.sleep(0.1)
            return first, second, third

    first, second, third = arun(scenario())
    assert first == ["ChannelOffer", "FileResume"]
    assert second == ["FileResume"]
    assert third == ["ChannelOffer", "FileResume"]


def _hostile_tar() -> bytes:
    """A tar whose entries climb out of the folder it is unpacked into."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in ("fine.txt", "../escaped.txt", "../../escaped-too.txt"):
            info = tarfile.TarInfo(name)
            data = b"payload\n"
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_a_hostile_tar_over_the_data_channel_meets_the_same_unpacker(pair, tmp_path: Path) -> None:
    """A consumer that sends a tar with escaping names over the channel is refused as
    over QUIC, and nothing lands in the sandbox, its staging folder or above them."""
    from gpumesh.blocking import in_thread
    from gpumesh.errors import GPUMeshError, ProtocolError
    from gpumesh.protocol.messages import ChannelOffer, DirPut, FileDone, FileResume
    from gpumesh.transport.channel import dial

    alice, bob = pair
    data = _hostile_tar()
    digest = hashlib.sha256(data).digest()
    files = alice.home.path / "files"

    async def scenario() -> GPUMeshError:
        async with _serving(alice, bob):
            peer = bob.peer("alice")
            async with bob.session(str(peer.node_id)) as session:
                stream = session.open_stream()
                stream.send_message(DirPut(path="/evil", size=len(data), channel=True))
                offer = await stream.expect(ChannelOffer)
                await stream.expect(FileResume)
                host = session.address[0]
                channel = await in_thread(
                    dial, host, offer.port, peer.public_key, offer.ticket, 10.0
                )
                try:
                    await in_thread(channel.sock.sendall, data)
                finally:
                    channel.close()
                stream.send_message(FileDone(size=len(data), digest=digest), end=True)
                with pytest.raises(GPUMeshError) as caught:
                    await stream.expect(FileDone)
                return caught.value

    error = arun(scenario())
    assert isinstance(error, ProtocolError)
    assert "'../escaped.txt' climbs out" in str(error)
    assert not (sandbox_of(alice, bob) / "evil").exists()
    assert list(partials_of(alice, bob).iterdir()) == []
    leaked = [p for p in alice.home.path.rglob("escaped*")] + list(tmp_path.rglob("escaped*"))
    assert leaked == []
    assert files.is_dir()
