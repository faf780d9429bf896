"""The relay on real sockets: an asyncio adapter around :class:`RelayCore`.

What it owns: the UDP socket every node talks to, a second socket that sends
``ReachProbe`` from another port and answers a padded ``Hello`` there (so a
node can tell whether its NAT maps by destination), the clock, the periodic
tick, the bounded per-destination output queues and the stats file; with
``tcp_port`` set, the TCP listener too (:mod:`gpumesh.relay.tcp`): its
connections' packets meet the same core, and what the core sends to a TCP
address goes to its connection. The rules live in the core; nothing here
decides who may send what.

Why raw non-blocking sockets rather than a ``DatagramTransport``: asyncio's
transport buffers without bound when the socket would block, so one slow or
vanished client could grow memory and delay everyone. Here each destination
gets at most ``config.queue`` waiting packets, and the queues drain
round-robin.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpumesh.protocol.addresses import Address
from gpumesh.protocol.relay import DATA_HEADER, MAX_PACKET, T_DATA
from gpumesh.protocol.relaycore import TCP_PORT_BASE, RelayCore, Send, address_text, is_reach_probe
from gpumesh.relay.config import RelayConfig
from gpumesh.relay.tcp import HEAD_TIMEOUT, TcpListener, tls_context
from gpumesh.transport.udp import (
    GSO_MAX_BYTES,
    GSO_MAX_SEGMENTS,
    Received,
    UdpSocket,
    gso_control,
    gso_runs,
    open_udp_socket,
)

__all__ = ["RelayServer", "serve"]

logger = logging.getLogger(__name__)

TICK_INTERVAL = 0.25
STATS_INTERVAL = 1.0
_READ_BATCH = 256
_DATA_TYPE = bytes([T_DATA])
_SOL_UDP = 17
_UDP_GRO = 104


async def serve(
    config: RelayConfig,
    *,
    clock: Callable[[], float] = time.monotonic,
    receive_offload: bool = True,
    head_timeout: float = HEAD_TIMEOUT,
) -> RelayServer:
    """Start a relay for ``config`` (checked) and return it running; ``close()`` stops it.

    ``receive_offload=False`` reads every datagram on its own even where the kernel
    could coalesce them (GRO), as packets from a link without it arrive (tests).
    ``head_timeout``: seconds a TCP connection has to finish TLS and ask for the upgrade."""
    server = RelayServer(
        config.check(), clock=clock, receive_offload=receive_offload, head_timeout=head_timeout
    )
    await server.start()
    return server


class RelayServer:
    """One relay process's sockets and timers around a :class:`RelayCore`."""

    def __init__(
        self,
        config: RelayConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        receive_offload: bool = True,
        head_timeout: float = HEAD_TIMEOUT,
    ) -> None:
        self.config = config
        self._head_timeout = head_timeout
        self._receive_offload = receive_offload
        self.core = RelayCore(config)
        self._clock = clock
        self._sock: socket.socket | None = None
        self._udp: UdpSocket | None = None
        """The main socket's batched reads: with GRO, a run of one node's datagrams
        comes in with one read and, when the core agrees, goes out unchanged with
        one write (GSO) instead of one syscall each."""
        self._probe_sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[Address, deque[bytes]] = {}
        self._writing = False
        self._timer: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._stats_written: tuple[int, int] | None = None
        self._address: Address | None = None
        self._gso = False
        self._tcp: TcpListener | None = None
        self.dropped = 0
        """Packets dropped because a destination's queue (or a TCP connection's write
        buffer) was full."""
        self.packets_sent = 0
        """Packets sent (forwarded or answered), however many writes they took."""
        self.writes = 0
        """Socket writes that sent them: fewer than packets when runs went with GSO."""

    @property
    def address(self) -> Address:
        """``(host, port)`` the relay listens on (the real port when 0 was asked)."""
        if self._address is None:
            raise RuntimeError("the relay is not started")
        return self._address

    @property
    def address_text(self) -> str:
        return address_text(self.address)

    @property
    def tcp_address(self) -> Address | None:
        """``(host, port)`` of the TCP listener (the real port when 0 was asked), if any."""
        return self._tcp.address if self._tcp is not None else None

    @property
    def tcp_address_text(self) -> str:
        """The TCP listener's address as text; empty without one."""
        return address_text(self._tcp.address) if self._tcp is not None else ""

    async def start(self) -> Address:
        """Bind both sockets (and the TCP listener) and start serving; raises OSError if an
        address is taken (TcpListenError for the TCP one), ConfigError for a bad certificate."""
        self._loop = asyncio.get_running_loop()
        # The certificate first: a bad one stops the relay before anything is bound.
        tls = tls_context(self.config) if self.config.tcp_port is not None else None
        host, port = self.config.host, self.config.port
        self._sock = open_udp_socket(host, port, dual_stack=True)
        try:
            self._probe_sock = open_udp_socket(host, 0, dual_stack=True)
        except OSError:
            self._sock.close()
            raise
        if tls is not None:
            context, presented = tls
            tcp = TcpListener(
                self.config,
                self.core,
                send=self._send_all,
                clock=self._clock,
                head_timeout=self._head_timeout,
            )
            try:
                await tcp.start(context)
            except BaseException:
                self._sock.close()
                self._probe_sock.close()
                raise
            self._tcp = tcp
            logger.info("tcp %s presents %s", address_text(tcp.address), presented)
        bound = self._sock.getsockname()
        self._address = (host or "0.0.0.0", bound[1])
        self.core.probe_port = self._probe_sock.getsockname()[1]
        self._udp = UdpSocket(self._sock)
        if not self._receive_offload and self._udp.gro:
            self._sock.setsockopt(_SOL_UDP, _UDP_GRO, 0)
            self._udp.gro = False
        self._gso = self._udp.gso
        self._loop.add_reader(self._sock.fileno(), self._on_readable)
        self._loop.add_reader(self._probe_sock.fileno(), self._on_probe_readable)
        self._timer = asyncio.create_task(self._run_timers(), name="gpumesh-relay-timers")
        logger.debug(
            "relay bound %s, probes from port %d", bound, self._probe_sock.getsockname()[1]
        )
        return self.address

    def stats(self) -> dict[str, Any]:
        """What the stats file holds, now."""
        stats = self.core.stats(self._clock())
        stats["listen"] = self.address_text if self._address else ""
        stats["listen_tcp"] = self.tcp_address_text
        stats["tcp_connections"] = self._tcp.connection_count if self._tcp is not None else 0
        stats["packets_sent"] = self.packets_sent
        stats["dropped_queue_full"] = self.dropped
        return stats

    def close(self) -> None:
        """Close every session at both ends, write the stats, release the sockets."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._probe_sock is not None and self._loop is not None:
            self._loop.remove_reader(self._probe_sock.fileno())
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            if self._writing:
                self._loop.remove_writer(self._sock.fileno())
                self._writing = False
            goodbyes = self.core.shutdown(self._clock())
            self._flush_queues()
            for data, address in goodbyes:
                if address[1] >= TCP_PORT_BASE:
                    self._send_tcp([data], address)
                    continue
                with contextlib.suppress(OSError):
                    self._sock.sendto(data, address)
        if self._tcp is not None:
            self._tcp.close()  # after the goodbyes written to its connections
        self._write_stats(force=True)
        for sock in (self._sock, self._probe_sock):
            if sock is not None:
                sock.close()
        self._queues.clear()

    async def wait_closed(self) -> None:
        """Until :meth:`close` has run and TCP connections are closed (or cut, after a
        grace); then the stats file is written once more."""
        await self._closed.wait()
        if self._tcp is not None:
            await self._tcp.wait_closed()
            self._write_stats(force=True)

    # --- receiving ----------------------------------------------------------------------------

    def _on_readable(self) -> None:
        udp = self._udp
        if udp is None:
            return
        try:
            batch = udp.receive_batch(_READ_BATCH)  # then yield: timers and writers get a turn
        except OSError as exc:  # e.g. an ICMP error reported on the socket
            logger.debug("receive error: %s", exc)
            return
        # What this wake-up's packets make the relay send, in order, sent together at
        # the end: packets that arrived one by one (from a link without receive
        # offload) leave in runs of one write each, and the node behind gets them
        # with one read (GRO) instead of one each.
        out: list[Send] = []
        for data, segment, address in _joined(batch):
            try:
                now = self._clock()
                if len(data) > segment:
                    destination = self.core.forward_run(data, segment, address, now)
                    if destination is not None:
                        self._send_all(out)
                        out = []
                        self._send_run(data, segment, destination, -(-len(data) // segment))
                        continue
                for offset in range(0, len(data), segment):
                    packet = data[offset : offset + segment]
                    out += self.core.handle(packet, address, now)
            except Exception:  # a bug must cost one packet, never the relay
                logger.exception("failed handling a packet from %s", address)
        self._send_all(out)

    def _on_probe_readable(self) -> None:
        """The second port: a padded Hello gets its Challenge from here; nothing else
        is answered (the core decides)."""
        sock = self._probe_sock
        if sock is None:
            return
        for _ in range(_READ_BATCH):
            try:
                data, source = sock.recvfrom(MAX_PACKET + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.debug("receive error on the probe port: %s", exc)
                return
            address = (source[0], source[1])
            try:
                out = self.core.handle_probe_port(data, address, self._clock())
            except Exception:  # a bug must cost one packet, never the relay
                logger.exception("failed handling a packet from %s on the probe port", address)
                continue
            for packet, to in out:
                with contextlib.suppress(OSError):
                    sock.sendto(packet, to)
                    self.packets_sent += 1

    async def _run_timers(self) -> None:
        next_stats = 0.0
        while True:
            await asyncio.sleep(TICK_INTERVAL)
            now = self._clock()
            try:
                self._send_all(self.core.tick(now))
            except Exception:
                logger.exception("relay tick failed")
            if now >= next_stats:
                next_stats = now + STATS_INTERVAL
                self._write_stats()

    # --- sending ------------------------------------------------------------------------------

    def _send_all(self, out: list[Send]) -> None:
        """Send ``out`` in order; consecutive packets of one size to one address (the
        last of a run may be shorter) go as one run (:meth:`_send_run`)."""
        for run, size, address in gso_runs(self._probes_sent(out)):
            self._send_packets(run, size, address)

    def _probes_sent(self, out: list[Send]) -> Iterator[Send]:
        """``out`` but its reach probes, each sent from the second port as it comes, once
        (a lost probe reads as "not reachable")."""
        for data, address in out:
            if not is_reach_probe(data):
                yield data, address
            elif self._probe_sock is not None and address[1] < TCP_PORT_BASE:
                with contextlib.suppress(OSError):
                    self._probe_sock.sendto(data, address)

    def _send_packets(self, run: list[bytes], size: int, address: Address) -> None:
        if address[1] >= TCP_PORT_BASE:  # a TCP connection's address (core.tcp_address)
            self._send_tcp(run, address)
            return
        if len(run) > 1 and self._gso:
            self._send_run(b"".join(run), size, address, len(run))
            return
        for data in run:
            self._send(data, address)

    def _send(self, data: bytes, address: Address) -> None:
        queue = self._queues.get(address)
        if queue is None:
            sock = self._sock
            if sock is None:
                return
            try:
                sock.sendto(data, address)
                self.writes += 1
                self.packets_sent += 1
                return
            except (BlockingIOError, InterruptedError):
                queue = self._queues[address] = deque()
                self._want_writable()
            except OSError as exc:
                logger.debug("send to %s failed: %s", address, exc)
                return
        if len(queue) >= self.config.queue:
            self.dropped += 1
            return
        queue.append(data)

    def _send_run(self, data: bytes, segment: int, address: Address, count: int) -> None:
        """Send a run of ``count`` packets of ``segment`` bytes (the last may be shorter)
        with one write where the kernel allows (GSO)."""
        if address[1] >= TCP_PORT_BASE:
            self._send_tcp([data[o : o + segment] for o in range(0, len(data), segment)], address)
            return
        sock = self._sock
        if sock is None:
            return
        if self._gso and address not in self._queues:
            cmsg = gso_control(segment)
            try:
                sock.sendmsg([data], cmsg, 0, address)
                self.writes += 1
                self.packets_sent += count
                return
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                if exc.errno not in (errno.EIO, errno.EINVAL, errno.ENOPROTOOPT):
                    logger.debug("send to %s failed: %s", address, exc)
                    return
                self._gso = False  # no segmentation offload here: one write per packet
        for offset in range(0, len(data), segment):
            self._send(data[offset : offset + segment], address)

    def _send_tcp(self, packets: list[bytes], address: Address) -> None:
        """Write to a TCP connection, with one write; a full one drops them, as a full
        queue does."""
        if self._tcp is None:
            return
        sent, dropped = self._tcp.send(packets, address)
        if sent:
            self.writes += 1
            self.packets_sent += sent
        self.dropped += dropped

    def _want_writable(self) -> None:
        if not self._writing and self._sock is not None and self._loop is not None:
            self._writing = True
            self._loop.add_writer(self._sock.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        self._flush_queues()
        if not self._queues and self._writing and self._sock is not None and self._loop:
            self._loop.remove_writer(self._sock.fileno())
            self._writing = False

    def _flush_queues(self) -> None:
        """Send one packet per destination per round, so nobody waits behind a slow peer."""
        sock = self._sock
        while sock is not None and self._queues:
            for address in list(self._queues):
                queue = self._queues[address]
                try:
                    sock.sendto(queue[0], address)
                    self.writes += 1
                    self.packets_sent += 1
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:
                    logger.debug("send to %s failed: %s", address, exc)
                queue.popleft()
                if not queue:
                    del self._queues[address]

    # --- stats --------------------------------------------------------------------------------

    def _write_stats(self, *, force: bool = False) -> None:
        path = self.config.stats_file
        # What changes the file: the core's state, and TCP connections that come and go
        # without a registration.
        version = (self.core.version, self._tcp.connection_count if self._tcp is not None else 0)
        if path is None or (not force and version == self._stats_written):
            return
        self._stats_written = version
        try:
            write_atomically(path, json.dumps(self.stats(), indent=2) + "\n")
        except OSError as exc:
            logger.warning("cannot write the stats file %s: %s", path, exc)


def _joined(batch: list[Received]) -> list[tuple[bytes, int, Address]]:
    """``batch`` as ``(buffer, segment size, source)``, where consecutive Data packets
    of one source with one session header and one size (the last may be shorter) are
    joined into one buffer, as if they had come with receive offload (GRO): the core
    then takes the run with one check (:meth:`RelayCore.forward_run`), and one write
    forwards it."""
    joined: list[tuple[bytes, int, Address]] = []
    run: list[bytes] = []
    header = b""
    source: Address | None = None
    size = 0
    for item in batch:
        data = item.data
        if (
            run
            and item.address == source
            and len(data) <= size
            and len(data) == item.segment_size
            and len(run) < GSO_MAX_SEGMENTS
            and (len(run) + 1) * size <= GSO_MAX_BYTES
            and data.startswith(header)
        ):
            run.append(data)
            if len(data) < size:  # a shorter packet ends a run
                joined.append((b"".join(run), size, item.address))
                run = []
            continue
        if run and source is not None:
            joined.append((b"".join(run) if len(run) > 1 else run[0], size, source))
            run = []
        if len(data) == item.segment_size and data[:1] == _DATA_TYPE and len(data) > DATA_HEADER:
            run, header, source, size = [data], data[:DATA_HEADER], item.address, len(data)
        else:
            joined.append((data, item.segment_size, item.address))
    if run and source is not None:
        joined.append((b"".join(run) if len(run) > 1 else run[0], size, source))
    return joined


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` so a reader sees the old file or the new one, never half of one."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
