"""The pure decisions of the restart protocol over a round's records: where a process joins, who a barrier
waits for, the seal, what it means for each process, when an iteration ended, which fault of an iteration
is its cause and what a failure reports. No etcd, no clock, no threads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest

from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import AliveRecord, ArrivalRecord, FaultRecord, SealRecord
from stalwart.etcd.keys import ALIVE, ARRIVE, SEAL
from stalwart.etcd.records import WatchRange
from stalwart.restart.assignment import RankAssignment
from stalwart.restart.protocol import (
    Arrived,
    EpochView,
    Exit,
    Finished,
    Join,
    Participant,
    Report,
    Run,
    Spare,
    WaitEnd,
    apply_changes,
    barrier_complete,
    barrier_sealer,
    barrier_state,
    better_cause,
    budget_left,
    completes,
    completion_known,
    fault_report,
    iteration_end,
    join,
    missing_slots,
    of_another,
    parse_view,
    placement,
    plan_seal,
    sealer_parts,
    stale_iterations,
    verdict,
)

ME = Participant(slot=1, node_id="n", slots=3, target_world=2)


def arrivals(*slots: int, spare: tuple[int, ...] = (), sick: tuple[int, ...] = ()) -> dict[int, ArrivalRecord]:
    return {s: ArrivalRecord(slot=s, node_id="n", spare=s in spare, healthy=s not in sick) for s in slots}


def seal(iteration: int, ranks: Mapping[int, int], *, inactive: tuple[int, ...] = (), error: str = "") -> SealRecord:
    return SealRecord(iteration=iteration, world_size=0 if error else len(ranks),
                      ranks={str(s): r for s, r in ranks.items()}, inactive=list(inactive), sealed_by=0, error=error)


def fault(slot: int, kind: str, iteration: int = 0) -> FaultRecord:
    return FaultRecord(slot=slot, node_id="n", iteration=iteration, kind=kind, reason=kind,  # type: ignore[arg-type]
                       time=0.0)


def alive(*slots: int) -> dict[int, AliveRecord]:
    return {s: AliveRecord(slot=s, node_id="n", pid=1) for s in slots}


def view(*, now: tuple[int, ...], before: tuple[int, ...] | None = None, alive_: tuple[int, ...] = (),
         sealed: dict[str, int] | None = None, inactive: tuple[int, ...] = ()) -> EpochView:
    arr: dict[int, Mapping[int, ArrivalRecord]] = {1: arrivals(*now)}
    if before is not None:
        arr[0] = arrivals(*before)
    seals = {} if sealed is None else {0: SealRecord(iteration=0, world_size=len(sealed), ranks=sealed,
                                                     inactive=list(inactive), sealed_by=0)}
    return EpochView(alive=alive(*alive_), arrivals=arr, seals=seals)


@pytest.mark.parametrize(("the_view", "complete"), [
    (view(now=(0, 1, 2)), True),
    (view(now=(0, 1)), False),  # the first barrier waits for every slot
    (view(now=(0, 1), before=(0, 1)), True),  # slot 2 took no part and has no process
    (view(now=(0, 1), before=(0, 1), alive_=(2,)), False),  # ...but now it has one: waited for
    (view(now=(0,), before=(0,), sealed={"0": 0, "1": 1}), False),  # slot 1 ran iteration 0 (its arrival went
    # with its lease): waited for, it may come back with a new lease
    (view(now=(0, 1), before=(0, 1), sealed={"0": 0, "1": 1}, inactive=(2,)), False),  # an inactive spare too
], ids=["all", "first-missing", "never-there", "alive-now", "took-part", "spare-took-part"])
def test_who_the_barrier_waits_for(the_view: EpochView, complete: bool) -> None:
    assert barrier_complete(the_view, 1, slots=3) is complete
    state = barrier_state(the_view, 1, slots=3)
    assert isinstance(state, Arrived) if complete else state is None
    assert missing_slots(the_view, 1, slots=3) == sorted({0, 1, 2} - set(the_view.arrivals[1]))


def test_a_sealed_barrier_is_over_whoever_is_missing() -> None:
    sealed = seal(1, {0: 0})
    v = EpochView(arrivals={1: arrivals(0)}, seals={1: sealed})
    assert barrier_state(v, 1, slots=3) == sealed


@pytest.mark.parametrize(("arrived", "previous", "timed_out", "expected"), [
    (arrivals(0, 1, 2, spare=(2,)), None, False, ({"0": 0, "1": 1}, [2], "")),  # the first seal: slot i, rank i
    (arrivals(1, 2, spare=(2,)), seal(0, {0: 0, 1: 1}, inactive=(2,)), True, ({"2": 0, "1": 1}, [], "")),  # the
    # spare takes the lost rank 0
    (arrivals(0, 1, 2, spare=(2,), sick=(0, 2)), seal(0, {0: 0, 1: 1}), False, ({"1": 0}, [], "")),  # the world
    # shrinks from the top
    (arrivals(0, 1, 2, spare=(2,)), seal(0, {}, error="too small"), False, ({"0": 0, "1": 1}, [2], "")),  # an
    # invalid previous seal: start again from slot i, rank i
    (arrivals(spare=()), None, True, ({}, [], "0 healthy process(es) present")),
], ids=["first", "spare-fills", "shrinks", "after-error", "nobody"])
def test_the_seal(arrived: dict[int, ArrivalRecord], previous: SealRecord | None, timed_out: bool,
                  expected: tuple[dict[str, int], list[int], str]) -> None:
    ranks, inactive, error = expected
    v = EpochView(arrivals={1: arrived}, seals={} if previous is None else {0: previous})
    s = plan_seal(v, 1, ME, RankAssignment(), timed_out)
    assert (s.iteration, s.ranks, s.inactive, s.sealed_by, s.timed_out) == (1, ranks, inactive, ME.slot, timed_out)
    assert s.error.startswith(error) and bool(s.error) == bool(error)
    assert s.world_size == len(ranks)


@pytest.mark.parametrize(("the_seal", "healthy", "expected"), [
    (seal(3, {0: 1, 1: 0}), True, Run(0, 2, frozenset({0, 1}))),
    (seal(3, {0: 0, 2: 1}, inactive=(1,)), True, Spare(seal(3, {0: 0, 2: 1}, inactive=(1,)))),
    (seal(3, {}, error="too few"), True, Exit(ExitCode.WORLD_TOO_SMALL, "too few")),
    (seal(3, {0: 1, 1: 0}), False, Exit(ExitCode.UNHEALTHY, "gpu gone")),
], ids=["runs", "spare", "too-small", "unhealthy"])
def test_what_a_seal_means_for_a_process(the_seal: SealRecord, healthy: bool, expected: object) -> None:
    assert placement(the_seal, ME, healthy, "gpu gone") == expected


RUNNING = seal(4, {0: 0, 1: 1})


@pytest.mark.parametrize(("the_view", "expected"), [
    (EpochView(alive=alive(0, 1)), None),
    (EpochView(alive=alive(0, 1), done={4: frozenset({0})}), None),
    (EpochView(alive=alive(0, 1), done={4: frozenset({0, 1})}), ("done", None)),
    (EpochView(alive=alive(0), done={4: frozenset({1})}), None),  # slot 1 returned, then left: not lost
    (EpochView(alive=alive(1), faults={4: ((9, fault(0, "exception", 4)),)}), ("fault", None)),
    (EpochView(alive=alive(1)), ("fault", Report(4, 1, "peer_lost", "the heartbeat lease of slot(s) [0] ended",
                                                 (0,)))),
    (EpochView(alive=alive(1), faults={3: ((9, fault(0, "exception", 3)),)}), ("fault", Report(
        4, 1, "peer_lost", "the heartbeat lease of slot(s) [0] ended", (0,)))),  # a fault of another iteration
    (EpochView(ended=frozenset({4})), ("done", None)),  # the END record: the marks and heartbeats need not be read
    (EpochView(ended=frozenset({4}), faults={4: ((9, fault(0, "exception", 4)),)}), ("fault", None)),
], ids=["running", "one-returned", "all-returned", "returned-then-gone", "fault", "peer-lost", "older-fault", "end",
        "end-after-fault"])
def test_when_an_iteration_ended(the_view: EpochView, expected: object) -> None:
    assert iteration_end(the_view, RUNNING, ME) == expected
    # What a waiter that is sent only the faults and the END record knows agrees, where it knows anything.
    known = completion_known(replace(the_view, alive={}, done={}), 4)
    assert known is None or known == expected[0]  # type: ignore[index]
    assert (known is None) == (not the_view.faults.get(4) and 4 not in the_view.ended)


@pytest.mark.parametrize(("marks", "ranks", "last"), [
    (1, {0: 0, 1: 1}, False), (2, {0: 0, 1: 1}, True), (3, {0: 0, 1: 1}, True),  # a mark written again: still
    (1, {}, False),  # no seal known: no END, the waiters judge on a full read
])
def test_the_last_completion_mark_writes_the_end(marks: int, ranks: dict[int, int], last: bool) -> None:
    assert completes(marks, seal(4, ranks)) == last


@pytest.mark.parametrize(("the_view", "expected"), [
    (EpochView(), Join(0)),
    (EpochView(arrivals={0: arrivals(0, 2)}), Join(0)),  # the first barrier is under way
    (EpochView(seals={0: seal(0, {}, error="too few")}), Exit(ExitCode.WORLD_TOO_SMALL, "too few")),
    (EpochView(seals={2: seal(2, {0: 0, 1: 1})}, arrivals={3: arrivals(0)}), Join(3)),  # the next barrier began
    (EpochView(seals={2: seal(2, {0: 0, 1: 1})}), Join(3, Report(2, 1, "process_died",
                                                                  "the process of this slot was restarted"))),
    (EpochView(seals={2: seal(2, {0: 0, 1: 1})}, faults={2: ((5, fault(0, "exception", 2)),)}), Join(3)),
    (EpochView(seals={2: seal(2, {0: 0, 2: 1})}, done={2: frozenset({0, 2})}), Finished()),
    (EpochView(seals={2: seal(2, {0: 0, 2: 1})}, ended=frozenset({2})), Finished()),
    (EpochView(seals={2: seal(2, {0: 0, 2: 1})}), WaitEnd(2, seal(2, {0: 0, 2: 1}))),  # a spare: wait
    # This slot's process died after every rank had returned (killed in its teardown): the job is over.
    (EpochView(seals={2: seal(2, {0: 0, 1: 1})}, done={2: frozenset({0, 1})}), Finished()),
    (EpochView(seals={2: seal(2, {0: 0, 1: 1})}, ended=frozenset({2})), Finished()),
    (EpochView(seals={2: seal(2, {0: 0, 1: 1})}, ended=frozenset({2}), faults={2: ((5, fault(1, "hard_timeout", 2)),)}),
     Finished()),  # its agent recorded the teardown's hang as a fault after the end: the job is still over
    (EpochView(seals={2: seal(2, {0: 0, 1: 1})}, done={2: frozenset({1})}),
     Join(3, Report(2, 1, "process_died", "the process of this slot was restarted"))),  # its own mark only
], ids=["start", "first-barrier", "too-small", "next-barrier", "died-running", "after-fault", "finished", "ended",
        "spare", "died-after-all-done", "died-after-the-end", "fault-after-the-end", "died-after-own-mark"])
def test_where_a_process_joins(the_view: EpochView, expected: object) -> None:
    assert join(the_view, ME) == expected


@pytest.mark.parametrize(("iteration", "limit", "last", "expected"), [
    (0, 0, "", None),
    (3, 3, "", None),
    (4, 3, "rank 1: boom", Exit(ExitCode.RESTARTS_EXHAUSTED,
                                "4 in-process restarts; max_restarts is 3; the last failure: rank 1: boom")),
    (1, 0, "", Exit(ExitCode.RESTARTS_EXHAUSTED, "1 in-process restarts; max_restarts is 0")),
])
def test_the_restart_budget(iteration: int, limit: int, last: str, expected: Exit | None) -> None:
    assert budget_left(iteration, limit, last) == expected


@pytest.mark.parametrize(("interrupted", "peer", "deadline_hit", "expected"), [
    (True, None, False, None),  # someone reported the iteration's fault already
    (False, fault(0, "exception"), False, None),  # a consequence of the peer's fault
    (False, None, True, Report(2, 1, "init_timeout", "the process group was not built within 60s: E()")),
    (False, None, False, Report(2, 1, "exception", "E()")),
], ids=["interrupted", "consequence", "init-timeout", "own"])
def test_what_a_failure_reports(interrupted: bool, peer: FaultRecord | None, deadline_hit: bool,
                                expected: Report | None) -> None:
    assert fault_report(2, 1, interrupted=interrupted, peer_fault=peer, init_deadline_hit=deadline_hit,
                        barrier_timeout=60.0, error="E()") == expected


def test_a_report_becomes_a_bounded_record() -> None:
    rec = Report(2, None, "peer_lost", "x" * 5000, (3, 4)).record(1, "pod-1", 12.5, exception="E" * 600)
    assert (rec.slot, rec.node_id, rec.rank, rec.iteration, rec.kind, rec.lost_slots, rec.time) == \
        (1, "pod-1", None, 2, "peer_lost", [3, 4], 12.5)
    assert len(rec.reason) == 2048 and rec.exception is not None and len(rec.exception) == 512


def test_a_non_retryable_cause_ends_every_process() -> None:
    assert verdict(None, "") is None
    assert verdict(fault(0, "exception"), "rank 0: E") is None
    assert verdict(fault(0, "non_retryable"), "rank 0: E") == Exit(ExitCode.NON_RETRYABLE, "rank 0: E")


@pytest.mark.parametrize(("sealed", "removed"), [(0, []), (1, []), (2, [0]), (3, [0, 1]), (7, [4, 5])])
def test_the_sealer_removes_the_iterations_before_the_previous(sealed: int, removed: list[int]) -> None:
    assert list(stale_iterations(sealed)) == removed


def test_a_view_is_parsed_and_bad_records_left_out() -> None:
    entries = [
        ("alive/1", AliveRecord(slot=1, node_id="n", pid=7).to_json_bytes(), 3),
        ("arrive/2/1", ArrivalRecord(slot=1, node_id="n").to_json_bytes(), 4),
        ("seal/2", seal(2, {1: 0}).to_json_bytes(), 5),
        ("fault/2/1", fault(1, "soft_timeout", 2).to_json_bytes(), 9),
        ("fault/2/0", fault(0, "exception", 2).to_json_bytes(), 8),
        ("done/2/1", b"{}", 6),
        ("fault/2/2", b"not json", 7),
        ("seal/x", b"{}", 7),
        ("other/1", b"{}", 7),
    ]
    v, problems = parse_view(entries, 10)
    assert v.revision == 10 and set(v.alive) == {1} and set(v.arrivals[2]) == {1} and v.seals[2].ranks == {"1": 0}
    assert [rev for rev, _ in v.faults[2]] == [8, 9] and v.done == {2: frozenset({1})}
    assert set(problems) == {"fault/2/2", "seal/x"}
    assert v.first_fault(2) == fault(0, "exception", 2)


_A = AliveRecord(slot=1, node_id="n", pid=7).to_json_bytes()
_START = {"alive/1": (_A, 3), "alive/2": (AliveRecord(slot=2, node_id="n", pid=8).to_json_bytes(), 4),
          "arrive/1/1": (ArrivalRecord(slot=1, node_id="n").to_json_bytes(), 5),
          "fault/0/1": (fault(1, "exception").to_json_bytes(), 6), "done/0/2": (b"{}", 7),
          "seal/0": (seal(0, {1: 0, 2: 1}).to_json_bytes(), 2)}


@pytest.mark.parametrize(("changes", "bad"), [
    ([], set()),
    ([("arrive/1/2", ArrivalRecord(slot=2, node_id="n").to_json_bytes(), 8)], set()),  # an arrival
    ([("alive/2", None, 8), ("arrive/1/1", None, 8)], set()),  # a lease ended: its keys go in one revision
    ([("fault/0/1", fault(1, "soft_timeout").to_json_bytes(), 8)], set()),  # overwritten: the new one counts
    ([("fault/0/2", fault(2, "peer_lost").to_json_bytes(), 8), ("fault/0/1", None, 9)], set()),
    ([("done/0/2", None, 8), ("done/0/1", b"{}", 9)], set()),
    ([("seal/1", seal(1, {2: 0}).to_json_bytes(), 8), ("seal/0", None, 9)], set()),
    ([("end/0", b'{"slot":2,"iteration":0}', 8), ("end/1", b"{}", 9)], {"end/1"}),
    ([("arrive/1/1", b"not json", 8)], {"arrive/1/1"}),  # an unreadable record replaces the good one: left out
    ([("other/1", b"{}", 8), ("seal/x", b"{}", 9)], {"seal/x"}),  # no kind, a bad number: ignored, said
], ids=["none", "arrival", "lease-ended", "fault-overwritten", "fault-deleted", "done", "seal", "end", "bad",
        "junk"])
def test_changes_applied_to_a_view_equal_a_read_after_them(changes: list[tuple[str, bytes | None, int]],
                                                           bad: set[str]) -> None:
    before, _ = parse_view(((k, v, rev) for k, (v, rev) in _START.items()), 7)
    state = dict(_START)
    for key, value, rev in changes:
        if value is None:
            state.pop(key, None)
        else:
            state[key] = (value, rev)
    revision = max([7] + [rev for _, _, rev in changes])
    after, problems = apply_changes(before, changes, revision)
    assert after == parse_view(((k, v, rev) for k, (v, rev) in state.items()), revision)[0]
    assert set(problems) == bad
    assert before == parse_view(((k, v, rev) for k, (v, rev) in _START.items()), 7)[0]  # not mutated


@pytest.mark.parametrize(("previous", "sealer"), [
    (None, 0),  # the first barrier: slot 0
    (seal(3, {4: 0, 6: 1}, inactive=(2,)), 2),  # the lowest that took part, a spare included
    (seal(3, {4: 0, 1: 1}), 1),
    (seal(3, {}, error="too few"), 0),
])
def test_who_seals_a_barrier(previous: SealRecord | None, sealer: int) -> None:
    assert barrier_sealer(previous) == sealer


@pytest.mark.parametrize("alive_slots", [(), (0, 1, 2, 3), (1, 2, 3)])
def test_the_barrier_waits_for_its_sealer(alive_slots: tuple[int, ...]) -> None:
    """Whoever is alive, the barrier after ``previous`` is not complete without its sealer's arrival, so the
    process that seals is there, watching, when it completes."""
    previous = seal(0, {3: 0, 2: 1}, inactive=(1,))
    sealer = barrier_sealer(previous)
    others = tuple(s for s in range(4) if s != sealer)
    v = EpochView(alive=alive(*alive_slots), arrivals={0: arrivals(1, 2, 3), 1: arrivals(*others)},
                  seals={0: previous})
    assert sealer == 1 and not barrier_complete(v, 1, 4)
    done = EpochView(alive=alive(*alive_slots), arrivals={0: arrivals(1, 2, 3), 1: arrivals(0, 1, 2, 3)},
                     seals={0: previous})
    assert barrier_complete(done, 1, 4)


def _entries(v: EpochView) -> list[tuple[str, bytes, int]]:
    """``v`` as the keys etcd would hold for it (relative to the round's restart prefix)."""
    out = [(f"{ALIVE}{s}", rec.to_json_bytes(), 1) for s, rec in v.alive.items()]
    out += [(f"{ARRIVE}{it}/{s}", rec.to_json_bytes(), 1) for it, a in v.arrivals.items() for s, rec in a.items()]
    return out + [(f"{SEAL}{it}", rec.to_json_bytes(), 1) for it, rec in v.seals.items()]


def _read(v: EpochView, parts: list[WatchRange] | None) -> EpochView:
    """What a read of ``parts`` of ``v``'s keys returns (all of them for ``None``)."""
    kept = [e for e in _entries(v) if parts is None
            or any(e[0].startswith(p.key) if p.prefix else e[0] == p.key for p in parts)]
    return parse_view(kept, 9)[0]


@pytest.mark.parametrize(("previous", "parts"), [
    (None, None),  # no seal to go by (a process that joined later finds none): everything
    (seal(0, {0: 0, 1: 1, 2: 2, 3: 3}), [f"{ARRIVE}1/", f"{SEAL}1", f"{SEAL}0"]),
    (seal(0, {0: 0, 1: 1, 2: 2}, inactive=(3,)), [f"{ARRIVE}1/", f"{SEAL}1", f"{SEAL}0"]),  # a spare is placed
    (seal(0, {0: 0, 1: 1}), None),  # slots 2 and 3 missed the last barrier: who is alive matters
    (seal(0, {}, error="too few"), None),
    (seal(5, {0: 0, 1: 1, 2: 2, 3: 3}), None),  # not the previous iteration's seal
])
def test_what_the_sealer_reads(previous: SealRecord | None, parts: list[str] | None) -> None:
    got = sealer_parts(1, previous, 4)
    assert (None if got is None else [p.key for p in got]) == parts
    assert sealer_parts(0, None, 4) == [WatchRange(f"{ARRIVE}0/", prefix=True), WatchRange(f"{SEAL}0")]


@pytest.mark.parametrize(("now", "before", "alive_slots"), [
    ((0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)),
    ((0, 1, 3), (0, 1, 2, 3), (0, 1, 3)),  # slot 2 ran iteration 0 and lost its lease: still waited for
    ((0, 1, 2), (0, 1, 2), (0, 1, 2, 3)),
    ((0, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)),
    ((0, 1, 2, 3), (0, 1, 2), ()),
], ids=["all", "lost-lease", "spare-missing", "one-missing", "no-heartbeats"])
@pytest.mark.parametrize("inactive", [(), (3,)])
def test_the_sealers_narrow_read_decides_as_the_whole_prefix(now: tuple[int, ...], before: tuple[int, ...],
                                                               alive_slots: tuple[int, ...],
                                                               inactive: tuple[int, ...]) -> None:
    previous = seal(0, {s: s for s in range(4) if s not in inactive}, inactive=inactive)
    whole = EpochView(alive=alive(*alive_slots), arrivals={0: arrivals(*before), 1: arrivals(*now)},
                      seals={0: previous})
    parts = sealer_parts(1, previous, 4)
    assert parts is not None
    narrow = _read(whole, parts)
    assert not narrow.alive and 0 not in narrow.arrivals  # what it leaves out
    full = _read(whole, None)
    assert barrier_state(narrow, 1, 4) == barrier_state(full, 1, 4)
    me = Participant(slot=0, node_id="n", slots=4, target_world=4)
    assert plan_seal(narrow, 1, me, RankAssignment(), timed_out=False) == \
        plan_seal(full, 1, me, RankAssignment(), timed_out=False)


@pytest.mark.parametrize(("faults", "cause"), [
    ([], None),
    ([(5, fault(0, "soft_timeout"))], 0),
    ([(5, fault(0, "soft_timeout")), (6, fault(1, "stopped"))], 1),  # the stopped rank, not the peer it held up
    ([(5, fault(0, "exception")), (6, fault(1, "exception"))], 0),  # the first by revision
    ([(5, fault(0, "peer_lost")), (6, fault(2, "completion_timeout")), (7, fault(1, "process_died"))], 1),
])
def test_the_cause_of_an_iteration(faults: list[tuple[int, FaultRecord]], cause: int | None) -> None:
    v = EpochView(faults={0: tuple(faults)} if faults else {})
    found = v.cause(0)
    assert (found.slot if found is not None else None) == cause
    assert [f.slot for f in v.faults_of_others(0, 0)] == [f.slot for _, f in faults if f.slot != 0]
    known: FaultRecord | None = None
    for _, rec in faults:  # what the monitor knows as records arrive, in revision order
        known = rec if better_cause(known, rec) else known
    assert (known.slot if known is not None else None) == cause


@pytest.mark.parametrize(("slot", "pid", "other"), [
    (1, None, True),    # another slot's fault, whoever recorded it
    (0, None, False),   # this slot's, by a process that did not say which (taken as this one's)
    (0, 100, False),    # this process's own report
    (0, 200, True),     # the agent's record of the process that held this slot before: a peer's fault
])
def test_whose_fault_a_record_is(slot: int, pid: int | None, other: bool) -> None:
    rec = fault(slot, "hard_timeout").model_copy(update={"pid": pid})
    assert of_another(rec, 0, 100) is other
    assert [f.slot for f in EpochView(faults={0: ((5, rec),)}).faults_of_others(0, 0, 100)] == ([slot] if other else [])
    # A process that does not know its pid goes by the slot alone.
    assert of_another(rec, 0, None) is (slot != 0)
