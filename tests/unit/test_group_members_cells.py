"""`group members`' live columns: this node, a member not asked, one that did not
answer and one that refused each read differently (all showed `-` alike), and
simulated GPUs are marked as such."""

from __future__ import annotations

from gpumesh.cli.group import _live_cells
from gpumesh.client.groups import MemberLive, MemberState
from gpumesh.protocol.messages import GpuReport

GB = 10**9


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


def test_this_node_unasked_unreachable_and_refused_members_read_differently() -> None:
    this = _live_cells(None, this_node=True)
    unasked = _live_cells(None, this_node=False)
    unreachable = _live_cells(MemberLive(MemberState.UNREACHABLE, "no answer"), this_node=False)
    refused = _live_cells(MemberLive(MemberState.REFUSED, "not paired"), this_node=False)
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
    cells = _live_cells(fake, this_node=False)
    assert cells[1] == "1x RTX 4090 (SIMULATED)" and cells[3] == "idle"
