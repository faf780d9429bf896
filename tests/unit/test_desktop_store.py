"""The desktop share, its allowlist, and the kernel socket table parser, without I/O
beyond a temporary SQLite file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpumesh.protocol.desktop import DesktopKind, client_commands, kind_for_port
from gpumesh.store.db import Store
from gpumesh.transport.sockowner import parse_listeners, parse_table

KEY_A = b"a" * 32
KEY_B = b"b" * 32


def test_the_desktop_allowlist_is_its_own_and_empty_by_default(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    alice = store.save_peer(KEY_A, "alice", [], "")
    bob = store.save_peer(KEY_B, "bob", [], "")
    assert alice.allowed and bob.allowed  # paired peers may run jobs...
    assert store.desktop_allowed_ids() == set()  # ...but nobody may use the desktop
    store.set_desktop_allowed(bob.node_id, True)
    store.set_desktop_allowed(bob.node_id, True)  # twice is once
    assert store.desktop_allowed_ids() == {bob.node_id}
    store.set_allowed(bob.node_id, False)  # `gpumesh deny` takes the desktop too
    assert store.desktop_allowed_ids() == set()
    store.set_allowed(bob.node_id, True)
    assert store.desktop_allowed_ids() == {bob.node_id}
    store.set_desktop_allowed(bob.node_id, False)
    assert store.desktop_allowed_ids() == set()
    store.set_desktop_allowed(alice.node_id, True)
    store.delete_peer(alice.node_id)  # unpaired: off the list, not back on a re-pair
    alice = store.save_peer(KEY_A, "alice", [], "")
    assert store.desktop_allowed_ids() == set()
    store.close()


def test_the_desktop_share_is_remembered_until_stopped(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    assert store.desktop_share() is None
    store.set_desktop_share(DesktopKind.VNC, 5901, now=10.0)
    store.close()
    store = Store(tmp_path / "state.db")
    share = store.desktop_share()
    assert share is not None
    assert (share.kind, share.port, share.shared_at) == (DesktopKind.VNC, 5901, 10.0)
    store.set_desktop_share(DesktopKind.RDP, 3389)
    share = store.desktop_share()
    assert share is not None and (share.kind, share.port) == (DesktopKind.RDP, 3389)
    assert store.clear_desktop_share()
    assert not store.clear_desktop_share()
    assert store.desktop_share() is None
    store.close()


def test_kinds_ports_and_what_to_run() -> None:
    assert kind_for_port(5901) is DesktopKind.VNC
    assert kind_for_port(3389) is DesktopKind.RDP
    assert kind_for_port(8080) is DesktopKind.TCP
    assert DesktopKind.parse("future-thing") is DesktopKind.TCP
    assert (DesktopKind.VNC.local_port, DesktopKind.RDP.local_port) == (15900, 13389)
    assert client_commands(DesktopKind.VNC, "127.0.0.1", 15900) == ["vncviewer 127.0.0.1::15900"]
    assert client_commands(DesktopKind.RDP, "127.0.0.1", 13389) == [
        "xfreerdp /v:127.0.0.1:13389",
        "mstsc /v:127.0.0.1:13389",
    ]


# Two rows of /proc/net/tcp (x86, little-endian words): a listener on 127.0.0.1:15900
# (0x3E1C) owned by uid 0, and a client 127.0.0.1:40000 (0x9C40) of uid 1000 connected
# to it; and one row of /proc/net/tcp6 with a v4-mapped client of uid 65534.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:3E1C 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 0100007F:9C40 0100007F:3E1C 01 00000000:00000000 00:00000000 00000000  1000        0 2 1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000100007F:9C41 0000000000000000FFFF00000100007F:3E1C 01 00000000:00000000 00:00000000 00000000 65534        0 3 1
"""  # noqa: E501


@pytest.mark.skipif(sys.byteorder != "little", reason="the sample rows are little-endian")
def test_the_socket_table_names_the_connecting_user() -> None:
    assert parse_table(TCP, ("127.0.0.1", 40000), ("127.0.0.1", 15900)) == 1000
    assert parse_table(TCP, ("127.0.0.1", 40001), ("127.0.0.1", 15900)) is None
    # The listener's own row proves no connecting user.
    assert parse_table(TCP, ("127.0.0.1", 15900), ("0.0.0.0", 0)) is None
    assert parse_table(TCP6, ("127.0.0.1", 40001), ("::ffff:127.0.0.1", 15900)) == 65534
    assert (
        parse_table("garbage\n 0: zz:zz yy:yy 01 a b c d e\n", ("1.2.3.4", 1), ("1.2.3.4", 2))
        is None
    )


@pytest.mark.skipif(sys.byteorder != "little", reason="the sample rows are little-endian")
def test_the_socket_table_names_listeners() -> None:
    assert parse_listeners(TCP) == {("127.0.0.1", 15900)}  # the connected row is not one
    assert parse_listeners(TCP6) == set()
