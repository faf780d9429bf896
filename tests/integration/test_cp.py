"""`gpumesh cp` between real nodes on loopback: round trips, the sandbox, the quota,
resuming after a dropped link and after a killed agent, and the CLI's messages.

Big files are never held in memory: they are written, hashed and compared in
1 MiB pieces (the 1 GiB one is sparse on the sending side).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.agent.server import Agent
from gpumesh.client.cpdownload import PART_SUFFIX
from gpumesh.client.files import CopyCallbacks, CopyResult, copy
from gpumesh.client.node import Node
from gpumesh.errors import (
    AccessDeniedError,
    ConfigError,
    ConnectionLostError,
    GPUMeshError,
    LimitError,
    NotFoundError,
)
from gpumesh.protocol.messages import (
    DirGet,
    DirPut,
    FileGet,
    FileInfo,
    FilePut,
    FileStat,
    Message,
)
from tests.integration.conftest import arun, gpumesh, pair_both, sharing
from tests.integration.node import wait_shares
from tests.integration.test_cli import _free_udp_port, _one_line_error

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

MIB = 1024 * 1024


# --- helpers ---------------------------------------------------------------------------------


def write_random(path: Path, size: int) -> None:
    """Distinct content in every MiB, written piece by piece."""
    block = os.urandom(MIB)
    with path.open("wb") as out:
        written = 0
        while written < size:
            piece = (written.to_bytes(8, "big") + block)[: min(MIB, size - written)]
            out.write(piece)
            written += len(piece)


def sha256_of(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as source:
        while piece := source.read(MIB):
            hasher.update(piece)
    return hasher.hexdigest()


def blake3_of(path: Path) -> str:
    """The digest copies between two nodes of this version agree on."""
    from blake3 import blake3

    hasher = blake3()
    with path.open("rb") as source:
        while piece := source.read(MIB):
            hasher.update(piece)
    return hasher.hexdigest()


def sandbox_of(provider: Node, consumer: Node) -> Path:
    return provider.home.path / "files" / str(consumer.info().node_id)


def partials_of(provider: Node, consumer: Node) -> Path:
    return provider.home.path / "files" / ".partial" / str(consumer.info().node_id)


def tree(root: Path) -> dict[str, tuple[str, int, str]]:
    """Every entry under ``root``: kind, permission bits, content hash or link target."""
    found: dict[str, tuple[str, int, str]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            relative = str(path.relative_to(root))
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                found[relative] = ("link", 0, os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                found[relative] = ("dir", stat.S_IMODE(st.st_mode), "")
            else:
                found[relative] = ("file", stat.S_IMODE(st.st_mode), sha256_of(path))
    return found


def everything_under(root: Path, skip: tuple[Path, ...]) -> set[str]:
    """Paths under ``root`` but outside ``skip`` (state files that change on their own left out)."""
    found = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(folder) / d not in skip]
        for name in dirs + files:
            if ".db" not in name and name != "logs" and not name.startswith("gpumesh.log"):
                found.add(str(Path(folder, name).relative_to(root)))
    return found


@pytest.fixture
def pair(make_node) -> tuple[Node, Node]:
    """alice (the provider) and bob, paired both ways."""
    alice, bob = make_node("alice"), make_node("bob")
    pair_both(alice, bob)
    return alice, bob


async def _copy_sharing(alice: Node, bob: Node, source: str, dest: str, **kw: object) -> CopyResult:
    async with _serving(alice, bob):
        return await copy(bob, source, dest, **kw)  # type: ignore[arg-type]


def _where(agent: Agent) -> str:
    host, port = agent.address
    return f"{host}:{port}"


@contextlib.asynccontextmanager
async def _serving(alice: Node, bob: Node):
    """alice's agent, and bob pointed at its ephemeral port."""
    async with sharing(alice) as agent:
        bob.home.store.touch_peer(bob.peer("alice").node_id, address=_where(agent))
        yield agent


# --- round trips -----------------------------------------------------------------------------


def test_small_and_empty_files_round_trip_with_their_modes(pair, tmp_path: Path) -> None:
    alice, bob = pair
    small, empty, script = tmp_path / "small.bin", tmp_path / "empty", tmp_path / "run.sh"
    write_random(small, 300_001)
    small.chmod(0o640)
    empty.touch()
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    back = tmp_path / "back"
    back.mkdir()

    async def scenario() -> list[CopyResult]:
        async with _serving(alice, bob):
            results = [
                await copy(bob, str(small), "alice:/data/small.bin"),  # parents are created
                await copy(bob, str(empty), "alice:"),  # into the sandbox root, own name
                await copy(bob, str(script), "alice:/data/"),  # into a folder
            ]
            for remote in ("/data/small.bin", "/empty", "data/run.sh"):
                results.append(await copy(bob, f"alice:{remote}", str(back)))
            return results

    results = arun(scenario())
    sandbox = sandbox_of(alice, bob)
    assert sorted(tree(sandbox)) == ["data", "data/run.sh", "data/small.bin", "empty"]
    assert [r.remote for r in results] == [
        "/data/small.bin",
        "/empty",
        "/data/run.sh",
        "/data/small.bin",
        "/empty",
        "/data/run.sh",
    ]
    for original in (small, empty, script):
        copied = back / original.name
        assert copied.read_bytes() == original.read_bytes()
        assert stat.S_IMODE(copied.stat().st_mode) == stat.S_IMODE(original.stat().st_mode)
    assert results[0].digest == blake3_of(small)
    assert results[1].size == 0 and results[4].size == 0
    assert all(r.offsets == [0] and r.resumed_from == 0 for r in results)
    assert not list(back.glob(f"*{PART_SUFFIX}"))
    assert not list(partials_of(alice, bob).iterdir())


def test_a_sparse_gib_round_trips_byte_identical(pair, tmp_path: Path) -> None:
    alice, bob = pair
    source = tmp_path / "sparse.bin"
    with source.open("wb") as out:
        out.truncate(1024 * MIB)  # a hole: nothing held in memory or on disk
        out.seek(512 * MIB)
        out.write(b"middle")  # and a little content inside it
    expected = sha256_of(source)

    up = arun(_copy_sharing(alice, bob, str(source), "alice:/big.bin"))
    stored = sandbox_of(alice, bob) / "big.bin"
    assert stored.stat().st_size == 1024 * MIB
    assert (up.hash, up.digest) == ("blake3", blake3_of(source))
    assert up.transferred == 1024 * MIB
    assert up.channel == "tls"  # the bytes took the data channel, not QUIC

    back = tmp_path / "back.bin"
    down = arun(_copy_sharing(alice, bob, "alice:big.bin", str(back)))
    stored.unlink()
    assert (down.hash, down.digest) == ("blake3", up.digest)
    assert down.channel == "tls"
    assert back.stat().st_size == 1024 * MIB
    assert sha256_of(back) == expected


# --- the data channel ------------------------------------------------------------------------


def test_the_quic_path_serves_when_the_data_channel_is_off(pair, tmp_path: Path) -> None:
    alice, bob = pair
    source, back = tmp_path / "data.bin", tmp_path / "back.bin"
    write_random(source, 5 * MIB + 3)

    async def scenario() -> list[CopyResult]:
        async with _serving(alice, bob):
            results = [
                await copy(bob, str(source), "alice:/a.bin", fast_path=False),
                await copy(bob, "alice:/a.bin", str(back), fast_path=False),
            ]
            # The provider turns it off: the consumer falls back without a word.
            alice.home.config.set("data_channel", "off")
            back.unlink()
            results += [
                await copy(bob, str(source), "alice:/b.bin"),
                await copy(bob, "alice:/b.bin", str(back)),
            ]
            return results

    results = arun(scenario())
    assert [r.channel for r in results] == ["quic"] * 4
    assert all(r.attempts == 1 for r in results)
    assert sha256_of(sandbox_of(alice, bob) / "b.bin") == sha256_of(source) == sha256_of(back)


def _put_offer(session: object, path: str, size: int) -> object:
    from gpumesh.protocol.messages import ChannelOffer, ChannelPut

    async def ask() -> tuple[object, ChannelOffer]:
        stream = session.open_stream()  # type: ignore[attr-defined]
        stream.send_message(ChannelPut(path=path, size=size, mode=0o644, source="ab" * 16))
        return stream, await stream.expect(ChannelOffer)

    return ask()


def test_the_data_channel_admits_only_its_ticket_once(pair, tmp_path: Path, monkeypatch) -> None:
    """A wrong ticket, no ticket, or a second connection: refused, nothing written.

    A refused connection leaves the listener waiting (the peer's own may come
    next): the request ends when its window closes without the right ticket."""
    import socket as sockets

    from gpumesh.blocking import in_thread
    from gpumesh.transport.channel import dial

    monkeypatch.setattr("gpumesh.transport.channel.ACCEPT_WAIT", 1.0)
    alice, bob = pair
    key = alice.home.identity.public_key
    outcomes: dict[str, object] = {}

    async def scenario() -> None:
        async with _serving(alice, bob), bob.session("alice") as session:
            host = session.address[0]
            for case in ("wrong ticket", "no ticket", "second connection"):
                stream, offer = await _put_offer(session, f"/{case}.bin", 1000)  # type: ignore[misc]
                ticket = offer.ticket if case == "second connection" else bytes(32)
                if case == "no ticket":
                    raw = await in_thread(sockets.create_connection, (host, offer.port))
                    raw.close()  # not even TLS: closed, and the window runs out
                else:
                    channel = await in_thread(dial, host, offer.port, key, ticket, 5.0)
                    if case == "second connection":
                        channel.close()  # its one connection, used up without a byte
                        try:
                            await in_thread(dial, host, offer.port, key, offer.ticket, 5.0)
                        except GPUMeshError as exc:
                            outcomes["reconnect"] = exc
                    else:
                        with contextlib.suppress(OSError):
                            channel.sock.sendall(b"x" * 1000)
                        channel.close()
                try:
                    outcomes[case] = await stream.read_message()
                except GPUMeshError as exc:
                    outcomes[case] = exc

    arun(scenario())
    assert isinstance(outcomes["wrong ticket"], AccessDeniedError)
    assert "ticket" in str(outcomes["wrong ticket"])
    assert isinstance(outcomes["no ticket"], GPUMeshError)
    assert isinstance(outcomes["second connection"], GPUMeshError)
    assert isinstance(outcomes["reconnect"], GPUMeshError)  # the listener is gone
    sandbox = sandbox_of(alice, bob)
    assert not sandbox.exists() or not list(sandbox.iterdir())
    for part in partials_of(alice, bob).glob("*.part"):
        assert part.stat().st_size == 0  # not a byte of the file was accepted


def test_strangers_cannot_break_a_copy_over_the_data_channel(
    pair, tmp_path: Path, monkeypatch
) -> None:
    """Before the consumer's own connection, others reach the listener: one from
    another address bearing the right ticket; from the peer's address, one that
    never starts TLS, one with a wrong ticket and then bytes, and one that says
    nothing and stays. Each is closed unread, and the copies, both ways, go
    over the channel whole."""
    import socket as sockets
    import ssl

    from gpumesh.client import bulk
    from gpumesh.transport import channel as channels

    alice, bob = pair
    source, back = tmp_path / "data.bin", tmp_path / "back.bin"
    write_random(source, 3 * MIB + 5)
    real_dial = channels.dial
    refused: list[str] = []

    def closed_on(sock: sockets.socket) -> bool:
        sock.settimeout(5)
        try:
            return sock.recv(1) == b""
        except OSError:  # reset
            return True

    def racing_dial(host: str, port: int, key: bytes, ticket: bytes, stall: float) -> object:
        silent = sockets.create_connection((host, port), timeout=5)
        other = sockets.create_connection((host, port), timeout=5, source_address=("127.0.0.2", 0))
        try:
            with channels.client_context().wrap_socket(other) as tls:
                tls.sendall(ticket)
                refused.append("another address" if closed_on(tls) else "ANOTHER ADDRESS GOT IN")
        except (OSError, ssl.SSLError):
            refused.append("another address")
        finally:
            other.close()
        plain = sockets.create_connection((host, port), timeout=5)
        plain.sendall(b"GET / HTTP/1.0\r\n\r\n")
        refused.append("no TLS" if closed_on(plain) else "NO TLS KEPT OPEN")
        plain.close()
        wrong = real_dial(host, port, key, bytes(32), 5.0)
        with contextlib.suppress(OSError):
            wrong.sock.sendall(b"x" * 1000)
        refused.append("wrong ticket" if closed_on(wrong.sock) else "WRONG TICKET KEPT OPEN")
        wrong.close()
        channel = real_dial(host, port, key, ticket, stall)
        refused.append("silent" if closed_on(silent) else "SILENT KEPT OPEN")
        silent.close()
        return channel

    monkeypatch.setattr(bulk, "dial", racing_dial)  # where the client dials

    async def scenario() -> tuple[CopyResult, CopyResult]:
        async with _serving(alice, bob):
            up = await copy(bob, str(source), "alice:/data.bin")
            down = await copy(bob, "alice:/data.bin", str(back))
            return up, down

    up, down = arun(scenario())
    assert refused == ["another address", "no TLS", "wrong ticket", "silent"] * 2
    assert (up.channel, down.channel) == ("tls", "tls")
    assert up.offsets == [0] and down.offsets == [0]  # first attempts: nothing broke
    expected = sha256_of(source)
    assert sha256_of(sandbox_of(alice, bob) / "data.bin") == expected
    assert sha256_of(back) == expected
    assert up.digest == down.digest == blake3_of(source)
    assert not list(partials_of(alice, bob).iterdir())


def test_a_dual_stack_listener_knows_its_ipv4_peer() -> None:
    """On ``::`` an IPv4 client shows as ``::ffff:a.b.c.d``: still the peer; ``::1`` is not."""
    import socket as sockets

    from gpumesh.identity.keys import Identity
    from gpumesh.transport.channel import Listener, dial, server_context

    identity = Identity.generate()
    try:
        listener = Listener("::", server_context(identity), bytes(range(32)), peer="127.0.0.1")
    except OSError:
        pytest.skip("no IPv6 here")
    stranger = sockets.create_connection(("::1", listener.port), timeout=5)
    try:

        async def scenario() -> bytes:
            from gpumesh.blocking import in_thread

            accepting = in_thread(listener.accept, 5.0, 5.0)
            channel = await in_thread(
                dial, "127.0.0.1", listener.port, identity.public_key, bytes(range(32)), 5.0
            )
            accepted = await accepting
            channel.sock.sendall(b"hello")
            got = accepted.sock.recv(5)
            channel.close()
            accepted.close()
            return got

        assert arun(scenario()) == b"hello"
        stranger.settimeout(5)
        assert stranger.recv(1) == b""  # ::1 is another address: closed unread
    finally:
        stranger.close()
        listener.close()


def test_a_tree_of_small_files_round_trips_with_modes(pair, tmp_path: Path) -> None:
    alice, bob = pair
    source = tmp_path / "dataset"
    for index in range(300):
        folder = source / f"part{index % 7}" / f"sub{index % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"f{index:03d}.txt"
        path.write_bytes(os.urandom(index * 13))
        path.chmod((0o600, 0o644, 0o755)[index % 3])
    (source / "empty-folder").mkdir()
    (source / "private").mkdir(mode=0o700)
    (source / "private" / "key").write_text("k")
    (source / "link").symlink_to("part0/sub0/f000.txt")
    deep = source / ("long-name-" * 12) / "inner"  # names past the 100 bytes of a tar header
    deep.mkdir(parents=True)
    deep.parent.chmod(0o750)
    (deep / "data").write_bytes(b"x" * 5000)
    expected = tree(source)
    out = tmp_path / "out"
    out.mkdir()

    async def scenario() -> tuple[CopyResult, CopyResult, CopyResult]:
        async with _serving(alice, bob):
            up = await copy(bob, str(source), "alice:/")
            down = await copy(bob, "alice:/dataset", str(out))
            # Into an existing folder again: merged, the new content wins.
            (source / "part0" / "sub0" / "f000.txt").write_text("changed")
            again = await copy(bob, str(source), "alice:/")
            return up, down, again

    up, down, again = arun(scenario())
    assert up.kind == down.kind == "dir"
    assert up.remote == "/dataset" and down.local == out / "dataset"
    assert tree(out / "dataset") == expected
    assert tree(sandbox_of(alice, bob) / "dataset") != expected  # f000.txt changed since
    assert expected["private"] == ("dir", 0o700, "")
    assert (sandbox_of(alice, bob) / "dataset/part0/sub0/f000.txt").read_text() == "changed"
    assert again.remote == "/dataset"
    assert not list(out.glob(f"*{PART_SUFFIX}"))


# --- the sandbox -----------------------------------------------------------------------------

ESCAPES = [
    "../x",
    "/../x",
    "..",
    "a/../../x",
    "sub/../../../x",
    "out/x",  # a symlink the provider's owner left, pointing out
    "out",
    "devnull",  # a symlink to a device outside
    "..\\..\\x",
    "x\x00y",
    "bad\nname",
]


async def _refusal(session: object, message: Message, data: bool) -> GPUMeshError:
    stream = session.open_stream()  # type: ignore[attr-defined]
    stream.send_message(message)
    if data:  # a hostile consumer that does not wait for FileResume
        await stream.send_data(b"x" * 1000)
        stream.end_data()
    try:
        reply = await stream.read_message()
    except GPUMeshError as exc:
        return exc
    raise AssertionError(f"{message} was answered with {reply}")


def test_every_escape_is_refused_and_nothing_is_written_outside(pair, tmp_path: Path) -> None:
    alice, bob = pair
    sandbox = sandbox_of(alice, bob)
    sandbox.mkdir(parents=True)
    (sandbox / "sub").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (sandbox / "out").symlink_to(outside)
    (sandbox / "devnull").symlink_to("/dev/null")
    os.mkfifo(sandbox / "pipe")
    before = everything_under(tmp_path, (sandbox,))
    digest = bytes(32)

    async def scenario() -> dict[tuple[str, str], GPUMeshError]:
        refused = {}
        async with _serving(alice, bob), bob.session("alice") as session:
            for remote in ESCAPES:
                for message, data in [
                    (FileStat(path=remote), False),
                    (FileGet(path=remote, offset=0), False),
                    (DirGet(path=remote), False),
                    (FilePut(path=remote, size=1000, mode=0o644, digest=digest), True),
                    (DirPut(path=remote, size=1000), True),
                ]:
                    refused[(type(message).__name__, remote)] = await _refusal(
                        session, message, data
                    )
            refused[("FileGet", "pipe")] = await _refusal(
                session, FileGet(path="pipe", offset=0), False
            )
        return refused

    refused = arun(scenario())
    for (kind, remote), error in refused.items():
        if remote in ("x\x00y", "bad\nname", "..\\..\\x"):
            assert isinstance(error, ConfigError), (kind, remote, error)
        else:
            assert isinstance(error, AccessDeniedError), (kind, remote, error)
        assert error.message.startswith("alice refused") or remote == "pipe", error.message
    assert "not a regular file" in refused[("FileGet", "pipe")].message
    assert everything_under(tmp_path, (sandbox,)) == before
    assert list(outside.iterdir()) == []
    assert sorted(os.listdir(sandbox)) == ["devnull", "out", "pipe", "sub"]


def test_the_client_reports_escapes_devices_and_missing_files(pair, tmp_path: Path) -> None:
    alice, bob = pair
    local = tmp_path / "f.bin"
    local.write_bytes(b"data")

    async def scenario() -> list[GPUMeshError]:
        errors = []
        async with _serving(alice, bob):
            for source, dest in [
                (str(local), "alice:../f.bin"),
                ("alice:/a/../../f.bin", str(tmp_path / "g")),
                (str(tmp_path / "missing.bin"), "alice:/x"),
                ("alice:/missing.bin", str(tmp_path / "g")),
                ("/dev/null", "alice:/null"),
                (str(local), str(tmp_path / "h")),
                ("alice:/a", "alice:/b"),
                (str(local), "nobody:/x"),
            ]:
                with pytest.raises(GPUMeshError) as info:
                    await copy(bob, source, dest)
                errors.append(info.value)
        return errors

    errors = arun(scenario())
    kinds = [type(e).__name__ for e in errors]
    assert kinds == [
        "AccessDeniedError",
        "AccessDeniedError",
        "NotFoundError",
        "NotFoundError",
        "ConfigError",
        "ConfigError",
        "ConfigError",
        "UnknownPeerError",
    ]
    assert "climbs out with '..'" in errors[0].message
    assert "missing.bin does not exist" in errors[2].message
    assert "alice:/missing.bin does not exist" in errors[3].message
    assert "not a regular file" in errors[4].message
    assert sorted(os.listdir(tmp_path)) == ["alice", "bob", "f.bin"]


def test_peers_never_see_each_others_files(make_node, tmp_path: Path) -> None:
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")
    pair_both(alice, bob)
    pair_both(alice, carol)
    secret = tmp_path / "secret.txt"
    secret.write_text("bob's")

    async def scenario() -> tuple[FileInfo, FileInfo]:
        async with sharing(alice) as agent:
            for node in (bob, carol):
                node.home.store.touch_peer(node.peer("alice").node_id, address=_where(agent))
            await copy(bob, str(secret), "alice:/secret.txt")
            async with carol.session("alice") as session:
                theirs = await session.request(FileStat(path="/secret.txt"))
            async with bob.session("alice") as session:
                mine = await session.request(FileStat(path="/secret.txt"))
            with pytest.raises(NotFoundError):
                await copy(carol, "alice:/secret.txt", str(tmp_path / "stolen"))
        assert isinstance(theirs, FileInfo) and isinstance(mine, FileInfo)
        return theirs, mine

    theirs, mine = arun(scenario())
    assert not theirs.exists
    assert mine.exists and mine.kind == "file" and mine.size == 5
    assert not (tmp_path / "stolen").exists()


def test_the_quota_refuses_before_any_byte_is_written(pair, tmp_path: Path) -> None:
    alice, bob = pair
    alice.home.config.set("file_quota", "1MB")
    alice.home.config.save()
    first, second, bigger = tmp_path / "1.bin", tmp_path / "2.bin", tmp_path / "3.bin"
    write_random(first, 600_000)
    write_random(second, 600_000)
    write_random(bigger, 900_000)
    folder = tmp_path / "folder"
    folder.mkdir()
    write_random(folder / "inside.bin", 600_000)

    async def scenario() -> list[GPUMeshError]:
        errors = []
        async with _serving(alice, bob):
            await copy(bob, str(first), "alice:/1.bin")
            for source in (second, folder):
                with pytest.raises(LimitError) as info:
                    await copy(bob, str(source), "alice:/")
                errors.append(info.value)
            await copy(bob, str(bigger), "alice:/1.bin")  # replaces: 900KB in all
        return errors

    errors = arun(scenario())
    assert "keeps at most 1MB of files for you (its file_quota)" in errors[0].message
    assert "600KB is in use" in errors[0].message
    assert sorted(os.listdir(sandbox_of(alice, bob))) == ["1.bin"]
    assert sha256_of(sandbox_of(alice, bob) / "1.bin") == sha256_of(bigger)
    assert list(partials_of(alice, bob).iterdir()) == []


# --- resuming --------------------------------------------------------------------------------


class _DropLinks:
    """Progress callback that drops the provider's links once, part-way."""

    def __init__(self, agent: Agent, at: int) -> None:
        self.agent = agent
        self.at = at
        self.dropped = False
        self.retries: list[str] = []

    def progress(self, done: int, _total: int) -> None:
        if not self.dropped and done >= self.at:
            self.dropped = True
            assert self.agent.endpoint is not None
            for link in list(self.agent.endpoint.links):
                link.close()

    def callbacks(self) -> CopyCallbacks:
        return CopyCallbacks(
            progress=self.progress, retrying=lambda error, _n: self.retries.append(str(error))
        )


def test_a_dropped_link_is_retried_and_resumed_both_ways(pair, tmp_path: Path) -> None:
    alice, bob = pair
    source, back = tmp_path / "data.bin", tmp_path / "back.bin"
    write_random(source, 48 * MIB)

    async def scenario() -> tuple[CopyResult, CopyResult, list[str]]:
        async with _serving(alice, bob) as agent:
            dropper = _DropLinks(agent, 24 * MIB)
            up = await copy(bob, str(source), "alice:/data.bin", callbacks=dropper.callbacks())
            dropper = _DropLinks(agent, 24 * MIB)
            down = await copy(bob, "alice:/data.bin", str(back), callbacks=dropper.callbacks())
            return up, down, dropper.retries

    up, down, retries = arun(scenario())
    for result in (up, down):
        assert result.attempts == 2
        assert result.offsets[0] == 0
        assert 0 < result.offsets[1] < 48 * MIB
        assert result.transferred < 48 * MIB + 24 * MIB
    assert len(retries) == 1 and "clos" in retries[0]  # "alice closed the connection" or the like
    assert sha256_of(sandbox_of(alice, bob) / "data.bin") == sha256_of(source)
    assert sha256_of(back) == sha256_of(source)
    assert up.digest == down.digest == blake3_of(source)
    assert not (tmp_path / f"back.bin{PART_SUFFIX}").exists()
    assert list(partials_of(alice, bob).iterdir()) == []


def _start_agent(home: Path) -> subprocess.Popen[bytes]:
    """This home's node process in the foreground (`gpumesh daemon run`), once it
    shares: killing it kills the agent."""
    env = dict(os.environ, GPUMESH_HOME=str(home))
    env.pop("GPUMESH_LOG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "daemon", "run", "--host", "127.0.0.1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_shares(home)
    except AssertionError:
        proc.kill()
        raise
    return proc


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[tuple[Node, Node, list[subprocess.Popen[bytes]]]]:
    """alice as a `gpumesh share` process on a fixed port (so it can be restarted), bob."""
    alice, bob = Node(tmp_path / "alice"), Node(tmp_path / "bob")
    alice.init("alice-pc")
    alice.home.config.set("listen_host", "127.0.0.1")
    alice.home.config.set("listen_port", str(_free_udp_port()))
    alice.home.config.save()
    alice.home.reload_config()
    bob.init("bob-laptop")
    bob.home.config.set("connect_timeout", "3")
    bob.home.config.save()
    pair_both(alice, bob)
    procs: list[subprocess.Popen[bytes]] = []
    yield alice, bob, procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    alice.close()
    bob.close()


def _kill_at(proc: subprocess.Popen[bytes], at: int) -> CopyCallbacks:
    def progress(done: int, _total: int) -> None:
        if done >= at and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    return CopyCallbacks(progress=progress)


def test_a_killed_agent_resumes_uploads_and_downloads(agent_process, tmp_path: Path) -> None:
    alice, bob, procs = agent_process
    source, back = tmp_path / "big.bin", tmp_path / "back.bin"
    size = 192 * MIB
    write_random(source, size)
    expected = sha256_of(source)
    partials = partials_of(alice, bob)

    # Upload: the agent dies a third of the way; its partial file stays.
    procs.append(agent := _start_agent(alice.home.path))
    with pytest.raises(ConnectionLostError, match="run the same `gpumesh cp` again to resume"):
        arun(
            copy(
                bob,
                str(source),
                "alice-pc:/big.bin",
                retries=0,
                stall_timeout=2,
                callbacks=_kill_at(agent, 64 * MIB),
            )
        )
    kept = list(partials.glob("*.part"))
    assert len(kept) == 1 and 0 < kept[0].stat().st_size < size
    assert not (sandbox_of(alice, bob) / "big.bin").exists()

    procs.append(_start_agent(alice.home.path))  # same home, same port
    again = gpumesh(bob.home.path, "cp", "--json", str(source), "alice-pc:/big.bin")
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["resumed_from"] > 0  # the provider said where to go on
    assert report["transferred"] == size - report["resumed_from"]
    assert sha256_of(sandbox_of(alice, bob) / "big.bin") == expected
    assert (report["hash"], report["digest"]) == ("blake3", blake3_of(source))
    assert list(partials.iterdir()) == []

    # Download: the agent dies again; the local part stays and the next cp resumes it.
    agent = procs[-1]
    with pytest.raises(ConnectionLostError, match=f"kept in .*{PART_SUFFIX}"):
        arun(
            copy(
                bob,
                "alice-pc:/big.bin",
                str(back),
                retries=0,
                stall_timeout=2,
                callbacks=_kill_at(agent, 64 * MIB),
            )
        )
    part = tmp_path / f"back.bin{PART_SUFFIX}"
    assert 0 < part.stat().st_size < size and not back.exists()
    procs.append(_start_agent(alice.home.path))
    again = gpumesh(bob.home.path, "cp", "--json", "alice-pc:/big.bin", str(back))
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["resumed_from"] > 0
    assert sha256_of(back) == expected
    assert not part.exists()


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_messages_and_exit_codes(agent_process, tmp_path: Path) -> None:
    alice, bob, procs = agent_process
    alice.home.config.set("file_quota", "100KB")
    alice.home.config.save()
    procs.append(_start_agent(alice.home.path))
    home = bob.home.path
    small = tmp_path / "small.bin"
    write_random(small, 1000)
    big = tmp_path / "big.bin"
    write_random(big, 200_000)

    ok = gpumesh(home, "cp", str(small), "alice-pc:/small.bin")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == ""
    assert ok.stderr.startswith(f"gpumesh: copied file {small} -> alice-pc:/small.bin: 1KB in ")
    assert ok.stderr.endswith("/s\n") and "Traceback" not in ok.stderr
    ok = gpumesh(home, "cp", "-q", "alice-pc:small.bin", str(tmp_path / "copy.bin"))
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "", "")
    assert (tmp_path / "copy.bin").read_bytes() == small.read_bytes()

    cases = [
        ((str(tmp_path / "nope.bin"), "alice-pc:/x"), 2, "nope.bin does not exist"),
        ((str(small), "alice-pc:../escape.bin"), 3, "alice-pc refused '../escape.bin' climbs out"),
        (("alice-pc:/a/../../etc/passwd", str(tmp_path)), 3, "climbs out with '..'"),
        ((str(small), "alice-pc:/x\\y"), 2, "backslash"),
        ((str(big), "alice-pc:/big.bin"), 2, "keeps at most 100KB of files for you"),
        (("alice-pc:/missing", str(tmp_path)), 2, "alice-pc:/missing does not exist"),
        ((str(small), "nobody:/x"), 2, "no paired peer named 'nobody'"),
        ((str(small), str(tmp_path / "local")), 2, "neither side names a peer"),
        (("/dev/null", "alice-pc:/null"), 2, "not a regular file"),
    ]
    for args, code, text in cases:
        _one_line_error(gpumesh(home, "cp", *args), code, text)

    alice.deny("bob-laptop")
    _one_line_error(gpumesh(home, "cp", str(small), "alice-pc:/again.bin"), 3, "denied you")
    assert sorted(os.listdir(sandbox_of(alice, bob))) == ["small.bin"]
    assert list(partials_of(alice, bob).iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "alice",
        "big.bin",
        "bob",
        "copy.bin",
        "small.bin",
    ]


def test_a_small_folder_reports_its_rate_in_a_unit_that_fits(agent_process, tmp_path: Path) -> None:
    alice, bob, procs = agent_process
    procs.append(_start_agent(alice.home.path))
    folder = tmp_path / "notes"
    folder.mkdir()
    for index in range(6):
        write_random(folder / f"part{index}.bin", 1000)
    ok = gpumesh(bob.home.path, "cp", str(folder), "alice-pc:/notes")
    assert ok.returncode == 0, ok.stderr
    # Once `10.2KB in 0.2s, 0 MB/s`: a rate of a few KB/s reads in KB/s.
    summary = re.fullmatch(
        rf"gpumesh: copied folder {folder} -> alice-pc:/notes: ([\d.]+)KB in \d+\.\ds, "
        r"([\d.]+)(B|KB|MB)/s\n",
        ok.stderr,
    )
    assert summary is not None, ok.stderr
    assert float(summary.group(2)) > 0


def test_a_folders_size_is_its_files_contents_not_its_tar(agent_process, tmp_path: Path) -> None:
    alice, bob, procs = agent_process
    procs.append(_start_agent(alice.home.path))
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "three.txt").write_bytes(b"abc")
    up = gpumesh(bob.home.path, "cp", str(folder), "alice-pc:/tiny")
    assert up.returncode == 0, up.stderr
    assert f"copied folder {folder} -> alice-pc:/tiny: 3B in " in up.stderr  # not its 2KB tar
    back = tmp_path / "back"
    down = gpumesh(bob.home.path, "cp", "alice-pc:/tiny", str(back), "--json")
    assert down.returncode == 0, down.stderr
    result = json.loads(down.stdout)
    assert result["content"] == 3 and result["size"] > 512  # the tar: headers and padding
    assert (back / "three.txt").read_bytes() == b"abc"


def test_a_folder_arrives_owned_by_the_jobs_user_on_both_paths(pair, tmp_path: Path) -> None:
    # A provider running as root hands uploads to the user its jobs run as; the
    # unpacker does it as it makes each entry, on the data channel and on QUIC.
    if os.geteuid() != 0:
        pytest.skip("changing owners needs root (CI runs as root)")
    alice, bob = pair
    source = tmp_path / "src"
    (source / "sub" / "deeper").mkdir(parents=True)
    (source / "sub" / "deeper" / "f.txt").write_text("deep\n")
    (source / "top.txt").write_text("top\n")
    os.symlink("sub/deeper/f.txt", source / "link")

    async def scenario() -> list[CopyResult]:
        async with _serving(alice, bob) as agent:
            agent.files.owner = (47000, 47001)
            return [
                await copy(bob, str(source), "alice:/fast"),
                await copy(bob, str(source), "alice:/slow", fast_path=False),
            ]

    results = arun(scenario())
    assert [r.channel for r in results] == ["tls", "quic"]
    for name in ("fast", "slow"):
        dest = sandbox_of(alice, bob) / name
        assert tree(dest) == tree(source)
        owners = {(p.lstat().st_uid, p.lstat().st_gid) for p in [dest, *dest.rglob("*")]}
        assert owners == {(47000, 47001)}
