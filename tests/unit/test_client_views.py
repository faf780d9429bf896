"""The view structs print the same ``--json`` shapes the CLI built by hand before."""

from __future__ import annotations

import json

import msgspec

from gpumesh.client.apps import SyncResult
from gpumesh.client.jobs import JobResult
from gpumesh.client.views.apps import SyncView
from gpumesh.client.views.jobs import JobResultView
from gpumesh.files.pack import Skipped
from gpumesh.protocol.states import JobRole


def _old_sync_json(result: SyncResult) -> dict[str, object]:
    """What `gpumesh app sync --json` printed before the view struct."""
    return {
        "peer": result.peer,
        "remote": result.remote,
        "dry_run": result.dry_run,
        "bytes_sent": result.bytes_sent,
        "manifest_bytes": result.manifest_bytes,
        "manifest": result.manifest,
        "files_sent": len(result.sent),
        "files_deleted": len(result.deleted),
        "files_unchanged": result.unchanged,
        "sent": result.sent,
        "deleted": result.deleted,
        "skipped": [{"path": s.path, "rule": s.reason} for s in result.skipped],
        "channel": result.channel,
        "no_channel": result.no_channel,
    }


def test_the_sync_view_prints_the_shape_app_sync_printed() -> None:
    result = SyncResult(
        "alice-pc",
        "/apps/proj",
        False,
        bytes_sent=10240,
        manifest_bytes=321,
        manifest="delta",
        sent=["a.py", "data/b.bin"],
        deleted=["old.txt"],
        unchanged=7,
        skipped=[Skipped(".git/", "default 'git'"), Skipped("x.pyc", ".gpumeshignore:1 '*.pyc'")],
        seconds=1.5,
        channel="quic",
        no_channel="off",
    )
    view = msgspec.to_builtins(SyncView.of(result))
    expected = _old_sync_json(result)
    # Same keys in the same order, same values and types: byte for byte the same JSON.
    assert json.dumps(view, indent=2) == json.dumps(expected, indent=2)


def test_the_job_result_view_carries_typed_state_and_role() -> None:
    result = JobResult("0123456789ab", "alice-pc", "failed", 3, 1, "exited 3", ["0"])
    view = msgspec.to_builtins(JobResultView.of(result))
    assert view == {
        "job_id": "0123456789ab",
        "peer": "alice-pc",
        "role": "submitted",
        "state": "failed",
        "final": True,
        "exit_code": 3,
        "attempt": 1,
        "message": "exited 3",
        "gpus": ["0"],
        "output_dropped": 0,
    }
    hosted = JobResult("0123456789ab", "bob", "running", None, 1, "", role=JobRole.HOSTED)
    assert msgspec.to_builtins(JobResultView.of(hosted))["final"] is False
