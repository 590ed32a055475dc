"""One failure record per fault, naming the culprit (the pure :mod:`stalwart.operator.failures`)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from stalwart.api.restart import FaultRecord, RankExit
from stalwart.api.status import FailureRecord, Position, SecondaryFailure
from stalwart.operator.failures import Fact, RankPlace, compose, exit_facts, rank_facts, split_exception

T = 1_800_000_000.0
PLACES = {0: RankPlace(0, "job-worker-0"), 1: RankPlace(1, "job-worker-1")}


@pytest.mark.parametrize(("text", "expected"), [
    ("RuntimeError('boom')", ("RuntimeError", "boom")),
    ('DrillFault("injected (request ab12)")', ("DrillFault", "injected (request ab12)")),
    ("non-retryable: ValueError('bad batch')", ("ValueError", "bad batch")),
    ("torch.distributed.DistBackendError('NCCL error')", ("DistBackendError", "NCCL error")),
    ("KeyboardInterrupt()", ("KeyboardInterrupt", "")),
    ("OSError(104, 'Connection reset by peer')", ("OSError", "(104, 'Connection reset by peer')")),
    ("Weird(__import__('os').system('x'))", ("Weird", "__import__('os').system('x')")),  # never evaluated
    ("no progress for 31.0s (soft timeout 30s)", (None, "no progress for 31.0s (soft timeout 30s)")),
])
def test_split_exception(text: str, expected: tuple[str | None, str]) -> None:
    assert split_exception(text) == expected


def fault(slot: int, kind: str, reason: str, *, iteration: int = 3, lost: list[int] | None = None) -> FaultRecord:
    return FaultRecord(slot=slot, rank=slot, node_id=f"job-worker-{slot}", iteration=iteration,
                       kind=kind, reason=reason, time=T + slot, lost_slots=lost or [])  # type: ignore[arg-type]


def test_a_killed_rank_is_the_culprit_not_the_survivor_whose_connection_reset() -> None:
    # The survivor's error is written first (lowest revision); the agent of the killed rank reports its death.
    survivor = fault(0, "exception", "RuntimeError('Connection reset by peer')")
    death = RankExit(local_rank=0, slot=1, rank=1, round=2, iteration=3, pid=77, signal="SIGKILL", time=T + 0.5)
    facts = rank_facts([(10, survivor)], 2, PLACES, exited=[(1, 3)]) + exit_facts([("job-worker-1", death)])
    record = compose(facts)
    assert record is not None
    assert (record.rank, record.pod, record.reason, record.signal) == (1, "job-worker-1", "ProcessExited", "SIGKILL")
    assert record.detected_by == "Process" and (record.round, record.iteration) == (2, 3)
    assert record.secondary == [SecondaryFailure(rank=0, pod="job-worker-0", reason="Exception",
                                                 message="Connection reset by peer")]


@pytest.mark.parametrize(("ended", "reason", "words"), [
    (RankExit(local_rank=0, slot=1, rank=1, round=2, pid=7, exit_code=98, time=T), "Hang", "ended itself"),
    (RankExit(local_rank=0, slot=1, rank=1, round=2, pid=7, signal="SIGQUIT", hung=True, time=T), "Hang",
     "hard timeout"),
    (RankExit(local_rank=0, slot=1, rank=1, round=2, pid=7, exit_code=1, time=T), "ProcessExited", "code 1"),
    (RankExit(local_rank=0, slot=1, rank=1, round=2, pid=7, signal="SIGKILL", time=T), "ProcessExited", "SIGKILL"),
])
def test_a_process_that_ended_itself_blocked_after_its_interrupt_hung(ended: RankExit, reason: str,
                                                                       words: str) -> None:
    # Exit code 98 (ABANDONED): the main thread stayed blocked where no interrupt frees it, the hang its agent's
    # hard timeout would have killed; any other exit is the process's own end.
    (fact,) = exit_facts([("job-worker-1", ended)])
    assert (fact.reason, fact.detected_by, fact.pod, fact.exit_code) == (reason, "Process", "job-worker-1",
                                                                         ended.exit_code)
    assert words in fact.message


def test_a_missed_heartbeat_is_blamed_on_the_hung_rank_not_on_the_one_that_noticed() -> None:
    noticed = fault(0, "peer_lost", "the heartbeat lease of slot 1 ended", lost=[1])
    later = fault(1, "exception", "RuntimeError('Connection closed by peer')")
    record = compose(rank_facts([(10, noticed), (12, later)], 2, PLACES))
    assert record is not None
    # PeerLost names the slot whose lease ended, with its pod and rank; the reporter's record is secondary.
    assert (record.rank, record.pod, record.reason, record.detected_by) == (1, "job-worker-1", "PeerLost",
                                                                            "Heartbeat")
    assert {(s.rank, s.reason) for s in record.secondary or []} == {(0, "PeerLost"), (1, "Exception")}


def test_an_exit_of_the_slot_in_an_earlier_iteration_does_not_hide_its_lost_heartbeat() -> None:
    # Slot 1 was killed in iteration 1 of this round (a Process fact there); in iteration 3 it froze and its lease
    # ended. Today's code skipped the Heartbeat fact for any slot that had exited in the round, and the survivor
    # that noticed was named.
    noticed = fault(0, "peer_lost", "the heartbeat lease of slot 1 ended", lost=[1])
    record = compose(rank_facts([(10, noticed)], 2, PLACES, exited=[(1, 1)]))
    assert record is not None and (record.rank, record.pod, record.reason) == (1, "job-worker-1", "PeerLost")
    same = compose(rank_facts([(10, noticed)], 2, PLACES, exited=[(1, 3)]))
    assert same is not None and same.pod == "job-worker-0"  # the exit of iteration 3 is its Process fact's to tell


def test_a_fault_seen_at_the_faulty_process_beats_a_survivors_earlier_symptom() -> None:
    # The survivor's soft timeout (it waited in a collective for a stopped rank) is written before the agent's
    # record of the stopped rank; the stopped rank is the culprit, the revision order notwithstanding.
    timed_out = fault(0, "soft_timeout", "no progress for 5.1s (soft timeout 5s)")
    stopped = fault(1, "stopped", "stopped (SIGSTOP) past the soft timeout")
    record = compose(rank_facts([(10, timed_out), (14, stopped)], 2, PLACES))
    assert record is not None and (record.rank, record.pod, record.reason) == (1, "job-worker-1", "Hang")
    assert [(s.rank, s.reason) for s in record.secondary or []] == [(0, "Hang")]
    # A written survivor's symptom does not outrank it either once it was the culprit for a while.
    first = compose(rank_facts([(10, timed_out)], 2, PLACES))
    again = compose(rank_facts([(10, timed_out), (14, stopped)], 2, PLACES), first)
    assert again is not None and (again.rank, again.pod) == (1, "job-worker-1")


def test_the_first_exception_by_revision_is_the_culprit() -> None:
    raised = fault(1, "exception", "DrillFault('injected')")
    consequence = fault(0, "exception", "RuntimeError('Connection closed by peer')")
    record = compose(rank_facts([(12, consequence), (11, raised)], 2, PLACES))
    assert record is not None and (record.rank, record.exception_type, record.message) == (1, "DrillFault", "injected")


def test_a_pod_the_operator_saw_go_beats_what_its_ranks_said() -> None:
    ranks = rank_facts([(10, fault(0, "peer_lost", "the heartbeat lease of slot 1 ended", lost=[1]))], 2, PLACES)
    pod = Fact("Pod", "PodLost", T + 5, Position(round=2, iteration=3), pod="job-worker-1",
               message="the pod was deleted (grace period 30s)")
    record = compose([*ranks, pod])
    assert record is not None and (record.pod, record.reason, record.rank) == ("job-worker-1", "PodLost", None)


def test_a_written_culprit_is_not_lost_when_its_facts_are_gone() -> None:
    written = compose([Fact("Process", "ProcessExited", T, Position(round=2, iteration=3), rank=1, pod="p1",
                            signal="SIGKILL")])
    assert written is not None
    # Only a weaker fact is visible now (the round's fault records were cleaned up): the culprit stays.
    again = compose([Fact("Rank", "Exception", T + 1, Position(round=2, iteration=3), 10, 0, "p0")], written)
    assert again is not None and (again.rank, again.signal, again.reason) == (1, "SIGKILL", "ProcessExited")
    assert again.secondary == [SecondaryFailure(rank=0, pod="p0", reason="Exception")]


def test_secondary_errors_are_bounded() -> None:
    many = [Fact("Rank", "Exception", T + i, None, i, i, f"p{i}", message="x") for i in range(20)]
    record = compose(many)
    assert record is not None and record.rank == 0 and len(record.secondary or []) == 8


def test_no_facts_keep_the_record() -> None:
    old = FailureRecord(pod="p", reason="PodLost", time=datetime.fromtimestamp(T, UTC))
    assert compose([], old) is old and compose([]) is None


def test_a_record_that_names_its_exception_is_read_from_its_fields_with_the_short_type() -> None:
    # The rank records the type (qualified) and the message apart: no need to parse a repr, and a message that
    # does not look like one (a multi-line text, quotes) stays whole.
    raised = fault(1, "exception", "DrillFault('it said \"no\"\\nline 2')").model_copy(
        update={"exception": "stalwart.restart.drill.DrillFault", "message": 'it said "no"\nline 2'})
    record = compose(rank_facts([(11, raised)], 2, PLACES))
    assert record is not None
    assert (record.exception_type, record.message) == ("DrillFault", 'it said "no"\nline 2')
