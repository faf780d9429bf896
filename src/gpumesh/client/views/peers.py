"""The shapes of the commands about peers: ``peers``, ``pair`` and ``connect``."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from gpumesh.client.node import ConnectResult, PairCheck, ThroughputResult
    from gpumesh.identity.codes import PairingOffer
    from gpumesh.store.peers import Peer

__all__ = ["ConnectView", "PairState", "PairView", "PairingCodeView", "PeerView"]


class PeerView(msgspec.Struct):
    """One paired peer (``peers``)."""

    name: str
    node_id: str
    allowed: bool
    last_seen: float | None
    """Unix time of the last authenticated exchange; None: never."""
    last_address: str | None
    last_path: str | None
    addresses: list[str]
    """The ``host:port`` hints from its pairing code."""
    relay: str | None
    paired_at: float

    @classmethod
    def of(cls, peer: Peer) -> PeerView:
        return cls(
            name=peer.name,
            node_id=str(peer.node_id),
            allowed=peer.allowed,
            last_seen=peer.last_seen,
            last_address=peer.last_address or None,
            last_path=peer.last_path or None,
            addresses=peer.addresses,
            relay=peer.relay or None,
            paired_at=peer.paired_at,
        )


class PairState(enum.StrEnum):
    """Where a pairing stands, seen from this side."""

    READY = "ready"
    """It serves us."""
    NOT_PAIRED = "not_paired"
    """It refuses us as unknown: it has not paired this node yet."""
    UNREACHABLE = "unreachable"
    REFUSED = "refused"
    """It refuses us for another reason (denied, limits)."""


class PairView(msgspec.Struct):
    """``pair``: the peer just paired with, and whether it has paired this node too."""

    name: str
    node_id: str
    addresses: list[str]
    allowed: bool
    paired_back: PairState | None
    """None when not checked."""
    paired_back_reason: str | None

    @classmethod
    def of(cls, peer: Peer, check: PairCheck | None) -> PairView:
        return cls(
            name=peer.name,
            node_id=str(peer.node_id),
            addresses=peer.addresses,
            allowed=peer.allowed,
            paired_back=check.state if check else None,
            paired_back_reason=(check.detail or None) if check else None,
        )


class ConnectView(msgspec.Struct):
    """``connect``: the path to a peer and how fast it answers."""

    peer: str
    node_id: str
    reachable: bool
    path: str
    """``lan``, ``direct``, ``direct (hole-punched) ADDR`` or ``relayed via RELAY``."""
    address: str
    rtt_ms: float
    connect_ms: float
    punch_ms: float | None
    remote_version: str
    sharing: bool
    warm: bool = False
    """True: the node process lent a session an earlier command had dialled; nothing
    was dialled now (``connect_ms`` is that session's own dial), the round trips were
    measured on it."""
    upload_mb_per_s: float | msgspec.UnsetType = msgspec.UNSET
    """Only with ``--speed``."""

    @classmethod
    def of(cls, result: ConnectResult, throughput: ThroughputResult | None) -> ConnectView:
        return cls(
            peer=result.peer.name,
            node_id=str(result.peer.node_id),
            reachable=True,
            path=result.path,
            address=result.address,
            rtt_ms=round(result.rtt_ms, 3),
            connect_ms=round(result.connect_ms, 3),
            punch_ms=None if result.punch_ms is None else round(result.punch_ms, 1),
            remote_version=result.remote.version,
            sharing=result.remote.sharing,
            warm=result.warm,
            upload_mb_per_s=round(throughput.mb_per_s, 1) if throughput else msgspec.UNSET,
        )


class PairingCodeView(msgspec.Struct):
    """``pair-code``: this node's pairing code, for a peer to paste into ``pair``."""

    code: str
    name: str
    node_id: str
    expires: float
    """Unix time after which the code no longer verifies."""
    addresses: list[str]
    relay: str | None

    @classmethod
    def of(cls, code: str, offer: PairingOffer) -> PairingCodeView:
        return cls(
            code=code,
            name=offer.name,
            node_id=str(offer.node_id),
            expires=offer.expires,
            addresses=list(offer.addresses),
            relay=offer.relay or None,
        )
