"""The identity proof that follows every QUIC handshake, without I/O.

TLS already proved the provider's key to the dialer (the dialer pins the key it
paired with). qh3 servers cannot ask for client certificates, so the dialer
proves its key on the first stream::

    dialer                               provider
      Hello(version, public_key, name) ->
                                      <- Challenge(nonce, version)
      Proof(sign(transcript))          ->
                                      <- Welcome(name) | Refusal(code, message)

``transcript = DOMAIN || nonce || provider key || dialer key``: the nonce is
fresh per connection (no replay) and binding both keys means a proof made for
one provider is worthless to another. The provider checks access only after
the proof, so an unproven caller learns nothing about the allowlist.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from gpumesh.errors import AccessDeniedError, GPUMeshError, ProtocolError, error_from_code
from gpumesh.identity.keys import Identity, verify_signature
from gpumesh.protocol.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    Message,
    Proof,
    Refusal,
    Welcome,
)

__all__ = ["ClientAuth", "ServerAuth", "auth_transcript"]

_DOMAIN = b"gpumesh-auth-v1\x00"


def auth_transcript(nonce: bytes, server_key: bytes, client_key: bytes) -> bytes:
    return _DOMAIN + nonce + server_key + client_key


class _State(enum.Enum):
    START = "start"
    WAIT_CHALLENGE = "wait_challenge"
    WAIT_HELLO = "wait_hello"
    WAIT_PROOF = "wait_proof"
    WAIT_WELCOME = "wait_welcome"
    DONE = "done"
    FAILED = "failed"


class ClientAuth:
    """The dialer's side. Call :meth:`start`, then feed each received message."""

    def __init__(self, identity: Identity, name: str, server_key: bytes) -> None:
        self._identity = identity
        self._name = name
        self._server_key = server_key
        self._state = _State.START
        self.server_name: str | None = None

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    def start(self) -> Hello:
        assert self._state is _State.START
        self._state = _State.WAIT_CHALLENGE
        return Hello(
            version=PROTOCOL_VERSION, public_key=self._identity.public_key, name=self._name
        )

    def receive(self, message: Message) -> Message | None:
        """Return the message to send next, if any; raise on refusal."""
        if isinstance(message, Refusal):
            self._state = _State.FAILED
            raise error_from_code(message.code, message.message)
        if self._state is _State.WAIT_CHALLENGE and isinstance(message, Challenge):
            if message.version != PROTOCOL_VERSION:
                self._state = _State.FAILED
                raise ProtocolError(
                    f"the peer speaks protocol version {message.version}, this node "
                    f"{PROTOCOL_VERSION}: upgrade GPUMesh on the older side"
                )
            self._state = _State.WAIT_WELCOME
            transcript = auth_transcript(message.nonce, self._server_key, self._identity.public_key)
            return Proof(signature=self._identity.sign(transcript))
        if self._state is _State.WAIT_WELCOME and isinstance(message, Welcome):
            self._state = _State.DONE
            self.server_name = message.name
            return None
        self._state = _State.FAILED
        raise ProtocolError(f"unexpected {type(message).__name__} during authentication")


class ServerAuth:
    """The provider's side. Feed each received message; send what it returns.

    ``authorize(client_key)`` raises :class:`AccessDeniedError` (or a subclass)
    when the proven key may not use this node.
    """

    def __init__(
        self,
        identity: Identity,
        name: str,
        nonce: bytes,
        authorize: Callable[[bytes], None],
    ) -> None:
        self._identity = identity
        self._name = name
        self._nonce = nonce
        self._authorize = authorize
        self._state = _State.WAIT_HELLO
        self.client_key: bytes | None = None
        self.client_name: str | None = None
        self.error: GPUMeshError | None = None

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def failed(self) -> bool:
        return self._state is _State.FAILED

    def receive(self, message: Message) -> Message:
        """Return the reply to send. After a Refusal the connection must close."""
        try:
            return self._receive(message)
        except GPUMeshError as exc:
            self._state = _State.FAILED
            self.error = exc
            return Refusal(code=exc.code, message=exc.message)

    def _receive(self, message: Message) -> Message:
        if self._state is _State.WAIT_HELLO and isinstance(message, Hello):
            if message.version != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"this node speaks protocol version {PROTOCOL_VERSION}, you "
                    f"{message.version}: upgrade GPUMesh on the older side"
                )
            self.client_key = message.public_key
            self.client_name = message.name
            self._state = _State.WAIT_PROOF
            return Challenge(nonce=self._nonce, version=PROTOCOL_VERSION)
        if self._state is _State.WAIT_PROOF and isinstance(message, Proof):
            assert self.client_key is not None
            transcript = auth_transcript(self._nonce, self._identity.public_key, self.client_key)
            if not verify_signature(self.client_key, message.signature, transcript):
                raise AccessDeniedError(
                    "identity proof failed: the signature does not match the key you claimed"
                )
            self._authorize(self.client_key)
            self._state = _State.DONE
            return Welcome(name=self._name)
        raise ProtocolError(f"unexpected {type(message).__name__} during authentication")
