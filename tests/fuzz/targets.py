"""The fuzz targets: what each decoder is fed, and what must hold for every input.

Shared by ``tests/fuzz`` (a short run in the normal suite) and
``bench/fuzz.py`` (a long run). Every target checks, for every case:

* only GPUMesh's own errors come out (``GPUMeshError`` subclasses, or the
  handshake's ``Refusal``): never an IndexError, KeyError, struct.error,
  UnicodeDecodeError, a msgspec error, RecursionError or MemoryError;
* the allocation peak of the decoder call (tracemalloc) stays under a ceiling
  derived from the input limits, whatever lengths the input announces;
* what is decoded keeps every bound its struct declares, patterns in full;
* valid input decodes to exactly what was encoded, and input known to be
  invalid is refused;
* the state machines answer as a reference model of the handshake says.
"""

from __future__ import annotations

import base64
import gc
import math
import re
import struct
import sys
import tracemalloc
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import msgspec.inspect as mi
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import strategies as st

from gpumesh.errors import (
    AccessDeniedError,
    FrameTooLargeError,
    GPUMeshError,
    NotPairedError,
    PairingCodeError,
    ProtocolError,
    error_from_code,
)
from gpumesh.identity import codes, invites
from gpumesh.identity.hints import check_hints
from gpumesh.identity.keys import Identity, verify_signature
from gpumesh.protocol import lan, relay
from gpumesh.protocol.framing import HEADER_SIZE, Frame, FrameDecoder, FrameKind
from gpumesh.protocol.handshake import (
    AuthForm,
    ClientAuth,
    ServerAuth,
    challenge_transcript,
    session_transcript,
)
from gpumesh.protocol.messages import (
    MAX_DATA_FRAME,
    MAX_MESSAGE_FRAME,
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    Message,
    Proof,
    Refusal,
    SessionProof,
    Welcome,
    decode_message,
    encode_message,
)
from tests.badhints import BAD_HINTS
from tests.fuzz.mpack import U32_MAX, pack
from tests.fuzz.strategies import (
    ANY,
    ERROR,
    OK,
    Case,
    Shape,
    expected,
    mutate_bytes,
    mutate_tree,
    one_in,
    register_tags,
    same,
    violations,
)

__all__ = ["KNOWN_ISSUES", "TARGETS", "KnownIssue", "Meter", "Target"]

KiB = 1024

# --- memory ------------------------------------------------------------------------------

# Ceilings on the allocation peak of one decoder call. None depends on a length
# an input announces: only on the limits the decoders declare.
FRAME_SLACK = 64 * KiB
"""Framing: on top of a small multiple of the bytes actually fed and buffered."""
MESSAGE_CEILING = 8 * MAX_MESSAGE_FRAME
"""A message decoder sees at most one 64 KiB frame; its Python objects stay within 8x."""
HANDSHAKE_CEILING = MAX_MESSAGE_FRAME
"""A handshake step builds one small reply from an already decoded message."""
RELAY_CEILING = 16 * relay.MAX_PACKET
"""A relay packet is at most 1500 bytes."""
TOKEN_CEILING = 16 * invites.MAX_INVITE_CHARS
"""A token is at most ~87 K characters (the largest invite), its body 64 KiB."""


class MemoryCeilingError(AssertionError):
    pass


KNOWN_ISSUES: dict[str, str] = {}
"""Bugs found and reported, not fixed yet: a case that hits one is counted apart."""


class KnownIssue(Exception):
    """A case hit a bug in :data:`KNOWN_ISSUES` (remove the entry with the fix)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"{key}: {KNOWN_ISSUES[key]}")
        self.key = key


RECURSION_LIMIT = 1000
"""Python's default: hypothesis raises the limit while a test runs, production does not."""


def _depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


class Meter:
    """Runs decoder calls as production would (default recursion limit), under
    tracemalloc, and keeps the largest allocation peak seen."""

    def __init__(self) -> None:
        self.peak = 0

    def run(self, ceiling: int, what: str, call: Callable[[], Any]) -> tuple[Any, Exception | None]:
        """``(result, None)`` or ``(None, the exception)``; fails over the ceiling."""
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(RECURSION_LIMIT, _depth() + 50))
        # No garbage collection inside: callbacks run by a collection (hypothesis
        # registers one) would allocate on the decoder's account, now and then.
        collecting = gc.isenabled()
        gc.disable()
        tracing = tracemalloc.is_tracing()
        if tracing:
            tracemalloc.reset_peak()
        else:
            tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        result: Any = None
        error: Exception | None = None
        try:
            result = call()
        except Exception as exc:
            error = exc
        finally:
            peak = tracemalloc.get_traced_memory()[1] - base
            if not tracing:
                tracemalloc.stop()
            if collecting:
                gc.enable()
            sys.setrecursionlimit(limit)
        self.peak = max(self.peak, peak)
        if peak > ceiling:
            raise MemoryCeilingError(
                f"{what} allocated {peak} bytes at its peak, over its {ceiling}-byte ceiling"
            )
        return result, error


def ours(error: Exception | None, allowed: type[GPUMeshError] = GPUMeshError) -> None:
    """Fail unless ``error`` is None or one of GPUMesh's own errors (of ``allowed``)."""
    if error is not None and not isinstance(error, allowed):
        raise AssertionError(
            f"{type(error).__name__} escaped where only {allowed.__name__} may: {error}"
        ) from error


def no_violations(value: Any, cls: type[Any]) -> None:
    problems = violations(value, mi.type_info(cls))
    assert not problems, f"decoded {type(value).__name__} breaks its declared bounds: {problems}"


@dataclass(frozen=True)
class Target:
    name: str
    modules: tuple[str, ...]
    """The modules this target exercises (for the coverage figures)."""
    strategy: st.SearchStrategy[Any]
    check: Callable[[Any, Meter], None]
    ceiling: str
    """The memory ceiling, for people."""

    def run(self, case: Any, meter: Meter) -> None:
        """Check one case; a memory ceiling counts only when exceeded with no tracer on.

        A tracer (coverage.py, hypothesis explaining a failure) allocates on
        the decoder's account the first time it sees a line; every check builds
        its decoders afresh, so the case is simply checked again without it.
        """
        try:
            self.check(case, meter)
        except MemoryCeilingError:
            tracer = sys.gettrace()
            if tracer is None:
                raise
            sys.settrace(None)
            try:
                self.check(case, Meter())
            finally:
                sys.settrace(tracer)


# --- framing -----------------------------------------------------------------------------

LIMITS = {FrameKind.MESSAGE: MAX_MESSAGE_FRAME, FrameKind.DATA: MAX_DATA_FRAME, FrameKind.CREDIT: 8}
_HEADER = struct.Struct("!BI")


@dataclass(frozen=True)
class RawFrame:
    kind: int
    length: int
    """What the header announces."""
    body: bytes

    def __repr__(self) -> str:
        shown = self.body if len(self.body) <= 64 else self.body[:64] + b"..."
        return f"RawFrame({self.kind}, {self.length}, {len(self.body)} bytes={shown!r})"


@dataclass(frozen=True)
class FrameCase:
    frames: tuple[RawFrame, ...]
    stream: bytes
    cuts: tuple[int, ...]
    valid: bool
    steps: tuple[str, ...]

    def __repr__(self) -> str:
        shown = self.stream if len(self.stream) <= 512 else self.stream[:512] + b"..."
        return (
            f"FrameCase(frames={self.frames!r}, steps={self.steps!r}, cuts={self.cuts!r}, "
            f"{len(self.stream)} bytes={shown!r})"
        )


def _message_bodies() -> st.SearchStrategy[bytes]:
    """Valid encoded messages of every type that fit in a frame."""
    return (
        st.sampled_from(MESSAGE_TYPES)
        .flatmap(lambda cls: MESSAGE_SHAPES[cls].valid())
        .map(pack)
        .filter(lambda data: len(data) <= MAX_MESSAGE_FRAME)
    )


@st.composite
def _frame(draw: st.DrawFn) -> RawFrame:
    kind = draw(st.sampled_from(list(FrameKind)))
    limit = LIMITS[kind]
    if kind is FrameKind.CREDIT:
        body = draw(st.binary(min_size=8, max_size=8) | st.binary(max_size=8))
    elif kind is FrameKind.MESSAGE:
        body = draw(MESSAGE_BODIES | st.binary(max_size=64))
    else:
        body = draw(st.binary(max_size=64))
    if draw(one_in(10)):
        body = bytes(draw(st.sampled_from([limit - 1, limit])))
    return RawFrame(int(kind), len(body), body)


@st.composite
def _frame_case(draw: st.DrawFn) -> FrameCase:
    frames = list(draw(st.lists(_frame(), max_size=5)))
    steps: list[str] = []
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        if not frames:
            break
        index = draw(st.integers(0, len(frames) - 1))
        frame = frames[index]
        op = draw(st.sampled_from(["kind", "length", "oversize"]))
        if op == "kind":
            kind = draw(st.integers(0, 255) | st.sampled_from([0, 4, *map(int, FrameKind)]))
            frames[index] = RawFrame(kind, frame.length, frame.body)
            steps.append(f"frame {index} kind {kind}")
        elif op == "length":
            limit = LIMITS.get(frame.kind, MAX_DATA_FRAME)
            length = draw(
                st.sampled_from([0, limit, limit + 1, MAX_DATA_FRAME + 1, U32_MAX])
                | st.integers(max(frame.length - 2, 0), min(frame.length + 2, U32_MAX))
                | st.integers(0, U32_MAX)
            )
            frames[index] = RawFrame(frame.kind, length, frame.body)
            steps.append(f"frame {index} length {length}")
        else:
            size = LIMITS.get(frame.kind, 8) + 1
            frames[index] = RawFrame(frame.kind, size, bytes(size))
            steps.append(f"frame {index} body {size}")
    stream = b"".join(_HEADER.pack(f.kind, f.length) + f.body for f in frames)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1]))):
        stream, step = draw(mutate_bytes(stream))
        steps.append(step)
    if len(stream) <= 48 and draw(st.booleans()):
        cuts = tuple(range(1, len(stream)))  # byte by byte
    else:
        cuts = tuple(sorted(draw(st.lists(st.integers(0, len(stream)), max_size=8))))
    valid = not steps and all(len(f.body) <= LIMITS[FrameKind(f.kind)] for f in frames)
    return FrameCase(tuple(frames), stream, cuts, valid, tuple(steps))


def reference_frames(stream: bytes) -> tuple[list[Frame], int, type[Exception] | None]:
    """Frames of a whole stream parsed at once: (frames, bytes they use, error class)."""
    frames: list[Frame] = []
    offset = 0
    while len(stream) - offset >= HEADER_SIZE:
        kind_value, length = _HEADER.unpack_from(stream, offset)
        if kind_value not in set(map(int, FrameKind)):
            return frames, offset, ProtocolError
        kind = FrameKind(kind_value)
        if length > LIMITS[kind]:
            return frames, offset, FrameTooLargeError
        end = offset + HEADER_SIZE + length
        if end > len(stream):
            break
        frames.append(Frame(kind, stream[offset + HEADER_SIZE : end]))
        offset = end
    return frames, offset, None


def check_framing(case: FrameCase, meter: Meter) -> None:
    want, used, want_error = reference_frames(case.stream)
    decoder = FrameDecoder()
    got: list[Frame] = []
    error: Exception | None = None
    for start, end in zip((0, *case.cuts), (*case.cuts, len(case.stream)), strict=True):
        chunk = case.stream[start:end]
        held = decoder.buffered
        ceiling = 4 * (held + len(chunk)) + FRAME_SLACK
        frames, error = meter.run(ceiling, "FrameDecoder.feed", lambda c=chunk: decoder.feed(c))
        ours(error, ProtocolError)
        if error is not None:
            break
        for frame in frames:
            assert len(frame.body) <= LIMITS[frame.kind], f"{frame.kind} frame over its limit"
        got += frames
        assert decoder.buffered < HEADER_SIZE + MAX_DATA_FRAME
        assert decoder.at_frame_boundary() == (decoder.buffered == 0)
    if want_error is None:
        assert error is None, f"refused a stream the reference parses: {error!r}"
        assert got == want
        assert decoder.buffered == len(case.stream) - used
    else:
        assert type(error) is want_error, f"expected {want_error.__name__}, got {error!r}"
        assert want[: len(got)] == got
    if case.valid:
        assert [(int(f.kind), f.body) for f in got] == [(f.kind, f.body) for f in case.frames]
        assert decoder.at_frame_boundary()


# --- messages ----------------------------------------------------------------------------

MESSAGE_TYPES: tuple[type[Any], ...] = get_args(Message)
_MESSAGE_BLOBS = (MAX_MESSAGE_FRAME - 64, MAX_MESSAGE_FRAME, MAX_MESSAGE_FRAME + 1)
MESSAGE_SHAPES = {cls: Shape(cls, blob_sizes=_MESSAGE_BLOBS) for cls in MESSAGE_TYPES}
register_tags({str(shape.info.tag) for shape in MESSAGE_SHAPES.values()})
MESSAGE_BODIES = _message_bodies()


@dataclass(frozen=True)
class MessageCase:
    cls: type[Any]
    case: Case


def _message_case() -> st.SearchStrategy[MessageCase]:
    return st.sampled_from(MESSAGE_TYPES).flatmap(
        lambda cls: MESSAGE_SHAPES[cls].cases().map(lambda case: MessageCase(cls, case))
    )


def check_message(item: MessageCase, meter: Meter) -> None:
    case = item.case
    message, error = meter.run(MESSAGE_CEILING, "decode_message", lambda: decode_message(case.data))
    ours(error, ProtocolError)
    _, view_error = meter.run(
        MESSAGE_CEILING, "decode_message", lambda: decode_message(memoryview(case.data))
    )
    assert type(view_error) is type(error), "a memoryview decodes otherwise than bytes"
    if len(case.data) > MAX_MESSAGE_FRAME:
        assert isinstance(error, FrameTooLargeError), "an oversize message was not refused"
        return
    if case.expect == OK:
        assert error is None, f"refused a valid {item.cls.__name__}: {error}"
        assert type(message) is item.cls
        assert same(message, expected(case, item.cls)), "decoded something else than was sent"
    elif case.expect == ERROR:
        assert error is not None, f"accepted an invalid {item.cls.__name__}: {message!r:.300}"
    if error is None:
        no_violations(message, type(message))
        try:
            again = decode_message(encode_message(message))
        except FrameTooLargeError:
            return  # a float32 widened to float64 may push a full frame over
        assert same(again, message), "a decoded message does not survive re-encoding"


# --- handshake ---------------------------------------------------------------------------


def _identity(seed: int) -> Identity:
    return Identity(Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32))


SERVER = _identity(1)
CLIENTS = (_identity(2), _identity(3), _identity(4))
NONCE = bytes(range(32))
BINDING = bytes(range(32, 64))
"""The TLS session binding of the provider's session (session form)."""


@dataclass(frozen=True)
class HelloStep:
    version: int
    client: int | bytes
    """Index into CLIENTS, or raw key bytes nobody can sign for."""
    name: str


@dataclass(frozen=True)
class ProofStep:
    signer: int | bytes
    """Index into CLIENTS, or a raw (forged) signature."""
    good_nonce: bool
    good_server: bool
    flip: int | None
    """A signature bit to flip."""


@dataclass(frozen=True)
class SessionProofStep:
    version: int
    client: int | bytes
    """The key claimed: index into CLIENTS, or raw key bytes nobody can sign for."""
    name: str
    signer: int | bytes
    """Index into CLIENTS, or a raw (forged) signature."""
    good_binding: bool
    """Signed over this session's binding, or another session's."""
    good_server: bool
    flip: int | None
    """A signature bit to flip."""


@dataclass(frozen=True)
class ChallengeStep:
    version: int
    nonce: bytes


@dataclass(frozen=True)
class SentStep:
    """A message as it arrives: any type, any fields within their bounds."""

    message: Any


def _decoded_messages() -> st.SearchStrategy[Any]:
    """Messages of every type with fields drawn from their declared bounds."""
    return MESSAGE_BODIES.map(decode_message)


_versions = st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, PROTOCOL_VERSION + 1]) | (
    st.integers(-(2**63), 2**64 - 1)
)
_hello_steps = st.builds(
    HelloStep,
    version=_versions,
    client=st.integers(0, len(CLIENTS) - 1) | st.binary(min_size=32, max_size=32),
    name=st.text(max_size=64),
)
_proof_steps = st.builds(
    ProofStep,
    signer=st.integers(0, len(CLIENTS) - 1) | st.binary(min_size=64, max_size=64),
    good_nonce=st.booleans() | st.just(True),
    good_server=st.booleans() | st.just(True),
    flip=st.none() | st.none() | st.integers(0, 511),
)
_session_proof_steps = st.builds(
    SessionProofStep,
    version=_versions,
    client=st.integers(0, len(CLIENTS) - 1) | st.binary(min_size=32, max_size=32),
    name=st.text(max_size=64),
    signer=st.integers(0, len(CLIENTS) - 1) | st.binary(min_size=64, max_size=64),
    good_binding=st.booleans() | st.just(True),
    good_server=st.booleans() | st.just(True),
    flip=st.none() | st.none() | st.integers(0, 511),
)
_forms = st.sampled_from(list(AuthForm))


@dataclass(frozen=True)
class ServerCase:
    form: AuthForm
    """The connection's form (its ALPN)."""
    denied: frozenset[int]
    """Clients the provider's authorize refuses."""
    refusal: type[AccessDeniedError]
    steps: tuple[Any, ...]


_server_cases = st.builds(
    ServerCase,
    form=_forms,
    denied=st.frozensets(st.integers(0, len(CLIENTS) - 1)),
    refusal=st.sampled_from([AccessDeniedError, NotPairedError]),
    steps=st.lists(
        _hello_steps | _proof_steps | _session_proof_steps | _decoded_messages().map(SentStep),
        min_size=1,
        max_size=5,
    ).map(tuple),
)


def _key(client: int | bytes) -> bytes:
    return CLIENTS[client].public_key if isinstance(client, int) else client


def _proof(step: ProofStep, claimed: bytes | None) -> tuple[Proof, bool]:
    """The Proof a step sends and whether it must verify against ``claimed``."""
    if isinstance(step.signer, bytes):
        return Proof(signature=step.signer), False
    signer = CLIENTS[step.signer]
    nonce = NONCE if step.good_nonce else bytes(32)
    server = SERVER.public_key if step.good_server else CLIENTS[0].public_key
    signature = signer.sign(challenge_transcript(nonce, server, claimed or signer.public_key))
    good = (
        claimed == signer.public_key and step.good_nonce and step.good_server and step.flip is None
    )
    return Proof(signature=_flipped(signature, step.flip)), good


def _flipped(signature: bytes, bit: int | None) -> bytes:
    if bit is None:
        return signature
    changed = bytearray(signature)
    changed[bit // 8] ^= 1 << (bit % 8)
    return bytes(changed)


def _session_proof(step: SessionProofStep) -> tuple[SessionProof, bool]:
    """The SessionProof a step sends and whether it must verify."""
    claimed = _key(step.client)
    if isinstance(step.signer, bytes):
        signature, good = step.signer, False
    else:
        signer = CLIENTS[step.signer]
        binding = BINDING if step.good_binding else NONCE  # another session's
        server = SERVER.public_key if step.good_server else CLIENTS[0].public_key
        signature = _flipped(signer.sign(session_transcript(binding, server, claimed)), step.flip)
        good = (
            claimed == signer.public_key
            and step.good_binding
            and step.good_server
            and step.flip is None
        )
    message = SessionProof(
        version=step.version, public_key=claimed, name=step.name, signature=signature
    )
    return message, good


def check_server(case: ServerCase, meter: Meter) -> None:
    authorized: list[bytes] = []
    denied_keys = {CLIENTS[i].public_key for i in case.denied}

    def authorize(key: bytes) -> None:
        authorized.append(key)
        if key in denied_keys:
            raise case.refusal("this node does not take work from you")

    if case.form is AuthForm.SESSION:
        server = ServerAuth.for_session(SERVER, "provider", BINDING, authorize)
    else:
        server = ServerAuth.for_challenge(SERVER, "provider", NONCE, authorize)
    state, claimed = "hello", None  # the reference model

    def judge(reply: Any, signature: bytes, transcript: bytes, good: bool, sent: bool) -> str:
        """The state after ``reply`` to a proof of ``claimed``'s key over ``transcript``."""
        assert claimed is not None
        verifies = verify_signature(claimed, signature, transcript)
        assert verifies == good or sent, "the proof was misjudged"
        if not verifies:
            _refused(reply, "denied")
            assert authorized == [], "authorize ran before the identity was proven"
            return "failed"
        if claimed in denied_keys:
            _refused(reply, case.refusal.code)
            assert authorized == [claimed]
            return "failed"
        assert reply == Welcome(name="provider")
        assert authorized == [claimed]
        return "done"

    for step in case.steps:
        good = False
        if isinstance(step, HelloStep):
            message: Any = Hello(version=step.version, public_key=_key(step.client), name=step.name)
        elif isinstance(step, ProofStep):
            message, good = _proof(step, claimed)
        elif isinstance(step, SessionProofStep):
            message, good = _session_proof(step)
        else:
            message = step.message
        if isinstance(message, Hello | Proof | SessionProof):  # what the wire would make of it
            message = decode_message(encode_message(message))
        reply, error = meter.run(
            HANDSHAKE_CEILING, "ServerAuth.receive", lambda m=message: server.receive(m)
        )
        ours(error, GPUMeshError)
        assert error is None, f"ServerAuth.receive raised {error!r} instead of answering"
        sent = isinstance(step, SentStep)
        session = case.form is AuthForm.SESSION
        if state == "hello" and session and isinstance(message, SessionProof):
            if message.version == PROTOCOL_VERSION:
                claimed = message.public_key
                transcript = session_transcript(BINDING, SERVER.public_key, claimed)
                state = judge(reply, message.signature, transcript, good, sent)
            else:
                _refused(reply, "protocol")
                state = "failed"
        elif state == "hello" and not session and isinstance(message, Hello):
            if message.version == PROTOCOL_VERSION:
                assert reply == Challenge(nonce=NONCE, version=PROTOCOL_VERSION)
                state, claimed = "proof", message.public_key
            else:
                _refused(reply, "protocol")
                state = "failed"
        elif state == "proof" and isinstance(message, Proof):
            assert claimed is not None
            transcript = challenge_transcript(NONCE, SERVER.public_key, claimed)
            state = judge(reply, message.signature, transcript, good, sent)
        else:
            _refused(reply, "protocol")
            state = "failed"
        assert server.done == (state == "done")
        assert server.failed == (state == "failed")
        if state == "failed":
            assert isinstance(server.error, GPUMeshError)
        if server.done:
            assert server.client_key == claimed


def _refused(reply: Any, code: str) -> None:
    assert isinstance(reply, Refusal), f"expected a {code!r} refusal, got {reply!r:.200}"
    assert reply.code == code, f"expected a {code!r} refusal, got {reply!r:.200}"
    decode_message(encode_message(reply))  # a refusal must fit its own bounds


def _error_codes() -> list[str]:
    found: list[str] = []
    pending: list[type[GPUMeshError]] = [GPUMeshError]
    while pending:
        cls = pending.pop()
        found.append(cls.code)
        pending.extend(cls.__subclasses__())
    return sorted(set(found))


@dataclass(frozen=True)
class ClientCase:
    form: AuthForm
    """The connection's form (its ALPN)."""
    pinned: int | None
    """None: the client pinned the real server key; else CLIENTS[pinned]'s (a wrong one)."""
    steps: tuple[Any, ...]


_refusal_steps = st.builds(
    Refusal,
    code=st.sampled_from(_error_codes()) | st.text(max_size=64),
    message=st.text(max_size=64) | st.just("m" * 2048),
)
_client_cases = st.builds(
    ClientCase,
    form=_forms,
    pinned=st.none() | st.integers(0, len(CLIENTS) - 1),
    steps=st.lists(
        st.builds(ChallengeStep, _versions, st.binary(min_size=32, max_size=32))
        | st.builds(Welcome, name=st.text(max_size=64))
        | _refusal_steps
        | _decoded_messages().map(SentStep),
        min_size=1,
        max_size=4,
    ).map(tuple),
)


def check_client(case: ClientCase, meter: Meter) -> None:
    me = CLIENTS[0]
    pinned = SERVER.public_key if case.pinned is None else CLIENTS[case.pinned].public_key
    client = ClientAuth(me, "dialer", pinned)
    first = client.start(case.form, BINDING)
    if case.form is AuthForm.SESSION:
        assert isinstance(first, SessionProof)
        assert (first.version, first.public_key, first.name) == (
            PROTOCOL_VERSION,
            me.public_key,
            "dialer",
        )
        transcript = session_transcript(BINDING, pinned, me.public_key)
        assert verify_signature(me.public_key, first.signature, transcript)
        state = "welcome"  # requests may go with the proof
    else:
        assert first == Hello(version=PROTOCOL_VERSION, public_key=me.public_key, name="dialer")
        state = "challenge"
    assert client.may_send_requests == (state == "welcome")
    for step in case.steps:
        if isinstance(step, ChallengeStep):
            message: Any = Challenge(nonce=step.nonce, version=step.version)
        elif isinstance(step, SentStep):
            message = step.message
        else:
            message = step
        message = decode_message(encode_message(message))
        reply, error = meter.run(
            HANDSHAKE_CEILING, "ClientAuth.receive", lambda m=message: client.receive(m)
        )
        ours(error, GPUMeshError)
        if isinstance(message, Refusal):
            want = error_from_code(message.code, message.message)
            assert type(error) is type(want) and str(error) == message.message
            state = "failed"
        elif state == "challenge" and isinstance(message, Challenge):
            if message.version != PROTOCOL_VERSION:
                assert isinstance(error, ProtocolError), f"another version was taken: {error!r}"
                state = "failed"
            else:
                assert error is None and isinstance(reply, Proof)
                transcript = challenge_transcript(message.nonce, pinned, me.public_key)
                assert verify_signature(me.public_key, reply.signature, transcript)
                state = "welcome"
        elif state == "welcome" and isinstance(message, Welcome):
            assert error is None and reply is None
            assert client.server_name == message.name
            state = "done"
        else:
            assert isinstance(error, ProtocolError), f"{message!r:.200} was taken: {reply!r:.80}"
            state = "failed"
        assert client.done == (state == "done")
        session = case.form is AuthForm.SESSION
        assert client.may_send_requests == (state == "done" or (session and state == "welcome"))


# --- relay packets -----------------------------------------------------------------------

RELAY_TYPES: tuple[type[Any], ...] = get_args(relay.RelayMessage)
_RELAY_BLOBS = (relay.MAX_PACKET - 8, relay.MAX_PACKET, relay.MAX_PACKET + 1)
RELAY_SHAPES = {cls: Shape(cls, blob_sizes=_RELAY_BLOBS) for cls in RELAY_TYPES}
# The type byte of each packet struct is only written down in this mapping.
_TYPE_BYTES = {cls: cls.TYPE for cls in RELAY_TYPES}


@dataclass(frozen=True)
class PacketCase:
    cls: type[Any] | None
    """The packet's struct; None for a Data packet."""
    case: Case
    header: bytes
    good_header: bool
    packet: bytes
    datagram: bytes = b""
    session: int = 0


@st.composite
def _packet_case(draw: st.DrawFn) -> PacketCase:
    cls = draw(st.sampled_from([*RELAY_TYPES, None]))
    if cls is None:
        session = draw(st.sampled_from([0, 1, 2**63 - 1, 2**64 - 1]) | st.integers(0, 2**64 - 1))
        size = draw(st.integers(0, 64) | st.sampled_from([1486, 1487, 1488]))
        datagram = bytes(size) if size > 64 else draw(st.binary(min_size=size, max_size=size))
        body = struct.pack("!Q", session) + datagram
        case = Case(None, body[8:], OK, ())
        type_byte = relay.T_DATA
    else:
        case = draw(RELAY_SHAPES[cls].cases())
        datagram, session = b"", 0
        type_byte = _TYPE_BYTES[cls]
    header = bytes([type_byte]) + relay.MAGIC + bytes([relay.WIRE_VERSION])
    good = True
    if draw(one_in(5)):
        good = False
        part = draw(st.sampled_from(["type", "magic", "version"]))
        if part == "type":
            header = bytes([draw(st.integers(0, 255))]) + header[1:]
        elif part == "magic":
            header = header[:1] + draw(st.binary(min_size=2, max_size=2)) + header[3:]
        else:
            header = header[:3] + bytes([draw(st.integers(0, 255))])
    rest = case.data if cls is not None else struct.pack("!Q", session) + datagram
    packet = header + rest
    if cls is None and draw(one_in(4)):
        packet, step = draw(mutate_bytes(packet))
        good = False
        case = Case(None, packet, ANY, (step,))
    return PacketCase(cls, case, header, good, packet, datagram, session)


def check_relay(item: PacketCase, meter: Meter) -> None:
    packet = item.packet
    results = []
    for data in (packet, memoryview(packet)):
        assert isinstance(relay.is_relay_packet(data), bool)
        assert isinstance(relay.is_data(data), bool)
        decoded = meter.run(RELAY_CEILING, "decode_packet", lambda d=data: relay.decode_packet(d))
        ours(decoded[1], ProtocolError)
        unwrapped = meter.run(RELAY_CEILING, "decode_data", lambda d=data: relay.decode_data(d))
        ours(unwrapped[1], ProtocolError)
        results.append((decoded, unwrapped))
    (message, error), (data_result, data_error) = results[0]
    assert type(results[1][0][1]) is type(error), "a memoryview decodes otherwise than bytes"
    assert type(results[1][1][1]) is type(data_error), "a memoryview decodes otherwise than bytes"
    too_big = len(packet) > relay.MAX_PACKET
    if too_big:
        assert error is not None and data_error is not None, "an oversize packet was taken"
    if item.cls is None:
        if item.good_header and not too_big:
            assert data_result == (item.session, item.datagram)
            assert error is not None, "a Data packet decoded as a message"
        return
    if item.good_header:
        assert data_error is not None, f"a {item.cls.__name__} packet decoded as Data"
    if item.good_header and not too_big and item.case.expect == OK:
        assert error is None, f"refused a valid {item.cls.__name__}: {error}"
        assert same(message, expected(item.case, item.cls))
    elif item.good_header and item.case.expect == ERROR:
        assert error is not None, f"accepted an invalid {item.cls.__name__}: {message!r:.300}"
    if error is None:
        no_violations(message, type(message))


# --- pairing codes and group invites -----------------------------------------------------

NOW = 1_700_000_000.0
CODE_DOMAIN = b"gpumesh-pairing-offer-v1\x00"
INVITE_DOMAIN = b"gpumesh-group-invite-v1\x00"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
GROUP_ID = re.compile(r"[a-z2-7]{24}")
SIGNERS = CLIENTS
_TOKEN_BLOBS = (codes.MAX_BODY_BYTES - 64, codes.MAX_BODY_BYTES, codes.MAX_BODY_BYTES + 1)


def mostly(usual: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``usual`` four times in five: valid tokens must be common for verification to be reached."""
    return one_in(5).flatmap(lambda rare: other if rare else usual)


_KEYS = [s.public_key for s in SIGNERS]
_names = mostly(
    st.from_regex(NAME, fullmatch=True),
    st.sampled_from(["a" * 63, "a" * 64, "-a", "a b", "", "a\n"]) | st.text(max_size=70),
)
_keys = mostly(st.sampled_from(_KEYS), st.binary(max_size=33))
_addresses = mostly(
    st.lists(st.sampled_from(["192.0.2.1:47000", "[2001:db8::1]:47000"]), max_size=3),
    st.lists(st.sampled_from(["a" * 255, "a" * 256, *BAD_HINTS]) | st.text(max_size=24), max_size=3)
    | st.sampled_from([16, 17]).map(lambda n: ["h:1"] * n),
)
_relays = mostly(
    st.sampled_from(["", "relay.example.org:4799", "relay.example.org", "r" * 255]),
    st.sampled_from(["r" * 256, *BAD_HINTS]) | st.text(max_size=24),
)
_nonces = mostly(st.binary(min_size=16, max_size=16), st.binary(max_size=20))


def _expiry(lifetime: float) -> st.SearchStrategy[float]:
    edges = [NOW - 1, NOW, NOW + 1, NOW + lifetime, NOW + lifetime + 300, NOW + lifetime + 301]
    return mostly(
        st.floats(NOW, NOW + lifetime),
        st.sampled_from([math.nan, math.inf, -math.inf, 0.0])
        | st.sampled_from(edges)
        | st.floats(),
    )


_OFFER = Shape(
    codes.PairingOffer,
    overrides={
        "name": _names,
        "public_key": _keys,
        "addresses": _addresses,
        "relay": _relays,
        "expires": _expiry(codes.CODE_LIFETIME),
        "nonce": _nonces,
    },
    blob_sizes=_TOKEN_BLOBS,
)
_MEMBER = Shape(
    invites.InviteMember,
    overrides={"name": _names, "public_key": _keys, "addresses": _addresses, "relay": _relays},
)


def _member_of(index: int) -> st.SearchStrategy[Any]:
    """A member tree with SIGNERS[index]'s key."""
    return _MEMBER.valid().map(lambda tree: {**tree, "public_key": _KEYS[index]})


_INVITE = Shape(
    invites.GroupInvite,
    overrides={
        "group_id": st.from_regex(GROUP_ID, fullmatch=True) | st.text(max_size=25),
        "group_name": _names,
        "inviter": _keys,
        "members": mostly(
            st.lists(st.sampled_from(range(len(SIGNERS))), unique=True, max_size=3).flatmap(
                lambda indexes: st.tuples(*(_member_of(i) for i in indexes)).map(list)
            ),
            st.lists(_MEMBER.valid(), max_size=4)
            | st.sampled_from([64, 65]).flatmap(
                lambda n: _MEMBER.valid().map(lambda m: [m] * n)  # one key 64 times: refused
            ),
        ),
        "expires": _expiry(invites.MAX_INVITE_LIFETIME),
        "nonce": _nonces,
    },
    blob_sizes=_TOKEN_BLOBS,
)


@dataclass(frozen=True)
class TokenCase:
    kind: str
    """``code`` or ``invite``: which decoder the token was made for."""
    inner: Case
    """The offer or invite struct."""
    signer: int | bytes
    """Index into SIGNERS, or a raw signature."""
    signature: bytes
    text: str
    intact: bool
    """No mutation after signing: the token is what a genuine node would make of it."""
    steps: tuple[str, ...]

    def __repr__(self) -> str:
        shown = self.text if len(self.text) <= 2048 else self.text[:2048] + "..."
        return (
            f"TokenCase({self.kind}, inner={self.inner!r}, signer={self.signer!r}, "
            f"intact={self.intact}, steps={self.steps!r}, {len(self.text)} chars={shown!r})"
        )


@st.composite
def _token_case(draw: st.DrawFn, kind: str) -> TokenCase:
    shape = _OFFER if kind == "code" else _INVITE
    # One layer is mutated (or none): stacking them would leave little for verify to check.
    layer = draw(st.sampled_from(["none", "struct", "envelope", "frame", "text"]))
    if layer == "struct":
        inner = draw(shape.cases())
    else:
        tree = draw(shape.valid())
        inner = Case(tree, pack(tree), OK, ())
    # Mostly the key the struct names, so that genuine tokens are common.
    named = (
        inner.tree.get("public_key" if kind == "code" else "inviter")
        if isinstance(inner.tree, dict)
        else None
    )
    signer = draw(
        mostly(
            st.just(_KEYS.index(named)) if named in _KEYS else st.integers(0, len(SIGNERS) - 1),
            st.integers(0, len(SIGNERS) - 1) | st.binary(max_size=65),
        )
    )
    domain = CODE_DOMAIN if kind == "code" else INVITE_DOMAIN
    signature = SIGNERS[signer].sign(domain + inner.data) if isinstance(signer, int) else signer
    envelope: Any = {"offer" if kind == "code" else "invite": inner.data, "signature": signature}
    steps: list[str] = []
    for _ in range(draw(st.integers(1, 2)) if layer == "envelope" else 0):
        envelope, step = draw(mutate_tree(envelope, _TOKEN_BLOBS))
        steps.append(step)
    body = pack(envelope)
    raw = _frame_token(draw, body, steps) if layer == "frame" else _framed(body)
    prefix = codes.CODE_PREFIX if kind == "code" else invites.INVITE_PREFIX
    text = prefix + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")
    longest = codes.MAX_CODE_CHARS if kind == "code" else invites.MAX_INVITE_CHARS
    if len(body) > codes.MAX_BODY_BYTES or len(text) > longest:
        # No genuine node makes this token (the u16 length cannot say it): refusing is right.
        steps.append(f"{len(body)}-byte body, {len(text)} characters: over the limits")
    if layer == "text":
        text = _mutate_text(draw, text, prefix, steps)
    return TokenCase(kind, inner, signer, signature, text, not steps, tuple(steps))


def _framed(body: bytes) -> bytes:
    raw = struct.pack("!H", len(body) & 0xFFFF) + body
    return raw + struct.pack("!I", zlib.crc32(raw))


def _frame_token(draw: st.DrawFn, body: bytes, steps: list[str]) -> bytes:
    length = len(body)
    if draw(st.booleans()):
        length = draw(
            st.sampled_from([0, 0xFFFF])
            | st.integers(max(len(body) - 2, 0), len(body) + 2)
            | st.integers(0, 0xFFFF)
        )
        if length != len(body):
            steps.append(f"length {length}")
    raw = struct.pack("!H", length & 0xFFFF) + body
    crc = zlib.crc32(raw)
    if draw(one_in(3)):
        crc ^= draw(st.integers(1, U32_MAX))
        steps.append("crc")
    raw += struct.pack("!I", crc)
    for _ in range(draw(st.sampled_from([0, 1]))):
        raw, step = draw(mutate_bytes(raw))
        steps.append(step)
    return raw


def _mutate_text(draw: st.DrawFn, text: str, prefix: str, steps: list[str]) -> str:
    for _ in range(draw(st.integers(1, 2))):
        op = draw(st.sampled_from(["prefix", "space", "char", "cut", "pad", "append"]))
        at = draw(st.integers(0, len(text)))
        if op == "prefix":
            other = draw(st.sampled_from(["", "gpm1_", "gpg1_", "GPM1_", "gpm2_", " gpm1_"]))
            text = other + text[len(prefix) :]
            steps.append(f"prefix {other!r}")
            continue  # the decoders must cope; what they must answer is not predicted
        if op == "space":
            # Whitespace is ignored (chat apps wrap tokens): this one is harmless.
            text = text[:at] + draw(st.sampled_from([" ", "\n", "\t", "\u2003"])) + text[at:]
            continue
        if op == "char":
            char = draw(st.sampled_from(list("Aa0-_=+/.é\x00Ａ٣")) | st.characters(codec="utf-8"))
            text = text[:at] + char + text[at + 1 :]
            steps.append(f"char {at} {char!r}")
        elif op == "cut":
            text = text[:at]
            steps.append(f"cut {at}")
        elif op == "pad":
            text += "=" * draw(st.integers(1, 3))
            steps.append("pad")
        else:
            extra = draw(st.text("ABCabc012-_", min_size=1, max_size=8) | st.just("A" * 90_000))
            text += extra
            steps.append(f"append {len(extra)}")
    return text


def _offer_ok(offer: Any, lifetime: float) -> bool:
    """Whether a verified token's fields are what verification promises."""
    return (
        NAME.fullmatch(offer.name) is not None
        and len(offer.public_key) == 32
        and len(offer.addresses) <= codes.MAX_ADDRESSES
        and all(len(a) <= codes.MAX_ADDRESS_CHARS for a in offer.addresses)
        and len(offer.relay) <= codes.MAX_ADDRESS_CHARS
        and _hints_ok(offer.addresses, offer.relay)
        and len(offer.nonce) == 16
        and NOW <= offer.expires <= NOW + lifetime + 300
    )


def _hints_ok(addresses: list[str], relay: str) -> bool:
    """Whether every hint a verified token carries is one a dial can take."""
    try:
        check_hints(addresses, relay)
    except ValueError:
        return False
    return True


def _invite_ok(invite: Any) -> bool:
    keys = [m.public_key for m in invite.members]
    return (
        GROUP_ID.fullmatch(invite.group_id) is not None
        and NAME.fullmatch(invite.group_name) is not None
        and invite.inviter in keys
        and len(keys) == len(set(keys))
        and len(invite.members) <= invites.MAX_MEMBERS
        and all(
            NAME.fullmatch(m.name) is not None
            and len(m.public_key) == 32
            and len(m.addresses) <= codes.MAX_ADDRESSES
            and all(len(a) <= codes.MAX_ADDRESS_CHARS for a in m.addresses)
            and len(m.relay) <= codes.MAX_ADDRESS_CHARS
            and _hints_ok(m.addresses, m.relay)
            for m in invite.members
        )
        and len(invite.nonce) == 16
        and NOW <= invite.expires <= NOW + invites.MAX_INVITE_LIFETIME + 300
    )


def _signed_by(struct_: Any) -> bytes:
    return bytes(struct_.public_key if isinstance(struct_, codes.PairingOffer) else struct_.inviter)


def _fields_ok(struct_: Any) -> bool:
    if isinstance(struct_, codes.PairingOffer):
        return _offer_ok(struct_, codes.CODE_LIFETIME)
    return _invite_ok(struct_)


def check_token(case: TokenCase, meter: Meter) -> None:
    clock = lambda: NOW  # noqa: E731
    runs = {
        "code": (codes.decode_code, lambda t: codes.verify_code(t, clock=clock)),
        "invite": (invites.decode_invite, lambda t: invites.verify_invite(t, clock=clock)),
    }
    owner = SIGNERS[case.signer].public_key if isinstance(case.signer, int) else None
    for kind, (decode, verify) in runs.items():
        decoded, error = meter.run(TOKEN_CEILING, f"decode_{kind}", lambda d=decode: d(case.text))
        ours(error, PairingCodeError)
        verified, verify_error = meter.run(
            TOKEN_CEILING, f"verify_{kind}", lambda v=verify: v(case.text)
        )
        ours(verify_error, PairingCodeError)
        if error is not None:
            assert verify_error is not None, f"verify took what decode refused: {error}"
        if kind != case.kind:
            if case.intact:
                assert error is not None, f"a {case.kind} was read as a {kind}"
            continue
        cls = codes.PairingOffer if kind == "code" else invites.GroupInvite
        if case.intact and case.inner.expect == OK:
            assert error is None, f"refused a well-formed {kind}: {error}"
            assert same(decoded[0], expected(case.inner, cls))
        elif case.intact and case.inner.expect == ERROR:
            assert error is not None, f"accepted a malformed {kind}: {decoded!r:.300}"
        # Genuine: what decodes is what a key owner signed, whatever else was mutated.
        genuine = (
            error is None
            and decoded[1:] == (case.inner.data, case.signature)
            and _signed_by(decoded[0]) == owner
        )
        if verify_error is None:
            assert genuine, f"accepted a {kind} its key did not sign: {verified!r:.300}"
            assert not math.isnan(verified.expires), f"accepted a {kind} that never expires"
            assert _fields_ok(verified), f"accepted a {kind} with bad fields: {verified!r:.300}"
        elif genuine and _fields_ok(decoded[0]):
            raise AssertionError(f"refused a genuine, valid {kind}: {verify_error}")


# --- the list ----------------------------------------------------------------------------

# --- LAN announcements --------------------------------------------------------------------

LAN_CEILING = 64 * 1024
"""A datagram is at most 335 bytes; matching it against a few peers allocates little."""
LAN_NOW = 1_700_000_000.0
_LAN_KEYS = {f"peer{i}": bytes([i]) * 32 for i in range(3)}


@dataclass(frozen=True)
class LanCase:
    datagram: bytes
    matches: tuple[str, ...]
    """The peers whose tag it carries when it was left whole; empty once mutated."""
    offset: float
    """Seconds between its sending and its hearing."""


@st.composite
def _lan_case(draw: st.DrawFn) -> LanCase:
    peers = draw(st.lists(st.sampled_from(sorted(_LAN_KEYS)), max_size=3, unique=True))
    port = draw(st.sampled_from([0, 1, 47000, 65535]))
    answer = draw(st.booleans())
    randoms = iter(draw(st.lists(st.binary(min_size=10, max_size=10), min_size=40, max_size=40)))
    offset = draw(st.sampled_from([0.0, 30.0, -30.0, 200.0]))
    packets = lan.announcements(
        [_LAN_KEYS[p] for p in peers],
        port=port,
        answer=answer,
        now=LAN_NOW - offset,
        random=lambda n: next(randoms)[:n],
    )
    datagram = packets[0] if packets else draw(st.binary(max_size=400))
    matches = tuple(peers) if packets and abs(offset) < lan.WINDOW else ()
    if draw(one_in(2)):
        datagram, _ = draw(mutate_bytes(datagram))
        matches = ()
    return LanCase(datagram, matches, offset)


def check_lan(case: LanCase, meter: Meter) -> None:
    decoded, error = meter.run(LAN_CEILING, "decode", lambda: lan.decode(case.datagram))
    ours(error, ProtocolError)
    listener = lan.Listener()
    listener.set_peers(_LAN_KEYS)
    heard, error = meter.run(
        LAN_CEILING, "receive", lambda: listener.receive(case.datagram, "192.0.2.1", LAN_NOW)
    )
    assert error is None, f"Listener.receive raised {error!r}"
    assert isinstance(heard, lan.Heard)
    if case.matches:
        assert set(heard.peers) == set(case.matches), heard
        again = listener.receive(case.datagram, "192.0.2.2", LAN_NOW)
        assert again.dropped == "replayed", again
    elif heard.peers:
        # A mutation that kept a peer's tag and what it covers intact is still that peer's.
        assert decoded is not None and error is None
    assert listener.remembered <= lan.MAX_SEEN and listener.sources <= lan.MAX_SOURCES


TARGETS: tuple[Target, ...] = (
    Target(
        "framing",
        ("gpumesh.protocol.framing",),
        _frame_case(),
        check_framing,
        "4 x (bytes fed + bytes buffered) + 64 KiB per feed",
    ),
    Target(
        "messages",
        ("gpumesh.protocol.messages",),
        _message_case(),
        check_message,
        "8 x 64 KiB per message",
    ),
    Target(
        "handshake-server",
        ("gpumesh.protocol.handshake",),
        _server_cases,
        check_server,
        "64 KiB per step",
    ),
    Target(
        "handshake-client",
        ("gpumesh.protocol.handshake",),
        _client_cases,
        check_client,
        "64 KiB per step",
    ),
    Target(
        "relay",
        ("gpumesh.protocol.relay",),
        _packet_case(),
        check_relay,
        "16 x 1500 bytes per packet",
    ),
    Target(
        "pairing-codes",
        ("gpumesh.identity.codes", "gpumesh.identity.hints"),
        _token_case("code"),
        check_token,
        "16 x the longest token per call",
    ),
    Target(
        "group-invites",
        ("gpumesh.identity.invites",),
        _token_case("invite"),
        check_token,
        "16 x the longest token per call",
    ),
    Target(
        "lan-announcements",
        ("gpumesh.protocol.lan",),
        _lan_case(),
        check_lan,
        "64 KiB per datagram",
    ),
)
