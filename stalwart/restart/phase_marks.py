"""What a rank process records of its recoveries: the wall-clock marks the phases of a recovery are read from
(:class:`~stalwart.api.restart.RecoveryMarks`; the phases: :mod:`stalwart.api.recovery`).

For the iteration it runs, the process keeps when it first learned of the fault that iteration recovers from
(``knew``: an interrupt, an error of its own collective, a spare's wait ending in a fault, a handover to a
newer round), when it then left its training function (``left``), when it passed the iteration's barrier,
when its process group was built, when the decorator's prepare hook ran (once per process), and what
``sync_from_peers`` moved. The earliest knowledge of a fault, and the first leaving after it, are kept until an
iteration completes its first step: a fault during a recovery extends that recovery.

State is per process (a module's), not per session: a process handed over to a new round keeps what it knew
in the old one. The session's monitor attaches a sink that puts each new record into the status file; the
agent carries it into its progress record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from stalwart.api.restart import RecoveryMarks

__all__ = ["attach", "copied", "current", "detach", "entered", "group_built", "knew", "left", "prepared", "reset",
           "sealed", "stepped"]

_lock = threading.Lock()
_knew: float | None = None
_left: float | None = None
_entered: float | None = None
_prepare: tuple[float, float, bool] | None = None
_marks: RecoveryMarks | None = None
_sink: Callable[[RecoveryMarks], None] | None = None


def _publish(marks: RecoveryMarks | None) -> None:
    sink = _sink
    if sink is not None and marks is not None:
        sink(marks)


def _update(**changes: object) -> None:
    global _marks
    with _lock:
        if _marks is None:
            return
        _marks = _marks.model_copy(update=changes)
        marks = _marks
    _publish(marks)


def knew(at: float | None = None) -> None:
    """This process learned of a fault (``at``: when; now by default). The earliest since the last first
    step counts."""
    global _knew
    t = time.time() if at is None else at
    with _lock:
        if _knew is None or t < _knew:
            _knew = t


def left(at: float | None = None) -> None:
    """The process left its training function after a fault (``at``: when; now by default). The first time
    since the last first step counts: how long the fault's interruption took to take effect."""
    global _left
    with _lock:
        if _left is None:
            _left = time.time() if at is None else at


def entered(at: float | None = None) -> None:
    """The process takes up a round: its first session, or the one its handover to a newer round begins."""
    global _entered
    with _lock:
        _entered = time.time() if at is None else at


def prepared(start: float, end: float, *, parked: bool) -> None:
    """The decorator's prepare hook ran from ``start`` to ``end`` (``parked``: on a parked spare)."""
    global _prepare
    with _lock:
        _prepare = (start, end, parked)


def sealed(iteration: int, epoch: int | None, at: float | None = None) -> None:
    """The process passed the barrier of ``iteration`` (round ``epoch``): the marks of a new iteration."""
    global _marks
    with _lock:
        prep = _prepare
        _marks = RecoveryMarks(epoch=epoch, iteration=iteration, knew=_knew, left=_left, entered=_entered,
                               sealed=time.time() if at is None else at,
                               prepare_start=prep[0] if prep else None, prepare_end=prep[1] if prep else None,
                               prepare_parked=prep[2] if prep else False)
        marks = _marks
    _publish(marks)


def group_built(at: float | None = None) -> None:
    """The iteration's process group is built."""
    _update(group=time.time() if at is None else at)


def copied(start: float, end: float, nbytes: int, role: Literal["sent", "received"], sources: int) -> None:
    """``sync_from_peers`` moved ``nbytes`` between ``start`` and ``end`` (this rank sent or received)."""
    _update(copy_start=start, copy_end=end, copy_bytes=nbytes, copy_role=role, copy_sources=sources)


def stepped() -> None:
    """The iteration completed its first step: the fault it recovered from is behind."""
    global _knew, _left
    with _lock:
        _knew, _left = None, None


def current() -> RecoveryMarks | None:
    """The marks of the iteration the process runs (None before its first barrier)."""
    with _lock:
        return _marks


def attach(sink: Callable[[RecoveryMarks], None]) -> None:
    """Send every new record to ``sink`` (the session's monitor, into the status file), the current one now."""
    global _sink
    _sink = sink
    _publish(current())


def detach(sink: Callable[[RecoveryMarks], None]) -> None:
    """Stop sending to ``sink`` (a later session may have attached its own already)."""
    global _sink
    if _sink == sink:  # a bound method is a new object at each access, equal to the last
        _sink = None


def reset() -> None:
    """Forget everything (a test's fresh start)."""
    global _knew, _left, _entered, _prepare, _marks, _sink
    with _lock:
        _knew, _left, _entered, _prepare, _marks, _sink = None, None, None, None, None, None
