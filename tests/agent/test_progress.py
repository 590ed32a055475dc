"""The agent's progress reports: the pure :class:`ProgressBook`, and the reporter against a real etcd that goes away
and comes back (one log line when the outage starts, one when it ends, few attempts in between)."""

from __future__ import annotations

import logging
import time
import uuid

import pytest

from stalwart.agent.progress import (
    NO_STEP_GRACE,
    ProcView,
    ProgressBook,
    ProgressReporter,
    exited,
    joined,
    observed,
    record,
    respawned,
)
from stalwart.api.pacing import MAX_PACED_INTERVAL, PROGRESS_WRITES_PER_SECOND, progress_interval
from stalwart.api.restart import MAX_EXITS, MAX_HISTORY, ProgressRecord, RankStatus, RoundSummary
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import MANIFEST, JobKeys
from stalwart.etcd.outage import Backoff
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer

WALL = 1_800_000_000.0


def status(slot: int = 0, *, pid: int = 100, state: str = "running", iteration: int = 0, step: int | None = None,
           first_step: int | None = None, heartbeat: float = 50.0) -> RankStatus:
    return RankStatus(slot=slot, pid=pid, state=state, iteration=iteration, step=step,  # type: ignore[arg-type]
                      first_step=first_step, heartbeat=heartbeat, rank=slot)


def proc(st: RankStatus | None = None, *, pid: int = 100, started: float = 0.0,
         exit_code: int | None = None) -> ProcView:
    return ProcView(local_rank=0, slot=0, pid=pid, started=started, status=st, exit_code=exit_code)


def book() -> ProgressBook:
    return joined(ProgressBook(node_id="n0", incarnation="i0"), 1, 7)


def stepped(b: ProgressBook) -> int | None:
    return b.history[-1].stepped


@pytest.mark.parametrize(("procs", "now", "expected"), [
    # Started and in the training function, but no step reported: not stepping (the old report said "running").
    ([proc(status(step=None))], 1.0, None),
    # The first step of iteration 0.
    ([proc(status(step=1, first_step=1))], 1.0, 0),
    # Iteration 2 stepped after two restarts.
    ([proc(status(iteration=2, step=40, first_step=38))], 1.0, 2),
    # Restarting again after stepping in iteration 2: it did step there.
    ([proc(status(state="restarting", iteration=2, step=40, first_step=38))], 1.0, 2),
    # At the barrier of iteration 3 (no step in it yet): the step of iteration 2 is in the status no more.
    ([proc(status(state="barrier", iteration=3, step=40))], 1.0, None),
    # A script without the restart wrapper (no status file) counts once it ran for the grace period.
    ([proc(None)], NO_STEP_GRACE - 1, None),
    ([proc(None)], NO_STEP_GRACE + 1, 0),
    # A script that never pings returned from its training function in iteration 1: that iteration ran.
    ([proc(status(state="done", iteration=1))], 1.0, 1),
    # ... but a status left by an earlier process of the slot says nothing of this one.
    ([proc(status(state="done", iteration=1, pid=99))], 1.0, None),
], ids=["started", "first-step", "iteration-2", "restarting", "barrier", "bare-early", "bare-later", "done",
        "done-other-process"])
def test_stepped_iteration(procs: list[ProcView], now: float, expected: int | None) -> None:
    assert stepped(observed(book(), procs, now=now, wall=WALL)) == expected


def test_an_iteration_that_ran_into_a_fault_is_recorded() -> None:
    # The fault repeats at once after every restart: no step, but iteration 2 ran and failed again.
    b = observed(book(), [proc(status(state="restarting", iteration=2, step=4))], now=1.0, wall=WALL)
    assert b.history[-1].stepped is None and b.history[-1].faulted == 2
    # A rank seen only at the barrier of iteration 5 (its agent reads its status now and then): 4 ended in a fault.
    b = observed(b, [proc(status(state="barrier", iteration=5, step=4))], now=2.0, wall=WALL)
    assert b.history[-1].faulted == 4
    # The rank gave up (its restarts exhausted) after the fault of iteration 5: that iteration ran to a fault too.
    b = observed(b, [proc(status(state="failed", iteration=5, step=4))], now=3.0, wall=WALL)
    assert b.history[-1].faulted == 5


def test_a_rank_that_reports_no_steps_counts_after_the_grace_in_its_training_function() -> None:
    b = observed(book(), [proc(status(step=None))], now=100.0, wall=WALL)
    assert stepped(b) is None
    b = observed(b, [proc(status(step=None))], now=100.0 + NO_STEP_GRACE, wall=WALL)
    assert stepped(b) == 0


def test_a_respawned_process_is_recorded_at_the_iteration_it_joins() -> None:
    b = observed(book(), [proc(status(step=5, first_step=1))], now=1.0, wall=WALL)
    b = exited(b, proc(status(step=5, first_step=1), exit_code=-9), now=WALL)
    b = respawned(b, 0, 101)
    (ex,) = b.exits
    assert (ex.signal, ex.exit_code, ex.slot, ex.round, ex.iteration, ex.hung) == ("SIGKILL", None, 0, 1, 0, False)
    # The new process starts (iteration unknown yet), then waits at the barrier of iteration 1.
    b = observed(b, [proc(status(pid=101, state="starting"), pid=101)], now=2.0, wall=WALL)
    assert b.history[-1].respawned == []
    assert record(b, "running", wall=WALL).respawns_unplaced == 1  # the operator waits for where it joins
    b = observed(b, [proc(status(pid=101, state="barrier", iteration=1), pid=101)], now=3.0, wall=WALL)
    assert b.history[-1].respawned == [1] and b.pending == frozenset() and b.process_restarts == 1
    rec = record(b, "running", wall=WALL)
    assert rec.respawns_unplaced == 0
    assert rec.history[-1] == RoundSummary(round=1, epoch=7, stepped=0, respawned=[1], faulted=0)
    assert rec.last_failure is not None and "SIGKILL" in rec.last_failure.reason
    assert rec.last_failure.kind == "process_died"  # what the status's reason and the recovery metric name
    hung = exited(book(), proc(status(step=5), exit_code=-9), now=WALL, hung=True)
    assert hung.last_failure is not None and hung.last_failure.kind == "hard_timeout"
    # What the operator reads is what was written.
    assert ProgressRecord.from_json_bytes(rec.to_json_bytes()) == rec


def test_a_respawn_replaced_before_it_joined_is_no_longer_awaited() -> None:
    b = respawned(observed(book(), [proc(status(step=5))], now=1.0, wall=WALL), 0, 101)
    assert record(b, "running", wall=WALL).respawns_unplaced == 1
    # Process 101 died before it said where it joined; 102 took its place.
    b = respawned(b, 0, 102)
    b = observed(b, [proc(status(pid=102, state="starting"), pid=102)], now=2.0, wall=WALL)
    assert b.pending == frozenset({(0, 102)}) and record(b, "running", wall=WALL).respawns_unplaced == 1
    b = observed(b, [proc(status(pid=102, state="running", iteration=2), pid=102)], now=3.0, wall=WALL)
    assert record(b, "running", wall=WALL).respawns_unplaced == 0 and b.history[-1].respawned == [2]


def test_history_and_exits_are_bounded() -> None:
    b = book()
    for r in range(2, 12):
        b = joined(b, r, r * 10)
    assert [h.round for h in b.history] == list(range(12 - MAX_HISTORY, 12))
    for i in range(20):
        b = exited(b, proc(exit_code=1, pid=200 + i), now=WALL + i)
    assert len(b.exits) == MAX_EXITS and b.exits[-1].pid == 219 and b.exits[-1].exit_code == 1


def test_progress_time_is_the_main_threads_last_progress_on_the_wall_clock() -> None:
    b = observed(book(), [proc(status(step=3, first_step=1, heartbeat=40.0))], now=50.0, wall=WALL)
    (rank,) = b.ranks
    assert rank.progress_time == pytest.approx(WALL - 10.0) and rank.step == 3


def test_the_report_carries_the_soft_timeout_the_rank_uses() -> None:
    # The operator judges a stall by it (a @restartable(soft_timeout=...) may differ from the spec's).
    own = status(step=3).model_copy(update={"soft_timeout": 12.5})
    (rank,) = observed(book(), [proc(own)], now=50.0, wall=WALL).ranks
    assert rank.soft_timeout == 12.5
    (unknown,) = observed(book(), [proc(status(step=3))], now=50.0, wall=WALL).ranks
    assert unknown.soft_timeout is None


# -- how often a pod writes, by the job's size ------------------------------------------------------------------


@pytest.mark.parametrize(("nodes", "least", "soft_timeout", "expected"), [
    (1, 1.0, 60.0, 1.0),  # a small job: the agent's setting
    (PROGRESS_WRITES_PER_SECOND, 1.0, 60.0, 1.0),  # the largest job at one write a second per pod
    (512, 1.0, 60.0, 2.0),  # twice that: every other second, the job's writes a second the same
    (1024, 1.0, 60.0, 4.0),
    (2048, 1.0, 60.0, MAX_PACED_INTERVAL),  # 16,384 ranks of 8 a pod: 8 s by the rate, held to the longest wait
    (10_000, 1.0, None, MAX_PACED_INTERVAL),  # no soft timeout known: the same
    (2048, 1.0, 6.0, 2.0),  # a third of the soft timeout at most: the operator judges stalls by what it reads
    (2048, 30.0, 60.0, 30.0),  # never more often than the agent's setting
    (4, 0.0, 60.0, 4 / PROGRESS_WRITES_PER_SECOND),  # a setting of 0 (every poll) still paced by the rate
])
def test_the_interval_between_writes_keeps_a_jobs_writes_within_the_rate(
        nodes: int, least: float, soft_timeout: float | None, expected: float) -> None:
    assert progress_interval(nodes, least=least, soft_timeout=soft_timeout) == pytest.approx(expected)


@pytest.mark.parametrize(("nodes", "least", "field"), [(0, 1.0, "nodes"), (-3, 1.0, "nodes"), (8, -1.0, "least")])
def test_an_interval_of_a_bad_size_or_setting_names_it(nodes: int, least: float, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        progress_interval(nodes, least=least, soft_timeout=60.0)


@pytest.mark.integration
def test_a_pod_of_a_large_round_writes_its_record_at_the_rounds_pace(store: Store) -> None:
    keys = JobKeys("default", f"u-{uuid.uuid4().hex[:8]}")
    epoch = store.put(keys.rendezvous + MANIFEST, b"{}")

    def writes_in(seconds: float, nodes: int) -> int:
        """Publish as the agent's poll loop does, every 50 ms; how many records reached etcd."""
        reporter = ProgressReporter(store, keys, "n0", interval=0.1, context="pace")
        reporter.join(1, epoch, Fence(store, keys, epoch), nodes=nodes, soft_timeout=60.0)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            reporter.publish("running")
            time.sleep(0.05)
        kv = store.get(keys.progress + "n0")
        assert kv is not None and ProgressRecord.from_json_bytes(kv.value).incarnation == reporter.book.incarnation
        return reporter.writes

    try:
        # A pod of 8 writes every 0.1 s (its setting); one of 2,048 every 5 s: once in the same second and a half.
        assert writes_in(1.5, 8) >= 8
        assert writes_in(1.5, 2048) == 1
    finally:
        store.delete_prefix(keys.prefix)


# -- the reporter against a real etcd ------------------------------------------------------------------------


@pytest.mark.integration
def test_an_etcd_outage_logs_one_line_when_it_starts_and_one_when_it_ends(
        private_etcd: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    keys = JobKeys("default", f"u-{uuid.uuid4().hex[:8]}")
    store = Store([private_etcd.endpoint], timeout=2.0)
    reporter = ProgressReporter(store, keys, "n0", interval=0.1, context="job=default/j node=n0",
                                write_timeout=0.5, backoff=Backoff(initial=0.2, cap=2.0))
    epoch = store.put(keys.rendezvous + MANIFEST, b"{}")
    reporter.join(1, epoch, Fence(store, keys, epoch))
    caplog.set_level(logging.DEBUG, logger="stalwart.agent.progress")

    def loop(seconds: float) -> int:
        """Publish as the agent's poll loop does (every 0.1s); returns how many writes went through."""
        before = reporter.writes
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            reporter.publish("running")
            time.sleep(0.1)
        return reporter.writes - before

    try:
        assert loop(0.5) >= 3
        private_etcd.stop()
        attempts_before = reporter.outage.state.failures
        loop(6.0)
        failed = reporter.outage.state.failures - attempts_before
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
        assert "job=default/j node=n0" in warnings[0].getMessage()
        # 60 polls in 6s; with the back-off (0.2s doubling to 2s, jittered) a dozen attempts at most.
        assert 2 <= failed <= 12, failed
        private_etcd.start()
        deadline = time.monotonic() + 30
        while reporter.outage.active and time.monotonic() < deadline:
            loop(0.5)
        assert not reporter.outage.active
        ended = [r for r in caplog.records if "reachable again" in r.getMessage()]
        assert len(ended) == 1 and f"{failed}" in ended[0].getMessage()
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
        kv = store.get(keys.progress + "n0")
        assert kv is not None and ProgressRecord.from_json_bytes(kv.value).incarnation == reporter.book.incarnation
    finally:
        store.close()
