"""The job network's rules, computed without touching the firewall."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest

from gpumesh.errors import ConfigError
from gpumesh.runtime.jobnet import (
    JobNetwork,
    cannot_filter,
    install_problem,
    is_job_network,
    names_for,
    resolvers_from,
    rule_set,
)
from gpumesh.transport.sockowner import exposed_addresses


def _rules(mode: str, resolvers: Sequence[str] = ("10.255.255.53",)) -> list[str]:
    names = names_for(mode, "gpumesh-jobs")
    return rule_set(mode, names, resolvers).restore.splitlines()  # type: ignore[arg-type]


def test_internet_closes_this_machine_containers_link_local_and_private_ranges() -> None:
    names = names_for("internet")
    lines = _rules("internet")
    forward, inbound = names.forward_chain, names.input_chain
    assert lines[0] == "*filter" and lines[-1] == "COMMIT"
    # Declaring our chains empties them: applying twice gives the same chains.
    assert f":{forward} - [0:0]" in lines and f":{inbound} - [0:0]" in lines
    for cidr in ("169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"):
        assert f"-A {forward} -d {cidr} -j REJECT" in lines
    for bridge in (names.bridge, "docker+", "br-+", "gpm+"):
        assert f"-A {forward} -o {bridge} -j REJECT" in lines
    # This machine itself, at any address: everything but DNS to a resolver.
    assert [line for line in lines if line.startswith(f"-A {inbound} ")] == [
        f"-A {inbound} -p udp -d 10.255.255.53/32 --dport 53 -j RETURN",
        f"-A {inbound} -p tcp -d 10.255.255.53/32 --dport 53 -j RETURN",
        f"-A {inbound} -j REJECT",
    ]


def test_dns_to_the_resolvers_comes_before_any_refusal() -> None:
    names = names_for("internet")
    lines = [line for line in _rules("internet") if line.startswith(f"-A {names.forward_chain} ")]
    dns = [i for i, line in enumerate(lines) if "--dport 53" in line]
    refusals = [i for i, line in enumerate(lines) if line.endswith("REJECT")]
    assert dns == [0, 1] and min(refusals) > max(dns)
    assert lines[-1] == f"-A {names.forward_chain} -j RETURN"
    # Only port 53, only of the resolvers: no blanket opening of a private address.
    assert all("-d 10.255.255.53/32 --dport 53" in lines[i] for i in dns)


def test_lan_opens_private_ranges_but_never_link_local_this_machine_or_containers() -> None:
    names = names_for("lan")
    lines = _rules("lan")
    for cidr in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"):
        assert not any(cidr in line for line in lines)
    assert f"-A {names.forward_chain} -d 169.254.0.0/16 -j REJECT" in lines
    assert f"-A {names.forward_chain} -o docker+ -j REJECT" in lines
    assert f"-A {names.input_chain} -j REJECT" in lines


def test_jumps_filter_only_the_job_bridge() -> None:
    names = names_for("internet")
    jumps = rule_set("internet", names, ()).jumps
    assert jumps == (
        ("DOCKER-USER", ("-i", names.bridge, "-j", names.forward_chain)),
        ("INPUT", ("-i", names.bridge, "-j", names.input_chain)),
    )


@pytest.mark.parametrize("mode", ["bridge", "none"])
def test_unfiltered_modes_have_no_rules_and_no_network_of_their_own(mode: str) -> None:
    with pytest.raises(ValueError):
        rule_set(mode, names_for("internet"), ())  # type: ignore[arg-type]
    network = JobNetwork(mode, resolvers=())  # type: ignore[arg-type]
    assert network.docker_network == mode and network.dns == ()
    assert network.problem(rootless=True) is None


def test_names_fit_the_kernel_and_each_mode_and_prefix_has_its_own() -> None:
    seen = set()
    for prefix in ("gpumesh-jobs", "gpumesh-jobs-t123456789"):
        for mode in ("internet", "lan"):
            names = names_for(mode, prefix)
            assert len(names.bridge) <= 15 and names.bridge.startswith("gpm")
            assert len(names.input_chain) <= 28
            assert is_job_network(names.network, prefix)
            seen.add(names.bridge)
    assert len(seen) == 4
    assert not is_job_network("host")
    assert not is_job_network("container:abc")
    assert not is_job_network("gpumesh-jobs-x:y")
    with pytest.raises(ConfigError):
        names_for("internet", "Bad Prefix")


def test_resolvers_are_the_ipv4_non_loopback_name_servers() -> None:
    text = "\n".join(
        [
            "# comment",
            "nameserver 127.0.0.53",
            "nameserver 10.0.0.2",
            "nameserver fe80::1",
            "nameserver not-an-address",
            "nameserver 10.0.0.2",
            "search example.org",
            "nameserver 1.1.1.1",
        ]
    )
    assert resolvers_from(text) == ("10.0.0.2", "1.1.1.1")


@pytest.mark.parametrize(
    ("euid", "rootless", "iptables", "why"),
    [
        (1000, False, True, "does not run as root"),
        (0, True, True, "rootless"),
        (0, False, False, "iptables"),
    ],
)
def test_where_rules_cannot_be_installed_the_refusal_names_both_ways_out(
    euid: int, rootless: bool, iptables: bool, why: str
) -> None:
    problem = install_problem(euid=euid, rootless=rootless, iptables=iptables)
    assert problem is not None and why in problem
    line = cannot_filter("internet", problem)
    assert "\n" not in line
    assert "job_network none" in line and "(jobs get no network)" in line
    assert "job_network bridge" in line and "this machine's services" in line
    assert install_problem(euid=0, rootless=False, iptables=True) is None


class _Engine:
    def __init__(self) -> None:
        self.networks: list[tuple[str, str]] = []

    def ensure_network(self, name: str, bridge: str) -> None:
        self.networks.append((name, bridge))

    def is_rootless(self) -> bool:
        return False


class _Iptables:
    """A stand-in for iptables, iptables-restore and iptables-save over a filter
    table of jumps and our chains' rules; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[str, ...], str | None]] = []
        self.jumps: set[tuple[str, ...]] = set()
        self.chains: dict[str, list[str]] = {}

    def __call__(self, argv: Sequence[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        self.calls.append((tuple(argv), stdin))
        out = ""
        if argv[0] == "iptables-restore":
            assert stdin is not None
            for line in stdin.splitlines():
                if line.startswith(":"):
                    self.chains[line[1:].split()[0]] = []
                elif line.startswith("-A "):
                    self.chains[line.split()[1]].append(line)
        elif argv[0] == "iptables-save":
            lines = [f"-A {jump[0]} {' '.join(jump[1:])}" for jump in sorted(self.jumps)]
            out = "\n".join(lines + [rule for rules in self.chains.values() for rule in rules])
        elif argv[1] == "-C":
            found = tuple(argv[2:]) in self.jumps
            return subprocess.CompletedProcess(argv, 0 if found else 1, "", "")
        elif argv[1] == "-I":
            self.jumps.add((argv[2], *argv[4:]))
        return subprocess.CompletedProcess(argv, 0, out, "")

    def made(self, program: str, option: str | None = None) -> int:
        return sum(
            argv[0] == program and (option is None or argv[1] == option) for argv, _ in self.calls
        )


def test_install_replaces_our_chains_and_adds_each_jump_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 0)
    run = _Iptables()
    calls = run.calls
    engine = _Engine()
    for _ in range(2):  # two share starts: the second adds no second jump
        network = JobNetwork("internet", resolvers=("10.0.0.2",), run=run)
        network.ensure(engine)
        network.ensure(engine)  # and within one, the rules are only read back
    inserts = [argv for argv, _ in calls if argv[1] == "-I"]
    assert len(inserts) == 2
    assert all(argv[3] == "1" for argv in inserts)  # first in their chains
    restores = [stdin for argv, stdin in calls if argv[0] == "iptables-restore"]
    assert len(restores) == 2 and all(
        argv[1] == "--noflush" for argv, _ in calls if argv[0] == "iptables-restore"
    )
    assert engine.networks == [(network.names.network, network.names.bridge)] * 2  # type: ignore[union-attr]


def test_rules_removed_while_sharing_are_installed_again_before_the_next_container(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A flush (a firewall manager's reload) or a jump deleted by hand would leave
    the next jobs unfiltered: each ensure reads the rules back first."""
    monkeypatch.setattr("os.geteuid", lambda: 0)
    run = _Iptables()
    network = JobNetwork("internet", resolvers=("10.0.0.2",), run=run)
    names = network.names
    assert names is not None
    network.ensure(_Engine())
    assert run.made("iptables-restore") == 1
    network.ensure(_Engine())
    assert run.made("iptables-restore") == 1 and run.made("iptables-save") == 1

    run.chains[names.forward_chain] = run.chains[names.forward_chain][:-3]  # rules deleted
    network.ensure(_Engine())
    assert run.made("iptables-restore") == 2
    assert "were removed" in caplog.text

    run.jumps.clear()  # `iptables -F DOCKER-USER; iptables -F INPUT`
    network.ensure(_Engine())
    assert run.made("iptables-restore") == 3 and len(run.jumps) == 2
    network.ensure(_Engine())
    assert run.made("iptables-restore") == 3  # intact again: read back only


def test_a_failing_iptables_refuses_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 0)

    def run(argv: Sequence[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 1, "", "iptables: No chain/target/match\n")

    network = JobNetwork("lan", resolvers=(), run=run)
    with pytest.raises(ConfigError) as caught:
        network.ensure(_Engine())
    assert "No chain/target/match" in caught.value.message
    assert "\n" not in caught.value.message
    assert "job_network none" in caught.value.message


def test_exposed_addresses_are_the_non_loopback_ones_of_that_port() -> None:
    listeners = {
        ("127.0.0.1", 5900),
        ("0.0.0.0", 5900),
        ("::", 5900),
        ("::1", 5900),
        ("192.0.2.2", 5900),
        ("0.0.0.0", 3389),
    }
    assert exposed_addresses(listeners, 5900) == ["0.0.0.0", "192.0.2.2", "::"]
    assert exposed_addresses({("127.0.0.1", 5900)}, 5900) == []


@pytest.mark.parametrize("mode", ["internet", "lan"])
def test_filtered_modes_join_a_network_of_their_own_given_exactly_the_opened_resolvers(
    mode: str,
) -> None:
    network = JobNetwork(mode, prefix="gpumesh-jobs", resolvers=("10.0.0.2",))  # type: ignore[arg-type]
    assert network.docker_network == f"gpumesh-jobs-{mode}"
    assert network.dns == ("10.0.0.2",)
    names = network.names
    assert names is not None
    restore = rule_set(mode, names, network.dns).restore  # type: ignore[arg-type]
    assert "-d 10.0.0.2/32 --dport 53" in restore
