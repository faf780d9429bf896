"""Getting a job to its provider: the steps of :func:`gpumesh.client.jobs.run_job`
before the job's events come.

Where a group's job goes, the session it is submitted on, the refusal of a
provider that took it without its mounts, and its workdir: over the data
channel the provider offered, else as DATA frames on the job's stream, and on
a detached submit, held until the provider has it all. The data channel's and
the packer's modules are imported only when a workdir is sent: a job without
one loads none of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, NoReturn, TypeVar

from gpumesh.client.bulk import NoChannel, send_tar
from gpumesh.client.files import STALL_TIMEOUT
from gpumesh.client.groups import members
from gpumesh.client.placement import Placement, place
from gpumesh.errors import GPUMeshError, LimitError, ProtocolError, error_from_code
from gpumesh.files.hashing import offered, taken
from gpumesh.files.transfer import NoHash, tar_chunks
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import JobCancel, Refusal, decode_message

if TYPE_CHECKING:
    from gpumesh.client.jobs import JobCallbacks, JobResult
    from gpumesh.client.node import Node
    from gpumesh.files.pack import PackPlan
    from gpumesh.protocol.messages import ChannelOffer
    from gpumesh.store.peers import Peer
    from gpumesh.transport.session import Session
    from gpumesh.transport.stream import Stream

__all__ = ["place_in_group", "refuse_unmounted", "send_workdir", "session_with", "until_received"]

T = TypeVar("T")


async def place_in_group(
    node: Node, group: str, gpu_memory: int, *, leaving: frozenset[str] = frozenset()
) -> Placement:
    """Probe the group's other members and choose where a job goes; never on a
    member in ``leaving`` (node ids: the providers a moved job left)."""

    views = [v for v in members(node, group) if not v.is_self]
    views = [v for v in views if v.peer is None or v.peer.node_id not in leaving]
    if leaving and not views:
        raise LimitError("every other member of the group already had the job")
    return await place(node, [(v.name, v.peer if v.usable else None) for v in views], gpu_memory)


@contextlib.asynccontextmanager
async def session_with(
    node: Node, peer: Peer, session: Session | None, first: Callable[[Session], Awaitable[T]]
) -> AsyncGenerator[tuple[Session, T], None]:
    """``session`` (left open) when given, else a new one closed on exit (or a warm
    one, on which ``first`` is sent again should it die under it), with what
    ``first``, a request safe to send twice, answered on it."""
    if session is not None:
        yield session, await first(session)
        return
    async with node.session_for(peer.node_id, first) as lent:
        yield lent


async def refuse_unmounted(
    session: Session, peer_name: str, job_id: str, stream: Stream, what: str = "mount"
) -> NoReturn:
    """A provider from before mounts (or outputs: ``what``) accepted a job without
    them: cancel it, say so."""
    stream.abort()
    with contextlib.suppress(GPUMeshError):
        await session.request(JobCancel(job_id=job_id, knows_preempted=True), timeout=60)
    doing, flag = (
        ("mount folders into jobs", "--mount")
        if what == "mount"
        else ("bring a job's outputs home", "--outputs")
    )
    raise ProtocolError(
        f"{peer_name} runs an older GPUMesh that cannot {doing} "
        f"(job {job_id} was cancelled there): ask its owner to upgrade, or run without {flag}"
    )


async def send_workdir(
    node: Node,
    session: Session,
    peer: Peer,
    stream: Stream,
    channel: tuple[ChannelOffer | None, NoChannel | None],
    plan: PackPlan,
    size: int,
    callbacks: JobCallbacks,
    result: JobResult,
) -> None:
    """The workdir's tar: over the offered data channel, else as DATA on the stream."""

    offer, no_channel = channel
    sent = 0

    def progress(count: int) -> None:
        nonlocal sent
        sent += count
        callbacks.upload(sent, size)

    if offer is not None:
        # The offer names the hash picked from JobSubmit's list (none: SHA-256).
        hash_name = taken(offer.hash, offered())
        args = (node, session, peer, stream, offer, plan, size, hash_name, progress, STALL_TIMEOUT)
        if await send_tar(*args) is not None:
            result.workdir_channel = "tls"
            return
        no_channel = NoChannel.FAILED
    elif no_channel is None:
        no_channel = NoChannel.NOT_OFFERED
    result.workdir_channel = "quic"
    result.workdir_no_channel = no_channel
    await _upload(stream, plan, size, callbacks.upload)


async def _upload(
    stream: Stream, plan: PackPlan, total: int, progress: Callable[[int, int], None]
) -> None:
    """Stream the workdir tar with constant memory, packed on a thread.

    ``tar_chunks`` stops its packing thread when this ends early (the link
    dropped under ``send_data``), so a failed upload raises instead of waiting
    for a thread blocked on a queue nothing reads any more.
    """

    sent = 0
    async with contextlib.aclosing(tar_chunks(plan, NoHash())) as chunks:
        async for chunk in chunks:
            await stream.send_data(chunk)
            sent += len(chunk)
            progress(sent, total)
    stream.end_data()
    if sent != total:
        raise ProtocolError(f"the workdir changed while it was sent ({sent} of {total} bytes)")


async def until_received(stream: Stream) -> None:
    """Wait for the provider to end a detached submit: then it holds the whole workdir
    (closing the session sooner cuts the upload off), or it says why not."""
    while (frame := await stream.read_frame()) is not None:
        if frame.kind is FrameKind.MESSAGE:
            message = decode_message(frame.body)
            if isinstance(message, Refusal):
                raise error_from_code(message.code, message.message)
