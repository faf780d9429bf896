"""Address hints no node may hand out, for the tests of every place that reads them.

Markup, names no resolver takes, zones, ports out of range: each is signed by
the node's own key where a test puts it in a code or invite, so only the check
of the hint's grammar (``identity/hints.py``) can refuse it.
"""

from __future__ import annotations

BAD_HINTS = [
    "<script>alert(1)</script>:47000",
    "a b.example:47000",
    "\x1b[2Jexample.org:47000",
    "exa_mple.org:47000",
    "a..b:47000",
    "-leading.example:47000",
    "x" * 64 + ".example:47000",
    "bücher.example:47000",
    "1.2.3.999:47000",
    "[fe80::1%eth0]:47000",
    "[not-v6]:47000",
    "192.0.2.1",
    "192.0.2.1:0",
    "192.0.2.1:65536",
    "192.0.2.1:+80",
    "192.0.2.1:٤٤",
    ":47000",
]
