"""The pure decisions of the restart protocol over an epoch's records: who a barrier waits for, and which
fault of an iteration is its cause."""

from __future__ import annotations

import pytest

from stalwart.api.restart import AliveRecord, ArrivalRecord, FaultRecord, SealRecord
from stalwart.restart.coordination import EpochView, barrier_complete
from stalwart.restart.monitor import stall_limit


def arrivals(*slots: int) -> dict[int, ArrivalRecord]:
    return {s: ArrivalRecord(slot=s, node_id="n") for s in slots}


def view(*, now: tuple[int, ...], before: tuple[int, ...] | None = None, alive: tuple[int, ...] = (),
         sealed: dict[str, int] | None = None, inactive: tuple[int, ...] = ()) -> EpochView:
    v = EpochView(alive={s: AliveRecord(slot=s, node_id="n", pid=1) for s in alive}, arrivals={1: arrivals(*now)})
    if before is not None:
        v.arrivals[0] = arrivals(*before)
    if sealed is not None:
        v.seals[0] = SealRecord(iteration=0, world_size=len(sealed), ranks=sealed, inactive=list(inactive),
                                sealed_by=0)
    return v


@pytest.mark.parametrize(("the_view", "complete"), [
    (view(now=(0, 1, 2)), True),
    (view(now=(0, 1)), False),  # the first barrier waits for every slot
    (view(now=(0, 1), before=(0, 1)), True),  # slot 2 took no part and has no process
    (view(now=(0, 1), before=(0, 1), alive=(2,)), False),  # ...but now it has one: waited for
    (view(now=(0,), before=(0,), sealed={"0": 0, "1": 1}), False),  # slot 1 ran iteration 0 (its arrival went
    # with its lease): waited for, it may come back with a new lease
    (view(now=(0, 1), before=(0, 1), sealed={"0": 0, "1": 1}, inactive=(2,)), False),  # an inactive spare too
], ids=["all", "first-missing", "never-there", "alive-now", "took-part", "spare-took-part"])
def test_who_the_barrier_waits_for(the_view: EpochView, complete: bool) -> None:
    assert barrier_complete(the_view, 1, slots=3) is complete


def fault(slot: int, kind: str) -> FaultRecord:
    return FaultRecord(slot=slot, node_id="n", iteration=0, kind=kind, reason=kind, time=0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("faults", "cause"), [
    ([], None),
    ([(5, fault(0, "soft_timeout"))], 0),
    ([(5, fault(0, "soft_timeout")), (6, fault(1, "stopped"))], 1),  # the stopped rank, not the peer it held up
    ([(6, fault(1, "exception")), (5, fault(0, "exception"))], 0),  # the first by revision
    ([(5, fault(0, "peer_lost")), (6, fault(2, "completion_timeout")), (7, fault(1, "process_died"))], 1),
])
def test_the_cause_of_an_iteration(faults: list[tuple[int, FaultRecord]], cause: int | None) -> None:
    v = EpochView(faults={0: faults} if faults else {})
    found = v.cause(0)
    assert (found.slot if found is not None else None) == cause
    by_revision = [f.slot for _, f in sorted(faults, key=lambda rf: rf[0])]
    assert [f.slot for f in v.faults_of_others(0, 0)] == [s for s in by_revision if s != 0]


@pytest.mark.parametrize(("soft", "startup", "pinged", "limit"), [
    (5.0, 60.0, True, 5.0),    # training has stepped: the soft timeout
    (5.0, 60.0, False, 60.0),  # still in the first collectives, a peer may be starting: the barrier's allowance
    (90.0, 60.0, False, 90.0),  # never shorter than the soft timeout
])
def test_stall_limit(soft: float, startup: float, pinged: bool, limit: float) -> None:
    assert stall_limit(soft, startup, pinged=pinged) == limit
