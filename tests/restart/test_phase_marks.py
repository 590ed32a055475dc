"""A rank process's marks of its recovery (stalwart.restart.phase_marks): what a sequence of events leaves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stalwart.api.restart import RecoveryMarks
from stalwart.restart import phase_marks


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    phase_marks.reset()
    yield
    phase_marks.reset()


def test_a_recovery_leaves_every_mark_in_order() -> None:
    seen: list[RecoveryMarks] = []
    phase_marks.attach(seen.append)
    phase_marks.prepared(5.0, 6.0, parked=True)
    phase_marks.knew(at=10.0)
    phase_marks.knew(at=10.5)  # a later sign of the same fault: the earliest counts
    phase_marks.left(at=10.6)
    phase_marks.left(at=10.9)  # left again (a failed group build, say): the first time counts
    phase_marks.sealed(0, 3, at=11.0)
    phase_marks.group_built(at=11.2)
    phase_marks.copied(11.3, 11.9, 800, "received", 2)
    got = phase_marks.current()
    assert got == RecoveryMarks(epoch=3, iteration=0, knew=10.0, left=10.6, sealed=11.0, group=11.2, prepare_start=5.0,
                                prepare_end=6.0, prepare_parked=True, copy_start=11.3, copy_end=11.9,
                                copy_bytes=800, copy_role="received", copy_sources=2)
    assert seen[-1] == got and len(seen) == 3  # each new mark went to the status file


def test_a_fault_during_a_recovery_extends_it_and_a_step_ends_it() -> None:
    phase_marks.knew(at=10.0)
    phase_marks.sealed(1, 2, at=11.0)
    phase_marks.knew(at=12.0)  # the iteration failed before its first step
    phase_marks.sealed(2, 2, at=13.0)
    assert (m := phase_marks.current()) is not None and m.knew == 10.0 and m.iteration == 2
    phase_marks.stepped()
    phase_marks.knew(at=20.0)  # the next fault: a new recovery
    phase_marks.left(at=20.5)
    phase_marks.sealed(3, 2, at=21.0)
    assert (m := phase_marks.current()) is not None and m.knew == 20.0 and m.left == 20.5


def test_marks_before_any_barrier_change_nothing_and_a_process_started_late_knew_nothing() -> None:
    phase_marks.group_built(at=1.0)
    phase_marks.copied(1.0, 2.0, 5, "sent", 1)
    assert phase_marks.current() is None
    phase_marks.sealed(0, 1, at=3.0)
    assert (m := phase_marks.current()) is not None and m.knew is None and m.group is None


def test_a_detached_sink_hears_nothing_and_a_newer_one_stays() -> None:
    first: list[RecoveryMarks] = []
    second: list[RecoveryMarks] = []
    phase_marks.attach(first.append)
    phase_marks.sealed(0, 1, at=1.0)
    phase_marks.attach(second.append)  # the next round's session; it is sent the current record at once
    phase_marks.detach(first.append)  # the old session closes after: the new sink stays
    phase_marks.group_built(at=2.0)
    assert len(first) == 1 and [m.group for m in second] == [None, 2.0]
    phase_marks.detach(second.append)
    phase_marks.group_built(at=3.0)
    assert len(second) == 2
