"""gpu/inventory: where GPU facts come from.

``nvidia-smi`` CSV output is parsed from fixture files shaped like the real
thing, and run through a fake ``nvidia-smi`` script written into a temporary
folder. NVML is faked with a stand-in ``pynvml`` module because there is no
NVIDIA hardware (or driver) on the machines these tests run on; the real
``pynvml`` module is only ever made to fail.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.errors import ConfigError
from gpumesh.gpu import inventory as inv
from gpumesh.gpu.inventory import (
    ENV_SIMULATED,
    GpuInfo,
    NoGpus,
    NvidiaSmiInventory,
    NvmlInventory,
    SimulatedInventory,
    detect_inventory,
    parse_nvidia_smi_csv,
)

FIXTURES = Path(__file__).parent / "fixtures"
MIB = 1024 * 1024
SMI_ARGS = [
    "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,temperature.gpu",
    "--format=csv,noheader,nounits",
]


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --- parse_nvidia_smi_csv --------------------------------------------------------------------


def test_parse_one_gpu() -> None:
    gpus = parse_nvidia_smi_csv(_fixture("nvidia_smi_1_rtx4090.csv"))
    assert gpus == [
        GpuInfo(
            index=0,
            uuid="GPU-3f9a1c2e-7b4d-4e8a-9c61-0d2b5e8f4a17",
            name="NVIDIA GeForce RTX 4090",
            memory_total=24564 * MIB,
            memory_used=1187 * MIB,
            utilization=7,
            temperature=43,
        )
    ]
    assert gpus[0].memory_free == (24564 - 1187) * MIB


def test_parse_eight_gpus() -> None:
    gpus = parse_nvidia_smi_csv(_fixture("nvidia_smi_8_h100.csv"))
    assert [g.index for g in gpus] == list(range(8))
    assert {g.name for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert all(g.memory_total == 81559 * MIB for g in gpus)
    assert len({g.uuid for g in gpus}) == 8
    assert all(g.uuid.startswith("GPU-") and " " not in g.uuid for g in gpus)
    assert [g.memory_used // MIB for g in gpus] == [79821, 79821, 42113, 3, 3, 0, 12288, 81001]
    assert [g.utilization for g in gpus] == [100, 99, 58, 0, 0, 0, 13, 100]
    assert [g.temperature for g in gpus] == [67, 65, 54, 31, 30, 29, 38, 71]
    assert gpus[5].memory_free == 81559 * MIB
    assert gpus[7].memory_free == (81559 - 81001) * MIB


def test_parse_not_available_and_not_supported_values_become_none() -> None:
    gpus = parse_nvidia_smi_csv(_fixture("nvidia_smi_na_values.csv"))
    assert [(g.name, g.utilization, g.temperature) for g in gpus] == [
        ("NVIDIA A100-SXM4-80GB", None, 36),
        ("Tesla K80", None, None),
        ("NVIDIA GeForce GTX 1060 6GB", None, None),
    ]
    # Memory is still read on the same lines.
    assert [g.memory_total for g in gpus] == [81920 * MIB, 11441 * MIB, 6144 * MIB]
    assert [g.memory_used for g in gpus] == [29184 * MIB, 0, 412 * MIB]


def test_parse_ignores_trailing_blank_lines() -> None:
    text = _fixture("nvidia_smi_trailing_blank_lines.csv")
    assert text.endswith("\n\n\n")
    gpus = parse_nvidia_smi_csv(text)
    assert [(g.index, g.name) for g in gpus] == [(0, "Tesla T4"), (1, "NVIDIA L4")]
    assert gpus[1].memory_used == 20480 * MIB


def test_parse_windows_line_endings_and_blank_lines_between() -> None:
    text = _fixture("nvidia_smi_1_rtx4090.csv").strip() + "\r\n\r\n"
    text += "1, GPU-x, NVIDIA RTX A6000, 49140, 0, 0, 30\r\n"
    gpus = parse_nvidia_smi_csv(text)
    assert [g.name for g in gpus] == ["NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000"]
    assert gpus[1].temperature == 30


@pytest.mark.parametrize("text", ["", "\n", "  \n\n"])
def test_parse_empty_output_is_no_gpus(text: str) -> None:
    assert parse_nvidia_smi_csv(text) == []


def test_parse_skips_short_lines() -> None:
    text = "No devices were found\n0, GPU-a, Tesla T4, 15360, 0, 0, 27\n"
    assert [g.name for g in parse_nvidia_smi_csv(text)] == ["Tesla T4"]


def test_parse_unknown_memory_is_zero_bytes() -> None:
    gpus = parse_nvidia_smi_csv("0, GPU-a, NVIDIA A100 MIG, [N/A], [N/A], [N/A], [N/A]\n")
    assert gpus[0].memory_total == 0
    assert gpus[0].memory_used == 0
    assert gpus[0].memory_free == 0


_NAMES = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 -_", min_size=1
)
_OPTIONAL = st.one_of(st.none(), st.integers(min_value=0, max_value=100))


@given(
    rows=st.lists(
        st.tuples(
            _NAMES.map(str.strip).filter(bool),
            st.integers(min_value=0, max_value=200_000),
            st.integers(min_value=0, max_value=200_000),
            _OPTIONAL,
            _OPTIONAL,
            st.sampled_from(["[N/A]", "[Not Supported]"]),
        ),
        max_size=16,
    )
)
def test_parse_round_trips_what_nvidia_smi_prints(
    rows: list[tuple[str, int, int, int | None, int | None, str]],
) -> None:
    lines = []
    expected = []
    for index, (name, total, used, util, temp, missing) in enumerate(rows):
        uuid = f"GPU-{index:08x}-0000-0000-0000-000000000000"
        util_text = missing if util is None else str(util)
        temp_text = missing if temp is None else str(temp)
        lines.append(f"{index}, {uuid}, {name}, {total}, {used}, {util_text}, {temp_text}")
        expected.append(GpuInfo(index, uuid, name, total * MIB, used * MIB, util, temp))
    assert parse_nvidia_smi_csv("\n".join(lines) + "\n") == expected


# --- GpuInfo ---------------------------------------------------------------------------------


def test_memory_free_is_total_minus_used_never_negative() -> None:
    assert GpuInfo(0, "u", "n", memory_total=100, memory_used=30).memory_free == 70
    assert GpuInfo(0, "u", "n", memory_total=100, memory_used=100).memory_free == 0
    assert GpuInfo(0, "u", "n", memory_total=100, memory_used=130).memory_free == 0


def test_gpu_info_defaults_and_is_frozen() -> None:
    gpu = GpuInfo(0, "u", "n", memory_total=1, memory_used=0)
    assert gpu.utilization is None
    assert gpu.temperature is None
    with pytest.raises(AttributeError):
        gpu.memory_used = 1  # type: ignore[misc]


# --- NvidiaSmiInventory against a fake nvidia-smi ---------------------------------------------


def _fake_smi(folder: Path, *, fixture: str | None = None, exit_code: int = 0) -> Path:
    """An executable ``nvidia-smi`` that insists on the exact query, then prints ``fixture``.

    Wrong arguments exit 2 (so a changed query is not silently accepted).
    """
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    output = (FIXTURES / fixture).read_text() if fixture else ""
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"if sys.argv[1:] != {SMI_ARGS!r}:\n"
        "    sys.stderr.write('unexpected arguments: %r' % (sys.argv[1:],))\n"
        "    sys.exit(2)\n"
        f"sys.stdout.write({output!r})\n"
        f"if {exit_code}:\n"
        "    sys.stderr.write('NVIDIA-SMI has failed because it could not communicate "
        "with the NVIDIA driver.')\n"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(0o755)
    return script


def test_nvidia_smi_inventory_runs_the_query_and_parses_it(tmp_path: Path) -> None:
    script = _fake_smi(tmp_path, fixture="nvidia_smi_8_h100.csv")
    inventory = NvidiaSmiInventory(str(script))
    assert inventory.source == "nvidia-smi"
    gpus = inventory.gpus()
    assert gpus == parse_nvidia_smi_csv(_fixture("nvidia_smi_8_h100.csv"))
    assert len(gpus) == 8


def test_fake_nvidia_smi_refuses_a_different_query(tmp_path: Path) -> None:
    """Guards the guard: the fake really checks the arguments."""
    script = _fake_smi(tmp_path, fixture="nvidia_smi_1_rtx4090.csv")
    result = subprocess.run(
        [str(script), "--query-gpu=index,name", "--format=csv"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""


@pytest.mark.parametrize("exit_code", [1, 9, 255])
def test_nvidia_smi_failing_means_no_gpus(tmp_path: Path, exit_code: int) -> None:
    # Even output printed before failing is not trusted.
    script = _fake_smi(tmp_path, fixture="nvidia_smi_1_rtx4090.csv", exit_code=exit_code)
    assert NvidiaSmiInventory(str(script)).gpus() == []


def test_nvidia_smi_with_no_output_means_no_gpus(tmp_path: Path) -> None:
    script = _fake_smi(tmp_path)
    assert NvidiaSmiInventory(str(script)).gpus() == []


def test_nvidia_smi_hanging_means_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    script.chmod(0o755)
    real_run = subprocess.run

    def quick_run(*args: object, **kwargs: object) -> object:
        kwargs["timeout"] = 0.5  # the real limit is 10s; same path, less waiting
        return real_run(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(inv.subprocess, "run", quick_run)
    assert NvidiaSmiInventory(str(script)).gpus() == []


# --- SimulatedInventory ----------------------------------------------------------------------


def test_simulated_inventory_parses_declarations() -> None:
    inventory = SimulatedInventory("RTX-4090:24GB,A100:80GB:10GB")
    assert inventory.source == "simulated"
    assert inventory.gpus() == [
        GpuInfo(
            index=0,
            uuid="GPU-simulated-0",
            name="RTX-4090",
            memory_total=24 * 10**9,
            memory_used=0,
            utilization=0,
            temperature=None,
        ),
        GpuInfo(
            index=1,
            uuid="GPU-simulated-1",
            name="A100",
            memory_total=80 * 10**9,
            memory_used=10 * 10**9,
            utilization=0,
            temperature=None,
        ),
    ]
    assert [g.memory_free for g in inventory.gpus()] == [24 * 10**9, 70 * 10**9]


def test_simulated_inventory_binary_units_spaces_and_empty_items() -> None:
    gpus = SimulatedInventory(" T4:16GiB:512MiB , ,L4:24GB,").gpus()
    assert [(g.index, g.name) for g in gpus] == [(0, "T4"), (1, "L4")]
    assert gpus[0].memory_total == 16 * 2**30
    assert gpus[0].memory_free == 16 * 2**30 - 512 * 2**20
    assert [g.uuid for g in gpus] == ["GPU-simulated-0", "GPU-simulated-1"]


def test_simulated_inventory_gpus_returns_a_copy() -> None:
    inventory = SimulatedInventory("T4:16GB")
    inventory.gpus().clear()
    assert len(inventory.gpus()) == 1


@pytest.mark.parametrize(
    "declaration",
    [
        "RTX-4090",
        "RTX-4090:24GB,A100",
        "A100:80GB:10GB:1GB",
        "A100:lots",
        "A100:80GB:some",
        "A100:",
        "A100:80XB",
    ],
)
def test_simulated_inventory_refuses_bad_declarations(declaration: str) -> None:
    with pytest.raises(ConfigError):
        SimulatedInventory(declaration)


def test_simulated_inventory_refusal_names_the_variable_and_the_item() -> None:
    with pytest.raises(ConfigError) as caught:
        SimulatedInventory("T4:16GB,oops")
    assert ENV_SIMULATED in str(caught.value)
    assert "'oops'" in str(caught.value)
    assert "NAME:MEMORY" in str(caught.value)


# --- NvmlInventory with a fake pynvml --------------------------------------------------------


class FakeNVMLError(Exception):
    pass


def _fake_pynvml(
    devices: list[dict[str, object]],
    *,
    init_error: bool = False,
) -> types.ModuleType:
    """A stand-in ``pynvml``: NVML is faked because there is no NVIDIA hardware here.

    Each device is a dict with name, uuid, total, used and optionally util/temp
    (an int, or None to make that call raise NVMLError as unsupported devices do).
    """
    module = types.ModuleType("pynvml")
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def handle(index: int) -> str:
        return f"handle-{index}"

    def device(handle: str) -> dict[str, object]:
        assert handle.startswith("handle-"), handle
        return devices[int(handle.removeprefix("handle-"))]

    def memory(handle: str) -> SimpleNamespace:
        d = device(handle)
        total, used = int(d["total"]), int(d["used"])  # type: ignore[call-overload]
        return SimpleNamespace(total=total, used=used, free=total - used)

    def utilization(handle: str) -> SimpleNamespace:
        value = device(handle).get("util")
        if value is None:
            raise FakeNVMLError("Not Supported")
        return SimpleNamespace(gpu=value, memory=0)

    def temperature(handle: str, sensor: int) -> int:
        assert sensor == 0  # NVML_TEMPERATURE_GPU
        value = device(handle).get("temp")
        if value is None:
            raise FakeNVMLError("Not Supported")
        return int(value)  # type: ignore[call-overload]

    module.calls = calls  # type: ignore[attr-defined]
    module.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    module.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    module.nvmlDeviceGetUtilizationRates = utilization  # type: ignore[attr-defined]
    module.nvmlDeviceGetTemperature = temperature  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda h: device(h)["name"]  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda h: device(h)["uuid"]  # type: ignore[attr-defined]
    return module


_TWO_DEVICES: list[dict[str, object]] = [
    {
        # Older nvidia-ml-py returns bytes for names and UUIDs...
        "name": b"NVIDIA H100 80GB HBM3",
        "uuid": b"GPU-8b2e4f61-1c3a-4d7e-a5b9-6f0e2d1c3b48",
        "total": 85520809984,
        "used": 565444608,
        "util": 12,
        "temp": 34,
    },
    {
        # ...newer releases return str.
        "name": "NVIDIA GeForce RTX 4090",
        "uuid": "GPU-3f9a1c2e-7b4d-4e8a-9c61-0d2b5e8f4a17",
        "total": 25757220864,
        "used": 25757220864 - 1024,
        "util": None,
        "temp": None,
    },
]


def test_nvml_inventory_reads_every_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML is faked (a stand-in pynvml module): there is no NVIDIA hardware here."""
    fake = _fake_pynvml(_TWO_DEVICES)
    monkeypatch.setattr(inv, "pynvml", fake)
    inventory = NvmlInventory()
    assert fake.calls == ["init"]  # type: ignore[attr-defined]
    assert inventory.source == "nvml"
    assert inventory.gpus() == [
        GpuInfo(
            index=0,
            uuid="GPU-8b2e4f61-1c3a-4d7e-a5b9-6f0e2d1c3b48",
            name="NVIDIA H100 80GB HBM3",
            memory_total=85520809984,
            memory_used=565444608,
            utilization=12,
            temperature=34,
        ),
        GpuInfo(
            index=1,
            uuid="GPU-3f9a1c2e-7b4d-4e8a-9c61-0d2b5e8f4a17",
            name="NVIDIA GeForce RTX 4090",
            memory_total=25757220864,
            memory_used=25757220864 - 1024,
            utilization=None,
            temperature=None,
        ),
    ]
    assert inventory.gpus()[1].memory_free == 1024
    assert all(isinstance(g.name, str) and isinstance(g.uuid, str) for g in inventory.gpus())


def test_nvml_inventory_with_no_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML is faked (a stand-in pynvml module): there is no NVIDIA hardware here."""
    monkeypatch.setattr(inv, "pynvml", _fake_pynvml([]))
    assert NvmlInventory().gpus() == []


def test_nvml_inventory_init_failure_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML is faked (a stand-in pynvml module): there is no NVIDIA hardware here."""
    monkeypatch.setattr(inv, "pynvml", _fake_pynvml(_TWO_DEVICES, init_error=True))
    with pytest.raises(FakeNVMLError):
        NvmlInventory()


# --- detect_inventory ------------------------------------------------------------------------


@pytest.fixture
def no_gpu_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No simulated GPUs, NVML failing, and a PATH holding only an empty folder.

    Returns that folder: put a fake ``nvidia-smi`` there to make it found.
    """
    import pynvml

    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.delenv(ENV_SIMULATED, raising=False)
    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    return folder


def test_detect_simulated_env_var_wins(
    no_gpu_sources: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Even with working NVML and an nvidia-smi on PATH.
    monkeypatch.setattr(inv, "pynvml", _fake_pynvml(_TWO_DEVICES))
    _fake_smi(no_gpu_sources, fixture="nvidia_smi_8_h100.csv")
    monkeypatch.setenv(ENV_SIMULATED, "RTX-4090:24GB,A100:80GB:10GB")
    inventory = detect_inventory()
    assert isinstance(inventory, SimulatedInventory)
    assert inventory.source == "simulated"
    assert [g.name for g in inventory.gpus()] == ["RTX-4090", "A100"]


def test_detect_bad_simulated_declaration_is_refused(
    no_gpu_sources: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_SIMULATED, "RTX-4090")
    with pytest.raises(ConfigError):
        detect_inventory()


def test_detect_prefers_nvml(no_gpu_sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML is faked (a stand-in pynvml module): there is no NVIDIA hardware here."""
    monkeypatch.setattr(inv, "pynvml", _fake_pynvml(_TWO_DEVICES))
    _fake_smi(no_gpu_sources, fixture="nvidia_smi_8_h100.csv")
    monkeypatch.setenv(ENV_SIMULATED, "   ")  # blank counts as unset
    inventory = detect_inventory()
    assert isinstance(inventory, NvmlInventory)
    assert inventory.source == "nvml"
    assert len(inventory.gpus()) == 2


def test_detect_falls_back_to_nvidia_smi_when_nvml_fails(no_gpu_sources: Path) -> None:
    _fake_smi(no_gpu_sources, fixture="nvidia_smi_8_h100.csv")
    inventory = detect_inventory()
    assert isinstance(inventory, NvidiaSmiInventory)
    assert inventory.source == "nvidia-smi"
    assert len(inventory.gpus()) == 8


def test_detect_falls_back_to_nvidia_smi_without_pynvml(
    no_gpu_sources: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inv, "pynvml", None)  # no binding: its first call fails
    _fake_smi(no_gpu_sources, fixture="nvidia_smi_1_rtx4090.csv")
    inventory = detect_inventory()
    assert inventory.source == "nvidia-smi"
    assert [g.name for g in inventory.gpus()] == ["NVIDIA GeForce RTX 4090"]


def test_detect_with_neither_nvml_nor_nvidia_smi_is_no_gpus(no_gpu_sources: Path) -> None:
    inventory = detect_inventory()
    assert isinstance(inventory, NoGpus)
    assert inventory.source == "none"
    assert inventory.gpus() == []


def test_detect_ignores_a_non_executable_nvidia_smi(no_gpu_sources: Path) -> None:
    (no_gpu_sources / "nvidia-smi").write_text("not a program\n")
    assert detect_inventory().source == "none"
