"""A hostile HTTP client, standard library only, so another local user can run it
as a plain script (``python3 -I floodclient.py hold|body ...``); the tests
import its functions too.

``hold HOST PORT IDLE HALF WAIT [bodies]``: open IDLE connections that send
nothing and HALF that send part of a head (with ``bodies``, every other one a
whole head and part of the login exchange's body instead), print ``held N``,
wait until stdin closes, then print (JSON) what each connection was told
before it closed within WAIT seconds, and how many stayed open.

``body HOST PORT PATH MB chunked|length``: send a request of MB megabytes of
body (a bearer token, if any, is the first line of stdin: never in argv), print
(JSON) the status line and body the server answered, and how much was sent.

``get HOST PORT PATH``: one GET; print its status line.

``$FLOOD_SOURCE``, when set, is the address every connection is made from.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time

HALF_HEAD = (
    b"POST /api/v1/auth/session HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/json\r\nContent-Length: 100\r\n"
)
"""A head that never ends."""
HALF_BODY = HALF_HEAD + b"\r\n" + b'{"code": "'
"""A whole head, and a body that never ends."""


def _connect(host: str, port: int) -> socket.socket:
    source = os.environ.get("FLOOD_SOURCE")
    return socket.create_connection(
        (host, port), timeout=30, source_address=(source, 0) if source else None
    )


def hold(
    host: str, port: int, idle: int, half: int, *, bodies: bool = False
) -> list[socket.socket]:
    held = []
    for i in range(idle + half):
        sock = _connect(host, port)
        if i >= idle:
            sock.sendall(HALF_BODY if bodies and i % 2 else HALF_HEAD)
        held.append(sock)
    return held


def told(held: list[socket.socket], wait: float) -> dict[str, object]:
    """What each connection received until it closed (within ``wait`` seconds)."""
    got = {sock: b"" for sock in held}
    answers: list[str] = []
    end = time.monotonic() + wait
    while got and time.monotonic() < end:
        ready, _, _ = select.select(list(got), [], [], 0.5)
        for sock in ready:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if data:
                got[sock] += data
                continue
            answers.append(got.pop(sock).decode(errors="replace"))
            sock.close()
    for sock in got:
        sock.close()
    return {"answers": answers, "open": len(got)}


def send_body(
    host: str, port: int, path: str, megabytes: int, *, chunked: bool, token: str = ""
) -> dict[str, object]:
    """Send a request with ``megabytes`` of body; what the server answered."""
    size = megabytes * 1024 * 1024
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}")
    if token:
        head.append(f"Authorization: Bearer {token}")
    piece = b"{" + b" " * (1024 * 1024 - 1)
    sock = socket.create_connection((host, port), timeout=60)
    sent = 0
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        while sent < size:
            data = piece if not chunked else b"%x\r\n%s\r\n" % (len(piece), piece)
            sock.sendall(data)
            sent += len(piece)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server answered and closed before the end: what a bound does
    answer = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    except OSError:
        pass
    finally:
        sock.close()
    status, _, rest = answer.partition(b"\r\n")
    return {
        "status": status.decode(errors="replace"),
        "body": rest.partition(b"\r\n\r\n")[2].decode(errors="replace"),
        "sent": sent,
    }


def main(argv: list[str]) -> None:
    if argv[0] == "hold":
        bodies = argv[6:7] == ["bodies"]
        held = hold(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), bodies=bodies)
        print(f"held {len(held)}", flush=True)
        sys.stdin.read()
        print(json.dumps(told(held, float(argv[5]))), flush=True)
    elif argv[0] == "get":
        with _connect(argv[1], int(argv[2])) as sock:
            sock.sendall(f"GET {argv[3]} HTTP/1.1\r\nHost: {argv[1]}\r\n\r\n".encode())
            print(sock.recv(65536).partition(b"\r\n")[0].decode(), flush=True)
    elif argv[0] == "body":
        token = sys.stdin.readline().strip()
        chunked = argv[5] == "chunked"
        result = send_body(
            argv[1], int(argv[2]), argv[3], int(argv[4]), chunked=chunked, token=token
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
