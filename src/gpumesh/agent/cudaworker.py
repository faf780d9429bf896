"""The provider's CUDA worker: one process per session, running its calls.

:class:`CallServer` is the session without I/O: call-protocol bytes in
(:mod:`gpumesh.protocol.cuda`), answer bytes out, calls run on a
:class:`~gpumesh.gpu.cudabackend.Backend`. :func:`main` runs it on the process's
stdin and stdout, which the agent connects to the consumer's stream; a fault
or crash here (a bad kernel, a driver bug) ends this process, never the agent.
The first line on stderr is a JSON description of the backend, for the
agent's ``status``; later lines are log lines.

The worker never decides who may use CUDA or how much memory: the agent starts
it for an allowed peer with the cap it reserved and the user to run as, and
ends it on ``deny``. It confines itself to those (:mod:`gpumesh.agent.cudaconfine`)
before it reads the first call.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gpumesh.agent.cudaconfine import Confinement, address_space_ceiling, confine, mapped_now
from gpumesh.errors import ProtocolError
from gpumesh.gpu.cudabackend import Backend, CudaFault
from gpumesh.gpu.cudadriver import DriverBackend, DriverUnavailable, load_driver
from gpumesh.gpu.cudafallback import FallbackBackend
from gpumesh.protocol.cuda import (
    SYNC_CALLS,
    VERSION,
    Call,
    CopyDtoD,
    CopyDtoH,
    CopyHtoD,
    DeviceCount,
    DeviceProps,
    FrameDecoder,
    FrameKind,
    Hello,
    Launch,
    MemAlloc,
    MemFree,
    Memset,
    ModuleLoad,
    Result,
    Synchronize,
    Welcome,
    data_parts,
    decode_call,
    end_frame,
    result_frame,
)

__all__ = ["CallServer", "main", "open_backend"]


@dataclass
class _Upload:
    """A host-to-device copy whose bytes are still arriving."""

    ptr: int
    left: int
    failed: bool = False


class CallServer:
    """One session's calls, run in order on ``backend``."""

    def __init__(self, backend: Backend, memory_cap: int) -> None:
        self.backend = backend
        self.memory_cap = memory_cap
        self._decoder = FrameDecoder(data_pieces=True)
        self._greeted = False
        self._upload: _Upload | None = None
        self._pending: CudaFault | None = None
        """The first failure of a call that is not answered, for the next answer."""

    def feed(self, data: bytes | memoryview) -> Iterator[bytes | bytearray | memoryview]:
        """Bytes from the client; the bytes to send back, as they are made
        (ProtocolError when malformed; a CudaFault in the middle of a device-to-host
        copy's bytes, which ends the session).

        ``data`` may be a view the caller reuses once this is exhausted; what comes
        back may be views of device memory, to be sent before the next ``feed``,
        and a copy's pieces are read from the device as they are taken.
        """
        for frame in self._decoder.feed(data):
            if frame.kind is FrameKind.DATA:
                self._data(frame.body)
            elif frame.kind is FrameKind.CALL:
                if self._upload is not None:
                    raise ProtocolError("a CUDA call arrived in the middle of a copy's bytes")
                yield from self._call(decode_call(frame.body))
            else:
                raise ProtocolError(f"a client may not send CUDA {frame.kind.name} frames")

    def _data(self, body: bytes | memoryview) -> None:
        upload = self._upload
        if upload is None or len(body) > upload.left:
            raise ProtocolError("CUDA copy bytes arrived that no copy announced")
        if not upload.failed:
            try:
                self.backend.write(upload.ptr, body)
            except CudaFault as fault:
                upload.failed = True
                self._fail(fault)
        upload.ptr += len(body)
        upload.left -= len(body)
        if not upload.left:
            self._upload = None

    def _fail(self, fault: CudaFault) -> None:
        if self._pending is None:
            self._pending = fault

    def _call(self, call: Call) -> Iterable[bytes | bytearray | memoryview]:
        if isinstance(call, Hello):
            return [self._hello(call)]
        if not self._greeted:
            raise ProtocolError("a CUDA session must start with Hello")
        if isinstance(call, SYNC_CALLS):
            pending, self._pending = self._pending, None
            if pending is not None:
                return [result_frame(Result(error=pending.name, message=pending.message))]
            try:
                return self._answer(call)
            except CudaFault as fault:
                return [result_frame(Result(error=fault.name, message=fault.message))]
        if isinstance(call, CopyHtoD) and call.size:
            self._upload = _Upload(call.ptr, call.size)
            return []
        try:
            self._run(call)
        except CudaFault as fault:
            self._fail(fault)
        return []

    def _hello(self, call: Hello) -> bytes:
        backend = self.backend
        try:
            if call.version != VERSION:
                raise CudaFault(
                    "CUDA_ERROR_NOT_SUPPORTED",
                    f"this provider speaks CUDA call protocol {VERSION}, "
                    f"not {call.version}: upgrade the older side",
                )
            info = backend.device_info(0)
        except CudaFault as fault:
            return result_frame(
                Welcome(
                    version=VERSION,
                    backend=backend.name,
                    device="",
                    error=fault.name,
                    detail=fault.message[:2048],
                )
            )
        self._greeted = True
        return result_frame(
            Welcome(
                version=VERSION,
                backend=backend.name,
                device=info.name[:256],
                detail=backend.detail[:2048],
                memory_cap=self.memory_cap,
            )
        )

    def _answer(self, call: Call) -> Iterable[bytes | bytearray | memoryview]:
        backend = self.backend
        if isinstance(call, DeviceCount):
            return [result_frame(Result(value=backend.device_count()))]
        if isinstance(call, DeviceProps):
            info = backend.device_info(call.device)
            props: dict[str, int | str] = {
                "name": info.name[:256],
                "memory_total": info.memory_total,
                "major": info.major,
                "minor": info.minor,
                "multiprocessors": info.multiprocessors,
                "backend": backend.name,
            }
            return [result_frame(Result(props=props))]
        if isinstance(call, MemAlloc):
            return [result_frame(Result(value=backend.alloc(call.size)))]
        if isinstance(call, CopyDtoH):
            pieces = backend.read(call.ptr, call.size)  # checked, its first piece read
            return itertools.chain(
                (result_frame(Result(value=call.size)),),
                itertools.chain.from_iterable(map(data_parts, pieces)),
            )
        if isinstance(call, ModuleLoad):
            return [result_frame(Result(value=backend.module_load(call.ptx)))]
        assert isinstance(call, Synchronize)
        backend.synchronize()
        return [result_frame(Result())]

    def _run(self, call: Call) -> None:
        backend = self.backend
        if isinstance(call, MemFree):
            backend.free(call.ptr)
        elif isinstance(call, Memset):
            backend.memset(call.ptr, call.value, call.size)
        elif isinstance(call, CopyDtoD):
            backend.copy(call.dst, call.src, call.size)
        elif isinstance(call, Launch):
            args = [(arg.kind, arg.value) for arg in call.args]
            backend.launch(call.module, call.name, call.grid, call.block, call.shared, args)
        # CopyHtoD of 0 bytes: nothing to do


def open_backend(memory_cap: int, which: str = "auto") -> Backend:
    """The driver backend when ``which`` allows it and libcuda loads, else the fallback
    (whose ``detail`` says why)."""
    if which == "fallback":
        # Only the agent asks for it: when the provider has no NVIDIA GPU.
        return FallbackBackend(memory_cap, "the provider has no NVIDIA GPU")
    try:
        return DriverBackend(load_driver(), memory_cap)
    except DriverUnavailable as exc:
        if which == "driver":
            raise CudaFault("CUDA_ERROR_NO_DEVICE", str(exc)) from None
        return FallbackBackend(memory_cap, str(exc))


def _widen_pipes() -> None:
    """Ask for 1 MiB pipe buffers (Linux): a copy's chunks then cross in a few
    reads and writes instead of sixteen each."""
    try:
        import fcntl

        for fd in (0, 1):
            fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass  # not a pipe, or not Linux: the default size works, slower


_WRITEV_PARTS = 64
"""Parts per vectored write (well under any system's IOV_MAX): a copy's headers
and chunks, so at most 32 MiB of a device-to-host copy is held to be written
(none on the fallback, whose chunks are views of the session's memory)."""
_READ_SIZE = 1 << 20


def _write_all(fd: int, parts: Iterable[bytes | bytearray | memoryview]) -> None:
    """Write ``parts`` in order with vectored writes, taking at most
    :data:`_WRITEV_PARTS` of them at a time: a copy's chunks leave from device
    memory (or the driver's pieces) without being joined to their headers."""
    source = iter(parts)
    while batch := list(itertools.islice(source, _WRITEV_PARTS)):
        views = [memoryview(part).cast("B") for part in batch if len(part)]
        while views:
            written = os.writev(fd, views)
            while written:
                if written >= len(views[0]):
                    written -= len(views.pop(0))
                else:
                    views[0] = views[0][written:]
                    written = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpumesh.agent.cudaworker")
    parser.add_argument("--memory-cap", type=int, required=True)
    parser.add_argument("--backend", choices=("auto", "driver", "fallback"), default="auto")
    parser.add_argument("--uid", type=int, help="run as this uid (the agent is root)")
    parser.add_argument("--gid", type=int, help="with --uid: this gid, no other groups")
    options = parser.parse_args(argv)
    try:
        backend = open_backend(options.memory_cap, options.backend)
        info = backend.device_info(0)
    except CudaFault as fault:
        _write_all(1, [end_frame("cuda", f"{fault.name}: {fault.message}")])
        return 1
    buffer = bytearray(_READ_SIZE)  # each read lands here; its pieces are used at once
    view = memoryview(buffer)
    gid = options.uid if options.gid is None else options.gid
    ids = None if options.uid is None else (options.uid, gid)
    # Confined once the device is open (its libraries loaded, as the agent's user)
    # and before the first byte of a call is read.
    ceiling = (
        address_space_ceiling(mapped_now(), options.memory_cap) if backend.name == "fallback" else 0
    )
    try:
        confine(Confinement(ids, ceiling))
    except OSError as exc:
        backend.close()
        _write_all(1, [end_frame("cuda", f"the CUDA worker could not confine itself: {exc}")])
        return 1
    sys.stderr.write(
        json.dumps({"backend": backend.name, "device": info.name, "detail": backend.detail}) + "\n"
    )
    sys.stderr.flush()
    server = CallServer(backend, options.memory_cap)
    _widen_pipes()
    try:
        while count := os.readv(0, [buffer]):
            _write_all(1, server.feed(view[:count]))
    except ProtocolError as exc:
        _write_all(1, [end_frame("protocol", str(exc))])
        return 2
    except CudaFault as fault:  # in the middle of a copy's bytes: the stream is cut
        _write_all(1, [end_frame("cuda", f"{fault.name}: {fault.message}")])
        return 1
    except BrokenPipeError:
        return 0
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
