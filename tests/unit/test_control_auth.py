"""The control API's access rules, without sockets: Host, Origin, bearer, token
file, and one-time login codes with an injected clock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpumesh.control import auth
from gpumesh.errors import ConfigError


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1:8080", True),
        ("localhost:8080", True),
        ("LOCALHOST", True),
        ("[::1]:8080", True),
        ("127.5.6.7", True),
        ("gpu-box.lan:8080", True),  # configured
        ("evil.example", False),
        ("127.0.0.1.nip.io:8080", False),
        ("localhost.evil.example", False),
        ("[::ffff:1.2.3.4]:80", False),
        ("", False),
        (None, False),
    ],
)
def test_host_must_be_loopback_or_configured(host: str | None, allowed: bool) -> None:
    assert auth.host_allowed(host, frozenset({"gpu-box.lan"})) is allowed


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        (None, True),
        ("http://127.0.0.1:8080", True),
        ("HTTP://127.0.0.1:8080", True),
        ("http://127.0.0.1:9999", False),
        ("http://localhost:8080", False),  # another origin, even if also loopback
        ("null", False),
        ("http://evil.example", False),
    ],
)
def test_origin_must_be_this_servers(origin: str | None, allowed: bool) -> None:
    assert auth.origin_allowed(origin, "127.0.0.1:8080") is allowed


def test_bearer_header() -> None:
    assert auth.bearer("Bearer abc") == "abc"
    assert auth.bearer("bearer  abc ") == "abc"
    assert auth.bearer("Basic abc") is None
    assert auth.bearer("Bearer") is None
    assert auth.bearer(None) is None
    assert auth.token_matches("abc", "abc") and not auth.token_matches("abd", "abc")
    assert not auth.token_matches(None, "abc")


def test_home_token_is_made_once_0600(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, open_umask: None
) -> None:
    monkeypatch.delenv("GPUMESH_API_TOKEN", raising=False)
    first = auth.api_token(tmp_path)
    assert len(first) >= 40
    assert (tmp_path / auth.TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    assert auth.api_token(tmp_path) == first
    monkeypatch.setenv("GPUMESH_API_TOKEN", "mine")
    assert auth.api_token(tmp_path) == "mine"
    # An empty file (a crash after create) gets a token instead of an empty one.
    monkeypatch.delenv("GPUMESH_API_TOKEN")
    other = tmp_path / "other"
    other.mkdir()
    fd = os.open(other / auth.TOKEN_FILE, os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    assert len(auth.api_token(other)) >= 40


def test_login_codes_are_one_time_and_expire() -> None:
    now = [1000.0]
    sessions = auth.Sessions(clock=lambda: now[0])
    code = sessions.new_code()
    session = sessions.exchange(code)
    assert session is not None and sessions.valid(session)
    assert sessions.exchange(code) is None  # spent
    assert not sessions.valid("forged") and not sessions.valid(None)

    late = sessions.new_code()
    now[0] += auth.CODE_TTL + 1
    assert sessions.exchange(late) is None
    assert sessions.valid(session)
    now[0] += auth.SESSION_TTL
    assert not sessions.valid(session)

    kept = sessions.exchange(sessions.new_code())
    sessions.end(kept)
    assert not sessions.valid(kept)


def test_the_dashboards_name_is_the_homes_own_and_says_nothing_of_the_token() -> None:
    name = auth.dashboard_host("token-one")
    label, _, tld = name.partition(".")
    assert tld == "localhost" and len(label) == 32 and int(label, 16) >= 0
    assert auth.dashboard_host("token-one") == name  # the same across restarts
    assert auth.dashboard_host("token-two") != name  # a new token, a new name
    assert label not in "token-one" and "token" not in label
    # The Host check takes it only when told: a bare *.localhost is not loopback.
    assert not auth.host_allowed(f"{name}:8080", frozenset())
    assert auth.host_allowed(f"{name}:8080", frozenset({name}))


def test_login_urls_name_the_dashboards_host_on_loopback_only() -> None:
    from gpumesh.control.call import ControlState

    state = ControlState(node=None, token="t", public_url="http://127.0.0.1:8080")  # type: ignore[arg-type]
    name = auth.dashboard_host("t")
    assert state.login_url("C") == f"http://{name}:8080/#code=C"
    assert state.cookie_hosts == frozenset({name})
    state.public_url = "http://[::1]:9090"
    assert state.login_url("C") == f"http://{name}:9090/#code=C"
    # A bind beyond loopback (--allow-remote) is reached by its own configured name.
    remote = ControlState(
        node=None,  # type: ignore[arg-type]
        token="t",
        host_names=frozenset({"gpu-box.lan"}),
        public_url="http://gpu-box.lan:8443",
    )
    assert remote.login_url("C") == "http://gpu-box.lan:8443/#code=C"
    assert remote.cookie_hosts == frozenset({"gpu-box.lan", name})


def test_a_link_planted_as_the_token_file_is_refused_and_its_target_untouched(
    tmp_path: Path,
) -> None:
    """Another account's link at api.token would hand its file to the API as the
    token (or take the token written through it): it is refused, never followed."""
    target = tmp_path / "elsewhere"
    target.write_text("someone else's token\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / auth.TOKEN_FILE).symlink_to(target)
    with pytest.raises(ConfigError, match="is a link: GPUMesh opens no links in its home"):
        auth.api_token(home)
    assert target.read_text() == "someone else's token\n"
