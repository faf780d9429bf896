"""Routes of peers: the list, pairing, allowlists, connect."""

from __future__ import annotations

from starlette.responses import Response

from gpumesh.client.bodies import PairBody
from gpumesh.client.cuda import allow, deny
from gpumesh.client.desktop import allow_desktop, deny_desktop
from gpumesh.client.views.peers import ConnectView, PairingCodeView, PairView, PeerView
from gpumesh.control.call import Call
from gpumesh.control.dashboard.pages import qr_svg
from gpumesh.errors import BadRequestError, PairingCodeError
from gpumesh.identity.codes import verify_code

__all__ = [
    "get_pairing_code",
    "get_pairing_qr",
    "get_peers",
    "post_allow",
    "post_connect",
    "post_cuda_allow",
    "post_cuda_deny",
    "post_deny",
    "post_desktop_allow",
    "post_desktop_deny",
    "post_pair",
]


async def get_peers(call: Call) -> object:
    return [PeerView.of(p) for p in call.node.peers()]


async def post_pair(call: Call) -> object:
    body: PairBody = call.body
    peer = call.node.pair(body.code.strip(), rekey=body.rekey)
    check = None
    if not body.offline and (peer.addresses or peer.relay):
        check = await call.node.check_paired_back(peer.name)
    return PairView.of(peer, check)


async def get_pairing_code(call: Call) -> object:
    code = call.node.pairing_code()
    return PairingCodeView.of(code, verify_code(code))


async def get_pairing_qr(call: Call) -> object:
    """The QR code of a pairing code of this node's (``code``), or of a fresh one."""

    code = call.request.query_params.get("code") or call.node.pairing_code()
    try:
        offer = verify_code(code)
    except PairingCodeError as exc:
        raise BadRequestError(f"code: {exc.message}") from None
    if offer.public_key != call.node.home.identity.public_key:
        raise BadRequestError("code: not a pairing code of this node")
    return Response(qr_svg(code), media_type="image/svg+xml")


async def post_allow(call: Call) -> object:
    return PeerView.of(call.node.allow(call.param("peer")))


async def post_deny(call: Call) -> object:
    return PeerView.of(call.node.deny(call.param("peer")))


async def post_desktop_allow(call: Call) -> object:
    return PeerView.of(allow_desktop(call.node, call.param("peer")))


async def post_desktop_deny(call: Call) -> object:
    return PeerView.of(deny_desktop(call.node, call.param("peer")))


async def post_cuda_allow(call: Call) -> object:
    return PeerView.of(allow(call.node, call.param("peer")))


async def post_cuda_deny(call: Call) -> object:
    return PeerView.of(deny(call.node, call.param("peer")))


async def post_connect(call: Call) -> object:
    """The path to a peer, on the warm session to it when there is one (dialled now
    when not, and kept warm for the next request); ``fresh``: a new dial all the
    same, timed whole and closed after; ``speed``: bytes to push too."""

    pings = call.number("pings", 5, least=1, most=100)
    size = call.number("speed", 0, most=2**62)
    timeout = call.request.query_params.get("timeout")
    seconds = None
    if timeout is not None:
        try:
            seconds = float(timeout)
        except ValueError:
            raise BadRequestError(f"query parameter timeout={timeout!r} is not a number") from None
        if not 0 < seconds <= 3600:
            raise BadRequestError("query parameter timeout must be above 0 and at most 3600")
    peer = call.param("peer")
    fresh = call.flag("fresh")
    result = await call.node.connect(peer, pings=pings, timeout=seconds, fresh=fresh)
    throughput = await call.node.throughput(peer, size) if size else None
    return ConnectView.of(result, throughput)
