"""The owner page's sharing section as HTML, without a browser: the control app in
this process, asked with the bearer token. It says whether this machine is shared
(since when, on which UDP address, with which options, or how the last share
ended) and offers the one button that fits, calling ``POST`` or ``DELETE
/api/v1/share``; without a node process behind the API it says where sharing is
changed instead, and offers no button."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gpumesh.client.bodies import ShareOptions
from gpumesh.client.node import Node
from gpumesh.control.app import create_app
from gpumesh.control.call import ControlState
from gpumesh.control.shareviews import ShareEnd
from gpumesh.daemon.sharing import Sharing

TOKEN = "t" * 32


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path / "home")
    made.init("erin-pc")
    try:
        yield made
    finally:
        made.close()


def _owner_page(node: Node, process: Any) -> str:
    app = create_app(ControlState(node=node, token=TOKEN, process=process))

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.get("/owner", headers={"authorization": f"Bearer {TOKEN}"})

    response = asyncio.run(get())
    assert response.status_code == 200, response.text
    found = re.search(r'<section class="card" id="share".*?</section>', response.text, re.S)
    assert found is not None, response.text
    return found.group(0)


def test_not_shared_after_a_share_ended_offers_start_with_the_defaults(node: Node) -> None:
    ended = ShareEnd(time.time() - 120, "stopped <by> the owner")
    section = _owner_page(node, SimpleNamespace(sharing=Sharing(node, ended)))
    assert 'data-sharing="false"' in section
    assert "<strong>Not shared.</strong> The last share ended <time datetime=" in section
    assert "(2 min ago): stopped &lt;by&gt; the owner." in section
    assert 'data-api="POST /api/v1/share"' in section and 'data-body="{}"' in section
    assert 'aria-label="Start sharing this machine with the default options"' in section
    assert "DELETE" not in section


def test_never_shared_says_so_without_an_end(node: Node) -> None:
    section = _owner_page(node, SimpleNamespace(sharing=Sharing(node)))
    assert '<p id="share-state"><strong>Not shared.</strong></p>' in section
    assert 'data-api="POST /api/v1/share"' in section


def test_shared_says_since_when_where_and_with_which_options_and_offers_stop(
    node: Node,
) -> None:
    sharing = Sharing(node)
    sharing.agent = SimpleNamespace(info=lambda: None)  # type: ignore[assignment]
    sharing._udp = "127.0.0.1:47001"
    sharing.options = ShareOptions(port=47001, max_vram="8GB")
    sharing.since = time.time() - 5
    section = _owner_page(node, SimpleNamespace(sharing=sharing))
    assert 'data-sharing="true"' in section
    assert '<strong class="shared">Shared</strong> since <time datetime=' in section
    assert "on UDP <code>127.0.0.1:47001</code>, with --port 47001 --max-vram 8GB." in section
    assert 'data-api="DELETE /api/v1/share"' in section and 'class="danger"' in section
    assert 'aria-label="Stop sharing this machine"' in section and "data-confirm=" in section
    assert 'data-api="POST /api/v1/share"' not in section
    assert 'data-api="POST /api/v1/share/pause"' in section  # the owner may take it back
    assert "share-resume" not in section


def test_without_a_node_process_it_says_where_sharing_is_changed(node: Node) -> None:
    section = _owner_page(node, None)
    assert "<strong>Not shared.</strong>" in section
    assert "not served by this home's node process" in section
    assert "<code>gpumesh share</code>" in section
    assert "<button" not in section


def test_a_stopping_node_process_offers_no_button(node: Node) -> None:
    section = _owner_page(node, SimpleNamespace(sharing=None))
    assert "The node process is stopping" in section
    assert "<button" not in section
