"""The errors that end a rank process instead of restarting it, and how faults are named in logs."""

from __future__ import annotations

import traceback

from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import FaultRecord

__all__ = ["NonRetryable", "ProcessGroupConflict", "RestartExit", "describe", "exception_name", "release_frames"]


class NonRetryable(Exception):
    """Raise from the training function to fail the job instead of restarting (exit code NON_RETRYABLE)."""


class ProcessGroupConflict(NonRetryable):
    """The training function asked ``init_process_group`` for a world that is not the iteration's (another
    rank or world size). No restart can fix that, so the job fails with this message."""


class RestartExit(SystemExit):
    """The wrapper gives up: the process exits with ``code`` (an :class:`ExitCode`)."""

    def __init__(self, code: ExitCode, reason: str) -> None:
        super().__init__(int(code))
        self.exit_code = code
        self.reason = reason

    def __str__(self) -> str:
        return f"exit {int(self.exit_code)} ({self.exit_code.name}): {self.reason}"


def exception_name(e: BaseException) -> str:
    """``ValueError`` for a builtin, ``package.module.Error`` otherwise."""
    t = type(e)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def describe(rec: FaultRecord) -> str:
    """One line for logs and exit reasons: who failed and how."""
    who = f"rank {rec.rank}" if rec.rank is not None else f"slot {rec.slot}"
    what = f"{rec.exception}: {rec.message}" if rec.exception else f"{rec.kind}: {rec.reason}"
    return f"{who} on {rec.node_id} in iteration {rec.iteration}: {what}"


def release_frames(fault: BaseException) -> None:
    """Drop what the failed iteration's frames still hold (model, DDP, the process group and its threads and
    sockets) now, instead of at the next garbage collection: the traceback links those frames to the
    exception, and the exception is referenced from a frame still running."""
    tb = fault.__traceback__
    if tb is not None:
        traceback.clear_frames(tb)
    fault.__traceback__ = None
    # Exception contexts can form a cycle (an interrupt delivered while another exception is being handled),
    # so the walk stops at the first exception it has already seen.
    seen = {id(fault)}
    ctx = fault.__context__
    while ctx is not None and id(ctx) not in seen:
        seen.add(id(ctx))
        if ctx.__traceback__ is not None:
            traceback.clear_frames(ctx.__traceback__)
            ctx.__traceback__ = None
        ctx = ctx.__context__
