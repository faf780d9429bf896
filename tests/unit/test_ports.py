"""``[LOCAL:]CONTAINER`` as ``run --port``, ``gpumesh port`` and job.yaml's ``ports:``
take it: one parser, one line per mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.client.jobspec import build_spec
from gpumesh.errors import BadRequestError, ConfigError, ExitCode
from gpumesh.protocol.ports import PortSpec, parse_port, parse_ports


def test_one_number_is_both_sides_and_two_are_local_then_container() -> None:
    assert parse_port("8888") == PortSpec(8888, 8888)
    assert parse_port("8080:80") == PortSpec(8080, 80)
    assert parse_port(6006) == PortSpec(6006, 6006)
    assert str(PortSpec(8080, 80)) == "8080:80"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("0", "0 is not a port number"),
        ("70000", "70000 is not a port number"),
        ("a:b", "'a' is not a port number"),
        ("8080:", "'' is not a port number"),
        ("-1", "'-1' is not a port number"),
        ("1:2:3", "'2:3' is not a port number"),
    ],
)
def test_bad_ports_are_usage_errors_of_one_line(text: str, says: str) -> None:
    with pytest.raises(BadRequestError) as refused:
        parse_port(text)
    assert says in refused.value.message
    assert "\n" not in refused.value.message
    assert refused.value.exit_code == ExitCode.USAGE


def test_a_local_port_named_twice_is_refused() -> None:
    with pytest.raises(BadRequestError, match="local port 8080 is named twice"):
        parse_ports(["8080:80", "8080:81"])
    assert parse_ports(["8080:80", "8081:80"]) == [PortSpec(8080, 80), PortSpec(8081, 80)]


def test_job_file_ports_are_read_and_flags_add_to_them(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text('command: ["true"]\npeer: alice\nports: [8888, 8080:80, "6006"]\n')
    spec = build_spec(job, ports=["9000"])
    assert spec.ports == [
        PortSpec(8888, 8888),
        PortSpec(8080, 80),
        PortSpec(6006, 6006),
        PortSpec(9000, 9000),
    ]
    with pytest.raises(BadRequestError, match="named twice"):
        build_spec(job, ports=["8888:1"])


def test_job_file_bad_ports_name_the_line(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text('command: ["true"]\npeer: alice\nports: [70000]\n')
    with pytest.raises(ConfigError, match=r"job.yaml:3: ports: 70000: 70000 is not a port number"):
        build_spec(job)
    job.write_text('command: ["true"]\npeer: alice\nports: 8888\n')
    with pytest.raises(ConfigError, match=r"ports: must be a list"):
        build_spec(job)
