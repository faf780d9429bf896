"""The one parser of the kernel's socket table fails closed (captured tables, no sockets)."""

from __future__ import annotations

import sys

import pytest

from gpumesh.transport.sockowner import parse_table

# /proc/net/tcp as captured on x86 (little-endian words) as root right after another
# process did connect-send-close to a listener on 127.0.0.1:34779 (0x87DB) that has
# not read yet: the listener; the closed client 127.0.0.1:36830 (0x8FDE), orphaned in
# FIN_WAIT2 (05) with uid 0 and inode 0; and the accepted side in CLOSE_WAIT (08).
ORPHANED = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   2: 0100007F:87DB 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 15175 1 00000000e3fcb0ed 100 0 0 10 0
   3: 0100007F:8FDE 0100007F:87DB 05 00000000:00000000 03:00001760 00000000     0        0 0 3 000000009071a600
   4: 0100007F:87DB 0100007F:8FDE 08 00000000:00000002 00:00000000 00000000     0        0 15177 1 00000000590fded4 20 4 28 10 -1
"""  # noqa: E501

LISTENER = ("127.0.0.1", 34779)
CLIENT = ("127.0.0.1", 36830)


def _row(state: str, uid: int, inode: int) -> str:
    return (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n"
        f"   3: 0100007F:8FDE 0100007F:87DB {state} 00000000:00000000 00:00000000 00000000 "
        f"{uid:>5}        0 {inode} 1 0000000000000000\n"
    )


@pytest.mark.skipif(sys.byteorder != "little", reason="the captured rows are little-endian")
def test_an_orphaned_socket_proves_no_owner() -> None:
    # Read naively, the orphan says uid 0: a root-run tunnel or bridge took it as root's.
    assert parse_table(ORPHANED, CLIENT, LISTENER) is None


@pytest.mark.skipif(sys.byteorder != "little", reason="the sample rows are little-endian")
@pytest.mark.parametrize(
    ("state", "inode", "owner"),
    [
        ("01", 4242, 1000),  # ESTABLISHED, held by a process: its uid
        ("08", 4242, 1000),  # CLOSE_WAIT (we closed first), still held: its uid
        ("01", 0, None),  # no inode: nobody holds it
        ("08", 0, None),
        ("04", 4242, None),  # FIN_WAIT1
        ("05", 4242, None),  # FIN_WAIT2: half-closed by its owner, or about to be orphaned
        ("06", 0, None),  # TIME_WAIT
        ("07", 4242, None),  # CLOSE
        ("0A", 4242, None),  # LISTEN
    ],
)
def test_only_a_live_held_connection_proves_its_owner(
    state: str, inode: int, owner: int | None
) -> None:
    assert parse_table(_row(state, 1000, inode), CLIENT, LISTENER) == owner


def test_short_or_garbled_rows_prove_nothing() -> None:
    short = "header\n   3: 0100007F:8FDE 0100007F:87DB 01 00000000:00000000 00:0 0 1000\n"
    assert parse_table(short, CLIENT, LISTENER) is None
    garbled = "header\n 0: zz:zz yy:yy 01 a b c 0 0 5\n"
    assert parse_table(garbled, CLIENT, LISTENER) is None
