"""The node's settings in ``config.toml``: typed keys, validated on write.

Every key is declared in :data:`KEYS` with its type, default, help and the
environment variable that overrides it, if any. ``gpumesh config set`` refuses
unknown keys and bad values with a message naming the valid ones. A key marked
``secret`` is shown masked (:meth:`Config.shown`) wherever settings are listed.
The file is 0600: it may hold such secrets.
"""

from __future__ import annotations

import ipaddress
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from gpumesh import settings
from gpumesh.errors import ConfigError, IdentityError
from gpumesh.identity.keys import check_node_name
from gpumesh.protocol.flow import DEFAULT_WINDOW
from gpumesh.runtime.users import parse_job_user
from gpumesh.store.modes import read_private, write_private
from gpumesh.units import parse_duration, parse_size

__all__ = [
    "AUTO",
    "DEFAULT_IMAGE",
    "DEFAULT_LAN_PORT",
    "DEFAULT_PORT",
    "DESKTOP",
    "DESKTOP_PROCESSES",
    "KEYS",
    "MASK",
    "MIN_LINK_BUFFER",
    "NO_LIMIT",
    "RECLAIM_IGNORE",
    "Config",
    "ConfigKey",
    "value_text",
]

DEFAULT_PORT = 47000
DEFAULT_LAN_PORT = 47099
"""The UDP port LAN announcements go to and are heard at."""
DEFAULT_IMAGE = "nvidia/cuda:12.8.0-runtime-ubuntu22.04"
MASK = "********"
"""What listings show instead of a secret's value (the same for every value)."""

AUTO = "auto"
"""A value the agent works out from the machine's size (see gpumesh.store.limits)."""
NO_LIMIT = "none"
"""A size limit that is switched off."""
MIN_LINK_BUFFER = 2 * DEFAULT_WINDOW
"""The smallest link_buffer: one upload's flow-control window and the others' messages."""

Value = str | int | float


def _name(text: str) -> str:
    try:
        return check_node_name(text)
    except IdentityError as exc:
        raise ConfigError(exc.message) from None


def _host(text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise ConfigError(
            f"invalid listen_host {text!r}: use an IP address such as 0.0.0.0"
        ) from None
    return text


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ConfigError(f"invalid port {text!r}: use a number from 1 to 65535")
    return port


def _relay_address(text: str) -> str:
    """``host``, ``host:port`` or ``[v6]:port``; without a port the relay's own, 4799."""
    text = text.strip()
    if not text:
        return ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port: str | None = rest.removeprefix(":") if rest.startswith(":") or not rest else None
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
        port = port or None
    else:  # a name, an IPv4 address, or a bare IPv6 address
        host, port = text, ""
    if not host or port is None or any(c.isspace() for c in host):
        raise ConfigError(
            f"invalid relay address {text!r}: use host or host:port, e.g. relay.example.org "
            "(the port defaults to 4799) or relay.example.org:4799"
        )
    if port:
        _port(port)
    return text


def _relay_tcp(text: str) -> str:
    """``host:port`` of a relay's TCP listener; empty: the relay host's 443; ``off``: none."""
    text = text.strip()
    if text.lower() == "off":
        return "off"
    try:
        return _relay_address(text)
    except ConfigError:
        raise ConfigError(
            f"invalid relay_tcp {text!r}: use host:port, e.g. relay.example.org:443 (empty: the "
            "relay host's port 443; off: UDP only)"
        ) from None


def _on_off(name: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        cleaned = text.strip().lower()
        if cleaned not in ("on", "off"):
            raise ConfigError(f"invalid {name} {text!r}: use on or off")
        return cleaned

    return check


def _lan_port(text: str) -> int:
    try:
        return _port(text)
    except ConfigError:
        raise ConfigError(
            f"invalid lan_port {text!r}: use a UDP port from 1 to 65535 (the same on every "
            f"node of the network; default {DEFAULT_LAN_PORT})"
        ) from None


def _lan_duration(name: str) -> Callable[[str], str]:
    """A LAN discovery period: a duration of at least a second."""
    duration = _duration(name)

    def check(text: str) -> str:
        cleaned = duration(text)
        if parse_duration(cleaned) < 1:
            raise ConfigError(f"invalid {name} {text!r}: at least 1s; use a duration such as 30s")
        return cleaned

    return check


def _url(text: str) -> str:
    if text and not text.startswith(("http://", "https://")):
        raise ConfigError(f"invalid URL {text!r}: it must start with http:// or https://")
    return text


def _text(text: str) -> str:
    if len(text) > 255:
        raise ConfigError("value too long (255 characters at most)")
    return text


def _size_or_empty(text: str) -> str:
    if not text or text.lower() in ("none", "unlimited") or parse_size(text) == 0:
        return ""
    return text.strip()


def _size(text: str) -> str:
    value = parse_size(text)
    if value <= 0:
        raise ConfigError(f"invalid size {text!r}: it must be more than zero")
    return text.strip()


def parse_rate(text: str) -> int:
    """Bytes a second in ``10MB/s`` (``/s`` may be left out); ConfigError if not above 0."""
    body = text.strip()
    if body.lower().endswith("/s"):
        body = body[:-2].strip()
    try:
        value = parse_size(body)
    except ConfigError:
        value = 0
    if value <= 0:
        raise ConfigError(
            f"invalid rate {text!r}: give bytes a second, such as 10MB/s, 500KB/s or 1GB/s"
        )
    return value


def _rate(text: str) -> str:
    parse_rate(text)
    body = text.strip()
    return body if body.lower().endswith("/s") else f"{body}/s"


def _log_limit(text: str) -> str:
    if parse_size(text) < 1000**2:
        raise ConfigError(f"invalid job_log_limit {text!r}: keep at least 1MB of a job's output")
    return text.strip()


def _number(kind: type[int] | type[float], zero: bool, advice: str) -> Callable[[str], Value]:
    """A number of ``kind`` above 0, or 0 too with ``zero``; ``advice`` says what to give."""

    def check(text: str) -> Value:
        try:
            value = kind(text)
        except ValueError:
            value = -1
        if value < 0 or (value == 0 and not zero):
            raise ConfigError(f"invalid number {text!r}: {advice}")
        return value

    return check


_positive_float = _number(float, False, "use a positive number such as 5 or 2.5")
_non_negative_float = _number(float, True, "use 0 (no limit) or a positive number")
_non_negative_int = _number(int, True, "use 0 (no limit) or a positive whole number")


def _auto_or(parse: Callable[[str], Value]) -> Callable[[str], Value]:
    """``auto`` (worked out from the machine) or a value ``parse`` accepts."""

    def check(text: str) -> Value:
        if text.strip().lower() == AUTO:
            return AUTO
        try:
            return parse(text)
        except ConfigError as exc:
            raise ConfigError(f"{exc.message}; or auto") from None

    return check


def _size_or_none(text: str) -> str:
    """A size; ``none`` (or 0) switches the limit off."""
    if text.strip().lower() in (NO_LIMIT, "unlimited") or parse_size(text) == 0:
        return NO_LIMIT
    return text.strip()


def _link_buffer(text: str) -> str:
    value = _size_or_none(text)
    if value != NO_LIMIT and parse_size(value) < MIN_LINK_BUFFER:
        raise ConfigError(
            f"invalid link_buffer {text!r}: at least 16MiB (one upload's 8MiB flow-control "
            "window and the replies of the connection's other requests), or none"
        )
    return value


def _job_user(text: str) -> str:
    parse_job_user(text)
    return text.strip()


def _image_patterns(text: str) -> str:
    patterns = text.replace(",", " ").split()
    if not patterns:
        raise ConfigError("allowed_images is empty: give * (any image) or glob patterns")
    for pattern in patterns:
        if len(pattern) > 255 or not pattern.isprintable():
            raise ConfigError(f"invalid image pattern {pattern!r}")
    return " ".join(patterns)


def _duration(name: str, *, zero: str = "") -> Callable[[str], str]:
    """A duration setting; ``zero``: what 0 means (empty: 0 is refused)."""
    example = "use a duration such as 30s, 2m" + (f" or 0 ({zero})" if zero else " or 1h")

    def check(text: str) -> str:
        cleaned = text.strip()
        try:
            seconds = parse_duration(cleaned) if not cleaned.startswith("-") else -1.0
        except ConfigError:
            raise ConfigError(f"invalid {name} {text!r}: {example}") from None
        if seconds < 0 or (seconds == 0 and not zero):
            must = "cannot be negative" if zero else "must be longer than 0"
            raise ConfigError(f"invalid {name} {text!r}: it {must}; {example}")
        return cleaned

    return check


_reclaim_grace = _duration("reclaim_grace", zero="stop at once")
"""A duration of 0 or more (SIGTERM to SIGKILL, and the quiet before a GPU is
offered again)."""


DESKTOP = "@desktop"
"""In ``reclaim_ignore``: the display servers and desktop shells, always on a GPU
and never the owner's use (:data:`DESKTOP_PROCESSES`). A name of its own keeps
``config show`` within 80 columns: the list spelled out is 50 characters."""
DESKTOP_PROCESSES = ("Xorg", "Xwayland", "gnome-shell", "kwin_wayland", "plasmashell")
RECLAIM_IGNORE = DESKTOP
_COMM_LENGTH = 15
"""The longest process name the kernel keeps (``/proc/PID/comm``)."""


def _process_names(text: str) -> str:
    """Process names separated by commas, as ``/proc/PID/comm`` gives them."""
    names = [name.strip() for name in text.split(",")]
    if names == [""]:
        return ""  # ignore none
    for name in names:
        if name.startswith("@") and name != DESKTOP:
            raise ConfigError(
                f"invalid reclaim_ignore name {name!r}: the one group is {DESKTOP} "
                f"({', '.join(DESKTOP_PROCESSES)}); give other processes by name"
            )
        if not name or not name.isprintable() or any(c.isspace() or c == "/" for c in name):
            raise ConfigError(
                f"invalid reclaim_ignore {text!r}: give process names separated by commas, "
                "as `ps -o comm` shows them (e.g. Xorg,gnome-shell), without spaces or paths"
            )
        if len(name) > _COMM_LENGTH:
            raise ConfigError(
                f"invalid reclaim_ignore name {name!r}: the kernel keeps the first "
                f"{_COMM_LENGTH} characters of a process name; use {name[:_COMM_LENGTH]!r}"
            )
    return ",".join(names)


_TRUE = ("true", "on", "yes", "1")
_FALSE = ("false", "off", "no", "0")


def _boolean(text: str) -> bool:
    """A yes/no setting: stored and shown (``config show --json``) as a boolean."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ConfigError(f"invalid value {text!r}: use true or false")


def value_text(value: Value) -> str:
    """A setting's value as ``config get`` and ``config show`` print it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _choice(*choices: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in choices:
            raise ConfigError(f"invalid value {text!r}: use one of {', '.join(choices)}")
        return text

    return check


@dataclass(frozen=True)
class ConfigKey:
    name: str
    parse: Callable[[str], Value]
    default: Value
    help: str
    env: str | None = None
    secret: bool = False
    """Listings mask the value; only asking for the key by name reveals it."""


KEYS: dict[str, ConfigKey] = {
    key.name: key
    for key in [
        ConfigKey("node_name", _name, "", "this node's name, shown to peers"),
        ConfigKey("listen_host", _host, "0.0.0.0", "address `gpumesh share` listens on"),
        ConfigKey("listen_port", _port, DEFAULT_PORT, "UDP port `gpumesh share` listens on"),
        ConfigKey(
            "relay",
            _relay_address,
            "",
            "relay host[:port] for peers behind NAT",
            settings.ENV_RELAY,
        ),
        ConfigKey(
            "relay_token",
            _text,
            "",
            "shared token of a private relay (keep it secret)",
            settings.ENV_RELAY_TOKEN,
            secret=True,
        ),
        ConfigKey(
            "relay_tcp",
            _relay_tcp,
            "",
            "relay host:port over TCP/TLS, used where UDP is blocked (empty: the relay "
            "host's 443; off: UDP only)",
            settings.ENV_RELAY_TCP,
        ),
        ConfigKey(
            "relay_udp_retry",
            _duration("relay_udp_retry"),
            "30s",
            "while the relay is reached over TCP, how often UDP is tried again",
        ),
        ConfigKey(
            "relay_for_peers",
            _boolean,
            False,
            "while sharing, relay sessions between two peers that this node has paired and "
            "allowed (and that both pair and allow it): they only see each other's "
            "ciphertext through it",
        ),
        ConfigKey(
            "relay_for_peers_sessions",
            _number(int, False, "use a positive whole number such as 8"),
            8,
            "most sessions relayed for peers at once (more are refused: relay-full)",
        ),
        ConfigKey(
            "relay_for_peers_rate",
            _rate,
            "10MB/s",
            "bytes a second relayed for peers, all sessions together",
        ),
        ConfigKey(
            "lan_discovery",
            _on_off("lan_discovery"),
            "on",
            "find paired peers on the same network with no server: announce this node "
            "(tags only paired peers recognise) and listen for theirs",
        ),
        ConfigKey("lan_port", _lan_port, DEFAULT_LAN_PORT, "UDP port of LAN announcements"),
        ConfigKey(
            "lan_interval",
            _lan_duration("lan_interval"),
            "30s",
            "how often this node announces itself to the LAN's multicast group",
        ),
        ConfigKey(
            "lan_reprobe",
            _lan_duration("lan_reprobe"),
            "60s",
            "how often the announcement goes by unicast to paired peers' last-known "
            "addresses (where multicast is filtered)",
        ),
        ConfigKey(
            "rendezvous_url",
            _url,
            "",
            "public registry (gpumesh-registry) for `share --public`, `search` and `sync`",
        ),
        ConfigKey("region", _text, "", "region shown in public listings", settings.ENV_REGION),
        ConfigKey(
            "announce_addresses",
            _boolean,
            False,
            "publish signed address records (to rendezvous_url, and to paired peers, which "
            "hand them on) so paired peers find this node after it moves (`share --public` "
            "implies it)",
        ),
        ConfigKey("image", _text, DEFAULT_IMAGE, "default job image", settings.ENV_IMAGE),
        ConfigKey(
            "max_vram", _size_or_empty, "", "most GPU memory peers may ask for (empty: no cap)"
        ),
        ConfigKey("connect_timeout", _positive_float, 5.0, "seconds to wait for a peer to answer"),
        ConfigKey(
            "job_memory",
            _auto_or(_size),
            AUTO,
            "memory limit of each job and shell container; auto: share_memory / 8, so one "
            "peer at its job and shell limits holds at most 3/4 of it",
        ),
        ConfigKey("job_pids_limit", _non_negative_int, 1024, "process limit of each job container"),
        ConfigKey(
            "job_cpus",
            _auto_or(_non_negative_float),
            AUTO,
            "CPU limit of each job and shell container (0: none); auto: the machine's cores "
            "minus one, at least 1",
        ),
        ConfigKey(
            "share_memory",
            _auto_or(_size_or_none),
            AUTO,
            "memory all running jobs, shells and CUDA sessions may be promised together "
            "(none: no cap); "
            "auto: the machine's memory less the larger of 2GB and a quarter of it",
        ),
        ConfigKey(
            "max_jobs_per_peer",
            _non_negative_int,
            4,
            "unfinished jobs (queued to retrying) each peer may have here (0: no limit)",
        ),
        ConfigKey(
            "max_shells_per_peer",
            _non_negative_int,
            2,
            "`gpumesh exec` shells each peer may have open here (0: no limit)",
        ),
        ConfigKey(
            "max_links_per_peer",
            _non_negative_int,
            8,
            "connections each peer may hold open here at once (0: no limit)",
        ),
        ConfigKey(
            "max_requests_per_link",
            _non_negative_int,
            16,
            "requests one connection may have open at once (0: no limit)",
        ),
        ConfigKey(
            "link_buffer",
            _link_buffer,
            "32MB",
            "bytes the agent holds for one connection, unread requests and unsent replies "
            "together; a stream that would go over is refused (none: no limit)",
        ),
        ConfigKey(
            "job_network",
            # runtime/jobnet.py's MODES, named here so that reading a home's config
            # never loads the job runtime (a consumer's copy has no use for it).
            _choice("internet", "lan", "bridge", "none"),
            "internet",
            "what jobs reach: internet (DNS and the internet; never this machine, other "
            "containers, link-local or private addresses), lan (adds private ranges), "
            "bridge (Docker's bridge: this machine's services too) or none; internet and "
            "lan need root and iptables",
        ),
        ConfigKey(
            "job_user",
            _job_user,
            "auto",
            "who jobs run as inside their containers: UID or UID:GID (numbers), or auto: the "
            "agent's own uid:gid when it does not run as root, else 47000:47000; under "
            "userns-remap or rootless Docker, root inside the remapped namespace",
        ),
        ConfigKey(
            "job_root",
            _choice("on", "off"),
            "off",
            "run jobs as root inside the container with a writable root filesystem; "
            "`share` and `doctor` warn loudly",
        ),
        ConfigKey("job_tmp", _size, "1GB", "size of /tmp and HOME in each job container"),
        ConfigKey("job_shm", _size, "2GB", "/dev/shm of each job container, within job_memory"),
        ConfigKey("upload_limit", _size, "10GB", "largest job workdir a peer may upload"),
        ConfigKey(
            "allowed_images",
            _image_patterns,
            "*",
            "images peers may run, as glob patterns separated by spaces or commas "
            "(e.g. 'nvidia/cuda:* pytorch/pytorch:*'); * allows any",
        ),
        ConfigKey(
            "pull_timeout", _positive_float, 300.0, "seconds a pull for a peer's job may take"
        ),
        ConfigKey(
            "image_disk",
            _size,
            "50GB",
            "most disk the images pulled for peers may take; the least recently used go first",
        ),
        ConfigKey(
            "file_quota", _size, "50GB", "most bytes each peer may keep here with `gpumesh cp`"
        ),
        ConfigKey(
            "outputs_limit",
            _size,
            "10GB",
            "most bytes of a job's outputs (`run --outputs`) this node receives; the "
            "stream stops beyond it",
        ),
        ConfigKey(
            "job_log_limit",
            _log_limit,
            "64MB",
            "most output of each job kept here (the oldest is dropped beyond it, and its "
            "readers are told)",
        ),
        ConfigKey(
            "reclaim_on_gpu_use",
            _boolean,
            True,
            "take a GPU back while a process that is not a GPUMesh job uses it (a game, "
            "your own CUDA work): its guest jobs are preempted, and it is offered again "
            "once no such process used it for reclaim_grace",
        ),
        ConfigKey(
            "reclaim_grace",
            _reclaim_grace,
            "30s",
            "a reclaimed GPU's guest jobs get SIGTERM and this long before they are "
            "stopped; and it is offered again after this long without the owner's processes",
        ),
        ConfigKey(
            "job_lease",
            _duration("job_lease"),
            "60s",
            "a job run with --group whose provider does not answer for this long is "
            "placed again on another member",
        ),
        ConfigKey(
            "reclaim_ignore",
            _process_names,
            RECLAIM_IGNORE,
            "process names (comma-separated, as `ps -o comm` shows them) that never "
            "reclaim a GPU; @desktop: Xorg, Xwayland, gnome-shell, kwin_wayland, plasmashell",
        ),
        ConfigKey(
            "data_channel",
            _choice("on", "off"),
            "on",
            "move `gpumesh cp`, `run --workdir` and `app sync` bytes over a TLS/TCP "
            "channel when a direct path exists (off: QUIC only, both as consumer and "
            "as provider)",
        ),
    ]
}


def lookup_key(name: str) -> ConfigKey:
    try:
        return KEYS[name]
    except KeyError:
        raise ConfigError(f"unknown config key {name!r}; valid keys: {', '.join(KEYS)}") from None


class Config:
    """Values from ``config.toml`` over defaults, under environment overrides."""

    def __init__(self, path: Path, values: dict[str, Value]) -> None:
        self.path = path
        self._values = values

    @classmethod
    def load(cls, path: Path) -> Config:
        try:
            raw = tomllib.loads(read_private(path).decode())
        except FileNotFoundError:
            raw = {}
        except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}; fix or delete the file") from None
        values: dict[str, Value] = {}
        for name, value in raw.items():
            if name not in KEYS or not isinstance(value, (str, int, float)):
                continue  # tolerate keys written by a newer GPUMesh
            try:
                values[name] = KEYS[name].parse(str(value))
            except ConfigError as exc:
                raise ConfigError(f"{path}: {name}: {exc.message}") from None
        return cls(path, values)

    def get(self, name: str) -> Any:
        """The effective value: environment, then file, then default."""
        key = lookup_key(name)
        if key.env and (env_value := settings.env(key.env)):
            return key.parse(env_value)
        return self._values.get(name, key.default)

    def shown(self, name: str) -> Value:
        """The effective value as listings show it: a secret one masked (empty when unset)."""
        value: Value = self.get(name)
        if lookup_key(name).secret:
            return MASK if value else ""
        return value

    def shown_all(self) -> dict[str, Value]:
        """Every setting's effective value, a secret one masked (``config show``)."""
        return {name: self.shown(name) for name in KEYS}

    def shown_text(self, name: str) -> str:
        """``name``'s effective value as ``config get`` prints it, a secret one masked."""
        return value_text(self.shown(name))

    @staticmethod
    def is_secret(name: str) -> bool:
        return KEYS[name].secret

    def source(self, name: str) -> str:
        key = lookup_key(name)
        if key.env and settings.env(key.env):
            return f"env {key.env}"
        return "file" if name in self._values else "default"

    def set(self, name: str, text: str) -> Value:
        """Validate and set a value (in memory; call :meth:`save`)."""
        value = self._values[name] = lookup_key(name).parse(text)
        return value

    def unset(self, name: str) -> None:
        lookup_key(name)
        self._values.pop(name, None)

    def save(self) -> None:
        """Write the file, mode 0600 from its first byte."""

        write_private(self.path, tomli_w.dumps(dict(sorted(self._values.items()))).encode())

    # Typed accessors for the keys the code reads most.
    @property
    def node_name(self) -> str:
        return str(self.get("node_name"))

    @property
    def listen_host(self) -> str:
        return str(self.get("listen_host"))

    @property
    def listen_port(self) -> int:
        return int(self.get("listen_port"))

    @property
    def relay(self) -> str:
        return str(self.get("relay"))

    @property
    def relay_token(self) -> str:
        return str(self.get("relay_token"))

    @property
    def relay_tcp(self) -> str:
        return str(self.get("relay_tcp"))

    @property
    def relay_udp_retry(self) -> float:
        return parse_duration(str(self.get("relay_udp_retry")))

    @property
    def relay_for_peers(self) -> bool:
        return bool(self.get("relay_for_peers"))

    @property
    def relay_for_peers_sessions(self) -> int:
        return int(self.get("relay_for_peers_sessions"))

    @property
    def relay_for_peers_rate(self) -> int:
        return parse_rate(str(self.get("relay_for_peers_rate")))

    @property
    def connect_timeout(self) -> float:
        return float(self.get("connect_timeout"))

    @property
    def lan_discovery(self) -> bool:
        return str(self.get("lan_discovery")) == "on"

    @property
    def lan_port(self) -> int:
        return int(self.get("lan_port"))

    @property
    def lan_interval(self) -> float:
        return parse_duration(str(self.get("lan_interval")))

    @property
    def lan_reprobe(self) -> float:
        return parse_duration(str(self.get("lan_reprobe")))
