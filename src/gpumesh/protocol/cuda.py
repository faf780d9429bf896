"""The CUDA call protocol: what a consumer's program and a provider's CUDA worker say.

Owns the bytes of one CUDA session, and nothing else: no sockets, no processes,
no clock. The same bytes travel inside a QUIC request's DATA frames (consumer to
provider), over the bridge's local socket (a program to ``gpumesh cuda
bridge``), and through the pipes between the agent and its worker process, so
every hop only pumps bytes and only the two ends parse them.

A session is a byte stream of frames, each ``kind`` (1 byte), ``length`` (4
bytes, big-endian) and a body:

* ``CALL`` (client to worker): one msgpack-encoded :data:`Call`;
* ``RESULT`` (worker to client): one msgpack-encoded :class:`Result` (or the
  :class:`Welcome` that answers :class:`Hello`);
* ``DATA`` (either way): raw bytes of a copy, at most :data:`MAX_CHUNK` each;
* ``END`` (to the client): one msgpack-encoded :class:`End`: the session is over
  (the worker crashed, the owner revoked access, the provider stopped), with
  the one line that says why.

The client speaks first with :class:`Hello`; the worker answers with
:class:`Welcome`. After that, calls are handled in order. A call that returns
something (:data:`SYNC_CALLS`) is answered by one ``RESULT`` (``CopyDtoH``'s is
followed by its bytes as ``DATA``); the others are never answered, so a client
need not wait for them: when one fails, its error is kept and returned by the
next call that answers, which then does not run (as CUDA's asynchronous errors
surface at the next synchronising call). ``CopyHtoD`` is followed by its bytes
as ``DATA`` frames: a large copy is chunked and streamed without a round trip
per chunk.

Version: :data:`VERSION` is exchanged in ``Hello``/``Welcome``; a worker refuses
a client of another major version with ``CUDA_ERROR_NOT_SUPPORTED``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Annotated, TypeVar

import msgspec

from gpumesh.errors import ProtocolError

__all__ = [
    "MAX_CALL",
    "MAX_CHUNK",
    "SYNC_CALLS",
    "VERSION",
    "Arg",
    "Call",
    "CopyDtoD",
    "CopyDtoH",
    "CopyHtoD",
    "DeviceCount",
    "DeviceProps",
    "End",
    "Frame",
    "FrameDecoder",
    "FrameKind",
    "Hello",
    "Launch",
    "MemAlloc",
    "MemFree",
    "Memset",
    "ModuleLoad",
    "Result",
    "Synchronize",
    "Welcome",
    "call_frame",
    "data_frames",
    "data_parts",
    "decode_call",
    "decode_end",
    "decode_result",
    "decode_welcome",
    "encode_frame",
    "end_frame",
    "result_frame",
]

VERSION = 1
"""The call protocol's version (its major number: a change that breaks old peers)."""
MAX_CALL = 8 * 1024 * 1024
"""Largest CALL or RESULT body: a module's PTX travels in one."""
MAX_CHUNK = 1024 * 1024
"""Largest DATA frame: copies are cut into chunks of this size."""
MAX_COPY = 1 << 40
"""Largest single copy or allocation a call may name (1 TiB)."""
_HEADER = struct.Struct(">BI")

Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_COPY)]
Pointer = Annotated[int, msgspec.Meta(ge=0)]
Dim = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=2048)]
T = TypeVar("T")


class FrameKind(enum.IntEnum):
    CALL = 1
    RESULT = 2
    DATA = 3
    END = 4


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    body: bytes | memoryview
    """The whole body; with ``FrameDecoder(data_pieces=True)`` a DATA frame's body
    comes as several pieces, each a view into the bytes fed."""


class _Call(msgspec.Struct, tag_field="op", frozen=True):
    pass


class Hello(_Call, tag="hello", frozen=True):
    """The client's first call: which protocol it speaks."""

    version: int
    client: Name = ""
    """Who asks, for the provider's log (a program name, a version)."""


class DeviceCount(_Call, tag="device_count", frozen=True):
    """How many devices this session sees (answers ``value``)."""


class DeviceProps(_Call, tag="device_props", frozen=True):
    """One device's name, memory and compute capability (answers ``props``)."""

    device: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0


class MemAlloc(_Call, tag="mem_alloc", frozen=True):
    """Allocate ``size`` bytes of device memory (answers the pointer as ``value``)."""

    size: Size


class MemFree(_Call, tag="mem_free", frozen=True):
    ptr: Pointer


class Memset(_Call, tag="memset", frozen=True):
    """Set ``size`` bytes from ``ptr`` to the byte ``value``."""

    ptr: Pointer
    value: Annotated[int, msgspec.Meta(ge=0, le=255)]
    size: Size


class CopyHtoD(_Call, tag="copy_htod", frozen=True):
    """Host to device: ``size`` bytes follow as DATA frames."""

    ptr: Pointer
    size: Size


class CopyDtoH(_Call, tag="copy_dtoh", frozen=True):
    """Device to host: answered by a Result, then ``size`` bytes as DATA frames."""

    ptr: Pointer
    size: Size


class CopyDtoD(_Call, tag="copy_dtod", frozen=True):
    dst: Pointer
    src: Pointer
    size: Size


class ModuleLoad(_Call, tag="module_load", frozen=True):
    """Load a module from PTX text (answers a module handle as ``value``)."""

    ptx: Annotated[bytes, msgspec.Meta(max_length=MAX_CALL - 1024)]


class Arg(msgspec.Struct, array_like=True, frozen=True):
    """One typed kernel argument, packed on the provider as the kernel expects it."""

    kind: Annotated[str, msgspec.Meta(pattern=r"^(ptr|i32|u32|i64|u64|f32|f64)\Z")]
    value: int | float


class Launch(_Call, tag="launch", frozen=True):
    """Run kernel ``name`` of a loaded module on the device (asynchronous)."""

    module: Pointer
    name: Name
    grid: Annotated[tuple[Dim, Dim, Dim], msgspec.Meta()]
    block: Annotated[tuple[Dim, Dim, Dim], msgspec.Meta()]
    args: Annotated[list[Arg], msgspec.Meta(max_length=256)]
    shared: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 0


class Synchronize(_Call, tag="synchronize", frozen=True):
    """Wait for the device's work; answers with the first error since the last answer."""


Call = (
    Hello
    | DeviceCount
    | DeviceProps
    | MemAlloc
    | MemFree
    | Memset
    | CopyHtoD
    | CopyDtoH
    | CopyDtoD
    | ModuleLoad
    | Launch
    | Synchronize
)
SYNC_CALLS: tuple[type, ...] = (
    Hello,
    DeviceCount,
    DeviceProps,
    MemAlloc,
    CopyDtoH,
    ModuleLoad,
    Synchronize,
)
"""Calls the worker answers; every other call is never answered."""


class Welcome(msgspec.Struct, frozen=True):
    """The worker's answer to Hello: what runs the calls."""

    version: int
    backend: Name
    """``driver`` (the CUDA driver on a GPU) or ``fallback`` (host memory)."""
    device: Name
    """The device's name (the GPU's, or ``host-memory fallback``)."""
    detail: Text = ""
    """Why the fallback (libcuda did not load: the reason), or the driver version."""
    memory_cap: int = 0
    """Most bytes this session may allocate."""
    error: Name = ""
    """Set when the worker refuses the session (another major version)."""


class Result(msgspec.Struct, frozen=True, omit_defaults=True):
    """The answer to one call that answers."""

    error: Name = ""
    """A CUDA error name (``CUDA_ERROR_OUT_OF_MEMORY``); empty: success."""
    message: Text = ""
    """What went wrong, for people."""
    value: int = 0
    props: dict[Name, int | str] = {}


class End(msgspec.Struct, frozen=True):
    """The session is over: why, as a GPUMesh error code and one line."""

    code: Name
    message: Text


_call_encoder = msgspec.msgpack.Encoder()
_call_decoder: msgspec.msgpack.Decoder[Call] = msgspec.msgpack.Decoder(Call)
_result_decoder = msgspec.msgpack.Decoder(Result)
_welcome_decoder = msgspec.msgpack.Decoder(Welcome)
_end_decoder = msgspec.msgpack.Decoder(End)


def encode_frame(kind: FrameKind, body: bytes | memoryview) -> bytes:
    return _HEADER.pack(kind, len(body)) + bytes(body)


def call_frame(call: Call) -> bytes:
    return encode_frame(FrameKind.CALL, _call_encoder.encode(call))


def result_frame(result: Result | Welcome) -> bytes:
    return encode_frame(FrameKind.RESULT, _call_encoder.encode(result))


def end_frame(code: str, message: str) -> bytes:
    return encode_frame(FrameKind.END, _call_encoder.encode(End(code[:256], message[:2048])))


def data_parts(data: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
    """``data`` as DATA frames of at most MAX_CHUNK bytes each, as headers and views
    into ``data`` (for a vectored write: the bytes are not copied)."""
    view = memoryview(data).cast("B")
    parts: list[bytes | memoryview] = []
    for start in range(0, len(view), MAX_CHUNK):
        chunk = view[start : start + MAX_CHUNK]
        parts += (_HEADER.pack(FrameKind.DATA, len(chunk)), chunk)
    return parts


def data_frames(data: bytes | memoryview) -> list[bytes]:
    """``data`` as DATA frames of at most MAX_CHUNK bytes each."""
    view = memoryview(data)
    return [
        _HEADER.pack(FrameKind.DATA, len(view[i : i + MAX_CHUNK])) + view[i : i + MAX_CHUNK]
        for i in range(0, len(view), MAX_CHUNK)
    ]


def _decode(decoder: msgspec.msgpack.Decoder[T], body: bytes | memoryview, what: str) -> T:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid CUDA {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable CUDA {what}: {exc}") from None


def decode_call(body: bytes | memoryview) -> Call:
    return _decode(_call_decoder, body, "call")


def decode_result(body: bytes | memoryview) -> Result:
    return _decode(_result_decoder, body, "result")


def decode_welcome(body: bytes | memoryview) -> Welcome:
    return _decode(_welcome_decoder, body, "welcome")


def decode_end(body: bytes | memoryview) -> End:
    return _decode(_end_decoder, body, "session end")


class FrameDecoder:
    """Bytes in, whole frames out; refuses a frame over its kind's limit.

    A body is kept as the pieces it arrived in and joined once, when whole: a
    1 MiB chunk of a copy is copied once here, however the reads cut it.
    """

    def __init__(self, *, data_pieces: bool = False) -> None:
        self._header = bytearray()
        self._kind: FrameKind | None = None
        self._want = 0
        self._got = 0
        self._pieces: list[bytes | memoryview] = []
        self._data_pieces = data_pieces
        """Hand a DATA body out in the pieces it arrives in, as views into the bytes
        fed (never joined, never copied): for a caller that uses each piece before it
        feeds more bytes."""

    def _start(self, header: bytes | bytearray) -> None:
        kind_byte, length = _HEADER.unpack(header)
        try:
            kind = FrameKind(kind_byte)
        except ValueError:
            raise ProtocolError(f"unknown CUDA frame kind {kind_byte}") from None
        limit = MAX_CHUNK if kind is FrameKind.DATA else MAX_CALL
        if length > limit:
            raise ProtocolError(f"CUDA {kind.name} frame of {length} bytes over {limit}")
        self._kind, self._want, self._got, self._pieces = kind, length, 0, []

    def feed(self, data: bytes | memoryview) -> list[Frame]:
        view = memoryview(data)
        frames: list[Frame] = []
        pos, size = 0, len(view)
        while pos < size or (self._kind is not None and self._got == self._want):
            if self._kind is None:
                need = _HEADER.size - len(self._header)
                if not self._header and size - pos >= _HEADER.size:
                    self._start(view[pos : pos + _HEADER.size].tobytes())
                    pos += _HEADER.size
                else:
                    self._header += view[pos : pos + need]
                    pos += min(need, size - pos)
                    if len(self._header) < _HEADER.size:
                        break
                    header, self._header = self._header, bytearray()
                    self._start(header)
                continue
            take = min(self._want - self._got, size - pos)
            handed_out = self._data_pieces and self._kind is FrameKind.DATA
            if take:
                piece = view[pos : pos + take]
                if handed_out:
                    frames.append(Frame(FrameKind.DATA, piece))
                else:
                    self._pieces.append(piece)
                self._got += take
                pos += take
            if self._got == self._want:
                if not handed_out:
                    pieces = self._pieces
                    body = bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)
                    frames.append(Frame(self._kind, body))
                self._kind, self._pieces, self._want, self._got = None, [], 0, 0
        # Pieces still waiting point into ``data``: unless it is immutable, keep a copy
        # the caller cannot change.
        if self._pieces and not isinstance(data, bytes):
            self._pieces = [bytes(piece) for piece in self._pieces]
        return frames

    @property
    def buffered(self) -> int:
        return len(self._header) + self._got
