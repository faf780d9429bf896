"""What a job is, as the user describes it: ``gpumesh run`` flags and ``job.yaml``.

This module owns :class:`JobSpec`, the job file format, and every check on
what the user typed for a job: the file is read with line numbers so each
refusal says ``job.yaml:4: retries: ...``, and flags are merged over the file
(a flag that is given wins). Nothing here talks to a peer or touches Docker.

A job file::

    image: pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime
    command: python train.py --epochs 10     # or a list: [python, train.py]
    workdir: ./train                         # relative to this file's folder
    env:                                     # or a list: ["BATCH=32"]
      BATCH: 32
    gpu_memory: 8GB
    retries: 2
    timeout: 2h                              # or seconds: 7200
    peer: alice-pc                           # or group: lab (not both)
    mounts:                                  # folders copied there with gpumesh cp
      - /datasets:/data                      # read-only; /out:/results:rw to write
    outputs: /workspace/out                  # its finished files come home as it runs
    outputs_to: ./results                    # default ./gpumesh-outputs/JOB_ID
    max_moves: 5                             # with group: moves to another member
"""

from __future__ import annotations

import difflib
import math
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from gpumesh.errors import ConfigError
from gpumesh.runtime.base import MAX_MOUNTS, mount_target_problem
from gpumesh.units import parse_duration, parse_size

__all__ = [
    "FIELDS",
    "MAX_RETRIES",
    "JobFile",
    "JobSpec",
    "MountSpec",
    "build_spec",
    "load_job_file",
    "parse_env",
    "parse_mount",
    "queue_wait",
]

DEFAULT_MAX_MOVES = 3
"""Moves a group's job may make unless ``--max-moves`` says otherwise."""
MAX_MOVES = 10
"""The most ``--max-moves`` may allow."""


MAX_RETRIES = 20
FIELDS = (
    "image",
    "command",
    "env",
    "workdir",
    "gpu_memory",
    "retries",
    "timeout",
    "peer",
    "group",
    "mounts",
    "outputs",
    "outputs_to",
    "max_moves",
)
"""Every field a job file may set, in the order the docs list them."""

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RESERVED_ENV_PREFIX = "NVIDIA_"
_YAML_NULL = "tag:yaml.org,2002:null"
_YAML_STR = "tag:yaml.org,2002:str"


@dataclass(frozen=True)
class MountSpec:
    """A folder of the peer's sandbox to mount into the job."""

    source: str
    """The folder as a path in the peer's sandbox, e.g. ``/datasets``."""
    target: str
    """Where the job sees it, e.g. ``/data``."""
    rw: bool = False
    """False: read-only."""


@dataclass(frozen=True)
class JobSpec:
    """One job, ready to submit: file and flags merged and checked."""

    image: str | None
    """Container image; None: the user's configured default image."""
    command: list[str]
    """argv run in the container; empty: the image's default command."""
    env: dict[str, str]
    """Environment variables set in the container (never ``NVIDIA_*``)."""
    workdir: Path | None
    """Absolute path of an existing local folder to upload as the job's
    working directory; None: nothing is uploaded."""
    gpu_memory: int
    """GPU memory the job needs, in bytes; 0: no GPU requested."""
    retries: int
    """How many times a failed attempt is run again, 0 to ``MAX_RETRIES``."""
    timeout: float
    """Seconds after which an attempt is stopped; 0: no limit."""
    peer: str | None
    """Name of the provider to run on; exclusive with ``group``."""
    group: str | None
    """Group of providers to pick one from; exclusive with ``peer``."""
    mounts: list[MountSpec] = field(default_factory=list)
    """Folders of the peer's sandbox to mount (``--mount``, ``mounts:``)."""
    outputs: str = ""
    """A container path whose finished files come home (``--outputs``); empty: none."""
    outputs_to: Path | None = None
    """With ``outputs``: the absolute local folder they go to; None: ``JOB_ID`` under
    ``outputs_under``."""
    outputs_under: Path | None = None
    """With ``outputs`` and no ``outputs_to``: the absolute folder whose ``JOB_ID``
    subfolder they go to (the caller's ``./gpumesh-outputs``)."""
    max_moves: int = 0
    """With ``group``: how many times the job may move to another member (0 to 10)."""


@dataclass(frozen=True)
class JobFile:
    """What one job file sets, each value already checked; None where absent."""

    path: Path
    """The file, as the user named it (messages quote it this way)."""
    image: str | None = None
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None
    """Absolute: a relative path is taken from the job file's folder. Whether
    it exists is checked by :func:`build_spec`, as a flag may replace it."""
    gpu_memory: int | None = None
    retries: int | None = None
    timeout: float | None = None
    peer: str | None = None
    group: str | None = None
    mounts: list[MountSpec] | None = None
    outputs: str | None = None
    outputs_to: Path | None = None
    """Absolute: a relative path is taken from the job file's folder."""
    max_moves: int | None = None
    lines: dict[str, int] = field(default_factory=dict)
    """Line of each field the file sets, for messages about checks made later."""


# --- small parsers shared by flags and file -------------------------------------------------------


def parse_mount(text: str) -> MountSpec:
    """``/sandbox/folder:/container/path`` with an optional ``:rw`` or ``:ro``."""
    pieces = text.split(":")
    rw = False
    if len(pieces) == 3 and pieces[2] in ("rw", "ro"):
        rw = pieces.pop() == "rw"
    if len(pieces) != 2 or not pieces[0] or not pieces[1]:
        raise ConfigError(
            f"mount {text!r} is not FOLDER:PATH[:rw], such as /datasets:/data "
            "(a folder you copied there with gpumesh cp, and where the job sees it)"
        )
    source, target = pieces
    if not source.startswith("/"):
        source = "/" + source  # sandbox paths are from its root, as in `gpumesh cp`
    problem = mount_target_problem(target)
    if problem is not None:
        raise ConfigError(f"mount {text!r}: the container path {problem}")
    return MountSpec(source=source, target=target, rw=rw)


def outputs_problem(path: str, targets: Sequence[str] = ()) -> str | None:
    """Why a job's outputs may not be at container path ``path`` (None: they may)."""
    problem = mount_target_problem(path, targets, below_workdir=True)
    return None if problem is None else f"the container path {path!r} {problem}"


def _check_destination(path: Path, shown_as: str) -> Path:
    """Where outputs go: an absolute folder (made when missing) this user may write."""
    if not path.is_absolute():
        raise ConfigError(f"{shown_as} is not an absolute path: give the folder's full path")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{shown_as} is a file: name a folder (it is made when missing)")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{shown_as} cannot be written here ({existing} is not a folder you may write "
            "in): choose another folder"
        )
    return path


def _check_mounts(mounts: Sequence[MountSpec]) -> list[MountSpec]:
    if len(mounts) > MAX_MOUNTS:
        raise ConfigError(f"a job may mount at most {MAX_MOUNTS} folders, got {len(mounts)}")
    targets: list[str] = []
    for mount in mounts:
        problem = mount_target_problem(mount.target, targets)
        if problem is not None:
            raise ConfigError(f"mount {mount.source}:{mount.target}: the container path {problem}")
        targets.append(mount.target)
    return list(mounts)


def _env_key_problem(key: str) -> str | None:
    """Why ``key`` cannot be an environment variable name, or None when it can."""
    if not key:
        return "the variable name before = is empty"
    if not _ENV_KEY.fullmatch(key):
        return (
            f"{key!r} is not a valid variable name: use letters, digits and _, "
            "not starting with a digit"
        )
    if key.startswith(_RESERVED_ENV_PREFIX):
        return (
            f"variables starting with {_RESERVED_ENV_PREFIX} are set by the provider, "
            "which decides which GPUs the job sees; remove it"
        )
    return None


def _env_value_problem(value: str) -> str | None:
    # The kernel ends an environment string at NUL; Docker refuses it outright.
    return "the value contains a NUL character" if "\0" in value else None


def _split_env_item(item: str) -> tuple[str, str] | str:
    """``KEY=VAL`` as (key, value), or the reason it is not one."""
    if "=" not in item:
        return "write it as KEY=VALUE, e.g. BATCH_SIZE=32"
    key, value = item.split("=", 1)
    problem = _env_key_problem(key) or _env_value_problem(value)
    return problem if problem is not None else (key, value)


def _env_item_name(item: str) -> str:
    """How an error names a ``KEY=VALUE`` item: its key, the value left out."""
    key, sep, _value = item.partition("=")
    if not sep:
        return repr(item)  # no value in it
    return f"{key!r}=..." if key else "=..."


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``--env KEY=VAL`` flags as a mapping; a later flag for one key wins."""
    env: dict[str, str] = {}
    for item in items:
        parsed = _split_env_item(item)
        if isinstance(parsed, str):
            # Name the variable, never its value: errors reach the debug log.
            raise ConfigError(f"--env {_env_item_name(item)}: {parsed}")
        env[parsed[0]] = parsed[1]
    return env


def queue_wait(value: float | str) -> float:
    """``--wait``: seconds a job may wait in the queue, from seconds or a duration
    such as ``10m`` (0: it does not wait)."""
    if isinstance(value, str):
        try:
            seconds = parse_duration(value.strip()) if not value.strip().startswith("-") else -1.0
        except ConfigError:
            raise ConfigError(
                f"--wait {value!r} is not a duration: use one such as 30s, 10m or 2h "
                "(0: refuse at once)"
            ) from None
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"--wait {value!r} cannot be negative: use 0 (refuse at once) or more")
    return seconds


def _gpu_memory_problem(text: str) -> str | None:
    # parse_size reads a bare number as bytes; "gpu_memory: 8" almost surely
    # means 8GB, and 8 bytes would silently request no useful GPU at all.
    if re.fullmatch(r"\s*\d+\s*", text) and int(text) != 0:
        return (
            f"{text.strip()} has no unit and would mean {text.strip()} bytes; "
            "write it with a unit, such as 8GB or 16GiB"
        )
    return None


def _retries_problem(value: int) -> str | None:
    if 0 <= value <= MAX_RETRIES:
        return None
    return f"must be a whole number from 0 to {MAX_RETRIES}, got {value}"


# --- the job file ---------------------------------------------------------------------------------


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return "empty" if node.tag == _YAML_NULL else "a single value"


class _FileReader:
    """Walks one job file's YAML node tree, so every refusal can name its line."""

    def __init__(self, path: Path, loader: yaml.SafeLoader) -> None:
        self.path = path
        self.shown = str(path)
        self.loader = loader

    def fail(self, node: yaml.Node, message: str) -> NoReturn:
        raise ConfigError(f"{self.shown}:{node.start_mark.line + 1}: {message}")

    def construct(self, node: yaml.Node) -> object:
        """The node's value; SafeLoader refuses any tag that is not plain data."""
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or node.start_mark
            raise ConfigError(
                f"{self.shown}:{mark.line + 1}: invalid YAML: {_yaml_problem(exc)}"
            ) from None

    def shown_value(self, node: yaml.Node) -> str:
        """The value as the user wrote it, for messages: ``'many'``, ``25``."""
        if not isinstance(node, yaml.ScalarNode):
            return _kind(node)
        if node.tag == _YAML_NULL:
            return "nothing"
        return repr(node.value) if node.tag == _YAML_STR else str(node.value)

    def text(self, node: yaml.Node, name: str, example: str) -> str:
        """A single non-empty value as typed: ``1.10`` stays ``1.10``, ``yes`` stays ``yes``."""
        if not isinstance(node, yaml.ScalarNode):
            self.fail(node, f"{name}: must be {example}, got {_kind(node)}")
        self.construct(node)  # refuses explicit tags such as !!python/object
        value = str(node.value)
        if node.tag == _YAML_NULL or not value.strip():
            self.empty(node, name, example)
        return value

    def empty(self, node: yaml.Node, name: str, example: str) -> NoReturn:
        self.fail(node, f"{name}: is empty; give {example} or remove the line")

    def image(self, node: yaml.Node) -> str:
        example = "an image name such as pytorch/pytorch:latest"
        value = self.text(node, "image", example)
        if any(char.isspace() for char in value):
            self.fail(node, f"image: must be {example}, got {value!r}")
        return value

    def command(self, node: yaml.Node) -> list[str]:
        example = "a command line or a list of arguments"
        if isinstance(node, yaml.SequenceNode):
            argv: list[str] = []
            for item in node.value:
                if not isinstance(item, yaml.ScalarNode) or item.tag == _YAML_NULL:
                    self.fail(item, f"command: each argument must be text, got {_kind(item)}")
                self.construct(item)
                argv.append(str(item.value))
            return argv
        if not isinstance(node, yaml.ScalarNode):
            self.fail(node, f"command: must be {example}, got {_kind(node)}")
        if node.tag == _YAML_NULL:
            self.empty(node, "command", example)
        self.construct(node)
        try:
            return shlex.split(str(node.value))
        except ValueError as exc:
            self.fail(node, f"command: {str(exc).lower()}; check the quotes")

    def env(self, node: yaml.Node) -> dict[str, str]:
        env: dict[str, str] = {}
        lines: dict[str, int] = {}

        def add(key: str, value: str, at: yaml.Node) -> None:
            if key in env:
                self.fail(at, f"env: {key} is set twice (first on line {lines[key]}); keep one")
            env[key] = value
            lines[key] = at.start_mark.line + 1

        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    self.fail(key_node, f"env: variable names must be text, got {_kind(key_node)}")
                key = str(key_node.value)
                problem = _env_key_problem(key)
                if problem is not None:
                    self.fail(key_node, f"env: {problem}")
                if not isinstance(value_node, yaml.ScalarNode):
                    self.fail(
                        value_node, f"env: {key}: must be a single value, got {_kind(value_node)}"
                    )
                if value_node.tag == _YAML_NULL:
                    self.fail(
                        value_node, f'env: {key}: has no value; write {key}: "" for an empty one'
                    )
                self.construct(value_node)
                value = str(value_node.value)
                problem = _env_value_problem(value)
                if problem is not None:
                    self.fail(value_node, f"env: {key}: {problem}")
                add(key, value, key_node)
            return env
        if isinstance(node, yaml.SequenceNode):
            for item in node.value:
                if not isinstance(item, yaml.ScalarNode) or item.tag == _YAML_NULL:
                    self.fail(item, f"env: each item must be KEY=VALUE text, got {_kind(item)}")
                self.construct(item)
                parsed = _split_env_item(str(item.value))
                if isinstance(parsed, str):
                    self.fail(item, f"env: {_env_item_name(str(item.value))}: {parsed}")
                add(parsed[0], parsed[1], item)
            return env
        self.fail(
            node,
            f"env: must be a mapping of NAME: value, or a list of NAME=value, got {_kind(node)}",
        )

    def workdir(self, node: yaml.Node) -> Path:
        return self._folder(node, "workdir", "a folder path")

    def outputs(self, node: yaml.Node) -> str:
        text = self.text(node, "outputs", "a container path such as /workspace/out")
        problem = outputs_problem(text)
        if problem is not None:
            self.fail(node, f"outputs: {problem}")
        return text

    def outputs_to(self, node: yaml.Node) -> Path:
        return self._folder(node, "outputs_to", "a local folder")

    def _folder(self, node: yaml.Node, field: str, expected: str) -> Path:
        """A local folder the file names (``~`` and variables expanded)."""
        text = self.text(node, field, expected)
        try:
            value = _expanded(text)
        except ConfigError as exc:
            self.fail(node, f"{field}: {exc.message}")
        # Relative to the job file, so `gpumesh run -f exp/job.yaml` works from anywhere.
        return (self.path.parent / value).absolute()

    def gpu_memory(self, node: yaml.Node) -> int:
        value = self.text(node, "gpu_memory", "a size such as 8GB")
        problem = _gpu_memory_problem(value)
        if problem is not None:
            self.fail(node, f"gpu_memory: {problem}")
        try:
            return parse_size(value)
        except ConfigError as exc:
            self.fail(node, f"gpu_memory: {exc.message}")

    def retries(self, node: yaml.Node) -> int:
        value = None if node.tag == _YAML_NULL else self.construct(node)
        if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value):
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            problem = _retries_problem(value)
            if problem is None:
                return value
        self.fail(
            node,
            f"retries: must be a whole number from 0 to {MAX_RETRIES}, "
            f"got {self.shown_value(node)}",
        )

    def max_moves(self, node: yaml.Node) -> int:
        value = None if node.tag == _YAML_NULL else self.construct(node)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_MOVES:
            return value
        self.fail(
            node,
            f"max_moves: must be a whole number from 0 to {MAX_MOVES}, "
            f"got {self.shown_value(node)}",
        )

    def timeout(self, node: yaml.Node) -> float:
        value = None if node.tag == _YAML_NULL else self.construct(node)
        seconds: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            seconds = float(value)
        elif isinstance(value, str):
            try:
                seconds = parse_duration(value)
            except ConfigError:
                seconds = None
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            self.fail(
                node,
                "timeout: must be a number of seconds or a duration such as 90s, 30m or 2h "
                f"(0 for no limit), got {self.shown_value(node)}",
            )
        return seconds

    def mounts(self, node: yaml.Node) -> list[MountSpec]:
        example = "a list of FOLDER:PATH[:rw] such as [/datasets:/data]"
        if not isinstance(node, yaml.SequenceNode):
            self.fail(node, f"mounts: must be {example}, got {_kind(node)}")
        mounts: list[MountSpec] = []
        for item in node.value:
            text = self.text(item, "mounts", example)
            try:
                mounts.append(parse_mount(text))
            except ConfigError as exc:
                self.fail(item, f"mounts: {exc.message}")
        try:
            return _check_mounts(mounts)
        except ConfigError as exc:
            self.fail(node, f"mounts: {exc.message}")

    def name(self, node: yaml.Node, name: str) -> str:
        return self.text(node, name, f"a {name} name")


def _read_text(path: Path) -> str:
    shown = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"job file {shown} does not exist: check the path after -f") from None
    except IsADirectoryError:
        raise ConfigError(
            f"job file {shown} is a folder: give the path of a YAML file such as job.yaml"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read job file {shown}: {exc.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{shown}:{line}: not UTF-8 text; save the job file as UTF-8") from None


def load_job_file(path: Path) -> JobFile:
    """Read and check a job file; every refusal names the file, line and field."""
    shown = str(path)
    text = _read_text(path)
    try:
        loader = yaml.SafeLoader(text)
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise ConfigError(
            f"{shown}:{line}: invalid YAML: {_yaml_problem(exc)}; check the indentation and quotes"
        ) from None
    except yaml.YAMLError as exc:  # the reader's refusal of control characters
        position = getattr(exc, "position", 0)
        line = text.count("\n", 0, position) + 1
        raise ConfigError(
            f"{shown}:{line}: invalid YAML: a character YAML does not allow; remove it"
        ) from None
    try:
        reader = _FileReader(path, loader)
        if root is not None:
            # Build it all once, so a tag anywhere that is not plain data (such as
            # !!python/object) is refused even where a field only reads the text.
            reader.construct(root)
        return _read_fields(reader, root)
    finally:
        loader.dispose()


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    # The problem alone usually reads best ("mapping values are not allowed
    # here"); a context that is not a "while scanning ..." trace adds meaning.
    context = exc.context or ""
    if context and not context.startswith("while"):
        return f"{context}, {exc.problem}"
    return str(exc.problem)


def _read_fields(reader: _FileReader, root: yaml.Node | None) -> JobFile:
    if root is None or (isinstance(root, yaml.ScalarNode) and root.tag == _YAML_NULL):
        return JobFile(path=reader.path)  # empty, or only comments: flags say it all
    if not isinstance(root, yaml.MappingNode):
        reader.fail(
            root,
            f"a job file is a set of fields such as 'image:' and 'command:', not {_kind(root)}",
        )
    values: dict[str, Any] = {}
    lines: dict[str, int] = {}
    for key_node, value_node in root.value:
        key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
        if key not in FIELDS:
            close = difflib.get_close_matches(key, FIELDS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            reader.fail(key_node, f"unknown field {key!r}{hint}; valid fields: {', '.join(FIELDS)}")
        if key in lines:
            reader.fail(key_node, f"{key}: set twice (first on line {lines[key]}); keep one")
        lines[key] = key_node.start_mark.line + 1
        if key in ("peer", "group"):
            values[key] = reader.name(value_node, key)
        else:  # every other field has a reader method of its name
            values[key] = getattr(reader, key)(value_node)
        if "peer" in lines and "group" in lines:
            reader.fail(
                key_node,
                "peer and group cannot both be set: run on one peer, or let GPUMesh pick "
                "from a group",
            )
    return JobFile(path=reader.path, lines=lines, **values)


# --- merging --------------------------------------------------------------------------------------


def _expanded(text: str) -> Path:
    """``text`` as a path with ``~`` / ``~user`` expanded (ConfigError for a user or
    home this machine does not know)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        head = text.split("/", 1)[0]
        raise ConfigError(
            f"{text}: this machine has no home folder for {head}: give the folder's full path"
        ) from None


def _check_workdir(path: Path, shown_as: str) -> Path:
    if not path.exists():
        raise ConfigError(f"{shown_as} does not exist: give an existing folder to upload")
    if not path.is_dir():
        raise ConfigError(f"{shown_as} is not a folder: give the folder to upload")
    return path.resolve()


def build_spec(
    file: Path | None = None,
    *,
    image: str | None = None,
    command: Sequence[str] | None = None,
    env_items: Sequence[str] | None = None,
    workdir: Path | str | None = None,
    gpu_memory: int | str | None = None,
    retries: int | None = None,
    timeout: str | float | None = None,
    peer: str | None = None,
    group: str | None = None,
    mounts: Sequence[str] | None = None,
    outputs: str | None = None,
    outputs_to: Path | str | None = None,
    outputs_under: Path | str | None = None,
    max_moves: int | None = None,
) -> JobSpec:
    """Merge a job file (if any) with flags into a checked :class:`JobSpec`.

    Flags left at None keep the file's value. An empty ``command`` counts as
    not given (click passes ``()`` when nothing follows ``--``). ``env_items``
    are merged over the file's env. ``--peer`` or ``--group`` replaces the
    file's choice of where to run, whichever of the two the file used.
    ``gpu_memory`` is bytes when an int, or text such as ``8GB``. ``mounts``
    (``--mount``) are added to the file's. ``outputs_to`` and ``outputs_under``
    are absolute (the caller's working folder is not this process's).
    ``max_moves`` (``--max-moves``) is for a group's job only.
    """
    job = load_job_file(file) if file is not None else JobFile(path=Path())
    shown = str(job.path)

    def at(name: str) -> str:
        return f"{shown}:{job.lines[name]}: {name}:"

    if image is not None and (not image.strip() or any(ch.isspace() for ch in image)):
        raise ConfigError(f"--image {image!r} is not an image name, such as pytorch/pytorch:latest")
    final_image = image if image is not None else job.image

    final_command = list(command) if command else list(job.command or [])
    if final_image is None and not final_command:
        raise ConfigError(
            "nothing to run: put the command after --, as in `gpumesh run -- python train.py`, "
            "or give an image whose default command runs the job"
        )

    env = dict(job.env)
    env.update(parse_env(env_items or []))

    final_workdir: Path | None = None
    if workdir is not None:
        final_workdir = _check_workdir(_expanded(str(workdir)), f"--workdir {workdir}")
    elif job.workdir is not None:
        final_workdir = _check_workdir(job.workdir, f"{at('workdir')} folder {job.workdir}")

    final_gpu_memory = job.gpu_memory or 0
    if isinstance(gpu_memory, int):
        if gpu_memory < 0:
            raise ConfigError(f"--gpu-memory must be 0 or more, got {gpu_memory}")
        final_gpu_memory = gpu_memory
    elif gpu_memory is not None:
        problem = _gpu_memory_problem(gpu_memory)
        if problem is not None:
            raise ConfigError(f"--gpu-memory {problem}")
        final_gpu_memory = parse_size(gpu_memory)

    final_retries = job.retries or 0
    if retries is not None:
        problem = _retries_problem(retries)
        if problem is not None:
            raise ConfigError(f"--retries {problem}")
        final_retries = retries

    final_timeout = job.timeout or 0.0
    if timeout is not None:
        try:
            final_timeout = parse_duration(timeout) if isinstance(timeout, str) else float(timeout)
        except ConfigError as exc:
            raise ConfigError(f"--timeout: {exc.message}") from None
        if not math.isfinite(final_timeout) or final_timeout < 0:
            raise ConfigError(f"--timeout must be 0 (no limit) or more seconds, got {timeout}")

    for flag, value in (("--peer", peer), ("--group", group)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} needs a name")
    if peer is not None and group is not None:
        raise ConfigError(
            "--peer and --group cannot be used together: pick one peer, or a group to choose from"
        )
    final_peer, final_group = job.peer, job.group
    if peer is not None or group is not None:
        final_peer, final_group = peer, group

    final_max_moves = _max_moves(max_moves if max_moves is not None else job.max_moves, final_group)

    final_mounts = _check_mounts(
        list(job.mounts or []) + [parse_mount(text) for text in mounts or []]
    )

    final_outputs = outputs if outputs else job.outputs or ""
    final_outputs_to: Path | None = None
    final_outputs_under: Path | None = None
    if final_outputs:
        where = "--outputs:" if outputs else at("outputs")
        problem = outputs_problem(final_outputs, [m.target for m in final_mounts])
        if problem is not None:
            raise ConfigError(f"{where} {problem}")
        if outputs_to:
            final_outputs_to = _check_destination(
                _expanded(str(outputs_to)), f"--outputs-to {outputs_to}"
            )
        elif job.outputs_to is not None:
            shown_to = f"{at('outputs_to')} folder {job.outputs_to}"
            final_outputs_to = _check_destination(job.outputs_to, shown_to)
        elif outputs_under:
            final_outputs_under = _check_destination(
                _expanded(str(outputs_under)), f"the outputs folder {outputs_under}"
            )
    elif outputs_to:
        raise ConfigError("--outputs-to needs --outputs PATH: the folder in the job to bring home")

    return JobSpec(
        image=final_image,
        command=final_command,
        env=env,
        workdir=final_workdir,
        gpu_memory=final_gpu_memory,
        retries=final_retries,
        timeout=final_timeout,
        peer=final_peer,
        group=final_group,
        mounts=final_mounts,
        outputs=final_outputs,
        outputs_to=final_outputs_to,
        outputs_under=final_outputs_under,
        max_moves=final_max_moves,
    )


def _max_moves(given: int | None, group: str | None) -> int:
    """The moves a job may make: ``--max-moves`` (default 3, at most 10) for a group's job."""
    if given is None:
        return DEFAULT_MAX_MOVES if group is not None else 0
    if group is None:
        raise ConfigError(
            "--max-moves (max_moves:) needs --group: a job run with --peer stays on that "
            "peer; give a group to let it move"
        )
    if not 0 <= given <= MAX_MOVES:
        raise ConfigError(f"--max-moves must be 0 to {MAX_MOVES}, got {given}")
    return given
