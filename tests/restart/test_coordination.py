"""The etcd side of restart against a real etcd: fencing, one seal per iteration, bounded keys."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace

import pytest

from stalwart.api.restart import ArrivalRecord, FaultRecord, SealRecord
from stalwart.etcd.faults import record_fault
from stalwart.etcd.fence import StaleEpoch
from stalwart.etcd.keys import ARRIVE, END, SEAL, JobKeys
from stalwart.etcd.store import Store, WatchRange
from stalwart.local.etcd import EtcdServer
from stalwart.restart.coordination import CoordinationTimeout, Coordinator
from stalwart.restart.protocol import Participant, completion_known, iteration_end

pytestmark = pytest.mark.integration


@pytest.fixture
def job(store: Store) -> tuple[JobKeys, int]:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    epoch = store.put(keys.rendezvous + "manifest", b"{}")
    yield keys, epoch
    store.delete_prefix(keys.prefix)


def _fault(slot: int, iteration: int) -> FaultRecord:
    return FaultRecord(slot=slot, node_id="n", iteration=iteration, kind="exception", reason="x", time=time.time())


def test_writes_are_fenced_by_the_epoch(store: Store, job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    c = Coordinator(store, keys, epoch, slot=0, node_id="n", lease_ttl=5)
    c.start()
    c.report_fault(_fault(0, 0))
    store.put(keys.rendezvous + "manifest", b"{}")  # a newer round: the epoch moves on
    with pytest.raises(StaleEpoch):
        c.report_fault(_fault(0, 1))
    assert c.view().faults.keys() == {0}
    c.stop()


def test_one_seal_per_iteration_whoever_races(store: Store, job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    coords = [Coordinator(store, keys, epoch, slot=s, node_id="n") for s in range(4)]
    results: list[SealRecord] = []
    barrier = threading.Barrier(4)

    def seal(c: Coordinator) -> None:
        barrier.wait(30)
        mine = SealRecord(iteration=3, world_size=1, ranks={str(c.slot): 0}, sealed_by=c.slot)
        results.append(c.try_seal(mine))

    threads = [threading.Thread(target=seal, args=(c,)) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 4
    assert len({r.sealed_by for r in results}) == 1


def test_sealing_deletes_iterations_before_the_previous(store: Store, job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    c = Coordinator(store, keys, epoch, slot=0, node_id="n", lease_ttl=5)
    c.start()
    for it in range(6):
        c.arrive(it, ArrivalRecord(slot=0, node_id="n"))
        c.try_seal(SealRecord(iteration=it, world_size=1, ranks={"0": 0}, sealed_by=0))
        store.put(c.round_keys.torch_store_of(it) + "addr", b"x")
        c.report_fault(_fault(0, it))
    view = c.view()
    assert set(view.seals) == {4, 5}
    assert set(view.faults) == {4, 5}
    assert set(view.arrivals) == {4, 5}
    assert store.count_prefix(keys.torch_store(epoch)) == 2
    c.stop()
    assert c.view().alive == {}  # the heartbeat key went with the lease


def test_wait_until_wakes_on_a_write_and_times_out(store: Store, job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    c = Coordinator(store, keys, epoch, slot=0, node_id="n")
    other = Coordinator(store, keys, epoch, slot=1, node_id="n")
    threading.Timer(0.2, lambda: other.report_fault(_fault(1, 0))).start()
    _view, found = c.wait_until(lambda v: v.first_fault(0), time.monotonic() + 60)
    assert isinstance(found, FaultRecord) and found.slot == 1
    with pytest.raises(CoordinationTimeout):
        c.wait_until(lambda v: 2 in v.faults, time.monotonic() + 0.3)


def test_a_wait_on_parts_sees_only_them_and_keeps_its_view_from_the_watch(store: Store,
                                                                        job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    c = Coordinator(store, keys, epoch, slot=0, node_id="n")
    other = Coordinator(store, keys, epoch, slot=1, node_id="n", lease_ttl=5)
    other.start()

    def later(iteration: int) -> None:
        other.arrive(iteration, ArrivalRecord(slot=1, node_id="n"))
        other.report_fault(_fault(1, iteration))
        other.try_seal(SealRecord(iteration=iteration, world_size=1, ranks={"1": 0}, sealed_by=1))

    threading.Timer(0.3, later, args=(2,)).start()
    view, found = c.wait_until(lambda v: v.seals.get(2), time.monotonic() + 60, [WatchRange(f"{SEAL}2")])
    assert isinstance(found, SealRecord) and found.sealed_by == 1
    assert view.arrivals == {} and view.alive == {} and view.faults == {}  # the rest was not sent
    # The whole prefix, kept from the watch's events, is what a read then gives.
    threading.Timer(0.3, later, args=(3,)).start()
    full, _ = c.wait_until(lambda v: 3 in v.seals, time.monotonic() + 60)
    assert replace(full, revision=0) == replace(c.view(), revision=0)
    assert set(full.arrivals[3]) == {1} and set(full.alive) == {1} and full.first_fault(3) == c.faults(3).first_fault(3)
    assert set(c.view([WatchRange(f"{ARRIVE}2/", prefix=True)]).arrivals) == {2}
    other.stop()


def test_an_arrival_refused_for_a_lost_lease_takes_a_new_one(store: Store, etcd: EtcdServer,
                                                             job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    c = Coordinator(store, keys, epoch, slot=3, node_id="n", lease_ttl=30)
    c.start()
    old = c.lease
    with Store([etcd.endpoint]) as other:  # the lease ends where this process's keepalive cannot see it
        other.lease_revoke(old)
    assert c.view().alive == {}
    c.arrive(0, ArrivalRecord(slot=3, node_id="n"))  # etcd refuses the old lease; the arrival is made anyway
    view = c.view()
    assert c.lease != old and set(view.arrivals[0]) == {3} and set(view.alive) == {3}
    assert store.get(c.round_keys.arrival(0, 3)).lease == c.lease  # type: ignore[union-attr]
    c.stop()
    assert c.view().arrivals == {}  # bound to the new lease


def test_the_last_completion_mark_writes_the_end_record(store: Store, job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    coords = [Coordinator(store, keys, epoch, slot=s, node_id="n") for s in range(3)]
    seal = SealRecord(iteration=2, world_size=3, ranks={"0": 0, "1": 1, "2": 2}, sealed_by=0)
    waiter = coords[0].view([WatchRange(f"{END}2")])
    assert [c.mark_done(seal) for c in coords[:2]] == [False, False] and 2 not in coords[0].view().ended
    assert coords[2].mark_done(seal) is True  # the last mark: its writer writes END
    assert coords[1].mark_done(seal) is True  # a mark written again (a retry) finds them all too: END again
    view = coords[0].view()
    assert 2 in view.ended and view.done[2] == frozenset({0, 1, 2})
    # A waiter is sent the END record, not the marks.
    done, _ = coords[0].wait_until(lambda v: 2 in v.ended, time.monotonic() + 30, [WatchRange(f"{END}2")],
                                   start=waiter)
    assert done.done == {} and done.ended == frozenset({2})
    # The sealer of a later iteration removes it with the rest.
    for it in (3, 4):
        coords[0].try_seal(SealRecord(iteration=it, world_size=1, ranks={"0": 0}, sealed_by=0))
    assert coords[0].view().ended == frozenset()


def test_an_iteration_ends_once_a_fault_after_its_end_is_refused(store: Store, job: tuple[JobKeys, int]) -> None:
    """The race that made a finished rank's peer restart alone: both ranks returned, the last one's mark wrote
    END and it exited (its heartbeat lease revoked); the other, not yet sent END, had its monitor report the
    heartbeat's end as a lost peer. That report must be refused, by the rank's monitor and by its agent, and the
    iteration read as done."""
    keys, epoch = job
    coords = [Coordinator(store, keys, epoch, slot=s, node_id=f"n{s}", lease_ttl=5) for s in range(2)]
    for c in coords:
        c.start()
    seal = SealRecord(iteration=1, world_size=2, ranks={"0": 0, "1": 1}, sealed_by=0)
    assert [c.mark_done(seal) for c in coords] == [False, True]
    coords[1].stop()  # the finished process exits
    lost = FaultRecord(slot=0, rank=0, node_id="n0", iteration=1, kind="peer_lost", reason="the heartbeat lease "
                       "of slot(s) [1] ended", time=time.time(), lost_slots=[1])
    reported = coords[0].report_fault(lost)
    recorded = record_fault(store, keys, epoch, _fault(1, 1).model_copy(update={"kind": "process_died"}))  # its agent
    view = coords[0].view()
    assert iteration_end(view, seal, Participant(slot=0, node_id="n0", slots=2, target_world=2)) == ("done", None)
    assert view.faults == {} and 1 in view.ended
    assert (reported, recorded) == (False, False)
    coords[0].stop()


def test_an_iteration_ends_once_an_end_after_a_fault_is_not_written(store: Store, job: tuple[JobKeys, int]) -> None:
    """The other order: a fault reported before the last mark. Every process returned, but the fault came first:
    no END, so every process reads the same outcome, a fault, wherever it looks."""
    keys, epoch = job
    coords = [Coordinator(store, keys, epoch, slot=s, node_id=f"n{s}") for s in range(2)]
    seal = SealRecord(iteration=2, world_size=2, ranks={"0": 0, "1": 1}, sealed_by=0)
    assert coords[0].mark_done(seal) is False
    reported = coords[0].report_fault(_fault(0, 2))
    ended = coords[1].mark_done(seal)  # the last mark, refused its END
    view = coords[1].view()
    assert (reported, ended) == (True, False)
    assert 2 not in view.ended and view.done[2] == frozenset({0, 1}) and [f.slot for _, f in view.faults[2]] == [0]
    assert iteration_end(view, seal, Participant(slot=1, node_id="n1", slots=2, target_world=2)) == ("fault", None)
    assert completion_known(view, 2) == "fault"
