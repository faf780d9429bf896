"""View structs of ``gpumesh app``: the ``--json`` shape of ``app sync``, and what
one ``app run`` did."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gpumesh.client.views.jobs import JobResultView

if TYPE_CHECKING:
    from gpumesh.client.apps import AppRun, SyncResult

__all__ = ["AppPullView", "AppRunView", "SkippedView", "SyncView"]


class SkippedView(msgspec.Struct):
    path: str
    rule: str
    """Why it was left out: the ignore rule (or the kind of file) that matched."""


class SyncView(msgspec.Struct):
    """What one ``app sync`` did (with ``dry_run``: would do)."""

    peer: str
    remote: str
    """The app's folder in the peer's sandbox, ``/apps/NAME``."""
    dry_run: bool
    bytes_sent: int
    manifest_bytes: int
    manifest: str
    """``delta`` or ``full``."""
    files_sent: int
    files_deleted: int
    files_unchanged: int
    sent: list[str]
    deleted: list[str]
    skipped: list[SkippedView]
    channel: str
    """``tls``, ``quic``, or empty (nothing sent)."""
    no_channel: str

    @classmethod
    def of(cls, result: SyncResult) -> SyncView:
        return cls(
            peer=result.peer,
            remote=result.remote,
            dry_run=result.dry_run,
            bytes_sent=result.bytes_sent,
            manifest_bytes=result.manifest_bytes,
            manifest=result.manifest,
            files_sent=len(result.sent),
            files_deleted=len(result.deleted),
            files_unchanged=result.unchanged,
            sent=list(result.sent),
            deleted=list(result.deleted),
            skipped=[SkippedView(s.path, s.reason) for s in result.skipped],
            channel=result.channel,
            no_channel=result.no_channel,
        )


class AppRunView(msgspec.Struct):
    """What one ``app run`` did: the sync, the job, and the folder pulled back."""

    sync: SyncView
    job: JobResultView
    out_remote: str
    """The app's folder pulled back (``/apps/NAME/OUT``), or empty when none was asked."""
    pulled: bool
    """False when a folder was asked for and the job left none: nothing was pulled."""

    @classmethod
    def of(cls, run: AppRun) -> AppRunView:
        return cls(
            sync=SyncView.of(run.sync),
            job=JobResultView.of(run.job),
            out_remote=run.out_remote,
            pulled=run.pulled,
        )


class AppPullView(msgspec.Struct):
    """A past ``app run`` job's folder, pulled."""

    remote: str
    """The folder on the peer (``/apps/NAME``)."""
    size: int
    """Bytes of the tar that carried it."""
    peer: str
    """The provider's name."""
    job_id: str
    """The job's full id."""
