"""The owner comes first (reclaim_on_gpu_use), without sockets, Docker or sleeping:
when a GPU is reclaimed and offered again (agent/reclaim's tracker, time passed in),
which processes are GPUMesh's (cgroup text), the simulated process file, the
settings, the allocator withholding a reclaimed GPU, placement skipping it, and
one look of the reclaimer acted on with every dependency faked."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from gpumesh.agent.deps import Provider
from gpumesh.agent.gpus import GpuAllocator, Holder, HolderKind
from gpumesh.agent.reclaim import (
    ReclaimChanges,
    ReclaimTracker,
    container_ids,
    ignored_names,
    owner_processes,
)
from gpumesh.agent.reclaimer import GpuReclaimer
from gpumesh.client.placement import evaluate
from gpumesh.errors import ConfigError, LimitError
from gpumesh.gpu.inventory import (
    ENV_SIMULATED_PROCESSES,
    GpuProcess,
    NvmlInventory,
    SimulatedInventory,
    memory_by_pid,
    parse_compute_apps,
    parse_simulated_processes,
)
from gpumesh.store.config import RECLAIM_IGNORE, Config
from tests.unit.test_gpu_inventory import _TWO_DEVICES, FakeNVMLError, _fake_pynvml
from tests.unit.test_placement_choice import _gpu, _probe

GB = 1000**3
ID_A = "a" * 64
ID_B = "0123456789abcdef" * 4

# --- the tracker -------------------------------------------------------------------------------


def test_a_gpu_is_reclaimed_at_the_first_look_that_finds_an_owner_process() -> None:
    tracker = ReclaimTracker(grace=30)
    assert tracker.observe(0, {}) == ReclaimChanges()
    assert not tracker.observe(0, {})
    changes = tracker.observe(1, {1: ["game"], 0: []})
    assert changes == ReclaimChanges(reclaimed={1: ["game"]})
    assert tracker.held == {1: ["game"]}
    # Still there: not reclaimed again; a second process joining is not news either.
    assert tracker.observe(2, {1: ["game"]}) == ReclaimChanges()
    assert tracker.observe(3, {1: ["blender", "game"]}) == ReclaimChanges()
    assert tracker.held == {1: ["blender", "game"]}


def test_a_gpu_is_offered_again_only_after_the_grace_without_owner_processes() -> None:
    tracker = ReclaimTracker(grace=30)
    tracker.observe(100, {0: ["game"]})
    assert tracker.observe(110, {}) == ReclaimChanges()  # gone, but not for long
    assert tracker.observe(129.9, {0: []}) == ReclaimChanges()
    # Back before the grace ran out: the grace counts from the last sighting again.
    assert tracker.observe(131, {0: ["game"]}) == ReclaimChanges()
    assert tracker.observe(160, {}) == ReclaimChanges()
    assert tracker.observe(161, {}) == ReclaimChanges(offered=[0])
    assert tracker.held == {}
    assert tracker.observe(162, {}) == ReclaimChanges()  # offered once
    assert tracker.observe(163, {0: ["game"]}) == ReclaimChanges(reclaimed={0: ["game"]})


def test_gpus_are_reclaimed_and_offered_each_on_its_own() -> None:
    tracker = ReclaimTracker(grace=5)
    assert tracker.observe(0, {0: ["a"], 2: ["b"]}).reclaimed == {0: ["a"], 2: ["b"]}
    assert tracker.observe(3, {2: ["b"]}) == ReclaimChanges()
    assert tracker.observe(5, {2: ["b"]}) == ReclaimChanges(offered=[0])
    assert tracker.observe(6, {1: ["c"]}) == ReclaimChanges(reclaimed={1: ["c"]})
    assert tracker.observe(11, {}) == ReclaimChanges(offered=[1, 2])


def test_a_zero_grace_offers_at_the_first_look_without_owner_processes() -> None:
    tracker = ReclaimTracker(grace=0)
    tracker.observe(0, {0: ["game"]})
    assert tracker.observe(0.5, {}) == ReclaimChanges(offered=[0])


def test_the_grace_may_change_between_looks_and_release_all_forgets() -> None:
    tracker = ReclaimTracker(grace=60)
    tracker.observe(0, {0: ["game"], 1: ["x"]})
    tracker.grace = 2  # `config set reclaim_grace 2s` while sharing
    assert tracker.observe(2, {1: ["x"]}) == ReclaimChanges(offered=[0])
    assert tracker.release_all() == [1]
    assert tracker.held == {}


# --- which processes are GPUMesh's ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        # cgroup v1 under the cgroupfs driver (several hierarchies, one container)
        (f"12:memory:/docker/{ID_A}\n11:pids:/docker/{ID_A}\n0::/\n", {ID_A}),
        # cgroup v2 under systemd
        (f"0::/system.slice/docker-{ID_A}.scope\n", {ID_A}),
        # containerd under Kubernetes, a nested path
        (f"0::/kubepods/besteffort/pod1/cri-containerd-{ID_B}.scope\n", {ID_B}),
        # Docker in Docker: both the outer and the inner container
        (f"0::/docker/{ID_A}/docker/{ID_B}\n", {ID_A, ID_B}),
        # not in a container: a desktop session
        ("0::/user.slice/user-1000.slice/session-2.scope\n", set()),
        ("", set()),
        # a 64-hex id inside a longer run of hex is not an id
        (f"0::/x/{ID_A}b\n", set()),
        # the hierarchy's name is not a path
        (f"{ID_A}:cpu:/\n", set()),
    ],
)
def test_container_ids_are_read_from_cgroup_paths(text: str, ids: set[str]) -> None:
    assert container_ids(text) == ids


def test_the_owners_processes_are_all_but_gpumeshs_and_the_ignored() -> None:
    processes = [
        GpuProcess(0, 10, "Xorg", "graphics"),
        GpuProcess(0, 11, "python3", "compute"),  # a job's (its pid is ours)
        GpuProcess(1, 12, "game", "graphics"),
        GpuProcess(1, 13, "xorg", "graphics"),  # names compare case and all
        GpuProcess(1, 14, "", "compute"),
        GpuProcess(1, 12, "game", "compute"),  # one process on two lists
    ]
    owners = owner_processes(processes, ours={11}, ignore=ignored_names(RECLAIM_IGNORE))
    assert owners == {1: ["game", "pid 14", "xorg"]}
    assert owner_processes(processes, ours={11, 12, 13, 14}, ignore={"Xorg"}) == {}


def test_ignored_names_split_on_commas() -> None:
    assert ignored_names("Xorg, gnome-shell,,") == {"Xorg", "gnome-shell"}
    assert ignored_names("") == frozenset()
    assert ignored_names("@desktop,steam") >= {"steam", "Xorg", "plasmashell"}
    assert "@desktop" not in ignored_names("@desktop")


# --- the inventory's processes ------------------------------------------------------------------


def test_the_simulated_process_file_is_parsed() -> None:
    text = "# the owner\n1 4242 game graphics\n\n0 77 trainer   # a comment\n0 78 x compute\n"
    assert parse_simulated_processes(text, gpus=2) == [
        GpuProcess(1, 4242, "game", "graphics"),
        GpuProcess(0, 77, "trainer", "compute"),
        GpuProcess(0, 78, "x", "compute"),
    ]


@pytest.mark.parametrize(
    "line",
    ["1 4242", "x 4242 game", "1 -5 game", "1 4242 game sideways", "2 4242 game", "1 2 a b c"],
)
def test_a_malformed_simulated_process_line_names_the_variable(line: str) -> None:
    with pytest.raises(ConfigError, match=f"{ENV_SIMULATED_PROCESSES}: line 2 ") as info:
        parse_simulated_processes(f"0 1 ok\n{line}\n", gpus=2)
    assert "\n" not in info.value.message


def test_the_simulated_inventory_rereads_its_process_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = tmp_path / "processes"
    inventory = SimulatedInventory("A:24GB,B:24GB")
    assert inventory.processes() == []  # no variable: none
    monkeypatch.setenv(ENV_SIMULATED_PROCESSES, str(listing))
    assert inventory.processes() == []  # no file yet: none
    listing.write_text("1 4242 game graphics\n")
    assert inventory.processes() == [GpuProcess(1, 4242, "game", "graphics")]
    listing.write_text("")
    assert inventory.processes() == []
    assert inventory.process_memory() == {}


def test_nvml_lists_compute_and_graphics_processes_and_skips_what_it_cannot_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = _fake_pynvml(_TWO_DEVICES)
    me = os.getpid()

    def compute(handle: str) -> list[SimpleNamespace]:
        if handle == "handle-1":
            raise FakeNVMLError("Not Supported")
        return [SimpleNamespace(pid=me, usedGpuMemory=3 * GB)]

    def graphics(handle: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=999_999_999, usedGpuMemory=None)]

    module.nvmlDeviceGetComputeRunningProcesses = compute  # type: ignore[attr-defined]
    module.nvmlDeviceGetGraphicsRunningProcesses = graphics  # type: ignore[attr-defined]
    module.nvmlSystemGetProcessName = lambda pid: b"/usr/games/somegame-with-a-long-name"  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "pynvml", module)
    monkeypatch.setattr("gpumesh.gpu.inventory.pynvml", module)
    inventory = NvmlInventory()
    comm = Path(f"/proc/{me}/comm").read_text().strip()
    assert inventory.processes() == [
        GpuProcess(0, me, comm, "compute", 3 * GB),
        GpuProcess(0, 999_999_999, "somegame-with-a", "graphics", 0),  # no /proc entry
        GpuProcess(1, 999_999_999, "somegame-with-a", "graphics", 0),
    ]
    assert inventory.process_memory() == {me: 3 * GB}  # compute only, as before
    # An nvidia-ml-py without the graphics list: the compute one still counts.
    del module.nvmlDeviceGetGraphicsRunningProcesses  # type: ignore[attr-defined]
    assert [p.kind for p in inventory.processes()] == ["compute"]


def test_nvidia_smi_compute_apps_are_mapped_to_gpu_indexes() -> None:
    text = (
        "GPU-aaa, 999999998, /opt/my, app/train, 2048\n"
        "GPU-bbb, 999999999, python3, [N/A]\n"
        "GPU-gone, 5, x, 1\n"
        "short, line\n"
    )
    found = parse_compute_apps(text, {"GPU-aaa": 0, "GPU-bbb": 1})
    assert found == [
        GpuProcess(0, 999999998, "train", "compute", 2048 * 1024 * 1024),
        GpuProcess(1, 999999999, "python3", "compute", 0),
    ]
    assert memory_by_pid(found) == {999999998: 2048 * 1024 * 1024, 999999999: 0}


# --- settings -----------------------------------------------------------------------------------


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return Config.load(tmp_path / "config.toml")


def test_reclaim_settings_have_their_defaults(config: Config) -> None:
    assert config.get("reclaim_on_gpu_use") is True
    assert config.get("reclaim_grace") == "30s"
    assert config.get("reclaim_ignore") == "@desktop"
    assert ignored_names(config.get("reclaim_ignore")) == {
        "Xorg",
        "Xwayland",
        "gnome-shell",
        "kwin_wayland",
        "plasmashell",
    }


@pytest.mark.parametrize(
    ("key", "value", "stored"),
    [
        ("reclaim_grace", "2s", "2s"),
        ("reclaim_grace", "0", "0"),
        ("reclaim_grace", " 1m30s ", "1m30s"),
        ("reclaim_on_gpu_use", "off", False),
        ("reclaim_ignore", "Xorg, steam ,obs", "Xorg,steam,obs"),
        ("reclaim_ignore", "", ""),
        ("reclaim_ignore", "@desktop,steam", "@desktop,steam"),
    ],
)
def test_good_reclaim_settings_are_kept(config: Config, key: str, value: str, stored: Any) -> None:
    assert config.set(key, value) == stored


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "reclaim_grace",
            "soon",
            "invalid reclaim_grace 'soon': use a duration such as 30s, 2m or 0 (stop at once)",
        ),
        (
            "reclaim_grace",
            "-5s",
            "invalid reclaim_grace '-5s': it cannot be negative; use a duration such as 30s, 2m "
            "or 0 (stop at once)",
        ),
        (
            "reclaim_ignore",
            "Xorg,,steam",
            "invalid reclaim_ignore 'Xorg,,steam': give process names separated by commas, as "
            "`ps -o comm` shows them (e.g. Xorg,gnome-shell), without spaces or paths",
        ),
        ("reclaim_ignore", "/usr/bin/Xorg", "without spaces or paths"),
        ("reclaim_ignore", "my game", "without spaces or paths"),
        (
            "reclaim_ignore",
            "kwin_wayland_wrapper",
            "invalid reclaim_ignore name 'kwin_wayland_wrapper': the kernel keeps the first 15 "
            "characters of a process name; use 'kwin_wayland_wr'",
        ),
        (
            "reclaim_ignore",
            "@games",
            "invalid reclaim_ignore name '@games': the one group is @desktop (Xorg, Xwayland, "
            "gnome-shell, kwin_wayland, plasmashell); give other processes by name",
        ),
        ("reclaim_on_gpu_use", "maybe", "use true or false"),
    ],
)
def test_bad_reclaim_settings_are_refused_in_one_line(
    config: Config, key: str, value: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        config.set(key, value)
    assert message in info.value.message
    assert "\n" not in info.value.message
    assert config.source(key) == "default"


# --- the allocator and placement ----------------------------------------------------------------


def _allocator() -> GpuAllocator:
    inventory = SimulatedInventory("A:24GB,B:24GB")
    return GpuAllocator(lambda: inventory, provider="alice-pc")


def test_a_withheld_gpu_gets_no_new_holder_and_says_whose_it_is() -> None:
    gpus = _allocator()
    job = Holder(HolderKind.JOB, "j")

    async def scenario() -> None:
        gpus.withhold("1", "game")
        assert gpus.withheld() == {"1": "game"}
        assert await gpus.reserve(job, 10 * GB) == ["0"]
        with pytest.raises(LimitError) as info:
            await gpus.reserve(job, 10 * GB, preferred="1")
        assert info.value.message == (
            "GPU 1 (game) of alice-pc is in use by its owner; try again later or another peer"
        )
        with pytest.raises(LimitError, match=r"is 24GB .*; GPU 1 \(game\) of alice-pc is in use"):
            await gpus.reserve(job, 30 * GB)
        gpus.withhold("0", "blender")
        with pytest.raises(LimitError) as info:
            await gpus.reserve(job, 1 * GB)
        assert info.value.message == (
            "GPU 0 (blender) and GPU 1 (game) of alice-pc are in use by its owner; try again "
            "later or another peer"
        )
        # A holder that asks for no GPU memory runs on the CPUs meanwhile.
        assert await gpus.reserve(job, 0) == []
        report, _ = await gpus.report()
        assert [(g.owner, g.available) for g in report] == [("blender", 0), ("game", 0)]
        gpus.offer("1")
        gpus.offer("1")  # twice is harmless
        assert await gpus.reserve(job, 10 * GB) == ["1"]
        report, _ = await gpus.report()
        assert [(g.owner, g.available) for g in report] == [("blender", 0), ("", 14 * GB)]

    asyncio.run(scenario())


def test_placement_skips_a_gpu_its_owner_uses_and_says_why() -> None:
    owned = msgspec.structs.replace(_gpu(24 * GB), owner="game", available=0)
    candidate = evaluate(_probe("alice-pc", [owned], 0), 0)
    assert not candidate.eligible
    assert candidate.reason == "busy (GPU 0 in use by its owner (game))"
    other = msgspec.structs.replace(_gpu(20 * GB), index=1)
    candidate = evaluate(_probe("alice-pc", [owned, other], 0), GB)
    assert candidate.eligible and candidate.gpu == other


# --- one look of the reclaimer -----------------------------------------------------------------


class _Inventory(SimulatedInventory):
    def __init__(self) -> None:
        super().__init__("A:24GB,B:24GB")
        self.now: list[GpuProcess] = []

    def processes(self) -> list[GpuProcess]:
        return list(self.now)


class _Guests:
    def __init__(self, jobs: list[Any]) -> None:
        self.jobs = jobs
        self.lines: list[str] = []
        self.preempted: list[tuple[str, str, float]] = []

    def report(self, line: str) -> None:
        self.lines.append(line)

    async def preempt(self, job_id: str, reason: str, grace: float) -> Any:
        self.preempted.append((job_id, reason, grace))
        self.jobs = [j for j in self.jobs if j.job_id != job_id]
        return None


def _reclaimer(
    settings: dict[str, Any], cgroups: dict[int, str], listed: list[str]
) -> tuple[GpuReclaimer, _Inventory, _Guests, list[float], list[int]]:
    inventory = _Inventory()
    gpus = GpuAllocator(lambda: inventory, provider="alice-pc")
    guests = _Guests(
        [
            SimpleNamespace(job_id="j0", gpus=["0"]),
            SimpleNamespace(job_id="j1", gpus=["1"]),
            SimpleNamespace(job_id="cpu", gpus=[]),
        ]
    )
    clock = [0.0]
    listings: list[int] = []

    def list_jobs(node_id: str) -> list[Any]:
        assert node_id == "node-a"
        listings.append(1)
        return [SimpleNamespace(container_id=c) for c in listed]

    reclaimer = GpuReclaimer(
        Provider("alice-pc", "node-a", "127.0.0.1"),
        SimpleNamespace(get=settings.__getitem__),
        gpus,
        SimpleNamespace(runtime=SimpleNamespace(list_jobs=list_jobs)),
        guests,
        workers=lambda: [555],
        jobs=lambda: guests.jobs,
        clock=lambda: clock[0],
        cgroup=lambda pid: cgroups.get(pid, ""),
    )
    return reclaimer, inventory, guests, clock, listings


def test_a_look_reclaims_only_the_owners_gpu_and_preempts_only_its_jobs() -> None:
    settings = {"reclaim_on_gpu_use": True, "reclaim_grace": "2s", "reclaim_ignore": "Xorg"}
    cgroups = {30: f"0::/docker/{ID_A}\n", 31: f"0::/docker/{ID_B}\n"}
    reclaimer, inventory, guests, clock, listings = _reclaimer(settings, cgroups, [ID_A])

    async def scenario() -> None:
        inventory.now = [
            GpuProcess(0, 10, "Xorg", "graphics"),  # ignored
            GpuProcess(0, 30, "python3", "compute"),  # in a container of this node's
            GpuProcess(0, 555, "python3", "compute"),  # a CUDA session's worker
        ]
        assert await reclaimer.look() == ReclaimChanges()
        assert listings == [1]  # the unknown container id made it ask Docker once
        assert await reclaimer.look() == ReclaimChanges()
        assert listings == [1]  # known now
        assert guests.preempted == [] and reclaimer.gpus.withheld() == {}
        # The owner's own container counts as the owner's; so does a game.
        inventory.now += [
            GpuProcess(1, 31, "ollama", "compute"),
            GpuProcess(1, 40, "game", "graphics"),
        ]
        changes = await reclaimer.look()
        assert changes.reclaimed == {1: ["game", "ollama"]}
        assert listings == [1, 1]
        await asyncio.sleep(0)  # the preemptions run as tasks
        assert guests.preempted == [("j1", "alice-pc's owner is using GPU 1 (game, ollama)", 2.0)]
        assert reclaimer.gpus.withheld() == {"1": "game, ollama"}
        assert guests.lines == ["GPU 1 is in use by its owner (game, ollama): reclaimed"]
        # Gone: offered again once the grace passed without them.
        inventory.now = inventory.now[:3]
        clock[0] = 1.0
        assert await reclaimer.look() == ReclaimChanges()
        clock[0] = 2.0
        assert await reclaimer.look() == ReclaimChanges(offered=[1])
        assert reclaimer.gpus.withheld() == {}
        assert guests.lines[-1] == "GPU 1 offered again: no process of its owner's used it for 2s"
        assert [p[0] for p in guests.preempted] == ["j1"]
        assert reclaimer.looks == 5

    asyncio.run(scenario())


def test_switching_reclaim_off_offers_every_reclaimed_gpu_at_the_next_look() -> None:
    settings = {"reclaim_on_gpu_use": True, "reclaim_grace": "1h", "reclaim_ignore": ""}
    reclaimer, inventory, guests, _clock, _listings = _reclaimer(settings, {}, [])

    async def scenario() -> None:
        inventory.now = [GpuProcess(0, 40, "game", "graphics")]
        assert (await reclaimer.look()).reclaimed == {0: ["game"]}
        await asyncio.sleep(0)
        assert [p[0] for p in guests.preempted] == ["j0"]
        settings["reclaim_on_gpu_use"] = False
        assert await reclaimer.look() == ReclaimChanges()
        assert reclaimer.gpus.withheld() == {}
        assert guests.lines[-1] == "GPU 0 offered again: reclaim_on_gpu_use is off"

    asyncio.run(scenario())
