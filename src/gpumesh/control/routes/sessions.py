"""Routes of browser sign-in: one-time login codes and session cookies."""

from __future__ import annotations

from starlette.responses import Response

from gpumesh.client.bodies import ExchangeBody
from gpumesh.client.views.node import LoginCodeView
from gpumesh.control import auth
from gpumesh.control.call import Call, Refusal, cookie_host
from gpumesh.errors import AccessDeniedError, AgentError

__all__ = ["delete_session", "post_login_code", "post_session"]


async def post_session(call: Call) -> object:
    """Exchange a one-time login code for a browser session cookie."""
    body: ExchangeBody = call.body
    if not cookie_host(call.request, call.state):
        # Checked before the code is spent: the owner may still follow the right URL.
        raise Refusal(
            403,
            AccessDeniedError(
                "sign in through the URL `gpumesh dashboard` prints: a session cookie counts "
                "only at the host name in it"
            ),
        )
    session = call.state.sessions.exchange(body.code)
    if session is None:
        raise Refusal(401, AccessDeniedError("that login code is unknown, used or expired"))
    response = Response(status_code=204)
    response.set_cookie(
        auth.COOKIE,
        session,
        max_age=int(auth.SESSION_TTL),
        path="/",
        httponly=True,
        samesite="strict",
    )
    return response


async def delete_session(call: Call) -> object:
    call.state.sessions.end(call.request.cookies.get(auth.COOKIE))
    response = Response(status_code=204)
    response.delete_cookie(auth.COOKIE, path="/", httponly=True, samesite="strict")
    return response


async def post_login_code(call: Call) -> object:
    """A one-time login URL for a browser (the code is in its fragment, which
    browsers never send to a server or put in a Referer)."""
    if not call.state.public_url:
        raise AgentError("this control server does not listen on TCP: no browser can log in")
    code = call.state.sessions.new_code()
    return LoginCodeView(call.state.login_url(code), auth.CODE_TTL)
