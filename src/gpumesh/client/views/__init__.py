"""View structs: what the CLI prints with ``--json`` and what the control API returns.

One struct per shape, built from the client layer's typed results; the CLI
serialises them with :func:`to_json` and never builds a dictionary by hand, so
the machine-readable output of a command and of the API cannot drift apart.
Modules here are grouped by area (jobs, files, peers, groups, node).

A struct's fields are its keys, in order. A field that a shape leaves out in
some cases (rather than setting it to null) defaults to ``msgspec.UNSET``,
which :func:`to_json` omits.
"""

from __future__ import annotations

import json

import msgspec

__all__ = ["ErrorView", "to_json"]


class ErrorView(msgspec.Struct):
    """Every error's body: the error tree's stable code and a message for people."""

    code: str
    message: str


def to_json(view: object) -> str:
    """A view (a struct, a list of them, or plain data) as the CLI prints it.

    Indented by two spaces, keys in field order, non-ASCII escaped: the text
    every ``--json`` has always printed. A value with no JSON form prints as
    its ``str()``.
    """
    return json.dumps(msgspec.to_builtins(view, enc_hook=str), indent=2)
