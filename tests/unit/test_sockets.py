"""store/sockets.py: one way every socket in a home gets a name bind accepts."""

from __future__ import annotations

import socket
from pathlib import Path

from gpumesh.store.sockets import SUN_PATH_MAX, socket_name


def test_a_socket_deeper_than_a_unix_path_allows_is_reached_through_its_folder(
    tmp_path: Path,
) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert len(str(deep / "control.sock")) > SUN_PATH_MAX
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        with socket_name(deep, "control.sock") as name:
            assert name.startswith("/proc/self/fd/")
            server.bind(name)
        with socket_name(deep, "control.sock") as name:
            client.sendto(b"changed", name)
        assert server.recv(16) == b"changed"
        assert (deep / "control.sock").is_socket()  # the file is where it was asked for
    finally:
        server.close()
        client.close()


def test_a_short_path_is_used_as_it_is(tmp_path: Path) -> None:
    with socket_name(tmp_path, "a.sock") as name:
        assert name == str(tmp_path / "a.sock")
