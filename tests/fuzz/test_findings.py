"""What the fuzzer found, each as the smallest input that shows it."""

from __future__ import annotations

import msgspec
import pytest

from gpumesh.errors import ProtocolError
from gpumesh.protocol.messages import decode_message

DIGEST = "ab" * 32

# --- fixed: pattern fields took a trailing newline -----------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"t": "job_cancel", "job_id": "abcdefgh\n"},
        {"t": "job_output", "seq": 0, "attempt": 0, "stream": "stdout\n", "data": b""},
        {"t": "file_info", "path": "/a", "exists": True, "kind": "file\n", "size": 0}
        | {"mode": 0, "mtime": 0.0},
        {"t": "channel_put", "path": "/a", "size": 0, "mode": 0, "source": "ab\n"},
        {"t": "app_sync", "name": "app", "manifest_bytes": 0, "digest": DIGEST + "\n"},
        {"t": "exec_start", "image": "i", "command": [], "env": {"PATH\n": "/bin"}}
        | {"tty": False, "rows": 0, "cols": 0},
    ],
    ids=lambda fields: str(fields["t"]),
)
def test_a_pattern_field_with_a_trailing_newline_is_refused(fields: dict[str, object]) -> None:
    # Python's $ matches before a final newline; msgspec's patterns are re.search'ed.
    with pytest.raises(ProtocolError, match="invalid message"):
        decode_message(msgspec.msgpack.encode(fields))
