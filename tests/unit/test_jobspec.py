"""client/jobspec: job files read with line numbers, flags merged over them, every refusal.

Each refusal is checked word for word: the message is the whole user
interface of a mistake, and must name the file, the line and the field.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.client.jobspec import (
    FIELDS,
    JobSpec,
    MountSpec,
    build_spec,
    load_job_file,
    parse_env,
)
from gpumesh.errors import ConfigError
from gpumesh.units import parse_duration

FULL = """\
# a complete job
image: pytorch/pytorch:latest
command: python train.py --lr 1e-3 'two words'
workdir: ./train
env:
  BATCH: 32
  DEBUG: yes
  LR: 1.10
  EMPTY: ""
gpu_memory: 8GB
retries: 2
timeout: 1h30m
peer: alice-pc
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def refusal(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_job_file(path)
    message = str(caught.value)
    assert "\n" not in message
    return message.replace(f"{path}:", "job.yaml:")


# --- reading a good file ---------------------------------------------------------------------


def test_full_file(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    job = load_job_file(write(tmp_path, FULL))
    assert job.image == "pytorch/pytorch:latest"
    assert job.command == ["python", "train.py", "--lr", "1e-3", "two words"]
    # Values stay as typed: YAML would read yes as True and 1.10 as 1.1.
    assert job.env == {"BATCH": "32", "DEBUG": "yes", "LR": "1.10", "EMPTY": ""}
    assert job.workdir == tmp_path / "train"
    assert job.gpu_memory == 8_000_000_000
    assert job.retries == 2
    assert job.timeout == 5400.0
    assert job.peer == "alice-pc"
    assert job.group is None
    assert job.lines == {
        "image": 2,
        "command": 3,
        "workdir": 4,
        "env": 5,
        "gpu_memory": 10,
        "retries": 11,
        "timeout": 12,
        "peer": 13,
    }


def test_list_forms(tmp_path: Path) -> None:
    job = load_job_file(
        write(
            tmp_path,
            "command: [sleep, 10, 1.50, 'a b']\nenv:\n  - A=1\n  - B=x=y\n  - C=\ngroup: lab\n",
        )
    )
    assert job.command == ["sleep", "10", "1.50", "a b"]
    assert job.env == {"A": "1", "B": "x=y", "C": ""}
    assert job.group == "lab"


def test_command_list_may_be_empty_and_block_style(tmp_path: Path) -> None:
    assert load_job_file(write(tmp_path, "command: []\n")).command == []
    block = "command:\n  - python\n  - -c\n  - print('hi')\n"
    assert load_job_file(write(tmp_path, block)).command == ["python", "-c", "print('hi')"]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("90", 90.0), ("2.5", 2.5), ("'90'", 90.0), ("30m", 1800.0), ("0", 0.0), ("1:30", 90.0)],
)
def test_timeout_values(tmp_path: Path, value: str, seconds: float) -> None:
    assert load_job_file(write(tmp_path, f"timeout: {value}\n")).timeout == seconds


def test_retries_as_quoted_number(tmp_path: Path) -> None:
    assert load_job_file(write(tmp_path, "retries: '3'\n")).retries == 3


def test_workdir_relative_to_the_file_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "exp" / "data").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    job = load_job_file(write(tmp_path / "exp", "workdir: data\n"))
    assert job.workdir == tmp_path / "exp" / "data"
    job = load_job_file(Path("exp/job.yaml"))
    assert job.workdir == tmp_path / "exp" / "data"


def test_workdir_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_job_file(write(tmp_path, "workdir: ~/proj\n")).workdir == tmp_path / "proj"


def test_a_workdir_under_an_unknown_users_home_is_refused_in_one_line(tmp_path: Path) -> None:
    # Path.expanduser raises RuntimeError for a user this machine does not know.
    unknown = "~gpumesh-no-such-user-9x/proj"
    with pytest.raises(ConfigError) as caught:
        build_spec(None, command=["x"], workdir=unknown)
    assert str(caught.value) == (
        f"{unknown}: this machine has no home folder for ~gpumesh-no-such-user-9x: "
        "give the folder's full path"
    )
    with pytest.raises(ConfigError, match=r"job\.yaml:1: workdir: ~gpumesh-no-such-user-9x/proj: "):
        load_job_file(write(tmp_path, f"workdir: {unknown}\n"))


@pytest.mark.parametrize("text", ["", "# nothing yet\n", "---\n", "~\n"])
def test_empty_file_sets_nothing(tmp_path: Path, text: str) -> None:
    job = load_job_file(write(tmp_path, text))
    assert job.image is None and job.command is None and job.env == {} and job.lines == {}


# --- refusals, each with file, line and field -----------------------------------------------------

REFUSALS = [
    # retries
    ("retries: many", "job.yaml:2: retries: must be a whole number from 0 to 20, got 'many'"),
    ("retries: 21", "job.yaml:2: retries: must be a whole number from 0 to 20, got 21"),
    ("retries: -1", "job.yaml:2: retries: must be a whole number from 0 to 20, got -1"),
    ("retries: 2.5", "job.yaml:2: retries: must be a whole number from 0 to 20, got 2.5"),
    ("retries: true", "job.yaml:2: retries: must be a whole number from 0 to 20, got true"),
    ("retries:", "job.yaml:2: retries: must be a whole number from 0 to 20, got nothing"),
    ("retries: ~", "job.yaml:2: retries: must be a whole number from 0 to 20, got nothing"),
    ("retries: [1]", "job.yaml:2: retries: must be a whole number from 0 to 20, got a list"),
    # timeout
    (
        "timeout: soon",
        "job.yaml:2: timeout: must be a number of seconds or a duration such as 90s, 30m "
        "or 2h (0 for no limit), got 'soon'",
    ),
    (
        "timeout: -5",
        "job.yaml:2: timeout: must be a number of seconds or a duration such as 90s, 30m "
        "or 2h (0 for no limit), got -5",
    ),
    (
        "timeout: .inf",
        "job.yaml:2: timeout: must be a number of seconds or a duration such as 90s, 30m "
        "or 2h (0 for no limit), got .inf",
    ),
    (
        "timeout: no",
        "job.yaml:2: timeout: must be a number of seconds or a duration such as 90s, 30m "
        "or 2h (0 for no limit), got no",
    ),
    # gpu_memory
    (
        "gpu_memory: 8 gigs",
        "job.yaml:2: gpu_memory: invalid size '8 gigs': use a number with a unit such as "
        "512MB, 8GB or 16GiB",
    ),
    (
        "gpu_memory: 8",
        "job.yaml:2: gpu_memory: 8 has no unit and would mean 8 bytes; write it with a unit, "
        "such as 8GB or 16GiB",
    ),
    (
        "gpu_memory:",
        "job.yaml:2: gpu_memory: is empty; give a size such as 8GB or remove the line",
    ),
    # image
    (
        "image: [a, b]",
        "job.yaml:2: image: must be an image name such as pytorch/pytorch:latest, got a list",
    ),
    (
        "image: 'my image'",
        "job.yaml:2: image: must be an image name such as pytorch/pytorch:latest, got 'my image'",
    ),
    (
        "image: ''",
        "job.yaml:2: image: is empty; give an image name such as pytorch/pytorch:latest "
        "or remove the line",
    ),
    # command
    (
        "command: {a: b}",
        "job.yaml:2: command: must be a command line or a list of arguments, got a mapping",
    ),
    (
        "command:",
        "job.yaml:2: command: is empty; give a command line or a list of arguments "
        "or remove the line",
    ),
    (
        "command: python -c \"print('x)",
        "job.yaml:2: command: no closing quotation; check the quotes",
    ),
    (
        "command:\n  - python\n  - [x]",
        "job.yaml:4: command: each argument must be text, got a list",
    ),
    ("command:\n  - python\n  -", "job.yaml:4: command: each argument must be text, got empty"),
    # env
    (
        "env:\n  OK: 1\n  BAD-KEY: 2",
        "job.yaml:4: env: 'BAD-KEY' is not a valid variable name: use letters, digits and _, "
        "not starting with a digit",
    ),
    (
        "env:\n  1ST: x",
        "job.yaml:3: env: '1ST' is not a valid variable name: use letters, digits and _, "
        "not starting with a digit",
    ),
    (
        "env:\n  NVIDIA_VISIBLE_DEVICES: all",
        "job.yaml:3: env: variables starting with NVIDIA_ are set by the provider, which "
        "decides which GPUs the job sees; remove it",
    ),
    ("env:\n  A: [1, 2]", "job.yaml:3: env: A: must be a single value, got a list"),
    ("env:\n  A:", 'job.yaml:3: env: A: has no value; write A: "" for an empty one'),
    ("env:\n  A: 1\n  A: 2", "job.yaml:4: env: A is set twice (first on line 3); keep one"),
    ("env:\n  [a]: 1", "job.yaml:3: invalid YAML: found unhashable key"),
    (
        "env:\n  - A=1\n  - FOO",
        "job.yaml:4: env: 'FOO': write it as KEY=VALUE, e.g. BATCH_SIZE=32",
    ),
    ("env:\n  - =x", "job.yaml:3: env: =...: the variable name before = is empty"),
    (
        "env:\n  - NVIDIA_DRIVER_CAPABILITIES=all",
        "job.yaml:3: env: 'NVIDIA_DRIVER_CAPABILITIES'=...: variables starting with NVIDIA_ "
        "are set by the provider, which decides which GPUs the job sees; remove it",
    ),
    ("env:\n  - A=1\n  - A=2", "job.yaml:4: env: A is set twice (first on line 3); keep one"),
    ("env:\n  - {A: 1}", "job.yaml:3: env: each item must be KEY=VALUE text, got a mapping"),
    (
        "env: A=1",
        "job.yaml:2: env: must be a mapping of NAME: value, or a list of NAME=value, got a "
        "single value",
    ),
    ('env:\n  A: "x\\0y"', "job.yaml:3: env: A: the value contains a NUL character"),
    # workdir, peer, group
    ("workdir: [a]", "job.yaml:2: workdir: must be a folder path, got a list"),
    ("peer: ''", "job.yaml:2: peer: is empty; give a peer name or remove the line"),
    ("group: {a: 1}", "job.yaml:2: group: must be a group name, got a mapping"),
    (
        "peer: alice\nretries: 1\ngroup: lab",
        "job.yaml:4: peer and group cannot both be set: run on one peer, or let GPUMesh pick "
        "from a group",
    ),
    # the file's shape
    (
        "gpu_mem: 8GB",
        "job.yaml:2: unknown field 'gpu_mem' (did you mean gpu_memory?); valid fields: image, "
        "command, env, workdir, gpu_memory, retries, timeout, peer, group, mounts, outputs, "
        "outputs_to, max_moves",
    ),
    (
        "image: x\ndetach: true",
        "job.yaml:3: unknown field 'detach'; valid fields: image, command, env, workdir, "
        "gpu_memory, retries, timeout, peer, group, mounts, outputs, outputs_to, max_moves",
    ),
    ("image: a\nimage: b", "job.yaml:3: image: set twice (first on line 2); keep one"),
    (
        "- image: x",
        "job.yaml:2: a job file is a set of fields such as 'image:' and 'command:', not a list",
    ),
    (
        "just text",
        "job.yaml:2: a job file is a set of fields such as 'image:' and 'command:', "
        "not a single value",
    ),
    # YAML itself
    (
        "image: x\n  command: y",
        "job.yaml:3: invalid YAML: mapping values are not allowed here; check the indentation "
        "and quotes",
    ),
    (
        "env:\n  A: 1\n B: 2",
        "job.yaml:4: invalid YAML: expected <block end>, but found '<block mapping start>'; "
        "check the indentation and quotes",
    ),
    (
        "image: x\n---\nimage: y",
        "job.yaml:3: invalid YAML: expected a single document in the stream, but found another "
        "document; check the indentation and quotes",
    ),
    (
        "image: *nowhere",
        "job.yaml:2: invalid YAML: found undefined alias 'nowhere'; check the indentation "
        "and quotes",
    ),
    (
        "env:\n\tA: 1",
        "job.yaml:3: invalid YAML: found character '\\t' that cannot start any token; "
        "check the indentation and quotes",
    ),
]


@pytest.mark.parametrize(("body", "expected"), REFUSALS, ids=[r[0][:30] for r in REFUSALS])
def test_refusal(tmp_path: Path, body: str, expected: str) -> None:
    assert refusal(tmp_path, "# first line\n" + body + "\n") == expected


def test_refusal_names_the_file_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "exp").mkdir()
    write(tmp_path / "exp", "retries: lots\n", "run.yaml")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^exp/run\.yaml:1: retries: "):
        load_job_file(Path("exp/run.yaml"))


@pytest.mark.parametrize(
    "body",
    [
        "env:\n  X: !!python/object/apply:os.system ['touch {marker}']",
        "image: !!python/object/apply:os.system ['touch {marker}']",
        "command: !!python/object/apply:os.system ['touch {marker}']",
        "retries: !!python/object/apply:os.system ['touch {marker}']",
        "timeout: !!python/name:os.system ''",
        "peer: !!python/name:os.system ''",
        "env:\n  X: !!python/name:os.system ''",
        "!!python/object/apply:os.system ['touch {marker}']",
    ],
)
def test_python_tags_are_refused_and_never_run(tmp_path: Path, body: str) -> None:
    marker = tmp_path / "ran"
    path = write(tmp_path, body.format(marker=marker) + "\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:\d: invalid YAML: could not "):
        load_job_file(path)
    assert not marker.exists()


def test_unknown_tag_is_a_yaml_error(tmp_path: Path) -> None:
    message = refusal(tmp_path, "image: x\nretries: !custom 3\n")
    assert message.startswith("job.yaml:2: invalid YAML: could not determine a constructor")


def test_nested_aliases_are_not_expanded(tmp_path: Path) -> None:
    # "Billion laughs": nine levels of nine aliases would be 9**9 items if expanded.
    levels = ["&l0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    message = refusal(tmp_path, f"command: [{', '.join(levels)}]\n")
    assert message == "job.yaml:1: command: each argument must be text, got a list"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as caught:
        load_job_file(path)
    assert str(caught.value) == f"job file {path} does not exist: check the path after -f"


def test_folder_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_job_file(tmp_path)
    assert str(caught.value) == (
        f"job file {tmp_path} is a folder: give the path of a YAML file such as job.yaml"
    )


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(b"image: x\ncommand: caf\xe9\n")
    with pytest.raises(ConfigError) as caught:
        load_job_file(path)
    assert str(caught.value) == f"{path}:2: not UTF-8 text; save the job file as UTF-8"


def test_control_character(tmp_path: Path) -> None:
    message = refusal(tmp_path, "image: x\ncommand: a\x07b\n")
    assert message == "job.yaml:2: invalid YAML: a character YAML does not allow; remove it"


def test_recursive_alias(tmp_path: Path) -> None:
    message = refusal(tmp_path, "image: x\ncommand: &a [*a]\n")
    assert message == "job.yaml:2: invalid YAML: found unconstructable recursive node"


# --- parse_env ---------------------------------------------------------------------------------


def test_parse_env() -> None:
    assert parse_env(["A=1", "B=x=y=z", "C=", "_u9=ok", "A=2"]) == {
        "A": "2",
        "B": "x=y=z",
        "C": "",
        "_u9": "ok",
    }
    assert parse_env([]) == {}


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("FOO", "--env 'FOO': write it as KEY=VALUE, e.g. BATCH_SIZE=32"),
        ("=x", "--env =...: the variable name before = is empty"),
        (
            "MY-VAR=1",
            "--env 'MY-VAR'=...: 'MY-VAR' is not a valid variable name: use letters, digits "
            "and _, not starting with a digit",
        ),
        (
            "9A=1",
            "--env '9A'=...: '9A' is not a valid variable name: use letters, digits and _, "
            "not starting with a digit",
        ),
        (
            " A=1",
            "--env ' A'=...: ' A' is not a valid variable name: use letters, digits and _, "
            "not starting with a digit",
        ),
        (
            "NVIDIA_VISIBLE_DEVICES=all",
            "--env 'NVIDIA_VISIBLE_DEVICES'=...: variables starting with NVIDIA_ are set by "
            "the provider, which decides which GPUs the job sees; remove it",
        ),
        ("A=x\0y", "--env 'A'=...: the value contains a NUL character"),
    ],
)
def test_parse_env_refusals(item: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_env(["OK=1", item])
    assert str(caught.value) == expected


def test_lowercase_nvidia_is_an_ordinary_variable() -> None:
    assert parse_env(["nvidia_thing=1"]) == {"nvidia_thing": "1"}


_KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True).filter(
    lambda key: not key.startswith("NVIDIA_")
)
_VALUES = st.text(st.characters(codec="utf-8", exclude_characters="\0"))


@given(st.dictionaries(_KEYS, _VALUES, max_size=8))
def test_parse_env_round_trip(env: dict[str, str]) -> None:
    assert parse_env([f"{key}={value}" for key, value in env.items()]) == env


# --- parse_duration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("0", 0.0),
        ("1.5", 1.5),
        ("90s", 90.0),
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("1h30m", 5400.0),
        ("1h 30m 15s", 5415.0),
        ("1.5h", 5400.0),
        ("2d", 172800.0),
        ("1d2h3m4s", 93784.0),
        (" 45S ", 45.0),
        ("10M", 600.0),
        ("500ms", 0.5),
        ("1m30s", 90.0),
        ("2m 500ms", 120.5),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "soon",
        "-5",
        "5x",
        "m",
        "ms",
        "30m1h",
        "1h1h",
        "5ms1s",
        "1e3",
        "inf",
        "nan",
        "1.h",
        "h30",
    ],
)
def test_parse_duration_refusals(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_duration(text)
    assert str(caught.value) == (
        f"invalid duration {text!r}: use seconds or a number with a unit, "
        "such as 90s, 30m, 2h or 1h30m"
    )


@given(
    st.integers(0, 99),
    st.integers(0, 99),
    st.integers(0, 99),
    st.integers(0, 99),
)
def test_parse_duration_parts_add_up(d: int, h: int, m: int, s: int) -> None:
    assert parse_duration(f"{d}d{h}h{m}m{s}s") == d * 86400 + h * 3600 + m * 60 + s


# --- build_spec: merging and the last checks ---------------------------------------------------


def test_flags_only(tmp_path: Path) -> None:
    spec = build_spec(
        None,
        image="python:3.12",
        command=["python", "-V"],
        env_items=["A=1"],
        workdir=tmp_path,
        gpu_memory="16GiB",
        retries=3,
        timeout="30m",
        peer="alice-pc",
    )
    assert spec == JobSpec(
        image="python:3.12",
        command=["python", "-V"],
        env={"A": "1"},
        workdir=tmp_path.resolve(),
        gpu_memory=16 * 1024**3,
        retries=3,
        timeout=1800.0,
        peer="alice-pc",
        group=None,
    )


def test_defaults() -> None:
    spec = build_spec(None, command=["nvidia-smi"])
    assert spec == JobSpec(
        image=None,
        command=["nvidia-smi"],
        env={},
        workdir=None,
        gpu_memory=0,
        retries=0,
        timeout=0.0,
        peer=None,
        group=None,
    )


def test_file_only(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    spec = build_spec(write(tmp_path, FULL))
    assert spec.image == "pytorch/pytorch:latest"
    assert spec.command[:2] == ["python", "train.py"]
    assert spec.workdir == (tmp_path / "train").resolve()
    assert (spec.gpu_memory, spec.retries, spec.timeout) == (8_000_000_000, 2, 5400.0)
    assert (spec.peer, spec.group) == ("alice-pc", None)


def test_flags_override_the_file(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    other = tmp_path / "other"
    other.mkdir()
    spec = build_spec(
        write(tmp_path, FULL),
        image="python:3.12",
        command=["bash", "run.sh"],
        env_items=["BATCH=64", "NEW=1"],
        workdir=other,
        gpu_memory=1000,
        retries=0,
        timeout=0,
        peer="bob",
    )
    assert spec.image == "python:3.12"
    assert spec.command == ["bash", "run.sh"]
    assert spec.env == {"BATCH": "64", "DEBUG": "yes", "LR": "1.10", "EMPTY": "", "NEW": "1"}
    assert spec.workdir == other.resolve()
    assert (spec.gpu_memory, spec.retries, spec.timeout) == (1000, 0, 0.0)
    assert spec.peer == "bob"


def test_empty_command_flag_keeps_the_files(tmp_path: Path) -> None:
    path = write(tmp_path, "command: python train.py\n")
    assert build_spec(path, command=[]).command == ["python", "train.py"]
    assert build_spec(path, command=None).command == ["python", "train.py"]


def test_image_alone_runs_its_default_command() -> None:
    assert build_spec(None, image="hello-world").command == []


def test_nothing_to_run(tmp_path: Path) -> None:
    for file in (None, write(tmp_path, "peer: alice\n")):
        with pytest.raises(ConfigError) as caught:
            build_spec(file, peer="alice")
        assert str(caught.value) == (
            "nothing to run: put the command after --, as in `gpumesh run -- python train.py`, "
            "or give an image whose default command runs the job"
        )


def test_group_flag_replaces_the_files_peer(tmp_path: Path) -> None:
    path = write(tmp_path, "command: x\npeer: alice\n")
    spec = build_spec(path, group="lab")
    assert (spec.peer, spec.group) == (None, "lab")
    path = write(tmp_path, "command: x\ngroup: lab\n")
    spec = build_spec(path, peer="bob")
    assert (spec.peer, spec.group) == ("bob", None)
    spec = build_spec(path)
    assert (spec.peer, spec.group) == (None, "lab")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            {"peer": "a", "group": "b"},
            "--peer and --group cannot be used together: pick one peer, or a group to choose from",
        ),
        ({"peer": " "}, "--peer needs a name"),
        ({"group": ""}, "--group needs a name"),
        ({"retries": 21}, "--retries must be a whole number from 0 to 20, got 21"),
        ({"retries": -1}, "--retries must be a whole number from 0 to 20, got -1"),
        (
            {"timeout": "soon"},
            "--timeout: invalid duration 'soon': use seconds or a number with a unit, such as "
            "90s, 30m, 2h or 1h30m",
        ),
        ({"timeout": -1.0}, "--timeout must be 0 (no limit) or more seconds, got -1.0"),
        ({"timeout": float("inf")}, "--timeout must be 0 (no limit) or more seconds, got inf"),
        (
            {"gpu_memory": "8"},
            "--gpu-memory 8 has no unit and would mean 8 bytes; write it with a unit, such as "
            "8GB or 16GiB",
        ),
        (
            {"gpu_memory": "lots"},
            "invalid size 'lots': use a number with a unit such as 512MB, 8GB or 16GiB",
        ),
        ({"gpu_memory": -1}, "--gpu-memory must be 0 or more, got -1"),
        (
            {"image": "my image"},
            "--image 'my image' is not an image name, such as pytorch/pytorch:latest",
        ),
        ({"image": ""}, "--image '' is not an image name, such as pytorch/pytorch:latest"),
        ({"env_items": ["NOPE"]}, "--env 'NOPE': write it as KEY=VALUE, e.g. BATCH_SIZE=32"),
    ],
)
def test_flag_refusals(flags: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_spec(None, command=["x"], **flags)  # type: ignore[arg-type]
    assert str(caught.value) == expected


def test_zero_gpu_memory_means_no_gpu() -> None:
    assert build_spec(None, command=["x"], gpu_memory="0").gpu_memory == 0


def test_workdir_flag_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        build_spec(None, command=["x"], workdir="./x")
    assert str(caught.value) == "--workdir ./x does not exist: give an existing folder to upload"
    Path("file.txt").write_text("hi")
    with pytest.raises(ConfigError) as caught:
        build_spec(None, command=["x"], workdir=Path("file.txt"))
    assert str(caught.value) == "--workdir file.txt is not a folder: give the folder to upload"
    Path("d").mkdir()
    assert build_spec(None, command=["x"], workdir="d").workdir == tmp_path.resolve() / "d"


def test_workdir_from_the_file_must_exist(tmp_path: Path) -> None:
    path = write(tmp_path, "command: x\n\nworkdir: ./gone\n")
    with pytest.raises(ConfigError) as caught:
        build_spec(path)
    assert str(caught.value) == (
        f"{path}:3: workdir: folder {tmp_path / 'gone'} does not exist: "
        "give an existing folder to upload"
    )
    (tmp_path / "gone").write_text("a file")
    with pytest.raises(ConfigError) as caught:
        build_spec(path)
    assert str(caught.value) == (
        f"{path}:3: workdir: folder {tmp_path / 'gone'} is not a folder: give the folder to upload"
    )


def test_a_missing_workdir_in_the_file_is_fine_when_a_flag_replaces_it(tmp_path: Path) -> None:
    path = write(tmp_path, "command: x\nworkdir: ./gone\n")
    assert build_spec(path, workdir=tmp_path).workdir == tmp_path.resolve()


def test_file_errors_surface_through_build_spec(tmp_path: Path) -> None:
    path = write(tmp_path, "command: x\nretries: many\n")
    with pytest.raises(ConfigError, match=r":2: retries: must be a whole number"):
        build_spec(path, retries=1)


def test_fields_constant_matches_jobspec() -> None:
    # outputs_under is the caller's working folder, never a job file's.
    assert set(FIELDS) == set(JobSpec.__dataclass_fields__) - {"outputs_under"}


# --- mounts -----------------------------------------------------------------------------------


def test_mounts_from_the_file_and_flags_read_only_unless_rw(tmp_path: Path) -> None:
    path = write(tmp_path, "command: ls\nmounts:\n  - /datasets:/data\n  - out:/out:rw\n")
    spec = build_spec(path, mounts=["/more:/more:ro"])
    assert spec.mounts == [
        MountSpec("/datasets", "/data", rw=False),
        MountSpec("/out", "/out", rw=True),
        MountSpec("/more", "/more", rw=False),
    ]


@pytest.mark.parametrize(
    ("mount", "expected"),
    [
        ("/datasets", "is not FOLDER:PATH[:rw]"),
        ("/datasets:/data:rx", "is not FOLDER:PATH[:rw]"),
        (":/data", "is not FOLDER:PATH[:rw]"),
        ("/d:data", "plain absolute path"),
        ("/d:/data/../etc", "plain absolute path"),
        ("/d:/data/", "plain absolute path"),
        ("/d:/", "below /"),
        ("/d:/proc", "overlaps /proc"),
        ("/d:/dev/shm/x", "overlaps /dev"),
        ("/d:/sys", "overlaps /sys"),
        ("/d:/workspace", "overlaps /workspace"),
        ("/d:/tmp/x", "overlaps /tmp"),
        ("/d:/home", "overlaps /home/gpumesh"),
    ],
)
def test_mount_refusals(mount: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_spec(command=["ls"], mounts=[mount])
    assert expected in str(caught.value)


def test_mounts_over_each_other_or_too_many_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="another of the job's mounts"):
        build_spec(command=["ls"], mounts=["/a:/data", "/b:/data/sub"])
    many = [f"/d{i}:/m{i}" for i in range(9)]
    with pytest.raises(ConfigError, match="at most 8 folders"):
        build_spec(command=["ls"], mounts=many)
    message = refusal(tmp_path, "mounts: /datasets:/data\n")
    assert message.startswith("job.yaml:1: mounts: must be a list")
    message = refusal(tmp_path, "mounts:\n  - /a:/proc/x\n")
    assert message.startswith("job.yaml:2: mounts: mount '/a:/proc/x'")


def test_outputs_may_lie_inside_the_workdir_but_mounts_may_not() -> None:
    from gpumesh.client.jobspec import outputs_problem
    from gpumesh.runtime.base import mount_target_problem

    assert outputs_problem("/workspace/out") is None
    assert outputs_problem("/workspace/a/b") is None
    for path in ("/workspace", "/workspace/", "/workspace/../etc", "/tmp/out"):
        assert outputs_problem(path) is not None, path
    assert "overlaps /workspace" in (mount_target_problem("/workspace/out") or "")
    assert "another of the job's mounts" in (
        outputs_problem("/workspace/out", ["/workspace"]) or ""
    )
