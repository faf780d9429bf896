"""The CUDA call protocol and the worker's session, without I/O: bytes in, bytes out,
on the host-memory fallback (the backend every machine has)."""

from __future__ import annotations

import array

import pytest

from gpumesh.agent.cudaworker import CallServer, _write_all
from gpumesh.errors import ProtocolError
from gpumesh.gpu.cudabackend import CudaFault, pack_arg
from gpumesh.gpu.cudafallback import FallbackBackend, ptx_entries
from gpumesh.gpu.cudakernels import VADD_F32, VADD_PTX
from gpumesh.protocol.cuda import (
    MAX_CHUNK,
    VERSION,
    Arg,
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
    call_frame,
    data_frames,
    data_parts,
    decode_result,
    decode_welcome,
    encode_frame,
)

MiB = 1024 * 1024


class Client:
    """A test's side of one session: calls in, parsed answers out."""

    def __init__(self, cap: int = 64 * MiB) -> None:
        self.backend = FallbackBackend(cap, "no GPU in tests")
        self.server = CallServer(self.backend, cap)
        self.decoder = FrameDecoder()
        welcome = self.frames(call_frame(Hello(version=VERSION, client="test")))
        assert [f.kind for f in welcome] == [FrameKind.RESULT]
        self.welcome = decode_welcome(welcome[0].body)

    def frames(self, *chunks: bytes):  # type: ignore[no-untyped-def]
        out = []
        for chunk in chunks:
            for reply in self.server.feed(chunk):
                out.extend(self.decoder.feed(reply))
        return out

    def call(self, call) -> Result:  # type: ignore[no-untyped-def]
        frames = self.frames(call_frame(call))
        assert frames[0].kind is FrameKind.RESULT
        return decode_result(frames[0].body)

    def quiet(self, call) -> None:  # type: ignore[no-untyped-def]
        assert self.frames(call_frame(call)) == []  # never answered

    def upload(self, ptr: int, data: bytes) -> None:
        assert self.frames(call_frame(CopyHtoD(ptr=ptr, size=len(data))), *data_frames(data)) == []

    def download(self, ptr: int, size: int) -> tuple[Result, bytes]:
        frames = self.frames(call_frame(CopyDtoH(ptr=ptr, size=size)))
        result = decode_result(frames[0].body)
        assert all(f.kind is FrameKind.DATA for f in frames[1:])
        return result, b"".join(f.body for f in frames[1:])


def floats(values: list[float]) -> bytes:
    return array.array("f", values).tobytes()


def test_the_welcome_says_what_runs_the_calls() -> None:
    client = Client(cap=8 * MiB)
    assert client.welcome.backend == "fallback"
    assert client.welcome.device == "host-memory fallback"
    assert client.welcome.detail == "no GPU in tests"
    assert client.welcome.memory_cap == 8 * MiB
    assert client.call(DeviceCount()).value == 1
    props = client.call(DeviceProps(device=0)).props
    assert props["name"] == "host-memory fallback" and props["memory_total"] == 8 * MiB
    assert client.call(DeviceProps(device=3)).error == "CUDA_ERROR_INVALID_DEVICE"


def test_every_memory_call_on_the_fallback() -> None:
    client = Client()
    a = client.call(MemAlloc(size=3 * MiB + 5)).value
    b = client.call(MemAlloc(size=3 * MiB + 5)).value
    assert a and b and b >= a + 3 * MiB + 5  # no overlap
    payload = bytes(range(256)) * (12 * 1024) + b"12345"  # 3 MiB + 5: four chunks
    client.upload(a, payload)
    result, back = client.download(a, len(payload))
    assert result.value == len(payload) and back == payload
    client.quiet(CopyDtoD(dst=b, src=a, size=len(payload)))
    client.quiet(Memset(ptr=b + 10, value=0xAB, size=20))
    _, copied = client.download(b, 64)
    assert copied == payload[:10] + b"\xab" * 20 + payload[30:64]
    _, tail = client.download(a + MiB, 16)  # a pointer inside an allocation
    assert tail == payload[MiB : MiB + 16]
    client.quiet(MemFree(ptr=a))
    assert client.call(Synchronize()).error == ""
    assert client.call(CopyDtoH(ptr=a, size=4)).error == "CUDA_ERROR_INVALID_VALUE"


def test_a_failed_call_that_is_not_answered_surfaces_at_the_next_answer_only() -> None:
    client = Client()
    client.quiet(MemFree(ptr=0x1234))  # not an allocation: no answer now
    client.quiet(Memset(ptr=0x1234, value=1, size=1))  # a second failure: the first one wins
    result = client.call(Synchronize())
    assert result.error == "CUDA_ERROR_INVALID_VALUE" and "0x1234" in result.message
    assert client.call(Synchronize()).error == ""  # reported once


def test_a_copy_to_a_bad_pointer_still_consumes_its_bytes() -> None:
    client = Client()
    client.upload(0x99, b"x" * (MAX_CHUNK + 10))
    assert client.call(DeviceCount()).error == "CUDA_ERROR_INVALID_VALUE"
    assert client.call(DeviceCount()).value == 1  # the stream stayed in step


def test_the_memory_cap_is_out_of_memory() -> None:
    client = Client(cap=4_000_000)
    assert client.call(MemAlloc(size=3_000_000)).value
    over = client.call(MemAlloc(size=2_000_000))
    assert over.error == "CUDA_ERROR_OUT_OF_MEMORY"
    assert over.message == "2MB more would pass this session's cap of 4MB (3MB allocated)"
    assert client.call(MemAlloc(size=0)).error == "CUDA_ERROR_INVALID_VALUE"


def test_the_demo_kernel_runs_by_name_and_other_ptx_is_refused() -> None:
    client = Client()
    n = 1000
    left = [float(i) for i in range(n)]
    right = [0.5 * i for i in range(n)]
    a, b, c = (client.call(MemAlloc(size=n * 4)).value for _ in range(3))
    client.upload(a, floats(left))
    client.upload(b, floats(right))
    module = client.call(ModuleLoad(ptx=VADD_PTX.encode())).value
    args = [Arg("ptr", a), Arg("ptr", b), Arg("ptr", c), Arg("u32", n)]
    # 4 blocks of 256: threads past n do nothing, as on a GPU.
    client.quiet(Launch(module=module, name=VADD_F32, grid=(4, 1, 1), block=(256, 1, 1), args=args))
    assert client.call(Synchronize()).error == ""
    _, out = client.download(c, n * 4)
    assert array.array("f", out).tolist() == [x + y for x, y in zip(left, right, strict=True)]

    other = b".version 6.0\n.target sm_50\n.visible .entry my_kernel()\n{ ret; }\n"
    refused = client.call(ModuleLoad(ptx=other))
    assert refused.error == "CUDA_ERROR_NOT_SUPPORTED"
    assert "cannot run PTX (my_kernel)" in refused.message
    assert client.call(ModuleLoad(ptx=b"// nothing")).error == "CUDA_ERROR_INVALID_PTX"

    client.quiet(Launch(module=module, name="nope", grid=(1, 1, 1), block=(1, 1, 1), args=[]))
    assert client.call(Synchronize()).error == "CUDA_ERROR_NOT_FOUND"
    client.quiet(Launch(module=99, name=VADD_F32, grid=(1, 1, 1), block=(1, 1, 1), args=args))
    assert client.call(Synchronize()).error == "CUDA_ERROR_INVALID_HANDLE"
    client.quiet(Launch(module=module, name=VADD_F32, grid=(1, 1, 1), block=(1, 1, 1), args=[]))
    assert client.call(Synchronize()).error == "CUDA_ERROR_INVALID_VALUE"


def test_the_shipped_ptx_is_low_isa_and_names_its_kernel() -> None:
    assert VADD_PTX.startswith(".version 6.0\n.target sm_50\n")
    assert ptx_entries(VADD_PTX.encode()) == [VADD_F32]


def test_arguments_are_packed_as_the_kernel_reads_them() -> None:
    assert pack_arg("u32", 7) == b"\x07\0\0\0"
    assert pack_arg("ptr", 0x1122334455667788) == bytes.fromhex("8877665544332211")
    assert pack_arg("f32", 1.0) == b"\0\0\x80\x3f"
    assert pack_arg("i64", -1) == b"\xff" * 8
    with pytest.raises(CudaFault, match="does not fit a u32"):
        pack_arg("u32", -1)
    with pytest.raises(CudaFault, match="unknown argument kind"):
        pack_arg("u8", 1)


def test_a_session_must_start_with_hello_and_speak_its_version() -> None:
    backend = FallbackBackend(MiB, "")
    with pytest.raises(ProtocolError, match="must start with Hello"):
        list(CallServer(backend, MiB).feed(call_frame(DeviceCount())))
    server = CallServer(backend, MiB)
    [reply] = server.feed(call_frame(Hello(version=VERSION + 1)))
    welcome = decode_welcome(FrameDecoder().feed(reply)[0].body)
    assert welcome.error == "CUDA_ERROR_NOT_SUPPORTED" and "upgrade" in welcome.detail


def test_malformed_frames_are_protocol_errors() -> None:
    client = Client()
    with pytest.raises(ProtocolError, match="no copy announced"):
        list(client.server.feed(data_frames(b"stray")[0]))
    with pytest.raises(ProtocolError, match="unknown CUDA frame kind 9"):
        FrameDecoder().feed(b"\x09\0\0\0\0")
    with pytest.raises(ProtocolError, match="DATA frame of"):
        FrameDecoder().feed(bytes([FrameKind.DATA]) + (MAX_CHUNK + 1).to_bytes(4, "big"))
    with pytest.raises(ProtocolError, match="invalid CUDA call"):
        list(Client().server.feed(encode_frame(FrameKind.CALL, b"\x81\xa2op\xa4nope")))
    with pytest.raises(ProtocolError, match="may not send CUDA RESULT"):
        list(Client().server.feed(encode_frame(FrameKind.RESULT, b"")))


def test_frames_split_anywhere_decode_the_same() -> None:
    stream = call_frame(MemAlloc(size=5)) + b"".join(data_frames(b"abc" * 1000))
    whole = FrameDecoder().feed(stream)
    decoder = FrameDecoder()
    pieces = [f for i in range(0, len(stream), 7) for f in decoder.feed(stream[i : i + 7])]
    assert pieces == whole and decoder.buffered == 0


def test_data_pieces_come_as_views_of_what_was_fed_never_joined() -> None:
    data = bytes(range(256)) * 40
    stream = call_frame(MemAlloc(size=5)) + b"".join(data_parts(data)) + call_frame(Synchronize())
    decoder = FrameDecoder(data_pieces=True)
    buffer = bytearray(3000)  # one read buffer, reused as the worker reuses its own
    got, calls = bytearray(), []
    for start in range(0, len(stream), len(buffer)):
        count = len(stream[start : start + len(buffer)])
        buffer[:count] = stream[start : start + count]
        for frame in decoder.feed(memoryview(buffer)[:count]):
            if frame.kind is FrameKind.DATA:
                assert isinstance(frame.body, memoryview) and frame.body.obj is buffer
                got += frame.body  # used before the buffer is refilled
            else:
                calls.append(bytes(frame.body))
    assert got == data and decoder.buffered == 0
    assert calls == [f.body for f in FrameDecoder().feed(stream) if f.kind is FrameKind.CALL]


def test_a_copy_fed_in_odd_reads_of_a_reused_buffer_lands_whole() -> None:
    client = Client()
    ptr = client.call(MemAlloc(size=3 * MiB)).value
    data = bytes(range(251)) * (3 * MiB // 251)
    stream = call_frame(CopyHtoD(ptr=ptr, size=len(data))) + b"".join(data_parts(data))
    buffer = bytearray(100_003)
    for start in range(0, len(stream), len(buffer)):
        piece = stream[start : start + len(buffer)]
        buffer[: len(piece)] = piece
        assert list(client.server.feed(memoryview(buffer)[: len(piece)])) == []
    result, back = client.download(ptr, len(data))
    assert result.value == len(data) and back == data


def test_data_parts_are_data_frames_without_the_copy() -> None:
    data = bytearray(b"xyz" * (MiB // 2))
    parts = data_parts(data)
    assert b"".join(parts) == b"".join(data_frames(bytes(data)))
    assert all(isinstance(part, bytes) for part in parts[::2])
    assert all(isinstance(p, memoryview) and p.obj is data for p in parts[1::2])


def test_vectored_writes_send_every_part_in_order() -> None:
    import os
    import threading

    read_end, write_end = os.pipe()
    parts: list[bytes | memoryview] = [
        bytes([i % 251]) * (i * 37 % 5000) for i in range(300)
    ]  # more parts than one writev takes, some empty
    got = bytearray()

    def drain() -> None:
        while chunk := os.read(read_end, 65536):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        _write_all(write_end, [memoryview(p) for p in parts])
    finally:
        os.close(write_end)
        reader.join(10)
        os.close(read_end)
    assert got == b"".join(parts)
