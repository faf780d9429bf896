"""Every message GPUMesh sends between nodes, with its limits.

One stream carries one request. On a stream, bytes are frames (see
:mod:`gpumesh.protocol.framing`); a ``MESSAGE`` frame holds one msgpack-encoded
message from the union below. Messages from peers are decoded leniently
(unknown fields are ignored, so a newer peer can add fields) but every field
has a size bound, and frames have a hard size limit.

Protocol versions: ``PROTOCOL_VERSION`` names the message set and is exchanged
in ``SessionProof`` (or ``Hello``); a node refuses a peer whose major version it
does not speak. The connection's ALPN names how its first stream proves the
dialer's key: :data:`ALPN` (a ``SessionProof`` bound to the TLS session, sent
with the first request) or :data:`ALPN_CHALLENGE` (``Hello``, ``Challenge``,
``Proof``: the previous release's, kept so a peer one version behind connects).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from gpumesh.errors import FrameTooLargeError, ProtocolError
from gpumesh.protocol.listing import MAX_RECORD_BYTES

__all__ = [
    "ALPN",
    "ALPNS",
    "ALPN_CHALLENGE",
    "JOB_ID_PATTERN",
    "MAX_ADDRESS_QUERY",
    "MAX_DATA_FRAME",
    "MAX_JOB_MOUNTS",
    "MAX_MESSAGE_FRAME",
    "MAX_OUTPUTS_WAIT",
    "MAX_OUTPUT_FILES",
    "OUTPUTS_FOLDER",
    "PROTOCOL_VERSION",
    "PULL_PROGRESS_EVERY",
    "AddressAnswer",
    "AddressQuery",
    "AppJobDir",
    "AppJobDirReply",
    "AppNeeds",
    "AppSend",
    "AppSync",
    "AppSynced",
    "Challenge",
    "ChannelDeclined",
    "ChannelGet",
    "ChannelOffer",
    "ChannelPut",
    "CudaOpen",
    "CudaOpened",
    "DesktopOpen",
    "DesktopOpened",
    "DirGet",
    "DirPut",
    "ExecExit",
    "ExecResize",
    "ExecStart",
    "ExecStarted",
    "FileDone",
    "FileGet",
    "FileInfo",
    "FilePut",
    "FileResume",
    "FileStat",
    "GpuReport",
    "Hello",
    "ImagePull",
    "JobAccepted",
    "JobCancel",
    "JobLogs",
    "JobMount",
    "JobOutput",
    "JobQuery",
    "JobStatus",
    "JobSubmit",
    "Message",
    "OutputFile",
    "OutputsQuery",
    "OutputsReady",
    "Ping",
    "Pong",
    "Proof",
    "Refusal",
    "SessionProof",
    "SignedAddresses",
    "StatusReply",
    "StatusRequest",
    "ThroughputReply",
    "ThroughputRequest",
    "Welcome",
    "decode_message",
    "encode_message",
]

ALPN = "gpumesh/2"
"""Connections whose identity proof is bound to the TLS session (:class:`SessionProof`)."""
ALPN_CHALLENGE = "gpumesh/1"
"""Connections whose identity proof answers a provider's nonce (``Hello``/``Challenge``)."""
ALPNS = (ALPN, ALPN_CHALLENGE)
"""What a node offers and accepts, preferred first."""
PROTOCOL_VERSION = 1

MAX_MESSAGE_FRAME = 64 * 1024
"""Largest encoded message frame; control messages are small."""
MAX_DATA_FRAME = 1024 * 1024
"""Largest raw data frame in a bulk section."""
MAX_THROUGHPUT_TEST = 4 * 1024**3
"""Most bytes one throughput test may push at a provider."""

Name = Annotated[str, msgspec.Meta(max_length=64)]
Text = Annotated[str, msgspec.Meta(max_length=2048)]
Code = Annotated[str, msgspec.Meta(max_length=64)]
Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Signature = Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class _Msg(msgspec.Struct, tag_field="t", frozen=True):
    pass


# --- authentication (first stream of every connection) -------------------------


class SessionProof(_Msg, tag="session_proof", frozen=True):
    """Dialer -> provider, alone on the first stream of a :data:`ALPN` connection:
    who I am, proven by a signature over this TLS session's binding (see
    :mod:`gpumesh.protocol.handshake`). Requests may follow at once on other streams."""

    version: int
    """The dialer's protocol version."""
    public_key: Key
    """The dialer's raw Ed25519 public key."""
    name: Name
    """The dialer's node name (informational; the key is what counts)."""
    signature: Signature
    """Ed25519 over the session transcript: binding, provider key, dialer key."""
    fec_mac: bool = False
    """The dialer takes parity-protected datagrams in authenticated frames
    (:mod:`gpumesh.protocol.fec`); absent from older dialers. Those said ``fec``
    for the untagged frames, which this version neither reads nor sends: such a
    dialer gets no FEC."""


class Hello(_Msg, tag="hello", frozen=True):
    """Dialer -> provider on a :data:`ALPN_CHALLENGE` connection: who I claim to be."""

    version: int
    """The dialer's protocol version."""
    public_key: Key
    """The dialer's raw Ed25519 public key."""
    name: Name
    """The dialer's node name (informational; the key is what counts)."""


class Challenge(_Msg, tag="challenge", frozen=True):
    """Provider -> dialer: sign this to prove you hold that key."""

    nonce: Nonce
    """32 fresh random bytes chosen by the provider for this connection."""
    version: int
    """The provider's protocol version."""


class Proof(_Msg, tag="proof", frozen=True):
    """Dialer -> provider: signature over the challenge and both keys."""

    signature: Signature


class Welcome(_Msg, tag="welcome", frozen=True):
    """Provider -> dialer: identity proven and access granted."""

    name: Name
    """The provider's node name."""
    fec_mac: bool = False
    """The provider takes parity-protected datagrams in authenticated frames
    (:mod:`gpumesh.protocol.fec`), said only to a dialer that offered them; absent
    from older providers (whose ``fec`` named the untagged frames: no FEC with them)."""
    relays: bool = False
    """The provider relays sessions between peers it has paired and allowed
    (``relay_for_peers``): the dialer may register with it as with a relay."""


class Refusal(_Msg, tag="refusal", frozen=True):
    """Either way: the request is refused; ``code`` is a stable error code."""

    code: Code
    message: Text


# --- requests (one stream each, after authentication) ---------------------------


class Ping(_Msg, tag="ping", frozen=True):
    """Round-trip probe."""

    sent: float
    """The dialer's clock when sent (echoed back)."""


class Pong(_Msg, tag="pong", frozen=True):
    sent: float
    """Echo of ``Ping.sent``."""
    time: float
    """The provider's wall clock, to spot clock skew."""


class StatusRequest(_Msg, tag="status", frozen=True):
    """Ask a provider what it is and whether it takes work."""


class GpuReport(msgspec.Struct, frozen=True):
    """One GPU of a provider, as placement needs it."""

    index: int
    name: Name
    memory_total: Count
    memory_used: Count
    """Bytes in use by anything on the machine."""
    available: Count
    """Bytes a new job may still ask for: free memory minus what running jobs
    reserved, capped by the provider's --max-vram."""
    utilization: int | None
    """Percent, when the provider can tell."""
    jobs: Count
    """GPUMesh jobs running on this GPU."""
    owner: Annotated[str, msgspec.Meta(max_length=255)] = ""
    """The provider's owner is using this GPU (``reclaim_on_gpu_use``): the names of
    the owner's processes on it; it takes no guest work (``available`` is 0) until
    offered again. Empty: it is offered (absent from older providers)."""


class StatusReply(_Msg, tag="status_reply", frozen=True):
    name: Name
    node_id: Name
    version: Name
    """GPUMesh version of the provider."""
    sharing: bool
    """Whether the provider is accepting work."""
    uptime: float
    """Seconds since the provider agent started."""
    gpu_source: Name = ""
    """``nvml``, ``nvidia-smi``, ``simulated`` or ``none``."""
    gpus: Annotated[list[GpuReport], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=list
    )
    running_jobs: Count = 0
    max_vram: Count = 0
    """The provider's per-job GPU memory cap in bytes; 0: none."""
    container_gpus: bool = True
    """False: the provider's Docker cannot give its GPUs to containers (no NVIDIA
    container toolkit), so its jobs run without them (absent from older providers)."""
    paused: bool = False
    """The provider's owner paused sharing (``gpumesh pause``): it takes no jobs,
    shells or CUDA sessions until ``gpumesh resume``."""


class ThroughputRequest(_Msg, tag="throughput", frozen=True):
    """Dialer sends ``size`` bytes of data frames after this; provider discards them."""

    size: Annotated[int, msgspec.Meta(ge=0, le=MAX_THROUGHPUT_TEST)]


class ThroughputReply(_Msg, tag="throughput_reply", frozen=True):
    received: Count
    seconds: float


# --- jobs -------------------------------------------------------------------------

# Patterns end in \Z, not $: msgspec matches them with Python's re, where $ also
# matches before a final newline ("abcdefgh\n" would pass as a job id).
JOB_ID_PATTERN = r"^[a-z0-9]{8,32}\Z"
JobId = Annotated[str, msgspec.Meta(pattern=JOB_ID_PATTERN)]
Arg = Annotated[str, msgspec.Meta(max_length=8192)]
EnvKey = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")]
# No NUL: Docker's refusal of one quotes the whole variable, value included, into logs.
EnvValue = Annotated[str, msgspec.Meta(max_length=32768, pattern=r"^[^\x00]*\Z")]
PULL_PROGRESS_EVERY = 0.5
"""Fewest seconds between two ``ImagePull`` messages of one request."""
MAX_OUTPUT_CHUNK = 32 * 1024
"""Largest piece of job output in one JobOutput message."""


MAX_JOB_MOUNTS = 8
"""Most sandbox folders one job may mount."""


class JobMount(msgspec.Struct, frozen=True):
    """A folder of the submitter's sandbox to mount into its job."""

    source: Annotated[str, msgspec.Meta(max_length=4096)]
    """The folder, as a path in the sandbox (``/datasets``)."""
    target: Annotated[str, msgspec.Meta(max_length=4096)]
    """Where the job sees it (``/data``): absolute, not over the container's own paths."""
    rw: bool = False
    """False: read-only."""


class JobSubmit(_Msg, tag="job_submit", frozen=True):
    """Run a job. A DATA section with the workdir tar follows when ``workdir_bytes``."""

    job_id: JobId
    """Chosen by the consumer, so a resubmission after a dropped link is recognised."""
    image: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    command: Annotated[list[Arg], msgspec.Meta(max_length=1024)]
    env: Annotated[dict[EnvKey, EnvValue], msgspec.Meta(max_length=256)]
    workdir_bytes: Count
    """Exact size of the workdir tar that follows; 0: no workdir."""
    gpu_memory: Count
    """GPU memory the job needs, in bytes; 0: any GPU if there is one, else none."""
    retries: Annotated[int, msgspec.Meta(ge=0, le=20)]
    timeout: Annotated[float, msgspec.Meta(ge=0)]
    """Seconds per attempt; 0: no limit."""
    attach: bool
    """Stream the job's events on this stream after acceptance."""
    gpu: Annotated[str, msgspec.Meta(max_length=16)] = ""
    """The GPU (index) placement chose; empty: the provider picks."""
    sandbox_dir: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    """A folder in the submitter's sandbox on the provider (``/apps/NAME``) to
    mount as the working directory instead of an uploaded one; empty: none."""
    credited: bool = False
    """With ``attach``: send the job's events inside one DATA section, paced by the
    consumer's credit (:mod:`gpumesh.protocol.joboutput`); false: one message each,
    unpaced, as consumers before this field expect."""
    channel: bool = False
    """The workdir tar may take a data channel: a ChannelOffer may come before
    JobAccepted (see :class:`ChannelOffer`)."""
    mounts: Annotated[list[JobMount], msgspec.Meta(max_length=MAX_JOB_MOUNTS)] = []
    """Sandbox folders to mount into the job. A provider from before this field
    ignores it: the consumer finds that out from ``JobAccepted.mounts``."""
    pull_progress: bool = False
    """``ImagePull`` messages may come before ``JobAccepted`` while the provider
    pulls the image (a consumer from before this field would not expect them)."""
    hashes: Hashes = msgspec.field(default_factory=list)
    """With ``channel``: the hashes the consumer can check the workdir's tar with
    over a data channel; the provider names its pick in ``ChannelOffer.hash``.
    Empty (a consumer from before this field): SHA-256."""
    knows_preempted: bool = False
    """The requester knows the final state ``preempted``; a consumer from before it
    (False) is told ``failed``, with the same message."""
    outputs: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    """A container path (``/workspace/out``) where the provider mounts a folder of
    the submitter's sandbox (``/gpumesh-outputs/JOB_ID``) whose finished files the
    consumer fetches as the job runs (:class:`OutputsQuery`); empty: none. A
    provider from before this field ignores it: ``JobAccepted.outputs`` tells."""
    epoch: Count = 0
    """The hop's fencing epoch: raised by the submitter each time it moves the job to
    another provider (1 for the first; 0: a submitter that does not move jobs). A
    provider that holds the job id under another epoch refuses it."""
    attempts_before: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0
    """Starts the job made on providers before this one: the job's attempt N here is
    its start ``attempts_before + N`` (``GPUMESH_ATTEMPT``); above 0, the outputs
    folder holds what came home from them (``GPUMESH_RESUMED=1``), which the
    provider takes as already sent."""


class JobAccepted(_Msg, tag="job_accepted", frozen=True):
    job_id: JobId
    gpus: Annotated[list[Name], msgspec.Meta(max_length=64)]
    """GPUs assigned to the job (indexes); empty: CPU only."""
    provider: Name
    mounts: Annotated[list[str], msgspec.Meta(max_length=MAX_JOB_MOUNTS)] = []
    """The container paths of the ``JobSubmit.mounts`` this provider will mount,
    in order; empty from a provider that does not know mounts."""
    outputs: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    """``JobSubmit.outputs`` echoed by a provider that mounts it; empty from one
    that does not know outputs."""


class ImagePull(_Msg, tag="image_pull", frozen=True):
    """How the provider's pull of a requested image goes: sent before ``JobAccepted``
    (or ``ExecStarted``) to a requester that set ``pull_progress``, at most every
    ``PULL_PROGRESS_EVERY`` seconds and once when the pull ended. Figures are the
    engine's (compressed bytes of the layers it fetches; ``total`` grows as layer
    sizes become known)."""

    image: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    layers: Count
    layers_done: Count
    downloaded: Count
    total: Count
    done: bool = False


class JobOutput(_Msg, tag="job_output", frozen=True):
    seq: Count
    attempt: Count
    stream: Annotated[str, msgspec.Meta(pattern=r"^(stdout|stderr)\Z")]
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_OUTPUT_CHUNK)]
    offset: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """Where ``data`` starts in the job's output (stdout and stderr together, every
    attempt); -1: not known. A reader whose next expected offset is lower knows that
    the provider dropped the bytes between (its ``job_log_limit``)."""


class JobStatus(_Msg, tag="job_status", frozen=True):
    job_id: JobId
    seq: Count
    """Position in the job's event log (0 when not from the log)."""
    state: Annotated[str, msgspec.Meta(max_length=16)]
    attempt: Count
    exit_code: int | None
    message: Text
    time: float = 0.0
    """The provider's clock when the state was entered (0: unknown)."""
    peak_gpu_memory: Count = 0
    """Most GPU memory the job used at once so far, in bytes (0: unknown or none)."""
    started: float = 0.0
    """The provider's clock when the job last began running (0: not yet, or not told:
    only a reply to ``JobQuery`` says it)."""
    exited: bool | None = None
    """Whether the attempt's program exited on its own (``message`` then only repeats
    its exit code) rather than the job ending for a reason ``message`` gives (a
    timeout, a cancel, an error); None: not said (a provider before this field, an
    event stored before it, or a reply that is not a state change)."""
    epoch: Count = 0
    """The epoch of the copy this provider runs (``JobSubmit.epoch``; 0: a provider
    before fencing). The submitter applies a status only from the job's newest hop."""


class JobLogs(_Msg, tag="job_logs", frozen=True):
    """Stream a job's events after ``after_seq``; with ``follow`` until it ends."""

    job_id: JobId
    after_seq: Count
    follow: bool
    credited: bool = False
    """As ``JobSubmit.credited``: events inside one DATA section, paced by credit (the
    consumer then keeps its side of the stream open, to send CREDIT)."""
    knows_preempted: bool = False
    """The requester knows the final state ``preempted``; a consumer from before it
    (False) is told ``failed``, with the same message."""


class JobCancel(_Msg, tag="job_cancel", frozen=True):
    job_id: JobId
    knows_preempted: bool = False
    """The requester knows the final state ``preempted``; a consumer from before it
    (False) is told ``failed``, with the same message."""
    moved: bool = False
    """The submitter moved the job to another provider: stop this copy (it ends
    ``cancelled``, saying so) and drop its outputs not yet sent."""


class JobQuery(_Msg, tag="job_query", frozen=True):
    """Where a job stands now: answered with one ``JobStatus`` (``seq``: its last event),
    or refused ``not_found`` when the provider no longer knows the job."""

    job_id: JobId
    knows_preempted: bool = False
    """The requester knows the final state ``preempted``; a consumer from before it
    (False) is told ``failed``, with the same message."""


MAX_OUTPUT_FILES = 1000
"""Most files one ``OutputsReady`` lists (the next query gets the rest)."""
MAX_OUTPUTS_WAIT = 60.0
"""Longest an ``OutputsQuery`` may wait for something new."""
OUTPUTS_FOLDER = "gpumesh-outputs"
"""The folder of a submitter's sandbox on its provider that holds its jobs' outputs
folders (``/gpumesh-outputs/JOB_ID``): where a moved job's outputs are restored."""


class OutputsQuery(_Msg, tag="outputs_query", frozen=True):
    """Consumer -> provider: the job's finished output files after ``after`` (a
    sequence number of ``OutputFile.seq``), waiting up to ``wait`` seconds for one
    when there is none yet. Only the job's submitter may ask. Answered by one
    ``OutputsReady``."""

    job_id: JobId
    after: Count = 0
    wait: Annotated[float, msgspec.Meta(ge=0, le=MAX_OUTPUTS_WAIT)] = 0.0
    release: bool = False
    """Everything the job wrote has been fetched (after ``OutputsReady.final``): the
    provider may delete the outputs folder, freeing the peer's file_quota."""


class OutputFile(msgspec.Struct, frozen=True):
    """One file of a job's outputs, finished (closed after writing, or renamed into
    place) when the provider recorded it."""

    seq: Count
    """Its place in the job's outputs; a file written again gets a new one."""
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    """Relative to the outputs folder, ``/``-separated."""
    size: Count
    mtime: float
    """As ``FileInfo.mtime`` says it: the file changed since when they differ."""


class OutputsReady(_Msg, tag="outputs_ready", frozen=True):
    files: Annotated[list[OutputFile], msgspec.Meta(max_length=MAX_OUTPUT_FILES)]
    """In ``seq`` order, after the query's ``after``; bounded (ask again for more)."""
    final: bool
    """The job ended and its outputs' last scan is done: with ``files`` nothing more
    comes (more of them may wait for the next query when the list was full)."""
    folder: Annotated[str, msgspec.Meta(max_length=4096)]
    """The outputs folder in the submitter's sandbox (``/gpumesh-outputs/JOB_ID``):
    where ``FileGet`` finds ``folder/path``."""
    more: bool = False
    """``files`` was cut at the reply's bound: ask again at once."""
    epoch: Count = 0
    """The epoch of the copy whose outputs these are (``JobSubmit.epoch``; 0: a
    provider before fencing): the submitter takes files only from the newest hop."""


# --- files (paths are relative to the peer's sandbox on the provider) ---------------

RemotePath = Annotated[str, msgspec.Meta(max_length=4096)]
Digest = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
"""A hash of a whole file or tar, with the algorithm its transfer chose (see
:mod:`gpumesh.files.hashing`); sent in fields named ``sha256``, which is what
it always is with a peer from before the choice."""
HashName = Annotated[str, msgspec.Meta(max_length=16)]
Hashes = Annotated[list[HashName], msgspec.Meta(max_length=8)]
"""The hashes a requester can check, preferred first; empty (an older peer): SHA-256."""
SourceId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{1,64}\Z")]


class FileStat(_Msg, tag="file_stat", frozen=True):
    """What is at ``path`` in my sandbox?"""

    path: RemotePath


class FileInfo(_Msg, tag="file_info", frozen=True):
    path: RemotePath
    exists: bool
    kind: Annotated[str, msgspec.Meta(pattern=r"^(file|dir|)\Z")]
    size: Count
    """Bytes of a file; for a directory, the exact size of its tar."""
    mode: Annotated[int, msgspec.Meta(ge=0, le=0o7777)]
    mtime: float
    hash: HashName = ""
    """Answering FileGet, ChannelGet or DirGet: the hash the provider picked from the
    request's ``hashes`` for FileDone; empty (an older provider): SHA-256."""


class FilePut(_Msg, tag="file_put", frozen=True):
    """Upload a file; DATA frames from the offset in FileResume follow, then (without
    ``sha256``) the consumer's FileDone; the provider verifies the whole file's hash
    before renaming it into place, and answers FileDone."""

    path: RemotePath
    size: Count
    mode: Annotated[int, msgspec.Meta(ge=0, le=0o7777)]
    digest: Digest | None = msgspec.field(default=None, name="sha256")
    """SHA-256 of the whole file, known before sending: what an older consumer sends
    (and what an older provider requires). None: the hash comes in FileDone after
    the bytes, with the algorithm the provider picked from ``hashes``."""
    source: Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{1,64})?\Z")] = ""
    """As ``ChannelPut.source``, with ``digest`` None: partials of both paths are
    kept under the same key, so either path resumes what the other left."""
    hashes: Hashes = msgspec.field(default_factory=list)


class FileResume(_Msg, tag="file_resume", frozen=True):
    """Provider -> consumer: send from this offset (a kept partial upload)."""

    offset: Count
    hash: HashName = ""
    """Answering FilePut or DirPut: the hash picked from the request's ``hashes``;
    empty (an older provider, or a FilePut with ``sha256``): SHA-256."""


class FileGet(_Msg, tag="file_get", frozen=True):
    """Download a file from ``offset``; the provider answers FileInfo, DATA, FileDone."""

    path: RemotePath
    offset: Count
    hashes: Hashes = msgspec.field(default_factory=list)


class FileDone(_Msg, tag="file_done", frozen=True):
    size: Count
    digest: Digest = msgspec.field(name="sha256")
    """Hash of the whole file (or tar), for the receiver to verify, with the
    algorithm the request's first answer named."""


class DirPut(_Msg, tag="dir_put", frozen=True):
    """Upload a folder as a tar of exactly ``size`` bytes (DATA follows FileResume(0))."""

    path: RemotePath
    size: Count
    hashes: Hashes = msgspec.field(default_factory=list)
    channel: bool = False
    """The tar may take a data channel: a ChannelOffer may come before FileResume."""


class DirGet(_Msg, tag="dir_get", frozen=True):
    """Download a folder as a tar: FileInfo (kind dir, size of the tar), DATA, FileDone."""

    path: RemotePath
    hashes: Hashes = msgspec.field(default_factory=list)
    channel: bool = False
    """The tar may take a data channel: a ChannelOffer may come before FileInfo."""


# --- the data channel: file bytes over TLS/TCP, opened by the QUIC request ---------

Ticket = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


class ChannelPut(_Msg, tag="channel_put", frozen=True):
    """Upload a file over a data channel. The provider answers ChannelOffer; the bytes
    from its offset go over the channel; the consumer then sends FileDone (size and
    hash of the whole file, hashed while sending) and the provider, once the file
    matches, answers FileDone."""

    path: RemotePath
    size: Count
    mode: Annotated[int, msgspec.Meta(ge=0, le=0o7777)]
    source: SourceId
    """Names the local file (its identity, size and mtime, hashed) so that a
    dropped upload resumes only from a partial of the same file."""
    hashes: Hashes = msgspec.field(default_factory=list)


class ChannelGet(_Msg, tag="channel_get", frozen=True):
    """Download a file from ``offset`` over a data channel: the provider answers
    FileInfo and ChannelOffer, sends the bytes over the channel, then FileDone."""

    path: RemotePath
    offset: Count
    hashes: Hashes = msgspec.field(default_factory=list)


class ChannelOffer(_Msg, tag="channel_offer", frozen=True):
    """Provider -> consumer: connect with TLS to this port of the address the QUIC
    session uses, within a few seconds, and send ``ticket`` first.

    Also the answer to a tar request that asked for a channel (``DirPut``,
    ``DirGet``, ``JobSubmit``, ``AppSend`` with ``channel``): it comes right
    before the request's usual first answer, and the tar's exact bytes then
    cross the channel; after them the sender sends FileDone (size and hash of
    the tar) on the QUIC stream. A consumer that cannot connect answers
    ChannelDeclined instead, and the tar goes as DATA on the stream, as
    without a channel. A provider that opens none (an older one, or
    ``data_channel off``) sends no offer."""

    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    ticket: Ticket
    """32 random bytes, good for one connection of this request only."""
    offset: Count
    """Where the bytes on the channel start in the file (a resumed copy)."""
    hash: HashName = ""
    """Answering ChannelPut, or a JobSubmit that listed ``hashes``: the hash picked
    from its ``hashes``; empty (an older provider): SHA-256. (A ChannelGet's is
    in the FileInfo before.)"""


class ChannelDeclined(_Msg, tag="channel_declined", frozen=True):
    """Consumer -> provider: the offered channel could not be opened; the tar goes as
    DATA on this stream instead."""

    reason: Annotated[str, msgspec.Meta(max_length=512)] = ""


# --- apps: a project folder kept in sync in the sandbox's /apps/NAME ----------------

MAX_APP_LIST = 64 * 1024 * 1024
"""Largest manifest or file list of an app sync (sent as DATA, JSON)."""
AppName = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
ManifestDigest = Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{64})?\Z")]


class AppSync(_Msg, tag="app_sync", frozen=True):
    """Sync ``/apps/NAME``: DATA follows with the manifest, ``manifest_bytes`` of JSON
    (``{"files": [[path, size, mode, sha256 hex], ...]}``); the provider answers AppNeeds."""

    name: AppName
    """One folder name: no ``/``, no ``..``."""
    manifest_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_APP_LIST)]
    dry_run: bool = False
    """Only answer AppNeeds: nothing is sent or changed."""
    base: ManifestDigest = ""
    """Not empty: the DATA is a delta (``{"put": [[path, size, mode, sha256 hex], ...],
    "remove": [path, ...]}``) against the manifest with this digest, the one the
    provider applied last time (see :mod:`gpumesh.files.manifest`)."""
    digest: ManifestDigest = ""
    """The digest of the whole manifest the consumer holds (with ``base``)."""


class AppNeeds(_Msg, tag="app_needs", frozen=True):
    """Provider -> consumer: what it lacks; DATA of ``list_bytes`` JSON follows
    (``{"need": [path, ...], "delete": [path, ...]}``)."""

    need: Count
    delete: Count
    unchanged: Count
    list_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_APP_LIST)]
    rebase: bool = False
    """The delta's base is not what the provider holds: nothing follows, and the
    consumer syncs again with the whole manifest."""


class AppSend(_Msg, tag="app_send", frozen=True):
    """Consumer -> provider: a tar of exactly ``size`` bytes with the needed files follows."""

    size: Count
    channel: bool = False
    """The tar may take a data channel: a ChannelOffer may come before FileResume."""


class AppSynced(_Msg, tag="app_synced", frozen=True):
    """Provider -> consumer: the sync is applied."""

    received: Count
    """Bytes of tar received."""
    written: Count
    deleted: Count
    unchanged: Count


class AppJobDir(_Msg, tag="app_job_dir", frozen=True):
    """Where in my sandbox is the working folder of my job ``job_id``?"""

    job_id: JobId


class AppJobDirReply(_Msg, tag="app_job_dir_reply", frozen=True):
    path: RemotePath
    """The folder, from the sandbox root (``/apps/NAME``)."""


# --- exec: an interactive shell in a fresh container -------------------------------


class ExecStart(_Msg, tag="exec_start", frozen=True):
    """Start a container with a TTY; then DATA frames carry terminal bytes both ways."""

    image: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    command: Annotated[list[Arg], msgspec.Meta(max_length=1024)]
    env: Annotated[dict[EnvKey, EnvValue], msgspec.Meta(max_length=256)]
    tty: bool
    rows: Annotated[int, msgspec.Meta(ge=0, le=10000)]
    cols: Annotated[int, msgspec.Meta(ge=0, le=10000)]
    pull_progress: bool = False
    """As ``JobSubmit.pull_progress``, before ``ExecStarted``."""
    gpu_memory: Count = 0
    """GPU memory the shell needs, in bytes, held for it while it is open; 0: no GPU.
    A provider from before this field opens the shell without one: the consumer
    finds that out from ``ExecStarted.gpus``."""


class ExecStarted(_Msg, tag="exec_started", frozen=True):
    provider: Name
    gpus: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    """GPUs given to the shell (indexes); empty: none."""


class ExecResize(_Msg, tag="exec_resize", frozen=True):
    rows: Annotated[int, msgspec.Meta(ge=1, le=10000)]
    cols: Annotated[int, msgspec.Meta(ge=1, le=10000)]


class ExecExit(_Msg, tag="exec_exit", frozen=True):
    exit_code: int


# --- desktop: one TCP connection to the desktop server the owner shared ---------------

DesktopKindName = Annotated[str, msgspec.Meta(max_length=16)]
"""A :class:`gpumesh.protocol.desktop.DesktopKind`: ``vnc``, ``rdp`` or ``tcp``; a
newer peer's other name is shown as it is."""


class DesktopOpen(_Msg, tag="desktop_open", frozen=True):
    """Consumer -> provider: connect one TCP connection to the desktop server its owner
    shared (never an address the consumer names). After ``DesktopOpened``, DATA frames
    carry the connection's bytes both ways; an empty DATA frame ends that direction
    (TCP half-close); FIN follows once both directions ended."""

    probe: bool = False
    """Only check (allowed, shared, the server listens) and answer, then end: what
    ``desktop connect`` asks first to pick its local port."""
    channel: bool = False
    """Ask for a data channel (TLS on TCP, as ``cp``'s) to carry the connection's bytes
    instead of DATA frames: the path is direct and the consumer has not found the
    provider's channels blocked."""
    framing: int = 0
    """Sealed-frame version 1 (keys bound to the channel's ``tls-unique``), which
    a consumer from before version 2 offers; never agreed now, so always 0 here."""
    sealing: int = 0
    """The sealed-frame version, from 2 on (keys bound to this QUIC session), the
    consumer speaks on that channel after its TLS handshake and ticket (0: TLS
    records only). A field of its own: a provider that knows only ``framing``
    answers it (with 1, whatever higher version is offered) and never reads this."""


class DesktopOpened(_Msg, tag="desktop_opened", frozen=True):
    provider: Name
    kind: DesktopKindName
    """What the owner shared: ``vnc``, ``rdp`` or ``tcp``."""
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    """The provider's local port (for the consumer's messages; it never picks it)."""
    channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Where the provider listens for this connection's data channel (0: none offered;
    DATA frames carry it). The consumer connects within a few seconds from the
    address of the QUIC session, pins the provider's key, sends ``channel_ticket``
    first; or sends ``ChannelDeclined`` and DATA frames carry it after all."""
    channel_ticket: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    framing: int = 0
    """Sealed-frame version 1, as a provider from before version 2 agreed to it;
    never agreed now, so always 0 here (a consumer refuses any other answer)."""
    sealing: int = 0
    """The sealed-frame version (2 on) both ends switch the channel to once each sent
    32 random bytes through its TLS (0: TLS records carry it)."""


# --- CUDA remoting: one session per stream ------------------------------------------


class CudaOpen(_Msg, tag="cuda_open", frozen=True):
    """Open a CUDA session on the provider with ``memory`` bytes of device memory
    (held for it while it is open). After ``CudaOpened``, DATA frames carry the
    CUDA call protocol both ways (:mod:`gpumesh.protocol.cuda`); the consumer's
    FIN ends the session and frees its memory."""

    memory: Annotated[int, msgspec.Meta(ge=1)]
    version: int = 1
    """The CUDA call protocol the consumer speaks."""


class CudaOpened(_Msg, tag="cuda_opened", frozen=True):
    provider: Name
    backend: Name
    """``driver`` (a GPU) or ``fallback`` (host memory)."""
    device: Name
    """The GPU's name, or ``host-memory fallback``."""
    memory: Count
    """Bytes held for the session."""
    detail: Text = ""
    """The driver version, or why the fallback."""
    gpus: Annotated[list[Name], msgspec.Meta(max_length=64)] = []


# --- discovery among paired peers: current addresses, signed by their nodes ----------

MAX_ADDRESS_QUERY = 12
"""Most node ids one ``AddressQuery`` names and most records one ``AddressAnswer``
hands on: with the answering node's own, 13 records of at most 4 KiB each fit a frame."""

SignedBytes = Annotated[bytes, msgspec.Meta(max_length=MAX_RECORD_BYTES)]


class SignedAddresses(msgspec.Struct, frozen=True):
    """A :class:`gpumesh.protocol.listing.AddressRecord` exactly as its node signed it
    (the registry's format): the receiver checks the signature against the key it
    pinned for that node, never against anything the sender says."""

    record: SignedBytes
    signature: Signature


class AddressQuery(_Msg, tag="address_query", frozen=True):
    """Asker -> a paired peer: your current address record, and the records of these
    nodes (by id) that you are paired with and that handed you theirs to pass on."""

    node_ids: Annotated[list[Name], msgspec.Meta(max_length=MAX_ADDRESS_QUERY)] = []
    mine: SignedAddresses | None = None
    """The asker's own record, only when it asked to be findable (announce_addresses):
    the peer may then hand it on to its other paired peers that ask for it."""


class AddressAnswer(_Msg, tag="address_answer", frozen=True):
    own: SignedAddresses
    """The answering node's own record, signed by its key."""
    findable: bool = False
    """Whether the answering node asked to be findable: only then may the asker hand
    ``own`` on to its other peers."""
    peers: Annotated[list[SignedAddresses], msgspec.Meta(max_length=MAX_ADDRESS_QUERY)] = []
    """Records of asked-for nodes, each as that node signed it; omitted: not known,
    not paired there, or not findable (the answer never says which)."""


class AppPrepare(_Msg, tag="app_prepare", frozen=True):
    """Consumer -> provider, on a stream of its own, as an ``AppSync`` of the app
    begins: the provider may start walking ``/apps/NAME`` while the consumer
    scans its folder, for the ``AppSync`` that follows. Nothing answers it (a
    provider that does not know it refuses that stream, and nothing else)."""

    name: AppName
    dry_run: bool = False


Message = (
    SessionProof
    | Hello
    | Challenge
    | Proof
    | Welcome
    | Refusal
    | Ping
    | Pong
    | StatusRequest
    | StatusReply
    | ThroughputRequest
    | ThroughputReply
    | JobSubmit
    | JobAccepted
    | ImagePull
    | JobOutput
    | JobStatus
    | JobLogs
    | JobCancel
    | JobQuery
    | OutputsQuery
    | OutputsReady
    | FileStat
    | FileInfo
    | FilePut
    | FileResume
    | FileGet
    | FileDone
    | DirPut
    | DirGet
    | ChannelPut
    | ChannelGet
    | ChannelOffer
    | ChannelDeclined
    | AppSync
    | AppNeeds
    | AppSend
    | AppSynced
    | AppPrepare
    | AppJobDir
    | AppJobDirReply
    | ExecStart
    | ExecStarted
    | ExecResize
    | ExecExit
    | DesktopOpen
    | DesktopOpened
    | CudaOpen
    | CudaOpened
    | AddressQuery
    | AddressAnswer
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode_message(message: Message) -> bytes:
    data = _encoder.encode(message)
    if len(data) > MAX_MESSAGE_FRAME:
        raise FrameTooLargeError(
            f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_FRAME}-byte limit"
        )
    return data


def decode_message(data: bytes | memoryview) -> Message:
    if len(data) > MAX_MESSAGE_FRAME:
        raise FrameTooLargeError(
            f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_FRAME}-byte limit"
        )
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"peer sent an invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"peer sent an undecodable message: {exc}") from None
    except RecursionError:
        raise ProtocolError("peer sent a message nested too deeply") from None
