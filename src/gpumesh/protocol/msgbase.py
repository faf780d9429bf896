"""What every message of :mod:`gpumesh.protocol.messages` is built from: the tagged
base struct and the bounded field types the sections share."""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = [
    "JOB_ID_PATTERN",
    "Arg",
    "Code",
    "Count",
    "EnvKey",
    "EnvValue",
    "JobId",
    "Key",
    "Name",
    "Nonce",
    "Signature",
    "Text",
    "_Msg",
]

Name = Annotated[str, msgspec.Meta(max_length=64)]
Text = Annotated[str, msgspec.Meta(max_length=2048)]
Code = Annotated[str, msgspec.Meta(max_length=64)]
Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Signature = Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]
Count = Annotated[int, msgspec.Meta(ge=0)]

# Patterns end in \Z, not $: msgspec matches them with Python's re, where $ also
# matches before a final newline ("abcdefgh\n" would pass as a job id).
JOB_ID_PATTERN = r"^[a-z0-9]{8,32}\Z"
JobId = Annotated[str, msgspec.Meta(pattern=JOB_ID_PATTERN)]
Arg = Annotated[str, msgspec.Meta(max_length=8192)]
EnvKey = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")]
# No NUL: Docker's refusal of one quotes the whole variable, value included, into logs.
EnvValue = Annotated[str, msgspec.Meta(max_length=32768, pattern=r"^[^\x00]*\Z")]


class _Msg(msgspec.Struct, tag_field="t", frozen=True):
    pass
