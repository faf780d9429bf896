"""protocol/messages: every message round-trips; bad, oversize or garbage input is refused."""

from __future__ import annotations

import contextlib
from typing import Annotated, get_args

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.errors import FrameTooLargeError, ProtocolError
from gpumesh.protocol.messages import (
    MAX_ADDRESS_QUERY,
    MAX_MESSAGE_FRAME,
    PROTOCOL_VERSION,
    AddressAnswer,
    AddressQuery,
    AppJobDir,
    AppJobDirReply,
    AppNeeds,
    AppPrepare,
    AppSend,
    AppSync,
    AppSynced,
    Challenge,
    ChannelDeclined,
    ChannelGet,
    ChannelOffer,
    ChannelPut,
    CudaOpen,
    CudaOpened,
    DesktopOpen,
    DesktopOpened,
    DirGet,
    DirPut,
    ExecExit,
    ExecResize,
    ExecStart,
    ExecStarted,
    FileDone,
    FileGet,
    FileInfo,
    FilePut,
    FileResume,
    FileStat,
    Hello,
    ImagePull,
    JobAccepted,
    JobCancel,
    JobLogs,
    JobOutput,
    JobQuery,
    JobStatus,
    JobSubmit,
    Message,
    OutputFile,
    OutputsQuery,
    OutputsReady,
    Ping,
    Pong,
    Proof,
    Refusal,
    SessionProof,
    SignedAddresses,
    StatusReply,
    StatusRequest,
    ThroughputReply,
    ThroughputRequest,
    Welcome,
    decode_message,
    encode_message,
)

names = st.text(max_size=64)
finite = st.floats(allow_nan=False)
keys = st.binary(min_size=32, max_size=32)
hash_names = st.text(max_size=16)
hash_lists = st.lists(st.text(max_size=16), max_size=8)
job_ids = st.from_regex(r"[a-z0-9]{8,32}", fullmatch=True)
env_keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
env_values = st.text(st.characters(blacklist_characters="\0"), max_size=100)
signed_bytes = st.binary(max_size=300)
signatures = st.binary(min_size=64, max_size=64)

MESSAGES: st.SearchStrategy[Message] = st.one_of(
    st.builds(
        SessionProof,
        version=st.integers(0, 2**31),
        public_key=keys,
        name=names,
        signature=st.binary(min_size=64, max_size=64),
    ),
    st.builds(Hello, version=st.integers(0, 2**31), public_key=keys, name=names),
    st.builds(Challenge, nonce=keys, version=st.integers(0, 2**31)),
    st.builds(Proof, signature=st.binary(min_size=64, max_size=64)),
    st.builds(Welcome, name=names),
    st.builds(Refusal, code=names, message=st.text(max_size=2048)),
    st.builds(Ping, sent=finite),
    st.builds(Pong, sent=finite, time=finite),
    st.builds(StatusRequest),
    st.builds(
        StatusReply,
        name=names,
        node_id=names,
        version=names,
        sharing=st.booleans(),
        uptime=finite,
    ),
    st.builds(ThroughputRequest, size=st.integers(0, 4 * 1024**3)),
    st.builds(ThroughputReply, received=st.integers(0, 2**63 - 1), seconds=finite),
    st.builds(
        JobSubmit,
        job_id=job_ids,
        image=st.text(min_size=1, max_size=255),
        command=st.lists(st.text(max_size=100), max_size=10),
        env=st.dictionaries(env_keys, env_values, max_size=5),
        workdir_bytes=st.integers(0, 2**40),
        gpu_memory=st.integers(0, 2**40),
        retries=st.integers(0, 20),
        timeout=st.floats(min_value=0, allow_nan=False),
        attach=st.booleans(),
    ),
    st.builds(
        JobAccepted,
        job_id=job_ids,
        gpus=st.lists(st.text(max_size=8), max_size=4),
        provider=names,
    ),
    st.builds(
        ImagePull,
        image=st.text(min_size=1, max_size=255),
        layers=st.integers(0, 2**10),
        layers_done=st.integers(0, 2**10),
        downloaded=st.integers(0, 2**40),
        total=st.integers(0, 2**40),
        done=st.booleans(),
    ),
    st.builds(
        JobOutput,
        seq=st.integers(0, 2**40),
        attempt=st.integers(0, 21),
        stream=st.sampled_from(["stdout", "stderr"]),
        data=st.binary(max_size=1024),
    ),
    st.builds(
        JobStatus,
        job_id=job_ids,
        seq=st.integers(0, 2**40),
        state=st.sampled_from(["queued", "running", "failed"]),
        attempt=st.integers(0, 21),
        exit_code=st.none() | st.integers(-(2**31), 2**31),
        message=st.text(max_size=200),
        started=st.floats(0, 2e9),
    ),
    st.builds(JobLogs, job_id=job_ids, after_seq=st.integers(0, 2**40), follow=st.booleans()),
    st.builds(JobCancel, job_id=job_ids),
    st.builds(JobQuery, job_id=job_ids),
    st.builds(FileStat, path=st.text(max_size=200)),
    st.builds(
        FileInfo,
        path=st.text(max_size=200),
        exists=st.booleans(),
        kind=st.sampled_from(["file", "dir", ""]),
        size=st.integers(0, 2**50),
        mode=st.integers(0, 0o7777),
        mtime=finite,
        hash=hash_names,
    ),
    st.builds(
        FilePut,
        path=st.text(max_size=200),
        size=st.integers(0, 2**50),
        mode=st.integers(0, 0o7777),
        digest=st.none() | keys,
        source=st.from_regex(r"\A([0-9a-f]{1,64})?\Z"),
        hashes=hash_lists,
    ),
    st.builds(FileResume, offset=st.integers(0, 2**50), hash=hash_names),
    st.builds(FileGet, path=st.text(max_size=200), offset=st.integers(0, 2**50), hashes=hash_lists),
    st.builds(FileDone, size=st.integers(0, 2**50), digest=keys),
    st.builds(
        DirPut,
        path=st.text(max_size=200),
        size=st.integers(0, 2**50),
        hashes=hash_lists,
        channel=st.booleans(),
    ),
    st.builds(DirGet, path=st.text(max_size=200), hashes=hash_lists, channel=st.booleans()),
    st.builds(
        AppSync,
        name=st.text(min_size=1, max_size=255),
        manifest_bytes=st.integers(0, 1 << 20),
        dry_run=st.booleans(),
    ),
    st.builds(
        AppNeeds,
        need=st.integers(0, 2**40),
        delete=st.integers(0, 2**40),
        unchanged=st.integers(0, 2**40),
        list_bytes=st.integers(0, 1 << 20),
    ),
    st.builds(AppSend, size=st.integers(0, 2**50), channel=st.booleans()),
    st.builds(AppPrepare, name=st.text(min_size=1, max_size=255), dry_run=st.booleans()),
    st.builds(ChannelDeclined, reason=st.text(max_size=100)),
    st.builds(
        AppSynced,
        received=st.integers(0, 2**50),
        written=st.integers(0, 2**40),
        deleted=st.integers(0, 2**40),
        unchanged=st.integers(0, 2**40),
    ),
    st.builds(
        ChannelPut,
        path=st.text(max_size=200),
        size=st.integers(0, 2**50),
        mode=st.integers(0, 0o7777),
        source=st.from_regex(r"\A[0-9a-f]{1,64}\Z"),
        hashes=hash_lists,
    ),
    st.builds(
        ChannelGet, path=st.text(max_size=200), offset=st.integers(0, 2**50), hashes=hash_lists
    ),
    st.builds(
        ChannelOffer,
        port=st.integers(1, 65535),
        ticket=st.binary(min_size=32, max_size=32),
        offset=st.integers(0, 2**50),
        hash=hash_names,
    ),
    st.builds(AppJobDir, job_id=job_ids),
    st.builds(
        OutputsQuery,
        job_id=job_ids,
        after=st.integers(0, 2**50),
        wait=st.floats(0, 60),
        release=st.booleans(),
    ),
    st.builds(
        OutputsReady,
        files=st.lists(
            st.builds(
                OutputFile,
                seq=st.integers(0, 2**50),
                path=st.text(min_size=1, max_size=100),
                size=st.integers(0, 2**50),
                mtime=st.floats(0, 2**40),
            ),
            max_size=5,
        ),
        final=st.booleans(),
        folder=st.text(max_size=100),
        more=st.booleans(),
    ),
    st.builds(AppJobDirReply, path=st.text(max_size=200)),
    st.builds(
        ExecStart,
        image=st.text(min_size=1, max_size=255),
        command=st.lists(st.text(max_size=100), max_size=10),
        env=st.dictionaries(env_keys, env_values, max_size=5),
        tty=st.booleans(),
        rows=st.integers(0, 10000),
        cols=st.integers(0, 10000),
    ),
    st.builds(ExecStarted, provider=names),
    st.builds(ExecResize, rows=st.integers(1, 10000), cols=st.integers(1, 10000)),
    st.builds(ExecExit, exit_code=st.integers(-(2**31), 2**31)),
    st.builds(DesktopOpen, probe=st.booleans()),
    st.builds(
        DesktopOpened,
        provider=names,
        kind=st.sampled_from(["vnc", "rdp", "tcp"]),
        port=st.integers(1, 65535),
    ),
    st.builds(CudaOpen, memory=st.integers(1, 2**40), version=st.integers(0, 9)),
    st.builds(
        CudaOpened,
        provider=names,
        backend=st.sampled_from(["driver", "fallback"]),
        device=names,
        memory=st.integers(0, 2**40),
    ),
    st.builds(
        AddressQuery,
        node_ids=st.lists(names, max_size=MAX_ADDRESS_QUERY),
        mine=st.none() | st.builds(SignedAddresses, record=signed_bytes, signature=signatures),
    ),
    st.builds(
        AddressAnswer,
        own=st.builds(SignedAddresses, record=signed_bytes, signature=signatures),
        findable=st.booleans(),
        peers=st.lists(
            st.builds(SignedAddresses, record=signed_bytes, signature=signatures),
            max_size=MAX_ADDRESS_QUERY,
        ),
    ),
)

KEY = b"k" * 32


def _raw(fields: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode(fields)


@given(MESSAGES)
def test_every_message_round_trips(message: Message) -> None:
    decoded = decode_message(encode_message(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_every_message_type_is_covered_by_the_round_trip() -> None:
    covered = {SessionProof, Hello, Challenge, Proof, Welcome, Refusal, Ping, Pong}
    covered |= {StatusRequest, StatusReply, ThroughputRequest, ThroughputReply}
    covered |= {
        JobSubmit,
        JobAccepted,
        ImagePull,
        JobOutput,
        JobStatus,
        JobLogs,
        JobCancel,
        JobQuery,
        OutputsQuery,
        OutputsReady,
    }
    covered |= {FileStat, FileInfo, FilePut, FileResume, FileGet, FileDone, DirPut, DirGet}
    covered |= {ExecStart, ExecStarted, ExecResize, ExecExit}
    covered |= {CudaOpen, CudaOpened}
    covered |= {AppSync, AppNeeds, AppSend, AppSynced, AppJobDir, AppJobDirReply, AppPrepare}
    covered |= {ChannelPut, ChannelGet, ChannelOffer, ChannelDeclined}
    covered |= {DesktopOpen, DesktopOpened}
    covered |= {AddressQuery, AddressAnswer}
    assert set(get_args(Message)) == covered


def test_decode_accepts_a_memoryview() -> None:
    data = encode_message(Welcome(name="bob"))
    assert decode_message(memoryview(data)) == Welcome(name="bob")


# --- field bounds -------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        SessionProof(version=1, public_key=KEY, name="x" * 65, signature=b"s" * 64),
        SessionProof(version=1, public_key=KEY[:31], name="x", signature=b"s" * 64),
        SessionProof(version=1, public_key=KEY, name="x", signature=b"s" * 63),
        SessionProof(version=1, public_key=KEY, name="x", signature=b"s" * 65),
        Hello(version=1, public_key=KEY, name="x" * 65),
        Hello(version=1, public_key=KEY[:31], name="x"),
        Hello(version=1, public_key=KEY + b"k", name="x"),
        Challenge(nonce=b"n" * 16, version=1),
        Proof(signature=b"s" * 63),
        Proof(signature=b"s" * 65),
        Welcome(name="w" * 65),
        Refusal(code="c" * 65, message="m"),
        Refusal(code="denied", message="m" * 2049),
        StatusReply(name="n", node_id="i" * 65, version="1", sharing=True, uptime=1.0),
        ThroughputRequest(size=-1),
        ThroughputRequest(size=4 * 1024**3 + 1),
        ThroughputReply(received=-1, seconds=0.0),
        AddressQuery(node_ids=["n"] * (MAX_ADDRESS_QUERY + 1)),
        AddressQuery(node_ids=["n" * 65]),
        AddressQuery(mine=SignedAddresses(record=b"r", signature=b"s" * 63)),
        AddressAnswer(own=SignedAddresses(record=b"r" * 4097, signature=b"s" * 64)),
        AddressAnswer(
            own=SignedAddresses(record=b"r", signature=b"s" * 64),
            peers=[SignedAddresses(record=b"r", signature=b"s" * 64)] * (MAX_ADDRESS_QUERY + 1),
        ),
    ],
    ids=repr,
)
def test_out_of_bounds_fields_are_refused(message: Message) -> None:
    data = encode_message(message)  # the sender does not check; the receiver must
    with pytest.raises(ProtocolError, match="invalid message"):
        decode_message(data)


@pytest.mark.parametrize(
    "fields",
    [
        {"t": "hello", "version": 1, "public_key": "k" * 32, "name": "x"},  # str, not bytes
        {"t": "hello", "version": "1", "public_key": KEY, "name": "x"},
        {"t": "hello", "public_key": KEY, "name": "x"},  # missing version
        {"t": "no_such_message"},
        {"version": 1},  # no tag
        {"t": "ping", "sent": "yesterday"},
    ],
    ids=repr,
)
def test_wrong_types_missing_fields_and_unknown_tags_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        decode_message(_raw(fields))


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\xff\xff\xff", b"\x92\x01\x02", b"\x01", b"\x81\xa1t", b"not msgpack at all"],
    ids=repr,
)
def test_garbage_bytes_are_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_message(data)


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise_anything_but_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_message(data)


def test_unknown_extra_fields_from_a_newer_peer_are_tolerated() -> None:
    data = _raw({"t": "ping", "sent": 1.5, "future_field": [1, 2, {"x": b"y"}]})
    assert decode_message(data) == Ping(sent=1.5)


def test_fields_in_any_order_are_accepted() -> None:
    data = _raw({"name": "bob", "public_key": KEY, "version": PROTOCOL_VERSION, "t": "hello"})
    assert decode_message(data) == Hello(version=PROTOCOL_VERSION, public_key=KEY, name="bob")


def test_a_deeply_nested_unknown_field_is_a_protocol_error() -> None:
    nested = b"\x91" * 5000 + b"\xc0"  # [[[[...nil...]]]], well under the frame limit
    data = _raw({"t": "ping", "sent": 1.0})
    data = b"\x83" + data[1:] + msgspec.msgpack.encode("x") + nested
    assert len(data) < MAX_MESSAGE_FRAME
    with pytest.raises(ProtocolError):
        decode_message(data)


# --- size limit ---------------------------------------------------------------


def test_an_oversize_message_is_not_encoded() -> None:
    message = Refusal(code="denied", message="m" * (MAX_MESSAGE_FRAME + 1))
    with pytest.raises(FrameTooLargeError, match=str(MAX_MESSAGE_FRAME)):
        encode_message(message)


def test_an_oversize_message_is_not_decoded() -> None:
    data = _raw({"t": "welcome", "name": "bob", "pad": b"x" * MAX_MESSAGE_FRAME})
    with pytest.raises(FrameTooLargeError):
        decode_message(data)


def test_a_message_of_exactly_the_limit_is_allowed() -> None:
    def padded(size: int) -> bytes:
        return _raw({"t": "ping", "sent": 1.0, "pad": b"x" * size})

    first = padded(MAX_MESSAGE_FRAME - 100)
    data = padded(MAX_MESSAGE_FRAME - 100 + MAX_MESSAGE_FRAME - len(first))
    assert len(data) == MAX_MESSAGE_FRAME
    assert decode_message(data) == Ping(sent=1.0)


def test_data_channel_offers_are_bounded() -> None:
    for fields in (
        {"t": "channel_offer", "port": 0, "ticket": KEY, "offset": 0},
        {"t": "channel_offer", "port": 70000, "ticket": KEY, "offset": 0},
        {"t": "channel_offer", "port": 5, "ticket": b"short", "offset": 0},
        {"t": "channel_put", "path": "x", "size": 1, "mode": 0, "source": "NOT-HEX"},
        {"t": "app_sync", "name": "a", "manifest_bytes": 0, "base": "zz"},
    ):
        with pytest.raises(ProtocolError):
            decode_message(_raw(fields))


def test_a_nul_in_an_environment_value_is_refused_without_quoting_it() -> None:
    # Docker would refuse it later with an error that quotes the variable, value included.
    secret = "sk-live-5e0c2a"
    submit = JobSubmit(
        job_id="abcdef12",
        image="busybox",
        command=["true"],
        env={"TOKEN": f"{secret}\0rest"},
        workdir_bytes=0,
        gpu_memory=0,
        gpu="",
        retries=0,
        timeout=0.0,
        attach=False,
        sandbox_dir="",
    )
    with pytest.raises(ProtocolError) as refused:
        decode_message(encode_message(submit))
    assert secret not in str(refused.value)


# --- the hash negotiation: what a peer from before it sends and reads ---------


class _OldFilePut(msgspec.Struct, tag_field="t", tag="file_put", frozen=True):
    """FilePut as a node from before the hash negotiation decodes it."""

    path: str
    size: int
    mode: int
    sha256: Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


def test_an_older_consumers_requests_decode_as_sha256_only() -> None:
    put = decode_message(
        _raw({"t": "file_put", "path": "a", "size": 3, "mode": 0o644, "sha256": KEY})
    )
    assert put == FilePut(path="a", size=3, mode=0o644, digest=KEY)
    assert (put.source, put.hashes) == ("", [])
    assert decode_message(_raw({"t": "file_get", "path": "a", "offset": 0})) == FileGet(
        path="a", offset=0, hashes=[]
    )
    channel = {"t": "channel_put", "path": "a", "size": 3, "mode": 0, "source": "ab"}
    assert decode_message(_raw(channel)).hashes == []  # type: ignore[union-attr]


def test_an_older_providers_replies_name_no_hash() -> None:
    assert decode_message(_raw({"t": "file_resume", "offset": 5})) == FileResume(offset=5, hash="")
    offer = {"t": "channel_offer", "port": 9, "ticket": KEY, "offset": 0}
    assert decode_message(_raw(offer)).hash == ""  # type: ignore[union-attr]
    info = {"t": "file_info", "path": "a", "exists": True, "kind": "file", "size": 1}
    info |= {"mode": 0, "mtime": 0.0}
    assert decode_message(_raw(info)).hash == ""  # type: ignore[union-attr]


def test_digests_travel_in_the_fields_older_peers_read() -> None:
    done = msgspec.msgpack.decode(encode_message(FileDone(size=1, digest=KEY)))
    assert done == {"t": "file_done", "size": 1, "sha256": KEY}
    old = msgspec.msgpack.decode(
        encode_message(FilePut(path="a", size=1, mode=0, digest=KEY)), type=_OldFilePut
    )
    assert old.sha256 == KEY


def test_an_older_provider_refuses_a_file_put_without_its_sha256() -> None:
    """What the consumer's fallback to the SHA-256 up front relies on."""
    data = encode_message(FilePut(path="a", size=1, mode=0, source="ab", hashes=["blake3"]))
    with pytest.raises(msgspec.ValidationError, match="sha256"):
        msgspec.msgpack.decode(data, type=_OldFilePut)


def test_hash_lists_and_names_are_bounded() -> None:
    for fields in (
        {"t": "file_get", "path": "a", "offset": 0, "hashes": ["x"] * 9},
        {"t": "file_get", "path": "a", "offset": 0, "hashes": ["x" * 17]},
        {"t": "file_resume", "offset": 0, "hash": "x" * 17},
        {"t": "file_put", "path": "a", "size": 1, "mode": 0, "sha256": b"short"},
        {"t": "file_put", "path": "a", "size": 1, "mode": 0, "source": "NOT-HEX"},
    ):
        with pytest.raises(ProtocolError):
            decode_message(_raw(fields))


def test_the_largest_address_answer_fits_a_frame() -> None:
    """Every record at its size limit, as many as allowed: still one frame."""
    biggest = SignedAddresses(record=b"r" * 4096, signature=b"s" * 64)
    answer = AddressAnswer(own=biggest, findable=True, peers=[biggest] * MAX_ADDRESS_QUERY)
    assert decode_message(encode_message(answer)) == answer
    query = AddressQuery(node_ids=["n" * 64] * MAX_ADDRESS_QUERY, mine=biggest)
    assert len(encode_message(query)) < MAX_MESSAGE_FRAME
