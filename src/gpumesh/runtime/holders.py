"""Network holders: containers that only hold a network namespace, started before
the job that will join it.

Docker spends most of a container's start on its network: a veth pair, an
address, and on a user-defined network (every filtered job network) its
embedded name server's rules inside the container. Measured here on Docker 20.10,
create+start+wait+remove of ``echo hi`` took ~285 ms on the default bridge,
~340 ms on a job network, and ~110 ms for a container that joins the namespace
of one already running (``network_mode: container:<id>``). So the runtime
keeps two spare *holders* per network a container was asked for: containers
on that network, with that container's name servers and IPv6 switched off as
a job's would be, that run nothing but a program that waits. The next
container for that network joins the oldest spare's namespace instead of
having one made, and a new spare is made in the background.

A holder serves exactly one container and is removed with it, so no two
containers (of one peer or of two) ever share a namespace, and nothing a job
left in one (a socket, a route it could not change anyway: jobs have no
capabilities) meets the next. The job network's rules filter by the bridge
interface, which a holder's traffic crosses like any container's. When no
spare is ready (the first container for a network before the share start's
spares are made, a burst of them), a container joins the network directly, as
it would without holders.

The holder image is made here, without a registry: a tar of one static
program of 129 bytes, written below as machine code (``pause(2)`` in a loop
on x86-64, ``ppoll(2)`` with nothing to wait for on arm64), imported as
``gpumesh/holder``. Engines of other architectures get no holders. A holder
runs as nobody with no capabilities, a read-only root, 16 MiB and 4
processes at most; it is stopped with SIGKILL (its program handles no
signal), so stopping the engine never waits for it.

Holders are labelled with the node they serve (not with ``io.gpumesh.node``,
whose containers the agent takes for jobs) and with a token of the run that
made them: a node's start removes those of an earlier run that no container
uses any more (:meth:`Holders.sweep`); a runtime that closes removes its
spares.
"""

from __future__ import annotations

import contextlib
import io
import logging
import secrets
import struct
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import docker

from gpumesh.errors import AgentError, GPUMeshError
from gpumesh.runtime.base import LABEL_KIND, LABEL_PREFIX

__all__ = [
    "HOLDER_IMAGE",
    "KIND_HOLDER",
    "LABEL_HOLDER_OF",
    "Holders",
    "Placement",
    "pause_program",
]

logger = logging.getLogger(__name__)

KIND_HOLDER = "holder"
LABEL_HOLDER_OF = f"{LABEL_PREFIX}.holder-of"
"""Label holding the node id a holder was made for."""
LABEL_HOLDER_RUN = f"{LABEL_PREFIX}.holder-run"
"""Label holding a token of the :class:`Holders` that made a holder: a sweep keeps
its own run's, made or being made."""
HOLDER_IMAGE = "gpumesh/holder:1"
_NAME_PREFIX = "gpumesh-net-"
_MEMORY = 16 * 1024 * 1024
_PIDS = 4
_JOIN = "container:"

# The program's instructions, by the engine's architecture (Docker's "Arch").
# x86-64: mov eax, 34 (pause); syscall; jmp back to the mov.
# arm64: x0..x3 = 0; x8 = 73 (ppoll); svc #0; b back to the first mov.
_CODE = {
    "amd64": (0x3E, bytes.fromhex("b8220000000f05ebf7")),
    "arm64": (
        0xB7,
        struct.pack(
            "<7I",
            0xD2800000,  # mov x0, #0
            0xD2800001,  # mov x1, #0
            0xD2800002,  # mov x2, #0
            0xD2800003,  # mov x3, #0
            0xD2800928,  # mov x8, #73
            0xD4000001,  # svc #0
            0x17FFFFFA,  # b -6 instructions
        ),
    ),
}


def pause_program(arch: str) -> bytes | None:
    """A static ELF executable that waits for signals forever, for Docker's
    architecture name ``arch``; None for one not written here.

    One ELF header, one loadable, executable segment (the whole file, mapped
    at 0x400000), and the code right after the headers as its entry point."""
    if arch not in _CODE:
        return None
    machine, code = _CODE[arch]
    base, header, segment = 0x400000, 64, 56
    size = header + segment + len(code)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, v1
    elf = ident + struct.pack(
        "<HHIQQQIHHHHHH",
        2,  # an executable
        machine,
        1,
        base + header + segment,  # entry point
        header,  # the segment table follows this header
        0,  # no sections
        0,
        header,
        segment,
        1,  # one segment
        0,
        0,
        0,
    )
    load = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, size, size, 0x1000)  # r-x
    return elf + load + code


_TRIES = 2
"""Starts of one spare holder before its maker gives up (and says so)."""


@dataclass(frozen=True)
class Placement:
    """What a holder is made for: a container on ``network`` with name servers
    ``dns`` (empty: the engine's), its IPv6 off or not, for ``node``."""

    network: str
    dns: tuple[str, ...]
    ipv6_off: bool
    node: str

    @property
    def sysctls(self) -> dict[str, str] | None:
        """The kernel settings of a namespace made for this placement (the holder's,
        or the container's own when it joins the network itself)."""
        return {"net.ipv6.conf.all.disable_ipv6": "1"} if self.ipv6_off else None


Engine = Callable[[str], contextlib.AbstractContextManager[Any]]
"""The runtime's engine access: a context manager yielding Docker's low-level
client for an action named in its errors."""


class Holders:
    """``SPARES`` spare holders per placement, made in the background, and the
    holder of every container that joined one (thread-safe: jobs start from many
    threads)."""

    SPARES = 2
    """Two: a job that follows another at once (a retry, a script's loop) finds
    the second while the first one's replacement is being made (~250 ms)."""

    def __init__(self, engine: Engine, arch: Callable[[], str]) -> None:
        self._engine = engine
        self._arch = arch
        self._lock = threading.Lock()
        self._spare: dict[Placement, list[str]] = {}
        """The oldest first."""
        self._making: dict[Placement, threading.Thread] = {}
        self._joined: dict[str, str] = {}
        """Container id -> the holder whose namespace it joined."""
        self._run = secrets.token_hex(8)
        self._program: bytes | None = None
        self._supported: bool | None = None
        self._closed = False

    def take(self, placement: Placement) -> str | None:
        """A running spare for ``placement``, now no longer spare, or None."""
        with self._lock:
            spares = self._spare.get(placement)
            if not spares:
                return None
            holder = spares.pop(0)
        try:
            with self._engine("look at a network holder") as api:
                running = bool(api.inspect_container(holder)["State"].get("Running"))
        except GPUMeshError:
            running = False
        if not running:  # stopped under us (an engine restart, a hand): not used
            self._remove(holder)
            return None
        return holder

    def spares(self) -> list[str]:
        """The spare holders there are now."""
        with self._lock:
            return [holder for spares in self._spare.values() for holder in spares]

    @staticmethod
    def network_mode(holder: str) -> str:
        return _JOIN + holder

    def joined(self, container_id: str, holder: str) -> None:
        """``container_id`` was made in ``holder``'s namespace: removed with it."""
        with self._lock:
            self._joined[container_id] = holder

    def adopt(self, container_id: str, network_mode: str) -> None:
        """A container found on the engine (a node's restart): remember its holder,
        if it joined one, so it is removed with the container."""
        if network_mode.startswith(_JOIN):
            self.joined(container_id, network_mode[len(_JOIN) :])

    def removed(self, container_id: str) -> None:
        """``container_id`` is gone: remove the holder it joined (blocking)."""
        with self._lock:
            holder = self._joined.pop(container_id, None)
        if holder is not None:
            self._remove(holder)

    @contextlib.contextmanager
    def unless_made(self, holder: str | None) -> Iterator[None]:
        """Around making a container in ``holder``'s namespace: should it fail,
        the holder is removed (it was taken, and serves no other container)."""
        try:
            yield
        except BaseException:
            if holder is not None:
                self._remove(holder)
            raise

    def replenish(self, placement: Placement, *, wait: float = 0) -> bool:
        """Make spares for ``placement`` in the background up to ``SPARES``; wait up
        to ``wait`` seconds for them. Whether one is ready."""
        with self._lock:
            maker = self._making.get(placement)
            short = len(self._spare.get(placement, ())) < self.SPARES
            # (Not on an engine already found to have no holder program: no thread
            # for nothing at every container.)
            wanted = short and not self._closed and self._supported is not False
            if maker is None and wanted:
                maker = threading.Thread(
                    target=self._make, args=(placement,), name="gpumesh-holder", daemon=True
                )
                self._making[placement] = maker
                maker.start()
        if maker is not None and wait > 0:
            maker.join(wait)
        with self._lock:
            return bool(self._spare.get(placement))

    def sweep(self, node: str) -> None:
        """Remove ``node``'s holders that an earlier run made (left by a crash or a
        kill) and no container joined. Blocking."""
        with self._engine("list network holders") as api:
            found = api.containers(all=True, filters={"label": f"{LABEL_HOLDER_OF}={node}"})
        with self._lock:
            joined = set(self._joined.values())
        for summary in found:
            holder = str(summary["Id"])
            ours = (summary.get("Labels") or {}).get(LABEL_HOLDER_RUN) == self._run
            if not ours and holder not in joined:
                self._remove(holder)

    def close(self) -> None:
        """Make no more spares; remove the spares there are (blocking)."""
        with self._lock:
            self._closed = True
            makers = list(self._making.values())
        for maker in makers:
            maker.join(timeout=30)
        for holder in self.spares():
            self._remove(holder)
        with self._lock:
            self._spare = {}

    # --- making and removing -------------------------------------------------------------

    def _make(self, placement: Placement) -> None:
        """The maker of ``placement``'s spares: one after another, until there are
        ``SPARES`` or making one failed twice in a row (the engine's runtime fails a
        start now and then, "cannot start a stopped process": a second try makes it)."""
        failed = 0
        try:
            while self._supports():
                with self._lock:
                    spares = self._spare.setdefault(placement, [])
                    if self._closed or len(spares) >= self.SPARES:
                        return
                try:
                    holder = self._start(placement)
                except GPUMeshError:
                    failed += 1
                    if failed >= _TRIES:
                        raise
                    continue
                failed = 0
                if not self._keep(spares, holder):  # closed while it was made
                    self._remove(holder)
                    return
        except GPUMeshError as exc:
            logger.warning("no network holder made for %s: %s", placement.network, exc)
        finally:
            with self._lock:
                self._making.pop(placement, None)

    def _keep(self, spares: list[str], holder: str) -> bool:
        with self._lock:
            if not self._closed:
                spares.append(holder)
            return not self._closed

    def _supports(self) -> bool:
        if self._supported is None:
            self._program = pause_program(self._arch())
            self._supported = self._program is not None
            if not self._supported:
                logger.info("no network holders on this engine's architecture")
        return self._supported

    def _start(self, placement: Placement) -> str:
        try:
            return self._create_and_start(placement)
        except _ImageMissing:
            self._import_image()  # the first holder on this engine, or the image was removed
        try:
            return self._create_and_start(placement)
        except _ImageMissing:
            raise AgentError(f"Docker lost the image {HOLDER_IMAGE} just imported") from None

    def _create_and_start(self, placement: Placement) -> str:
        with self._engine("make a network holder") as api:
            host_config = api.create_host_config(
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                read_only=True,
                pids_limit=_PIDS,
                mem_limit=_MEMORY,
                memswap_limit=_MEMORY,
                network_mode=placement.network,
                dns=list(placement.dns) or None,
                sysctls=placement.sysctls,
                log_config=docker.types.LogConfig(type="none"),
            )
            try:
                created = api.create_container(
                    image=HOLDER_IMAGE,
                    name=_NAME_PREFIX + secrets.token_hex(6),
                    user="65534:65534",
                    labels={
                        LABEL_KIND: KIND_HOLDER,
                        LABEL_HOLDER_OF: placement.node,
                        LABEL_HOLDER_RUN: self._run,
                    },
                    stop_signal="SIGKILL",
                    host_config=host_config,
                    detach=True,
                )
            except docker.errors.ImageNotFound as exc:
                raise _ImageMissing from exc
            holder = str(created["Id"])
        try:
            with self._engine("start a network holder") as api:
                api.start(holder)
        except GPUMeshError:
            self._remove(holder)
            raise
        logger.debug("network holder %s ready on %s", holder[:12], placement.network)
        return holder

    def _import_image(self) -> None:
        program = self._program
        assert program is not None
        with self._engine("make the network holder's image") as api:
            repository, tag = HOLDER_IMAGE.split(":")
            api.import_image_from_data(
                _one_file_tar("pause", program),
                repository=repository,
                tag=tag,
                changes=['CMD ["/pause"]'],
            )
        logger.info("made the image %s (network holders)", HOLDER_IMAGE)

    def _remove(self, holder: str) -> None:
        # (Gone already is as good: the engine's errors are GPUMesh errors here.)
        with contextlib.suppress(GPUMeshError), self._engine("remove a network holder") as api:
            api.remove_container(holder, force=True)


class _ImageMissing(Exception):
    pass


def _one_file_tar(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o555
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
