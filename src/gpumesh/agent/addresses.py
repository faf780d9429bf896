"""Answering ``AddressQuery``: where this node and its findable peers are now.

A paired, allowed peer asks (``gpumesh sync``); the answer carries this
node's own address record, signed by its key, and the records of the nodes
the peer named that (a) this node is paired with and allows and (b) handed
this node their record themselves while asking to be findable
(``announce_addresses``). A node that did not opt in is never revealed: its
record is not kept as findable, and a node that stops announcing has it
dropped at its next query. Records learned second-hand are never handed on.

The asker's own record (when it is findable) is checked against the key
pinned for it and kept; its addresses become the stored hints for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gpumesh.agent.deps import Handlers, RequestContext
from gpumesh.errors import ProtocolError
from gpumesh.identity.keys import Identity
from gpumesh.protocol.messages import AddressAnswer, AddressQuery, SignedAddresses
from gpumesh.protocol.peeraddresses import (
    StaleRecordError,
    open_peer_record,
    seq_of,
    sign_own_record,
)
from gpumesh.store.config import Config
from gpumesh.store.db import Store
from gpumesh.store.peerrecords import PeerRecords, StoredRecord, findable

__all__ = ["AddressService"]

logger = logging.getLogger(__name__)


class AddressService:
    def __init__(
        self,
        identity: Identity,
        config: Config,
        store: Store,
        records: PeerRecords,
        addresses: Callable[[], list[str]],
    ) -> None:
        self.identity = identity
        self.config = config
        self.store = store
        self.records = records
        self.addresses = addresses
        """Where this node listens now, best first."""

    def register(self, handlers: Handlers) -> None:
        handlers.add(AddressQuery, self._handle)

    async def _handle(self, ctx: RequestContext, message: AddressQuery) -> None:
        now = time.time()
        asker = ctx.peer
        if message.mine is not None:
            self._take_askers(ctx, message.mine, now)
        else:
            stored = self.records.get(str(asker.node_id))
            if stored is not None and stored.findable:
                self.records.forget(str(asker.node_id))  # it no longer asks to be findable
        allowed = {str(peer.node_id): peer for peer in self.store.peers() if peer.allowed}
        handed: list[SignedAddresses] = []
        for node_id in dict.fromkeys(message.node_ids):
            peer = allowed.get(node_id)
            if peer is None or node_id == str(asker.node_id):
                continue
            stored = self.records.get(node_id)
            if stored is None or not stored.findable:
                continue
            signed = SignedAddresses(record=stored.record, signature=stored.signature)
            try:  # the file is not trusted: it must still verify, and not be too old
                open_peer_record(signed, peer.public_key, now)
            except ProtocolError:
                continue
            handed.append(signed)
        own = sign_own_record(self.identity, self.addresses(), self.config.relay, now)
        answer = AddressAnswer(own=own, findable=findable(self.config), peers=handed)
        ctx.stream.send_message(answer, end=True)

    def _take_askers(self, ctx: RequestContext, mine: SignedAddresses, now: float) -> None:
        asker = ctx.peer
        node_id = str(asker.node_id)
        stored = self.records.get(node_id)
        try:
            record = open_peer_record(
                mine, asker.public_key, now, after_seq=seq_of(stored.record) if stored else 0
            )
        except StaleRecordError:
            return
        except ProtocolError as exc:
            raise ProtocolError(f"your own address record was refused: {exc.message}") from None
        self.records.save(node_id, StoredRecord(mine.record, mine.signature, True, now))
        if sorted(record.addresses) != sorted(asker.addresses) or (
            record.relay and record.relay != asker.relay
        ):
            self.store.save_peer(
                asker.public_key, asker.name, record.addresses, record.relay or asker.relay
            )
            logger.info("[%s] now at %s", asker.name, ", ".join(record.addresses) or "no address")
