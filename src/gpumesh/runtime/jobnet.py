"""The job network: what a peer's job may reach, as firewall rules.

Owns config ``job_network`` and what each value means:

- ``internet`` (the default): DNS (port 53 of the resolvers the container is
  given) and the internet; never this machine's own addresses (the gateway and
  every interface), other containers (jobs or not), link-local addresses
  (169.254.0.0/16, where clouds serve instance credentials) nor private ranges
  (RFC 1918 and the shared 100.64.0.0/10, where tailnets and carrier NATs live);
- ``lan``: the same, plus the private ranges;
- ``bridge``: Docker's plain default bridge, which reaches all of the above;
- ``none``: no network at all.

For ``internet`` and ``lan`` jobs join a Docker network of their own
(inter-container traffic off, no IPv6: the containers' IPv6 is switched off by
sysctl, so fc00::/7 and the bridge's link-local fe80:: are out of reach too)
whose bridge interface is filtered by two chains of our own, one jumped to
from Docker's DOCKER-USER chain (what the job sends through this machine) and
one from INPUT (what it sends to this machine itself, at any of its addresses).

:func:`rule_set` computes the rules from the mode, the names and the resolvers
without touching anything; :class:`JobNetwork` applies them with
``iptables-restore --noflush`` (our chains are replaced in one step, nothing
else is flushed) and adds each jump once, so applying is idempotent and safe
at every share start; before each container it reads the rules back and
applies them again when they were removed meanwhile. This module must never
flush, reorder or weaken a rule that is not in its own chains, and never runs
without root: where rules cannot be installed it says why in one line, and
sharing refuses ``internet`` and ``lan`` rather than run jobs unfiltered.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from gpumesh.errors import ConfigError

__all__ = [
    "FILTERED_MODES",
    "LINK_LOCAL",
    "MODES",
    "NETWORK_PREFIX",
    "PRIVATE",
    "JobNetwork",
    "Mode",
    "NetworkNames",
    "RuleSet",
    "cannot_filter",
    "describe_mode",
    "install_problem",
    "iptables_installed",
    "is_job_network",
    "names_for",
    "resolvers_from",
    "rule_set",
]

logger = logging.getLogger(__name__)

Mode = Literal["internet", "lan", "bridge", "none"]
MODES: tuple[Mode, ...] = ("internet", "lan", "bridge", "none")
FILTERED_MODES: tuple[Mode, ...] = ("internet", "lan")
"""The modes that need our rules (and a network of their own)."""

NETWORK_PREFIX = "gpumesh-jobs"
"""Docker networks made here are named ``<prefix>-<mode>``."""
BRIDGE_PREFIX = "gpm"
"""Their bridge interfaces are ``gpm<hash>``: every one of ours matches ``gpm+``."""
OTHER_BRIDGES = ("docker+", "br-+", f"{BRIDGE_PREFIX}+")
"""Interfaces of the engine's other networks (the default bridge, user networks and
our own): a job reaches no container through them, whatever their addresses."""
LINK_LOCAL = ("169.254.0.0/16",)
PRIVATE = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
"""RFC 1918 and RFC 6598 (carrier NAT, and the addresses of tailnets)."""
DNS_PORT = "53"
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,40}")

_RESOLV_CONF = Path("/etc/resolv.conf")
_RESOLVED_UPSTREAM = Path("/run/systemd/resolve/resolv.conf")
"""Where systemd-resolved lists the real resolvers when resolv.conf names its stub
(Docker reads this one then, too)."""
_DOCKER_DEFAULT_DNS = ("8.8.8.8", "8.8.4.4")
"""What Docker gives containers when the host names only loopback resolvers."""


def describe_mode(mode: str) -> str:
    """What a job reaches under ``mode``, in a few words for the limits line and doctor."""
    return {
        "internet": "DNS and the internet only",
        "lan": "DNS, the internet and private ranges; not this machine, link-local "
        "addresses or other containers",
        "bridge": "Docker's bridge: this machine's services, other containers and its "
        "networks are reachable",
        "none": "no network",
    }.get(mode, mode)


def cannot_filter(mode: str, why: str) -> str:
    """The one line ``share`` refuses ``internet`` and ``lan`` with, and doctor shows."""
    return (
        f"job_network {mode} needs firewall rules that cannot be installed here ({why}); "
        "share as root with rootful Docker and iptables, or choose "
        "`gpumesh config set job_network none` (jobs get no network) or "
        "`gpumesh config set job_network bridge` (jobs can reach this machine's services "
        "and networks)"
    )


def iptables_installed() -> bool:
    """Whether the tools the rules are installed with are on PATH."""
    return all(shutil.which(tool) for tool in ("iptables", "iptables-restore"))


def install_problem(*, euid: int, rootless: bool, iptables: bool) -> str | None:
    """Why the rules cannot be installed here (None: they can)."""
    if euid != 0:
        return "the agent does not run as root"
    if rootless:
        return "Docker runs rootless"
    if not iptables:
        return "iptables and iptables-restore are not installed"
    return None


@dataclass(frozen=True)
class NetworkNames:
    """The Docker network of one mode, its bridge interface and our two chains."""

    network: str
    bridge: str
    forward_chain: str
    """Jumped to from DOCKER-USER for what the job's bridge forwards."""
    input_chain: str
    """Jumped to from INPUT for what the job sends to this machine itself."""


def names_for(mode: str, prefix: str = NETWORK_PREFIX) -> NetworkNames:
    """The names for ``mode``; ``prefix`` gives a test its own network and chains.

    Interface names hold 15 characters and chain names 28, so both carry a hash
    of the network's name rather than the name itself."""
    network = f"{prefix}-{mode}"
    if _NAME.fullmatch(network) is None:
        raise ConfigError(f"job network name {network!r} is not lower-case letters, digits, -")
    digest = hashlib.sha256(network.encode()).hexdigest()[:10]
    return NetworkNames(
        network=network,
        bridge=f"{BRIDGE_PREFIX}{digest}",
        forward_chain=f"GPM-{digest}",
        input_chain=f"GPM-{digest}-IN",
    )


def is_job_network(name: str, prefix: str = NETWORK_PREFIX) -> bool:
    """Whether ``name`` is a network this module makes (what a container may join
    besides ``bridge`` and ``none``)."""
    return name.startswith(f"{prefix}-") and _NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class RuleSet:
    """Our chains' whole content, and the jumps into them."""

    restore: str
    """Input for ``iptables-restore --noflush``: declares (and so empties) our two
    chains and fills them, one atomic step."""
    jumps: tuple[tuple[str, tuple[str, ...]], ...]
    """(built-in chain, rule) pairs that must each be there once, first in their chain."""

    def intact(self, saved: str) -> bool:
        """Whether ``saved`` (``iptables-save -t filter``) still has every jump and all
        of our chains' rules: False after a flush (``iptables -F``, a firewall
        manager's reload) or a rule deleted by hand."""
        present = saved.splitlines()
        for chain, rule in self.jumps:
            if f"-A {chain} {' '.join(rule)}" not in present:
                return False
        wanted = [line for line in self.restore.splitlines() if line.startswith("-A ")]
        for chain in {line.split()[1] for line in wanted}:
            head = f"-A {chain} "
            count = sum(line.startswith(head) for line in wanted)
            if sum(line.startswith(head) for line in present) != count:
                return False
        return True


def rule_set(mode: Mode, names: NetworkNames, resolvers: Sequence[str]) -> RuleSet:
    """The filter rules for a job network of ``mode``; ``resolvers``: the IPv4 name
    servers its containers are given (port 53 of each stays open, even on a private
    address or on this machine).

    REJECT, not DROP: a job learns at once that an address is closed to it
    instead of waiting out a timeout."""
    if mode not in FILTERED_MODES:
        raise ValueError(f"job network {mode!r} has no rules")
    forward, inbound = names.forward_chain, names.input_chain
    dns: list[str] = []
    for server in resolvers:
        for proto in ("udp", "tcp"):
            dns.append(f"-p {proto} -d {server}/32 --dport {DNS_PORT} -j RETURN")
    rules = [f"-A {forward} {rule}" for rule in dns]
    # br_netfilter shows a bridge's own traffic as bridge-to-bridge; without it the
    # network's inter-container switch (icc off) keeps jobs apart.
    rules += [f"-A {forward} -o {bridge} -j REJECT" for bridge in (names.bridge, *OTHER_BRIDGES)]
    closed = [*LINK_LOCAL, *(PRIVATE if mode == "internet" else ())]
    rules += [f"-A {forward} -d {cidr} -j REJECT" for cidr in closed]
    rules += [f"-A {forward} -j RETURN"]
    rules += [f"-A {inbound} {rule}" for rule in dns]
    rules += [f"-A {inbound} -j REJECT"]
    restore = "\n".join(
        ["*filter", f":{forward} - [0:0]", f":{inbound} - [0:0]", *rules, "COMMIT", ""]
    )
    jumps = (
        ("DOCKER-USER", ("-i", names.bridge, "-j", forward)),
        ("INPUT", ("-i", names.bridge, "-j", inbound)),
    )
    return RuleSet(restore=restore, jumps=jumps)


def resolvers_from(text: str) -> tuple[str, ...]:
    """The IPv4 name servers of a resolv.conf, loopback ones left out (a container
    cannot reach this machine's loopback; Docker forwards those itself)."""
    found: list[str] = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 2 or words[0] != "nameserver":
            continue
        try:
            address = ipaddress.ip_address(words[1])
        except ValueError:
            continue
        if address.version == 4 and not address.is_loopback and str(address) not in found:
            found.append(str(address))
    return tuple(found)


def host_resolvers() -> tuple[str, ...]:
    """The resolvers Docker would give a container on this machine."""
    for path in (_RESOLV_CONF, _RESOLVED_UPSTREAM):
        try:
            found = resolvers_from(path.read_text(errors="replace"))
        except OSError:
            continue
        if found:
            return found
    return _DOCKER_DEFAULT_DNS


class NetworkEngine(Protocol):
    """What :class:`JobNetwork` needs of the container engine."""

    def ensure_network(self, name: str, bridge: str) -> None:
        """Make the network (no inter-container traffic, no IPv6) unless it is there."""

    def is_rootless(self) -> bool: ...


Runner = Callable[[Sequence[str], str | None], subprocess.CompletedProcess[str]]


def _run(argv: Sequence[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), input=stdin, capture_output=True, text=True, timeout=30, check=False
    )


class JobNetwork:
    """One provider's job network: its mode, and (for ``internet`` and ``lan``) the
    Docker network and rules, installed on first need and checked before every
    container.

    Thread safe: the agent's job and shell threads each ask before a container is
    made; the first one installs, the rest find it done."""

    def __init__(
        self,
        mode: Mode,
        *,
        prefix: str = NETWORK_PREFIX,
        resolvers: Sequence[str] | None = None,
        run: Runner = _run,
    ) -> None:
        self.mode: Mode = mode
        self.names = names_for(mode, prefix) if mode in FILTERED_MODES else None
        self.resolvers = tuple(resolvers) if resolvers is not None else host_resolvers()
        self._run = run
        self._lock = threading.Lock()
        self._ready = False

    @property
    def docker_network(self) -> str:
        """What a container's ``network_mode`` is under this mode."""
        return self.names.network if self.names is not None else self.mode

    @property
    def dns(self) -> tuple[str, ...]:
        """The resolvers a container is given (only on our own network)."""
        return self.resolvers if self.names is not None else ()

    def problem(self, *, rootless: bool) -> str | None:
        """Why this mode cannot be had here, in one line (None: it can, or needs
        nothing); ``rootless``: whether the engine runs rootless."""
        if self.names is None:
            return None
        why = install_problem(euid=os.geteuid(), rootless=rootless, iptables=iptables_installed())
        return cannot_filter(self.mode, why) if why else None

    def ensure(self, engine: NetworkEngine) -> None:
        """Make the network and install the rules; refuse (ConfigError) where they
        cannot be, so no job ever runs unfiltered under ``internet`` or ``lan``.

        Called before every container: once installed, the rules are read back
        (one ``iptables-save``, a few milliseconds) and installed again when
        something removed them since (a flush, a firewall manager's reload)."""
        names = self.names
        if names is None:
            return
        rules = rule_set(self.mode, names, self.resolvers)
        with self._lock:
            if self._ready:
                if self._intact(rules):
                    return
                logger.warning(
                    "job network %s: its firewall rules were removed (a flush?); "
                    "installing them again before the next container",
                    self.mode,
                )
                self._ready = False
            problem = self.problem(rootless=engine.is_rootless())
            if problem is not None:
                raise ConfigError(problem)
            engine.ensure_network(names.network, names.bridge)
            self._install(rules)
            self._ready = True
        logger.info(
            "job network %s: %s (Docker network %s, bridge %s, resolvers %s)",
            self.mode,
            describe_mode(self.mode),
            names.network,
            names.bridge,
            ", ".join(self.resolvers) or "none",
        )

    def _intact(self, rules: RuleSet) -> bool:
        done = self._run(["iptables-save", "-t", "filter"], None)
        return done.returncode == 0 and rules.intact(done.stdout)

    def _install(self, rules: RuleSet) -> None:
        done = self._run(["iptables-restore", "--noflush"], rules.restore)
        if done.returncode != 0:
            self._refuse("iptables-restore", done)
        for chain, rule in rules.jumps:
            if self._run(["iptables", "-C", chain, *rule], None).returncode == 0:
                continue
            done = self._run(["iptables", "-I", chain, "1", *rule], None)
            if done.returncode != 0:
                self._refuse(f"iptables -I {chain}", done)

    def _refuse(self, what: str, done: subprocess.CompletedProcess[str]) -> None:
        detail = " ".join((done.stderr or done.stdout or "").split())[:200] or "no detail"
        raise ConfigError(cannot_filter(self.mode, f"{what} failed: {detail}"))
