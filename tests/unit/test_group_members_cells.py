"""`group members`' live columns, from the view the node process answers: this
node, a member not asked, one that did not answer and one that refused each
read differently (all showed `-` alike), and simulated GPUs are marked as such."""

from __future__ import annotations

from gpumesh.cli.group import _live_cells
from gpumesh.client.groups import MemberLive, MemberState, MemberStatus, MemberView
from gpumesh.client.views.groups import MemberStatusEntry
from gpumesh.identity.keys import NodeId
from gpumesh.protocol.messages import GpuReport
from gpumesh.store.groups import GroupMember

GB = 10**9
ID = NodeId("a" * 24 + "aa")


def _gpu(name: str) -> GpuReport:
    return GpuReport(
        index=0,
        name=name,
        memory_total=24 * GB,
        memory_used=0,
        available=24 * GB,
        utilization=0,
        jobs=0,
    )


def _cells(live: MemberLive | None, *, this_node: bool = False) -> list[str]:
    """The cells of one member, as the CLI prints them from its view."""
    member = GroupMember("g1", ID, "alice-pc", b"\1" * 32, ["192.0.2.9:47000"], "", 2.0)
    view = MemberView(member, is_self=this_node, peer=None, access="not paired")
    return _live_cells(MemberStatusEntry.of_status(MemberStatus(view, live)))


def test_this_node_unasked_unreachable_and_refused_members_read_differently() -> None:
    this = _cells(None, this_node=True)
    unasked = _cells(None)
    unreachable = _cells(MemberLive(MemberState.UNREACHABLE, "no answer"))
    refused = _cells(MemberLive(MemberState.REFUSED, "not paired"))
    assert this[0] == "this node" and unasked[0] == "not asked"
    assert (unreachable[0], unreachable[3]) == ("no", "unreachable")
    assert (refused[0], refused[3]) == ("refused", "refused")
    assert len({this[0], unasked[0], unreachable[0], refused[0]}) == 4


def test_simulated_gpus_are_marked() -> None:
    real = MemberLive(MemberState.IDLE, gpus=[_gpu("L4"), _gpu("L4")])
    fake = MemberLive(MemberState.IDLE, gpus=[_gpu("RTX 4090")], simulated=True)
    assert real.gpu_summary == "2x L4"
    assert fake.gpu_summary == "1x RTX 4090 (SIMULATED)"
    assert MemberLive(MemberState.IDLE, gpus=[], simulated=True).gpu_summary == "none"
    cells = _cells(fake)
    assert cells[1] == "1x RTX 4090 (SIMULATED)" and cells[3] == "idle"
