"""``RemoteDevice``: a provider's GPU (or its host-memory fallback) from Python.

A blocking client of the CUDA call protocol (:mod:`gpumesh.protocol.cuda`) on
one socket: either a socket pair whose other end a background thread carries
to the peer over this node's QUIC session (``RemoteDevice("alice-pc")``), or
a connection to a running ``gpumesh cuda bridge`` (``RemoteDevice.bridge(...)``).

Calls that return nothing (free, memset, copies to the device and between
device buffers, launch) are sent without waiting: a failure among them is
raised by the next call that returns something (``synchronize()`` at the
latest), as CUDA reports asynchronous errors. One device object is one session;
it is not for several threads at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumesh.client.cudaremote import DEFAULT_MEMORY, carry_socket
from gpumesh.client.node import Node
from gpumesh.errors import ConnectionLostError, CudaError, ProtocolError, error_from_code
from gpumesh.protocol.cuda import (
    MAX_CHUNK,
    VERSION,
    Arg,
    Call,
    CopyDtoD,
    CopyDtoH,
    CopyHtoD,
    DeviceCount,
    DeviceProps,
    FrameKind,
    Hello,
    Launch,
    MemAlloc,
    MemFree,
    Memset,
    ModuleLoad,
    Result,
    Synchronize,
    call_frame,
    decode_end,
    decode_result,
    decode_welcome,
)

__all__ = ["LOCAL_BUFFER", "DevicePointer", "Module", "RemoteDevice", "local_pair", "widen"]

_HEADER = struct.Struct(">BI")
_CLOSE_TIMEOUT = 10.0
LOCAL_BUFFER = 4 * 1024 * 1024
"""Socket buffers of a local CUDA connection: a program's copy crosses to the
thread that carries it in a few large pieces rather than many 200 KiB ones, each
waiting for the other thread's turn."""


def widen(sock: socket.socket) -> None:
    """Ask for :data:`LOCAL_BUFFER` socket buffers (the system may give less)."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, LOCAL_BUFFER)


def local_pair() -> tuple[socket.socket, socket.socket]:
    """A connected socket pair with wide buffers: a program's end and the carrier's."""
    mine, theirs = socket.socketpair()
    widen(mine)
    widen(theirs)
    return mine, theirs


Dims = int | tuple[int] | tuple[int, int] | tuple[int, int, int]


class DevicePointer(int):
    """An address in the remote device's memory (offsets stay pointers: ``ptr + 4``)."""

    def __add__(self, other: int) -> DevicePointer:
        return DevicePointer(int(self) + int(other))

    def __repr__(self) -> str:
        return f"DevicePointer({int(self):#x})"


class Module(int):
    """A module loaded on the remote device (from :meth:`RemoteDevice.load_module`)."""


def _dims(value: Dims) -> tuple[int, int, int]:
    items = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(items) <= 3 or any(not isinstance(v, int) or v < 1 for v in items):
        raise CudaError(f"grid and block are 1 to 3 positive ints, not {value!r}", "")
    padded = (*items, 1, 1)
    return padded[0], padded[1], padded[2]


def _arg(value: Any) -> Arg:
    """A Python value as a typed kernel argument: a DevicePointer is ``ptr``, an int
    ``i32`` (``i64`` past its range), a float ``f32``; ``("u32", 5)`` says the type."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        return Arg(value[0], value[1])
    if isinstance(value, DevicePointer):
        return Arg("ptr", int(value))
    if isinstance(value, bool):
        raise CudaError("a kernel argument cannot be a bool: pass ('u32', int(flag))")
    if isinstance(value, int):
        return Arg("i32" if -(2**31) <= value < 2**31 else "i64", value)
    if isinstance(value, float):
        return Arg("f32", value)
    raise CudaError(f"a kernel argument cannot be a {type(value).__name__}: {value!r}")


class RemoteDevice:
    """One CUDA session on a remote device."""

    def __init__(
        self,
        peer: str,
        *,
        memory: int | None = None,
        home: str | Path | None = None,
        client: str = "gpumesh.cuda",
    ) -> None:
        """Open a session on ``peer`` (a paired provider that allows you CUDA), with
        ``memory`` bytes of device memory held for it (default 1 GiB)."""

        node = Node(home)
        try:
            node.peer(peer)  # an unknown peer is an error here, in the caller's thread
        except BaseException:
            node.close()
            raise
        mine, theirs = local_pair()
        self.peer = peer
        self._thread: threading.Thread | None = threading.Thread(
            target=_carry_in_thread,
            args=(node, peer, memory or DEFAULT_MEMORY, theirs),
            name=f"gpumesh-cuda-{peer}",
            daemon=True,
        )
        self._thread.start()
        self._setup(mine, client)

    @classmethod
    def bridge(cls, address: str, *, client: str = "gpumesh.cuda") -> RemoteDevice:
        """A session through a running ``gpumesh cuda bridge`` at ``address``
        (``HOST:PORT`` or ``unix:PATH``)."""
        try:
            if address.startswith("unix:"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(address[5:])
                except OSError:
                    sock.close()
                    raise
            else:
                host, _, port = address.rpartition(":")
                sock = socket.create_connection((host.strip("[]"), int(port)))
        except (OSError, ValueError) as exc:
            raise ConnectionLostError(
                f"no CUDA bridge at {address}: {exc}; start one with "
                "`gpumesh cuda bridge --peer PEER --bind ADDRESS`"
            ) from None
        return cls.over_socket(sock, address, client=client)

    @classmethod
    def over_socket(
        cls, sock: socket.socket, name: str, *, client: str = "gpumesh.cuda"
    ) -> RemoteDevice:
        """A session on a connected socket that carries the call protocol (what the
        bridge serves; a benchmark carries one itself). ``name`` is for messages."""
        device = cls.__new__(cls)
        device.peer = name
        device._thread = None
        device._setup(sock, client)
        return device

    def _setup(self, sock: socket.socket, client: str) -> None:
        self._sock = sock
        self._closed = False
        self._modules: dict[bytes, Module] = {}
        try:
            self._greet(client)
        except BaseException:
            self.close()
            raise

    def _greet(self, client: str) -> None:
        self._send(call_frame(Hello(version=VERSION, client=client[:256])))
        kind, body = self._frame()
        if kind is not FrameKind.RESULT:
            raise ProtocolError(f"the CUDA session began with {kind.name}")
        welcome = decode_welcome(body)
        if welcome.error:
            raise CudaError(f"{welcome.error}: {welcome.detail}", welcome.error)
        self.backend = welcome.backend
        """``driver`` (a GPU) or ``fallback`` (host memory on the provider)."""
        self.name = welcome.device
        """The device's name: the GPU's, or ``host-memory fallback``."""
        self.detail = welcome.detail
        """The driver version, or why the provider uses the fallback."""
        self.memory_cap = welcome.memory_cap
        """Most bytes this session may allocate."""

    # --- the socket -----------------------------------------------------------------------

    def _send(self, *parts: bytes | memoryview) -> None:
        if self._closed:
            raise CudaError("this CUDA session is closed")
        try:
            for part in parts:
                self._sock.sendall(part)
        except OSError:
            self._raise_end()

    def _recv_into(self, view: memoryview) -> None:
        while view:
            try:
                count = self._sock.recv_into(view)
            except OSError as exc:
                raise ConnectionLostError(f"the CUDA session was lost: {exc}") from None
            if not count:
                self._closed = True
                raise ConnectionLostError(f"the CUDA session on {self.peer} ended")
            view = view[count:]

    def _frame(self) -> tuple[FrameKind, bytes]:
        header = bytearray(_HEADER.size)
        self._recv_into(memoryview(header))
        kind_byte, length = _HEADER.unpack(header)
        try:
            kind = FrameKind(kind_byte)
        except ValueError:
            raise ProtocolError(f"unknown CUDA frame kind {kind_byte}") from None
        body = bytearray(length)
        self._recv_into(memoryview(body))
        if kind is FrameKind.END:
            self._closed = True
            end = decode_end(bytes(body))
            raise error_from_code(end.code, end.message)
        return kind, bytes(body)

    def _raise_end(self) -> None:
        """The socket broke while sending: the END frame, if one came, says why."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        while True:
            self._frame()  # raises on END or at the end of the stream

    def _call(self, call: Call) -> Result:
        self._send(call_frame(call))
        kind, body = self._frame()
        if kind is not FrameKind.RESULT:
            raise ProtocolError(f"a CUDA call was answered with {kind.name}")
        result = decode_result(body)
        if result.error:
            raise CudaError(f"{result.error}: {result.message}", result.error)
        return result

    # --- calls ----------------------------------------------------------------------------

    def device_count(self) -> int:
        return self._call(DeviceCount()).value

    def properties(self, device: int = 0) -> dict[str, int | str]:
        """``name``, ``memory_total``, ``major``/``minor`` (compute capability),
        ``multiprocessors`` and ``backend``."""
        return dict(self._call(DeviceProps(device=device)).props)

    def alloc(self, size: int) -> DevicePointer:
        return DevicePointer(self._call(MemAlloc(size=size)).value)

    def free(self, ptr: int) -> None:
        self._send(call_frame(MemFree(ptr=int(ptr))))

    def memset(self, ptr: int, value: int, size: int) -> None:
        self._send(call_frame(Memset(ptr=int(ptr), value=value, size=size)))

    def copy_to(self, ptr: int, data: Any) -> None:
        """Host to device: ``data`` (bytes, bytearray, array, anything with the buffer
        protocol) at ``ptr``; sent in chunks without waiting."""
        view = memoryview(data).cast("B")
        self._send(call_frame(CopyHtoD(ptr=int(ptr), size=len(view))))
        for start in range(0, len(view), MAX_CHUNK):
            chunk = view[start : start + MAX_CHUNK]
            self._send(_HEADER.pack(FrameKind.DATA, len(chunk)), chunk)

    def copy_from(self, ptr: int, size: int) -> bytearray:
        """Device to host: ``size`` bytes at ``ptr``."""
        self._call(CopyDtoH(ptr=int(ptr), size=size))
        out = bytearray(size)
        view, done = memoryview(out), 0
        header = bytearray(_HEADER.size)
        while done < size:
            self._recv_into(memoryview(header))
            kind_byte, length = _HEADER.unpack(header)
            if kind_byte == FrameKind.END:
                body = bytearray(length)
                self._recv_into(memoryview(body))
                self._closed = True
                end = decode_end(bytes(body))
                raise error_from_code(end.code, end.message)
            if kind_byte != FrameKind.DATA or length > size - done:
                raise ProtocolError("a device-to-host copy's bytes did not arrive as announced")
            self._recv_into(view[done : done + length])
            done += length
        return out

    def copy_device(self, dst: int, src: int, size: int) -> None:
        """Device to device."""
        self._send(call_frame(CopyDtoD(dst=int(dst), src=int(src), size=size)))

    def load_module(self, ptx: str | bytes) -> Module:
        """Load PTX text (the same text is loaded once per session)."""
        text = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
        key = hashlib.sha256(text).digest()
        if key not in self._modules:
            self._modules[key] = Module(self._call(ModuleLoad(ptx=text)).value)
        return self._modules[key]

    def launch(
        self,
        module: Module | str | bytes,
        name: str,
        *,
        grid: Dims,
        block: Dims,
        args: Sequence[Any] = (),
        shared: int = 0,
    ) -> None:
        """Run kernel ``name`` of ``module`` (a loaded Module, or PTX text); asynchronous."""
        loaded = module if isinstance(module, Module) else self.load_module(module)
        call = Launch(
            module=int(loaded),
            name=name,
            grid=_dims(grid),
            block=_dims(block),
            args=[_arg(value) for value in args],
            shared=shared,
        )
        self._send(call_frame(call))

    def synchronize(self) -> None:
        """Wait for the device's work; raises the first error since the last answer."""
        self._call(Synchronize())

    # --- the session ----------------------------------------------------------------------

    def close(self) -> None:
        """End the session: the provider frees its memory."""
        if getattr(self, "_sock", None) is None or self._sock.fileno() < 0:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        self._sock.close()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(_CLOSE_TIMEOUT)

    def __enter__(self) -> RemoteDevice:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _carry_in_thread(node: Node, peer: str, memory: int, sock: socket.socket) -> None:
    try:
        asyncio.run(carry_socket(node, peer, memory, sock))
    finally:
        sock.close()
        node.close()
