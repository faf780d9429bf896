"""What `gpumesh dashboard --open` decides without a browser: the page it hands
one, and which browsers (snap, flatpak) cannot read the home and so get none."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.cli.dashboard import desktop_packaging, redirect_page, sandboxed_browser


def test_the_page_sends_the_browser_on_with_the_url_escaped() -> None:
    page = redirect_page('http://a.localhost:8080/#code=x"><script>')
    assert (
        '<meta http-equiv="refresh" content="0;url=http://a.localhost:8080/#code=x&quot;&gt;'
        in page
    )
    assert "<script>" not in page


@pytest.mark.parametrize(
    ("script", "packaging"),
    [
        ('#!/bin/sh\nexec /snap/bin/firefox "$@"\n', "snap"),
        ('#!/bin/sh\nexec snap run chromium "$@"\n', "snap"),
        ('#!/bin/sh\nexec flatpak run org.mozilla.firefox "$@"\n', "flatpak"),
        ('#!/bin/sh\nexec /usr/lib/firefox/firefox "$@"\n', None),
        ("\x7fELF not a script, /snap/bin/ inside", None),
    ],
)
def test_a_wrapper_script_of_a_sandboxed_browser_is_known(
    tmp_path: Path, script: str, packaging: str | None
) -> None:
    program = tmp_path / "browser"
    program.write_text(script)
    program.chmod(0o755)
    assert sandboxed_browser(str(program)) == packaging


def test_a_browser_under_the_snap_folders_is_known(tmp_path: Path) -> None:
    snap = tmp_path / "snap" / "bin"
    snap.mkdir(parents=True)
    (snap / "firefox").write_bytes(b"\x7fELF")
    (snap / "firefox").chmod(0o755)
    (tmp_path / "firefox").symlink_to(snap / "firefox")
    assert sandboxed_browser(str(tmp_path / "firefox")) == "snap"
    assert sandboxed_browser(str(tmp_path / "no-such-browser")) is None


def test_the_default_browsers_desktop_file_tells_a_snap() -> None:
    assert desktop_packaging("firefox_firefox.desktop") == "snap"
    assert desktop_packaging("chromium_chromium.desktop") == "snap"
    assert desktop_packaging("firefox.desktop") is None
    assert desktop_packaging("org.mozilla.firefox.desktop") is None  # not installed here
    assert desktop_packaging("../x_y.desktop") is None
    assert desktop_packaging("") is None
