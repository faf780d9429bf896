"""Finding paired peers again after they moved: ``gpumesh sync``.

With a registry (``rendezvous_url``), each paired peer's address record is
looked up by its id and accepted only when it is signed by the key pinned at
pairing (:meth:`RegistryClient.lookup_addresses` checks that); new addresses
replace the stored hints, the allowed flag untouched. Every peer is then
dialled once, in parallel, so the path that works is remembered for the next
dial.

Then, registry or not, every peer that answered is asked (``AddressQuery``)
for its own current record and for those of the peers that did not answer;
a record is taken only when signed by the key pinned for its node and newer
than the last one taken (:mod:`gpumesh.protocol.peeraddresses`), and a peer
found that way is dialled again. This node's own record goes with each
query when it asked to be findable (``announce_addresses``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpumesh.errors import GPUMeshError, ProtocolError
from gpumesh.protocol.messages import (
    MAX_ADDRESS_QUERY,
    AddressAnswer,
    AddressQuery,
    SignedAddresses,
)
from gpumesh.protocol.peeraddresses import (
    StaleRecordError,
    claimed_node,
    open_peer_record,
    seq_of,
    sign_own_record,
)
from gpumesh.store.peerrecords import PeerRecords, StoredRecord, findable

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.client.registry import RegistryClient
    from gpumesh.store.peers import Peer

__all__ = ["PeerRefresh", "refresh_peer", "refresh_peers"]


@dataclass(frozen=True)
class PeerRefresh:
    """What ``sync`` learned about one paired peer."""

    name: str
    node_id: str
    moved: bool
    """The registry had a newer signed address record, now stored."""
    addresses: list[str]
    reachable: bool | None
    """None: not dialled."""
    path: str
    note: str
    """Why it is unreachable, or what the registry said (empty when all went well)."""
    found_via: str = ""
    """The paired peer whose answer gave its new addresses; empty: none did."""
    registry_note: str = ""
    """What the registry said when asked for this peer's record (also in ``note``):
    the same for every peer when the registry itself failed."""


async def refresh_peer(
    node: Node, peer: Peer, registry: RegistryClient | None, *, timeout: float, dial: bool = True
) -> PeerRefresh:
    moved = False
    notes: list[str] = []
    registry_note = ""
    if registry is not None:
        try:
            record = await registry.alookup_addresses(str(peer.node_id), peer.public_key)
        except GPUMeshError as exc:
            record = None
            registry_note = exc.message
            notes.append(exc.message)
        if record is not None and (
            sorted(record.addresses) != sorted(peer.addresses)
            or (record.relay and record.relay != peer.relay)
        ):
            node.home.store.save_peer(
                peer.public_key, peer.name, record.addresses, record.relay or peer.relay
            )
            moved = True
    current = node.home.store.peer_by_id(peer.node_id)
    reachable: bool | None = None
    path = ""
    if dial:
        try:
            result = await node.connect(str(peer.node_id), pings=1, timeout=timeout)
        except GPUMeshError as exc:
            reachable = False
            notes.append(exc.message)
        else:
            reachable = True
            path = f"{result.path} {result.address}"
    return PeerRefresh(
        name=peer.name,
        node_id=str(peer.node_id),
        moved=moved,
        addresses=current.addresses,
        reachable=reachable,
        path=path,
        note="; ".join(notes),
        registry_note=registry_note,
    )


async def refresh_peers(
    node: Node, registry: RegistryClient | None, *, timeout: float = 5.0, dial: bool = True
) -> list[PeerRefresh]:
    """Refresh every paired peer at once (each in at most about ``timeout`` seconds);
    when dialling, ask the peers that answered about themselves and the others."""
    peers = node.peers()
    results = list(
        await asyncio.gather(
            *(refresh_peer(node, peer, registry, timeout=timeout, dial=dial) for peer in peers)
        )
    )
    if not dial:
        return results
    return await _ask_peers(node, peers, results, timeout=timeout)


@dataclass
class _Learned:
    moved: bool = False
    via: str = ""
    notes: list[str] | None = None

    def note(self, text: str) -> None:
        self.notes = [*(self.notes or []), text]


async def _ask_peers(
    node: Node, peers: list[Peer], results: list[PeerRefresh], *, timeout: float
) -> list[PeerRefresh]:
    reachable = [peer for peer, result in zip(peers, results, strict=True) if result.reachable]
    lost = [peer for peer, result in zip(peers, results, strict=True) if not result.reachable]
    config = node.home.config
    mine = (
        sign_own_record(node.home.identity, node.advertised_addresses(), config.relay)
        if findable(config)
        else None
    )
    learned = {str(peer.node_id): _Learned() for peer in peers}
    answers = await asyncio.gather(
        *(_ask(node, peer, lost, mine, timeout=timeout) for peer in reachable)
    )
    for peer, answer in zip(reachable, answers, strict=True):
        if isinstance(answer, GPUMeshError):
            learned[str(peer.node_id)].note(f"could not ask it for addresses: {answer.message}")
            continue
        _take(node, peer, answer, peer, learned, findable=answer.findable)
        for signed in answer.peers:
            claimed = claimed_node(signed)
            about = next((p for p in lost if str(p.node_id) == str(claimed)), None)
            if about is None:
                learned[str(peer.node_id)].note(
                    "it handed on an address record of a node not asked about (ignored)"
                )
                continue
            _take(node, about, signed, peer, learned, findable=False)
    refreshed = []
    for peer, first in zip(peers, results, strict=True):
        news = learned[str(peer.node_id)]
        current = node.home.store.peer_by_id(peer.node_id)
        result = replace(
            first,
            moved=first.moved or news.moved,
            addresses=current.addresses,
            found_via=news.via,
            note="; ".join(filter(None, [first.note, *(news.notes or [])])),
        )
        if news.moved and not result.reachable:
            result = await _redial(node, result, timeout=timeout)
        refreshed.append(result)
    return refreshed


async def _ask(
    node: Node, peer: Peer, lost: list[Peer], mine: SignedAddresses | None, *, timeout: float
) -> AddressAnswer | GPUMeshError:
    """One peer's answers about itself and ``lost`` (in batches the message allows)."""
    wanted = [str(other.node_id) for other in lost if other.node_id != peer.node_id]
    batches = [wanted[i : i + MAX_ADDRESS_QUERY] for i in range(0, len(wanted), MAX_ADDRESS_QUERY)]
    own: SignedAddresses | None = None
    is_findable = False
    handed: list[SignedAddresses] = []
    try:
        async with asyncio.timeout(timeout * 2):
            async with node.session(str(peer.node_id), timeout=timeout) as session:
                for batch in batches or [[]]:
                    reply = await session.request(
                        AddressQuery(node_ids=batch, mine=mine), timeout=timeout
                    )
                    if not isinstance(reply, AddressAnswer):
                        raise ProtocolError(
                            f"{peer.name} answered an address query with {type(reply).__name__}"
                        )
                    own, is_findable = reply.own, reply.findable
                    handed.extend(reply.peers)
    except TimeoutError:
        return ProtocolError(f"{peer.name} did not answer within {timeout * 2:.0f}s")
    except GPUMeshError as exc:
        return exc
    assert own is not None
    return AddressAnswer(own=own, findable=is_findable, peers=handed)


def _take(
    node: Node,
    about: Peer,
    answer: AddressAnswer | SignedAddresses,
    source: Peer,
    learned: dict[str, _Learned],
    *,
    findable: bool,
) -> None:
    """Store ``about``'s record from ``source`` when it verifies against the key
    pinned for ``about`` and is newer than the last one taken; note a refusal."""
    signed = answer.own if isinstance(answer, AddressAnswer) else answer
    records = PeerRecords(node.home.path)
    node_id = str(about.node_id)
    stored = records.get(node_id)
    now = time.time()
    news = learned[node_id]
    try:
        record = open_peer_record(
            signed, about.public_key, now, after_seq=seq_of(stored.record) if stored else 0
        )
    except StaleRecordError:
        return
    except ProtocolError as exc:
        news.note(
            f"{source.name} handed on an address record for it that was refused ({exc.message}); "
            "kept its stored addresses"
        )
        return
    records.save(node_id, StoredRecord(signed.record, signed.signature, findable, now))
    if sorted(record.addresses) != sorted(about.addresses) or (
        record.relay and record.relay != about.relay
    ):
        node.home.store.save_peer(
            about.public_key, about.name, record.addresses, record.relay or about.relay
        )
        news.moved = True
        news.via = source.name


async def _redial(node: Node, result: PeerRefresh, *, timeout: float) -> PeerRefresh:
    try:
        connected = await node.connect(result.node_id, pings=1, timeout=timeout)
    except GPUMeshError as exc:
        return replace(result, reachable=False, note=f"{result.note}; again: {exc.message}")
    return replace(
        result,
        reachable=True,
        path=f"{connected.path} {connected.address}",
        note="",
    )
