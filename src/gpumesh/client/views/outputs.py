"""The shape of a job's outputs (``run --outputs``) in ``jobs --json`` and at the
end of an attached ``run``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from gpumesh.store.jobs import JobRecord

__all__ = ["OutputsView"]


class OutputsView(msgspec.Struct):
    """Where a submitted job's outputs come home, and how far they came."""

    job_id: str
    path: str
    """The job's outputs folder inside its container (``/workspace/out``)."""
    dir: str
    """The local folder they go to."""
    state: str
    """``receiving``, ``complete`` (every finished file is here and the provider's
    copy was released) or ``stopped`` (``note`` says why)."""
    files: int
    """Files placed here so far (a file written again counts once)."""
    bytes: int
    """Bytes received so far."""
    note: str
    """The last file refused (as `cp` refuses it), or why the stream stopped."""

    @classmethod
    def of(cls, job: JobRecord) -> OutputsView | None:
        if not job.outputs or not job.outputs_state:
            return None
        return cls(
            job_id=job.job_id,
            path=job.outputs,
            dir=job.outputs_to,
            state=job.outputs_state,
            files=job.outputs_files,
            bytes=job.outputs_bytes,
            note=job.outputs_note,
        )
