"""The dashboard's pages show hostile text as text, without a browser.

Peer names, a job's argv and image, addresses and messages come from other
machines; the templates autoescape them. Each page's template is rendered with
such strings everywhere a peer can put one, and once more through the control
app with a hosted job whose peer name and argv are hostile. The page holds the
strings as text and attribute values, adds no element or handler of theirs, and
never evaluates ``{{7*7}}``. Log lines never reach a template: ``dashboard.js``
appends them as text, which the last test holds it to.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from markupsafe import escape

from gpumesh.client.node import Node
from gpumesh.client.views.owner import RelayedSessionView, RelayingView
from gpumesh.control.app import create_app
from gpumesh.control.call import ControlState
from gpumesh.control.dashboard.pages import NAV, TEMPLATES
from gpumesh.control.dashboard.views import (
    GpuCard,
    GroupCard,
    JobCard,
    JobRow,
    MemberRow,
    Moment,
    PeerRow,
    SessionRow,
    ShareCard,
    UserRow,
)
from gpumesh.protocol.states import JobRole, JobState
from gpumesh.store.jobs import JobRecord

HOSTILE = ("<script>alert(1)</script>", '"><img src=x onerror=alert(1)>', "{{7*7}}")
TOKEN = "t" * 32


class _Page(HTMLParser):
    """The elements, attributes and text of a page, entities decoded."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attributes: list[tuple[str, str]] = []
        self.text: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes += [(name, value or "") for name, value in attrs]

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _assert_text_only(html: str, evil: str) -> None:
    """``evil`` is in ``html`` as text, whole (``{{7*7}}`` too: not evaluated), and
    brought no element, handler or source of its own."""
    page = _Page(html)
    assert page.tags.count("script") == 3 and "img" not in page.tags  # the layout's scripts
    assert not [name for name, _ in page.attributes if name.startswith("on")]
    assert all(value.startswith("/static/") for name, value in page.attributes if name == "src")
    assert any(evil in text for text in page.text)
    assert str(escape(evil)) in html


def _job(evil: str, state: str = "running") -> JobRow:
    return JobRow(evil, "hosted", evil, state, "-", 1, 1, "-", "-", f"sh -c {evil}", True)


def _overview(evil: str) -> dict[str, object]:
    facts = [("Name", evil), ("Connected peers", f"{evil} (direct)")]
    return {"node": facts, "jobs": [_job(evil)], "gpus": [GpuCard(0, evil, "1GB", "24GB")]}


def _peers(evil: str) -> dict[str, object]:
    peer = PeerRow(evil, True, "never", evil, evil, True)
    return {
        "code": "gpm1_code",
        "qr": "",
        "peers": [peer, PeerRow(evil, False, "-", "-", "-", False)],
    }


def _jobs(evil: str) -> dict[str, object]:
    return {"peers": [evil], "groups": [evil], "jobs": [_job(evil)]}


def _job_page(evil: str) -> dict[str, object]:
    card = JobCard(
        evil, "running", "-", [("Peer", evil), ("Command", evil)], f'{{"peer": "{evil}"}}'
    )
    return {"title": f"Job {evil}", "error": "", "job": card}


def _job_missing(evil: str) -> dict[str, object]:
    return {"error": f"no job {evil}"}


def _groups(evil: str) -> dict[str, object]:
    member = MemberRow(evil, evil, evil, "-", "idle", evil)
    return {"groups": [GroupCard(evil, evil, [member])]}


def _owner(share: ShareCard) -> Callable[[str], dict[str, object]]:
    def context(evil: str) -> dict[str, object]:
        return {
            "share": share,
            "running": 1,
            "users": [UserRow(evil, evil, 1, True), UserRow(evil, "not connected", 0, False)],
            "hosted": [_job(evil, "succeeded")],
            "sessions": [SessionRow("Shell", "shells", evil, evil, evil, "now")],
            "relaying": RelayingView(
                [RelayedSessionView(evil, evil, 1000, 1.0, "active")], [evil], 8, 10**7, 0, {}
            ),
        }

    return context


def _shared(evil: str) -> dict[str, object]:
    share = ShareCard("here", True, since=Moment.of(time.time()), udp=evil, options=evil)
    return _owner(share)(evil)


def _ended(evil: str) -> dict[str, object]:
    share = ShareCard("here", False, ended=Moment.of(time.time()), how=evil)
    return _owner(share)(evil)


PAGES: dict[str, tuple[str, Callable[[str], dict[str, object]]]] = {
    "overview": ("overview.html", _overview),
    "peers": ("peers.html", _peers),
    "jobs": ("jobs.html", _jobs),
    "job": ("job.html", _job_page),
    "job-missing": ("job.html", _job_missing),
    "groups": ("groups.html", _groups),
    "owner-shared": ("owner.html", _shared),
    "owner-ended": ("owner.html", _ended),
}


@pytest.mark.parametrize("case", PAGES)
def test_each_template_shows_hostile_peer_text_as_text(case: str) -> None:
    template, context = PAGES[case]
    for evil in HOSTILE:
        values = {"nav": NAV, "page": "x", "title": "Page", "theme": "", **context(evil)}
        _assert_text_only(TEMPLATES.get_template(template).render(values), evil)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path / "home")
    made.init("erin-pc")
    try:
        yield made
    finally:
        made.close()


def _get(node: Node, *paths: str) -> list[httpx.Response]:
    app = create_app(ControlState(node=node, token=TOKEN))

    async def get() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        headers = {"authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return [await client.get(path, headers=headers) for path in paths]

    return asyncio.run(get())


def test_a_hosted_job_with_a_hostile_peer_name_and_argv_shows_as_text(node: Node) -> None:
    evil = " ".join(HOSTILE)
    node.home.store.add_job(
        JobRecord(
            role=JobRole.HOSTED,
            job_id="0123456789ab",
            peer_id="peer",
            peer_name=evil,
            image=evil,
            command=["sh", "-c", evil],
            env={},
            gpu_memory=0,
            gpus=[],
            retries=0,
            timeout=0.0,
            workdir="",
            created_at=time.time(),
            state=JobState.RUNNING,
        )
    )
    asked = HOSTILE[1] + HOSTILE[2]  # an id in a link someone sent (a path holds no "/")
    *pages, missing = _get(
        node, "/", "/jobs", "/jobs/0123456789ab", "/owner", f"/jobs/{quote(asked)}"
    )
    for response in pages:
        assert response.status_code == 200, response.text
        _assert_text_only(response.text, evil)
    assert missing.status_code == 404  # the error message names the id asked for
    _assert_text_only(missing.text, asked)


def test_the_log_goes_into_the_page_as_text() -> None:
    script = resources.files("gpumesh.control.dashboard").joinpath("static", "dashboard.js")
    text = script.read_text("utf-8")
    assert "line.textContent += part" in text
    assert not re.search(r"innerHTML|outerHTML\s*=|insertAdjacentHTML|document\.write", text)
