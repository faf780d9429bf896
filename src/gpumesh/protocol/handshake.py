"""The identity proof on the first stream of every connection, without I/O.

TLS already proved the provider's key to the dialer (the dialer pins the key it
paired with). qh3 servers cannot ask for client certificates, so the dialer
proves its key on the first stream (stream 0), in one of two forms chosen by
the connection's ALPN (see :class:`AuthForm`).

Session-bound (``gpumesh/2``): the dialer signs this TLS session's binding, a
secret both ends derive from the finished handshake (see
:func:`gpumesh.transport.quicsetup.session_binding`), and sends its first requests
on other streams right behind the proof, without waiting::

    dialer                                            provider
      SessionProof(version, key, name, sign(T)) ->
      request(s) on streams 4, 8, ...           ->    (held until the proof checks)
                               <- Welcome(name) | Refusal(code, message), then replies

``T = "gpumesh-session-v1" || binding || provider key || dialer key``. The
binding is fresh per session and no man in the middle can make two sessions
share one, so a proof is worthless on any other connection (no replay); binding
both keys makes a proof made for one provider worthless to another.

Challenge (``gpumesh/1``, the previous release's, kept for a peer one version
behind; two round trips before the first request)::

    dialer                               provider
      Hello(version, public_key, name) ->
                                      <- Challenge(nonce, version)
      Proof(sign(transcript))          ->
                                      <- Welcome(name) | Refusal(code, message)

``transcript = "gpumesh-auth-v1" || nonce || provider key || dialer key``. The
domains differ, so a signature made for one form never verifies in the other.

In both forms the provider checks access only after the proof, so an unproven
caller learns nothing about the allowlist, and serves no request before then.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from gpumesh.errors import AccessDeniedError, GPUMeshError, ProtocolError, error_from_code
from gpumesh.identity.keys import Identity, verify_signature
from gpumesh.protocol.messages import (
    ALPN,
    ALPN_CHALLENGE,
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    Message,
    Proof,
    Refusal,
    SessionProof,
    Welcome,
)

__all__ = [
    "AUTH_STREAM",
    "BINDING_SIZE",
    "AuthForm",
    "ClientAuth",
    "ServerAuth",
    "challenge_transcript",
    "session_transcript",
]

AUTH_STREAM = 0
"""The identity proof travels on the dialer's first stream; requests on any other."""
BINDING_SIZE = 32
"""Bytes of a TLS session's binding."""

_CHALLENGE_DOMAIN = b"gpumesh-auth-v1\x00"
_SESSION_DOMAIN = b"gpumesh-session-v1\x00"


class AuthForm(enum.Enum):
    """How a connection's first stream proves the dialer's key: its ALPN."""

    SESSION = ALPN
    """One message bound to the TLS session; requests follow at once."""
    CHALLENGE = ALPN_CHALLENGE
    """Hello, Challenge, Proof, Welcome: a peer one version behind."""

    @classmethod
    def of(cls, alpn: str | None) -> AuthForm:
        for form in cls:
            if form.value == alpn:
                return form
        raise ProtocolError(
            f"the peer speaks {alpn or 'no GPUMesh protocol'} and this node "
            f"{', '.join(form.value for form in cls)}: upgrade GPUMesh on the older side"
        )


def challenge_transcript(nonce: bytes, server_key: bytes, client_key: bytes) -> bytes:
    return _CHALLENGE_DOMAIN + nonce + server_key + client_key


def session_transcript(binding: bytes, server_key: bytes, client_key: bytes) -> bytes:
    if len(binding) != BINDING_SIZE:
        raise ProtocolError(f"a TLS session binding is {BINDING_SIZE} bytes, not {len(binding)}")
    return _SESSION_DOMAIN + binding + server_key + client_key


def _version_error(ours: int, theirs: int, *, we_are_server: bool) -> ProtocolError:
    if we_are_server:
        return ProtocolError(
            f"this node speaks protocol version {ours}, you {theirs}: "
            "upgrade GPUMesh on the older side"
        )
    return ProtocolError(
        f"the peer speaks protocol version {theirs}, this node {ours}: "
        "upgrade GPUMesh on the older side"
    )


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

    def __init__(
        self, identity: Identity, name: str, server_key: bytes, *, fec: bool = False
    ) -> None:
        self._identity = identity
        self._name = name
        self._server_key = server_key
        self._fec = fec
        self._state = _State.START
        self._form: AuthForm | None = None
        self.server_name: str | None = None
        self.server_fec = False
        """The provider's Welcome said it takes FEC frames (and we offered them)."""
        self.server_relays = False
        """The provider's Welcome said it relays for its peers."""

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def may_send_requests(self) -> bool:
        """Whether requests may go out now: at once after a session-bound proof, only
        after the Welcome in the challenge form (a provider of that version resets
        any stream that comes before it)."""
        if self._state is _State.DONE:
            return True
        return self._form is AuthForm.SESSION and self._state is _State.WAIT_WELCOME

    def start(self, form: AuthForm, binding: bytes = b"") -> Message:
        """The first message; ``binding`` is the TLS session's (session form only)."""
        assert self._state is _State.START
        self._form = form
        me = self._identity.public_key
        if form is AuthForm.SESSION:
            transcript = session_transcript(binding, self._server_key, me)
            self._state = _State.WAIT_WELCOME
            return SessionProof(
                version=PROTOCOL_VERSION,
                public_key=me,
                name=self._name,
                signature=self._identity.sign(transcript),
                fec_mac=self._fec,
            )
        self._state = _State.WAIT_CHALLENGE
        return Hello(version=PROTOCOL_VERSION, public_key=me, name=self._name)

    def receive(self, message: Message) -> Message | None:
        """Return the message to send next, if any; raise on refusal."""
        if isinstance(message, Refusal):
            self._state = _State.FAILED
            raise error_from_code(message.code, message.message)
        if self._state is _State.WAIT_CHALLENGE and isinstance(message, Challenge):
            if message.version != PROTOCOL_VERSION:
                self._state = _State.FAILED
                raise _version_error(PROTOCOL_VERSION, message.version, we_are_server=False)
            self._state = _State.WAIT_WELCOME
            transcript = challenge_transcript(
                message.nonce, self._server_key, self._identity.public_key
            )
            return Proof(signature=self._identity.sign(transcript))
        if self._state is _State.WAIT_WELCOME and isinstance(message, Welcome):
            self._state = _State.DONE
            self.server_name = message.name
            self.server_fec = self._fec and message.fec_mac
            self.server_relays = message.relays
            return None
        self._state = _State.FAILED
        raise ProtocolError(f"unexpected {type(message).__name__} during authentication")


class ServerAuth:
    """The provider's side. Feed each received message; send what it returns.

    ``authorize(client_key)`` raises :class:`AccessDeniedError` (or a subclass)
    when the proven key may not use this node. Make one with :meth:`for_session`
    or :meth:`for_challenge`, after the connection's ALPN.
    """

    def __init__(
        self,
        identity: Identity,
        name: str,
        authorize: Callable[[bytes], None],
        *,
        form: AuthForm,
        secret: bytes,
        fec: bool = False,
        relays: bool = False,
    ) -> None:
        self._identity = identity
        self._fec = fec
        self._relays = relays
        self.client_fec = False
        """The dialer's proof said it takes FEC frames (and so do we)."""
        self._name = name
        self._authorize = authorize
        self.form = form
        self._secret = secret
        """The session's binding (session form) or this connection's nonce (challenge)."""
        self._state = _State.WAIT_HELLO
        self.client_key: bytes | None = None
        self.client_name: str | None = None
        self.error: GPUMeshError | None = None

    @classmethod
    def for_session(
        cls,
        identity: Identity,
        name: str,
        binding: bytes,
        authorize: Callable[[bytes], None],
        *,
        fec: bool = False,
        relays: bool = False,
    ) -> ServerAuth:
        """``fec``: this end takes FEC frames; ``relays``: it relays for its peers (both
        said in the Welcome)."""
        return cls(
            identity,
            name,
            authorize,
            form=AuthForm.SESSION,
            secret=binding,
            fec=fec,
            relays=relays,
        )

    @classmethod
    def for_challenge(
        cls, identity: Identity, name: str, nonce: bytes, authorize: Callable[[bytes], None]
    ) -> ServerAuth:
        return cls(identity, name, authorize, form=AuthForm.CHALLENGE, secret=nonce)

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
        state, form = self._state, self.form
        if state is _State.WAIT_HELLO and form is AuthForm.SESSION:
            if isinstance(message, SessionProof):
                self._claim(message.version, message.public_key, message.name)
                assert self.client_key is not None
                self.client_fec = self._fec and message.fec_mac
                transcript = session_transcript(
                    self._secret, self._identity.public_key, self.client_key
                )
                return self._check(message.signature, transcript)
        elif state is _State.WAIT_HELLO and isinstance(message, Hello):
            self._claim(message.version, message.public_key, message.name)
            self._state = _State.WAIT_PROOF
            return Challenge(nonce=self._secret, version=PROTOCOL_VERSION)
        elif state is _State.WAIT_PROOF and isinstance(message, Proof):
            assert self.client_key is not None
            transcript = challenge_transcript(
                self._secret, self._identity.public_key, self.client_key
            )
            return self._check(message.signature, transcript)
        raise ProtocolError(f"unexpected {type(message).__name__} during authentication")

    def _claim(self, version: int, public_key: bytes, name: str) -> None:
        if version != PROTOCOL_VERSION:
            raise _version_error(PROTOCOL_VERSION, version, we_are_server=True)
        self.client_key = public_key
        self.client_name = name

    def _check(self, signature: bytes, transcript: bytes) -> Welcome:
        assert self.client_key is not None
        if not verify_signature(self.client_key, signature, transcript):
            raise AccessDeniedError(
                "identity proof failed: the signature does not match the key you claimed"
            )
        self._authorize(self.client_key)
        self._state = _State.DONE
        # Said only to a dialer that offered it: an older one gets the Welcome it knows.
        return Welcome(name=self._name, fec_mac=self.client_fec, relays=self._relays)
