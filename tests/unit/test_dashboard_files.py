"""The dashboard's shipped files: every vendored file is the one VENDORED.md names
(same SHA-256, licence beside it), and no page template holds inline script."""

from __future__ import annotations

import hashlib
import re
from importlib import resources

STATIC = resources.files("gpumesh.control.dashboard").joinpath("static")


def test_vendored_files_match_their_recorded_hashes_and_licences() -> None:
    vendor = STATIC.joinpath("vendor")
    table = vendor.joinpath("VENDORED.md").read_text("utf-8")
    row = r"^\| `([^`]+)` \| `([^`]+)` \| ([\d.]+) \| \S+ \(`([^`]+)`\) .*`([0-9a-f]{64})` \|$"
    rows = re.findall(row, table, flags=re.M)
    assert {r[0] for r in rows} == {
        "htmx.min.js",
        "htmx-ext-sse.min.js",
        "uPlot.iife.min.js",
        "uPlot.min.css",
    }
    for name, _package, _version, licence, digest in rows:
        assert hashlib.sha256(vendor.joinpath(name).read_bytes()).hexdigest() == digest, name
        assert vendor.joinpath(licence).is_file(), licence
    shipped = {p.name for p in vendor.iterdir()}
    listed = {r[0] for r in rows} | {r[3] for r in rows} | {"VENDORED.md"}
    assert shipped == listed  # nothing unrecorded ships


def test_templates_and_script_have_no_inline_script_or_handlers() -> None:
    templates = resources.files("gpumesh.control.dashboard").joinpath("templates")
    for page in templates.iterdir():
        text = page.read_text("utf-8")
        assert re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", text) == [], page.name
        assert not re.search(r"\son[a-z]+=", text), page.name
        assert "hx-on" not in text and "javascript:" not in text
