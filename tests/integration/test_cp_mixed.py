"""`gpumesh cp` across versions and across paths, between real nodes on loopback.

A node from before the hash negotiation is played by the exact messages it
sends and reads (its structs, copied here as they were): as a consumer, by
requests driven by hand; as a provider, by a shim around a real agent that
decodes each request the way it did (refusing what it could not read) and
answers with its structs. Copies with it must still run, checked with
SHA-256. Between two current nodes copies use BLAKE3, and a corrupted byte
is still caught. A copy dropped on one path (QUIC or the data channel)
resumes on the other.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest

from gpumesh.agent.server import Agent
from gpumesh.blocking import in_thread
from gpumesh.client.cpdownload import PART_SUFFIX
from gpumesh.client.files import copy
from gpumesh.client.node import Node
from gpumesh.errors import GPUMeshError, ProtocolError
from gpumesh.protocol import messages
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import encode_message
from gpumesh.transport.channel import dial
from gpumesh.transport.stream import Stream
from tests.integration.conftest import arun, pair_both
from tests.integration.test_cp import (
    MIB,
    _DropLinks,
    _serving,
    blake3_of,
    partials_of,
    sandbox_of,
    sha256_of,
    write_random,
)

# --- the messages of a node from before the hash negotiation, as they were -------------------

Digest = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


class _Old(msgspec.Struct, tag_field="t", frozen=True):
    pass


class OldFilePut(_Old, tag="file_put", frozen=True):
    path: str
    size: int
    mode: int
    sha256: Digest


class OldFileGet(_Old, tag="file_get", frozen=True):
    path: str
    offset: int


class OldChannelPut(_Old, tag="channel_put", frozen=True):
    path: str
    size: int
    mode: int
    source: str


class OldChannelGet(_Old, tag="channel_get", frozen=True):
    path: str
    offset: int


class OldDirPut(_Old, tag="dir_put", frozen=True):
    path: str
    size: int


class OldDirGet(_Old, tag="dir_get", frozen=True):
    path: str


class OldFileResume(_Old, tag="file_resume", frozen=True):
    offset: int


class OldFileInfo(_Old, tag="file_info", frozen=True):
    path: str
    exists: bool
    kind: str
    size: int
    mode: int
    mtime: float


class OldChannelOffer(_Old, tag="channel_offer", frozen=True):
    port: int
    ticket: bytes
    offset: int


class OldFileDone(_Old, tag="file_done", frozen=True):
    size: int
    sha256: Digest


OLD_REQUESTS: dict[type, type[_Old]] = {
    messages.FilePut: OldFilePut,
    messages.FileGet: OldFileGet,
    messages.ChannelPut: OldChannelPut,
    messages.ChannelGet: OldChannelGet,
    messages.DirPut: OldDirPut,
    messages.DirGet: OldDirGet,
}
OLD_REPLIES: dict[type, type[_Old]] = {
    messages.FileResume: OldFileResume,
    messages.FileInfo: OldFileInfo,
    messages.ChannelOffer: OldChannelOffer,
    messages.FileDone: OldFileDone,
}


def _old_fields(struct: msgspec.Struct, into: type[msgspec.Struct]) -> dict[str, Any]:
    """``struct``'s fields under their wire names, those ``into`` has."""
    wanted = {field.encode_name for field in msgspec.structs.fields(into)}
    wire = msgspec.msgpack.decode(encode_message(struct))  # type: ignore[arg-type]
    return {name: value for name, value in wire.items() if name in wanted}


async def _old_read(stream: Stream, kind: type[_Old]) -> Any:
    """The next message as an older node decodes it (unknown fields ignored)."""
    frame = await stream.read_frame()
    assert frame is not None and frame.kind is FrameKind.MESSAGE
    return msgspec.msgpack.decode(frame.body, type=kind)


async def _read_all(stream: Stream) -> bytes:
    data = bytearray()
    while chunk := await stream.read_data():
        data += chunk
    return bytes(data)


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def pair(make_node) -> tuple[Node, Node]:
    """alice (the provider) and bob, paired both ways."""
    alice, bob = make_node("alice"), make_node("bob")
    pair_both(alice, bob)
    return alice, bob


Handler = Callable[[Any, Any], Awaitable[None]]


class OlderProvider:
    """Makes a running agent answer as a node from before the hash negotiation.

    Each file request is decoded as that node's decoder did (a request it could
    not read is refused as it refused it) and handed on as the fields it read;
    every reply goes out as its struct, so no ``hash`` reaches the consumer.
    """

    def __init__(self, agent: Agent) -> None:
        self.refused: list[str] = []
        for kind, old in OLD_REQUESTS.items():
            agent.handlers[kind] = self._older(agent.handlers[kind], kind, old)

    def _older(self, real: Handler, kind: type, old: type[_Old]) -> Handler:
        async def handler(ctx: Any, message: Any) -> None:
            try:
                seen = msgspec.msgpack.decode(encode_message(message), type=old)
            except msgspec.ValidationError as exc:
                self.refused.append(type(message).__name__)
                raise ProtocolError(f"peer sent an invalid message: {exc}") from None
            fields = msgspec.structs.asdict(seen)
            if "sha256" in fields:
                fields["digest"] = fields.pop("sha256")
            ctx.stream.send_message = functools.partial(_send_as_older, ctx.stream.send_message)
            await real(ctx, kind(**fields))

        return handler


def _send_as_older(send: Callable[..., None], message: Any, *, end: bool = False) -> None:
    old = OLD_REPLIES.get(type(message))
    send(message if old is None else old(**_old_fields(message, old)), end=end)


# --- an older consumer -------------------------------------------------------------------------


def test_an_older_consumer_copies_both_ways_on_both_paths_with_sha256(pair, tmp_path: Path) -> None:
    alice, bob = pair
    data = bytes(range(256)) * 12_000 + b"tail"  # about 3 MiB
    sha = hashlib.sha256(data).digest()
    key = alice.home.identity.public_key
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with _serving(alice, bob), bob.session("alice") as session:
            # FilePut over QUIC, its SHA-256 up front.
            stream = session.open_stream()
            stream.send_message(OldFilePut(path="/q.bin", size=len(data), mode=0o640, sha256=sha))  # type: ignore[arg-type]
            seen["put resume"] = await _old_read(stream, OldFileResume)
            for start in range(0, len(data), MIB):
                await stream.send_data(data[start : start + MIB])
            stream.end_data()
            stream.finish()
            seen["put done"] = await _old_read(stream, OldFileDone)

            # ChannelPut: the bytes over the channel, then its FileDone with the SHA-256.
            stream = session.open_stream()
            put = OldChannelPut(path="/c.bin", size=len(data), mode=0o600, source="ab" * 16)
            stream.send_message(put)  # type: ignore[arg-type]
            offer = await _old_read(stream, OldChannelOffer)
            channel = await in_thread(dial, session.address[0], offer.port, key, offer.ticket, 10.0)
            try:
                await in_thread(channel.sock.sendall, data)
                stream.send_message(OldFileDone(size=len(data), sha256=sha), end=True)  # type: ignore[arg-type]
                seen["channel put done"] = await _old_read(stream, OldFileDone)
            finally:
                channel.close()

            # FileGet over QUIC, from byte 1000 (a kept part): the hash covers the whole file.
            stream = session.open_stream()
            stream.send_message(OldFileGet(path="/q.bin", offset=1000))  # type: ignore[arg-type]
            seen["get info"] = await _old_read(stream, OldFileInfo)
            seen["get data"] = await _read_all(stream)
            seen["get done"] = await _old_read(stream, OldFileDone)
            stream.finish()

            # ChannelGet: the bytes over the channel, FileDone on QUIC.
            stream = session.open_stream()
            stream.send_message(OldChannelGet(path="/c.bin", offset=0))  # type: ignore[arg-type]
            seen["channel get info"] = await _old_read(stream, OldFileInfo)
            offer = await _old_read(stream, OldChannelOffer)
            channel = await in_thread(dial, session.address[0], offer.port, key, offer.ticket, 10.0)
            try:
                received = bytearray()
                while len(received) < len(data):
                    piece = await in_thread(channel.sock.recv, MIB)
                    assert piece
                    received += piece
                seen["channel get data"] = bytes(received)
                seen["channel get done"] = await _old_read(stream, OldFileDone)
                stream.finish()
            finally:
                channel.close()

    arun(scenario())
    assert seen["put resume"] == OldFileResume(offset=0)
    for name in ("put done", "channel put done", "get done", "channel get done"):
        assert seen[name] == OldFileDone(size=len(data), sha256=sha), name
    assert seen["get info"].size == seen["channel get info"].size == len(data)
    assert seen["get data"] == data[1000:]
    assert seen["channel get data"] == data
    sandbox = sandbox_of(alice, bob)
    assert (sandbox / "q.bin").read_bytes() == (sandbox / "c.bin").read_bytes() == data
    assert list(partials_of(alice, bob).iterdir()) == []


# --- an older provider -------------------------------------------------------------------------


@pytest.mark.parametrize("fast_path", [False, True], ids=["quic", "channel"])
def test_a_newer_consumer_copies_with_an_older_provider_with_sha256(
    pair, tmp_path: Path, fast_path: bool
) -> None:
    alice, bob = pair
    source, back = tmp_path / "data.bin", tmp_path / "back.bin"
    write_random(source, 3 * MIB + 17)
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    write_random(folder / "sub" / "inside.bin", 200_000)

    async def scenario() -> tuple[list[Any], list[str]]:
        async with _serving(alice, bob) as agent:
            older = OlderProvider(agent)
            results = [
                await copy(bob, str(source), "alice:/data.bin", fast_path=fast_path),
                await copy(bob, "alice:/data.bin", str(back), fast_path=fast_path),
                await copy(bob, str(folder), "alice:/", fast_path=fast_path),
                await copy(bob, "alice:/folder", str(tmp_path / "folder-back")),
            ]
            return results, older.refused

    results, refused = arun(scenario())
    expected = sha256_of(source)
    assert [r.hash for r in results] == ["sha256"] * 4
    assert results[0].digest == results[1].digest == expected
    assert [r.channel for r in results[:2]] == (["tls"] * 2 if fast_path else ["quic"] * 2)
    # Over QUIC the FilePut without its SHA-256 was refused once, then sent with it.
    assert refused == ([] if fast_path else ["FilePut"])
    assert sha256_of(sandbox_of(alice, bob) / "data.bin") == sha256_of(back) == expected
    inside = tmp_path / "folder-back" / "sub" / "inside.bin"
    assert sha256_of(inside) == sha256_of(folder / "sub" / "inside.bin")
    assert list(partials_of(alice, bob).iterdir()) == []


# --- between current nodes: BLAKE3, and resuming across paths ----------------------------------


def _flip_a_byte(path: Path, at: int = 100) -> None:
    with path.open("r+b") as handle:
        handle.seek(at)
        byte = handle.read(1)
        handle.seek(at)
        handle.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize(
    ("first", "then"),
    [(False, True), (True, False)],
    ids=["quic-then-channel", "channel-then-quic"],
)
def test_an_upload_dropped_on_one_path_resumes_on_the_other(
    pair, tmp_path: Path, first: bool, then: bool
) -> None:
    """And a byte of the kept part changed meanwhile is caught by BLAKE3 before the
    file appears under its name."""
    alice, bob = pair
    source = tmp_path / "data.bin"
    size = 48 * MIB
    write_random(source, size)
    partials = partials_of(alice, bob)
    target = sandbox_of(alice, bob) / "data.bin"

    async def dropped(agent: Agent) -> None:
        dropper = _DropLinks(agent, 24 * MIB)
        with pytest.raises(GPUMeshError, match="run the same `gpumesh cp` again to resume"):
            await copy(
                bob,
                str(source),
                "alice:/data.bin",
                retries=0,
                fast_path=first,
                callbacks=dropper.callbacks(),
            )

    async def scenario() -> tuple[Any, GPUMeshError, Any]:
        async with _serving(alice, bob) as agent:
            await dropped(agent)
            resumed = await copy(bob, str(source), "alice:/data.bin", fast_path=then)
            target.unlink()
            await dropped(agent)
            (kept,) = partials.glob("*.part")
            _flip_a_byte(kept)
            with pytest.raises(ProtocolError) as caught:
                await copy(bob, str(source), "alice:/data.bin", fast_path=then)
            assert not target.exists() and not list(partials.glob("*.part"))
            again = await copy(bob, str(source), "alice:/data.bin", fast_path=then)
            return resumed, caught.value, again

    resumed, caught, again = arun(scenario())
    assert resumed.channel == ("tls" if then else "quic")
    assert 0 < resumed.resumed_from < size
    assert resumed.transferred == size - resumed.resumed_from
    assert (resumed.hash, resumed.digest) == ("blake3", blake3_of(source))
    assert "does not match its BLAKE3 hash and was discarded" in caught.message
    assert again.resumed_from == 0 and again.digest == resumed.digest
    assert sha256_of(target) == sha256_of(source)
    assert list(partials.iterdir()) == []


@pytest.mark.parametrize(
    ("first", "then"),
    [(False, True), (True, False)],
    ids=["quic-then-channel", "channel-then-quic"],
)
def test_a_download_dropped_on_one_path_resumes_on_the_other(
    pair, tmp_path: Path, first: bool, then: bool
) -> None:
    """And a byte of the kept part changed meanwhile is caught by BLAKE3: the part is
    fetched again from the start, and only the whole file appears under its name."""
    alice, bob = pair
    source, back = tmp_path / "data.bin", tmp_path / "back.bin"
    size = 48 * MIB
    write_random(source, size)
    part = tmp_path / f"back.bin{PART_SUFFIX}"

    async def dropped(agent: Agent) -> None:
        dropper = _DropLinks(agent, 24 * MIB)
        with pytest.raises(GPUMeshError, match=f"kept in .*{PART_SUFFIX}"):
            await copy(
                bob,
                "alice:/data.bin",
                str(back),
                retries=0,
                fast_path=first,
                callbacks=dropper.callbacks(),
            )
        assert 0 < part.stat().st_size < size and not back.exists()

    async def scenario() -> tuple[Any, Any]:
        async with _serving(alice, bob) as agent:
            await copy(bob, str(source), "alice:/data.bin")
            await dropped(agent)
            resumed = await copy(bob, "alice:/data.bin", str(back), fast_path=then)
            back.unlink()
            await dropped(agent)
            _flip_a_byte(part)
            refetched = await copy(bob, "alice:/data.bin", str(back), fast_path=then)
            return resumed, refetched

    resumed, refetched = arun(scenario())
    assert resumed.channel == refetched.channel == ("tls" if then else "quic")
    assert 0 < resumed.resumed_from < size
    assert resumed.transferred == size - resumed.resumed_from
    assert (resumed.hash, resumed.digest) == ("blake3", blake3_of(source))
    # The corrupted part was resumed, failed its check, and was fetched again whole.
    assert refetched.offsets[0] > 0 and refetched.offsets[-1] == 0
    assert refetched.digest == resumed.digest
    assert sha256_of(back) == sha256_of(source)
    assert not part.exists()
    with contextlib.suppress(FileNotFoundError):
        assert list(partials_of(alice, bob).iterdir()) == []
