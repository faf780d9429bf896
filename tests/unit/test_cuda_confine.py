"""What a CUDA session may cost the provider, without a worker process: the
fallback's calls hold no more than a chunk beyond the session's memory, the
worker's user, environment and address-space ceiling are decided as the
security model says, and CUDA sessions count against ``share_memory``.

The host-memory fallback stands in for the GPU (these machines have none)."""

from __future__ import annotations

import array
import tracemalloc
from collections.abc import Callable

import pytest

from gpumesh.agent.cuda import worker_argv, worker_environment
from gpumesh.agent.cudaconfine import HEADROOM, address_space_ceiling, worker_ids
from gpumesh.agent.limits import Admission, Claim, Kind
from gpumesh.client.owner import worker_user_note
from gpumesh.errors import LimitError
from gpumesh.gpu.cudabackend import Allocations, CudaFault
from gpumesh.gpu.cudafallback import FallbackBackend
from gpumesh.gpu.cudakernels import VADD_F32, VADD_PTX
from gpumesh.store.limits import ShareLimits

MiB = 1024 * 1024
MB = 1000**2


def _peak(action: Callable[[], object]) -> int:
    """Bytes Python allocated at most while ``action`` ran, beyond what it held before."""
    tracemalloc.start()
    try:
        action()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def test_vector_add_on_the_fallback_holds_a_chunk_not_the_vectors_as_floats() -> None:
    """The attack: the fallback's vector add built Python lists of floats, so a
    733 MiB session peaked at 3.9 GB."""
    n = 2 * MiB  # 8 MiB per vector
    backend = FallbackBackend(32 * MiB, "no GPU in tests")
    a, b, c = (backend.alloc(n * 4) for _ in range(3))
    backend.write(a, array.array("f", range(n)).tobytes())
    backend.write(b, array.array("f", [0.5] * n).tobytes())
    module = backend.module_load(VADD_PTX.encode())
    args = [("ptr", a), ("ptr", b), ("ptr", c), ("u32", n)]
    peak = _peak(lambda: backend.launch(module, VADD_F32, (n // 256, 1, 1), (256, 1, 1), 0, args))
    assert peak < 4 * MiB  # half of one vector; the lists took over 100 MiB
    out = array.array("f", b"".join(backend.read(c, n * 4)))
    assert (out[0], out[12345], out[n - 1]) == (0.5, 12345.5, n - 0.5)


def test_memset_and_device_copies_on_the_fallback_copy_nothing_whole() -> None:
    backend = FallbackBackend(32 * MiB, "no GPU in tests")
    a, b = backend.alloc(12 * MiB), backend.alloc(12 * MiB)
    assert _peak(lambda: backend.memset(a, 0x5A, 12 * MiB)) < MiB
    assert _peak(lambda: backend.copy(b, a, 12 * MiB)) < MiB
    assert b"".join(backend.read(b + 12 * MiB - 3, 3)) == b"ZZZ"
    backend.copy(a + 1, a, 8)  # overlapping, within one allocation, as memmove
    backend.write(a, b"01234567")
    backend.copy(a + 1, a, 7)
    assert b"".join(backend.read(a, 8)) == b"00123456"


def test_sizes_are_checked_against_the_allocations_before_anything_is_touched() -> None:
    backend = FallbackBackend(MiB, "no GPU in tests")
    ptr = backend.alloc(4096)
    huge = 1 << 40  # the largest copy the call protocol carries
    for call in (
        lambda: backend.read(ptr, huge),
        lambda: backend.memset(ptr, 1, huge),
        lambda: backend.copy(ptr, ptr, huge),
    ):
        with pytest.raises(CudaFault, match=r"^CUDA_ERROR_INVALID_VALUE: \d+ bytes at 0x"):
            assert _peak(call) < MiB


def test_allocations_find_the_one_that_holds_a_range() -> None:
    books = Allocations(cap=10_000)
    books.add(1000, 100)
    books.add(5000, 200)
    assert books.span(1000, 100) == (1000, 0)
    assert books.span(5150, 50) == (5000, 150)
    for ptr, size in ((999, 1), (1050, 51), (1100, 1), (4000, 10), (5000, -1), (0, 0)):
        with pytest.raises(CudaFault, match="not inside one allocation"):
            books.span(ptr, size)
    with pytest.raises(
        CudaFault,
        match=r"CUDA_ERROR_OUT_OF_MEMORY: 9\.7KB more would pass this session's cap of 10KB",
    ):
        books.check_new(9_701)
    assert books.remove(1000) == 100 and books.used == 200
    with pytest.raises(CudaFault, match="0x3e8 is not an allocation"):
        books.remove(1000)


@pytest.mark.parametrize(
    ("job_user", "agent_uid", "ids"),
    [
        ("auto", 0, (47000, 47000)),
        ("1234", 0, (1234, 1234)),
        ("1234:99", 0, (1234, 99)),
        ("0", 0, (47000, 47000)),  # never root
        ("0:0", 0, (47000, 47000)),
        ("auto", 1000, None),  # not root: it cannot switch
        ("1234", 1000, None),
    ],
)
def test_the_worker_runs_as_job_user_when_the_agent_is_root(
    job_user: str, agent_uid: int, ids: tuple[int, int] | None
) -> None:
    assert worker_ids(job_user, agent_uid) == ids


def test_the_owner_is_told_in_one_line_when_the_worker_stays_the_agents_user() -> None:
    assert worker_user_note(0) is None
    note = worker_user_note(1000)
    assert note is not None and "\n" not in note
    assert note.startswith("CUDA workers run as the agent's own user (uid 1000, with its groups)")


def test_the_worker_gets_no_environment_of_the_agents() -> None:
    agent = {
        "GPUMESH_HOME": "/home/alice/.gpumesh",
        "GPUMESH_RELAY_TOKEN": "secret",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "PATH": "/home/alice/bin:/usr/bin",
        "PYTHONSTARTUP": "/tmp/evil.py",
        "PYTHONPATH": "/opt/gpumesh/src",
        "LD_PRELOAD": "/tmp/evil.so",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    }
    assert worker_environment([], agent) == {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": "/",
        "PYTHONPATH": "/opt/gpumesh/src",  # where the agent found its own code
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    }
    env = worker_environment(["GPU-1"], {})
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("GPU-1", "PCI_BUS_ID")
    argv = worker_argv(MiB, "fallback", (47000, 47001))
    assert argv[1:4] == ["-s", "-m", "gpumesh.agent.cudaworker"]  # no user site folder
    assert argv[-4:] == ["--uid", "47000", "--gid", "47001"]


def test_the_fallbacks_address_space_ceiling_is_its_memory_beyond_what_it_maps() -> None:
    assert address_space_ceiling(40 * MiB, 256 * MiB) == 40 * MiB + 256 * MiB + HEADROOM


def _limits(share_memory: int) -> ShareLimits:
    return ShareLimits(1.0, 256 * MB, share_memory, 4, 2, 8, 64, 0)


def test_cuda_sessions_count_against_share_memory_with_jobs_and_shells() -> None:
    """The attack: one CUDA-allowed peer held 4 sessions of 4 GiB, in no budget."""
    jobs: list[Claim] = [Claim("carol", Kind.JOB, 256 * MB)]
    admission = Admission(lambda: _limits(2 * 1000 * MB), lambda _limits: jobs, "alice")
    with admission.cuda("bob", 1000 * MB), admission.shell("carol"):
        kinds = sorted(claim.kind for claim in admission.claims())
        assert kinds == [Kind.CUDA, Kind.JOB, Kind.SHELL]
        with (
            pytest.raises(
                LimitError,
                match=r"^alice refused the CUDA session: 1.5GB of memory is promised to its "
                r"running jobs, shells and CUDA sessions, and this CUDA session's 500MB would "
                r"go over its share_memory of 2GB; ask for less \(--memory\) or try again "
                r"when one ends$",
            ),
            admission.cuda("bob", 500 * MB),
        ):
            pass
        with pytest.raises(LimitError, match="refused the job"):
            jobs.append(Claim("carol", Kind.JOB, 256 * MB))
            admission.admit_job("carol")  # the CUDA session's memory is counted here too
    assert [claim.kind for claim in admission.claims()] == [Kind.JOB, Kind.JOB]
