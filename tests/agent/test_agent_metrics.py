"""The agent's metrics: the pure :func:`events` over the progress book as a table, the counters they feed, and
the endpoint served and closed."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from stalwart.agent.metrics import (
    AgentMetrics,
    MetricsState,
    Recovered,
    Restarted,
    RoundJoined,
    events,
    pod_snapshot,
)
from stalwart.agent.progress import ProgressBook, joined, respawned
from stalwart.api.restart import FailureInfo, RankReport, RoundSummary
from stalwart.local.etcd import EtcdServer
from stalwart.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_agent import TIMEOUT, start_agent

T = 1_800_000_000.0


def book(*, round_: int = 1, faulted: int | None = None, kept: bool = False, process_restarts: int = 0,
         ranks: tuple[RankReport, ...] = (), failure: FailureInfo | None = None) -> ProgressBook:
    b = joined(ProgressBook(node_id="n0", incarnation="i0"), round_, round_ + 10, kept=kept)
    history = (*b.history[:-1], RoundSummary(round=round_, epoch=round_ + 10, faulted=faulted, kept=kept))
    return replace(b, history=history, ranks=ranks, process_restarts=process_restarts, last_failure=failure)


def rank(iteration: int, *, state: str = "running", first_step_time: float | None = None) -> RankReport:
    return RankReport(local_rank=0, slot=0, rank=0, pid=100, state=state, iteration=iteration,  # type: ignore[arg-type]
                      first_step=None if first_step_time is None else 5, first_step_time=first_step_time)


def fault(at: float, kind: str | None = "exception") -> FailureInfo:
    return FailureInfo(rank=1, pod="n1", reason="boom", kind=kind, time=at)  # type: ignore[arg-type]


SEEN_ROUND_1 = MetricsState(round=1)


@pytest.mark.parametrize(("state", "the_book", "wall", "expected"), [
    # The first round: joined, nothing else.
    (MetricsState(), book(), T, (RoundJoined(kept=False),)),
    # Nothing new.
    (SEEN_ROUND_1, book(), T, ()),
    # Two iterations of round 1 ended by faults at once (0 and 1): two in-process restarts.
    (SEEN_ROUND_1, book(faulted=1), T, (Restarted("in_process", 2),)),
    # One more after the first two were counted.
    (replace(SEEN_ROUND_1, faulted=1), book(faulted=2), T, (Restarted("in_process", 1),)),
    # A new round, entered with the processes kept, whose iteration 0 faulted: counted afresh.
    (replace(SEEN_ROUND_1, faulted=3), book(round_=2, faulted=0, kept=True), T,
     (RoundJoined(kept=True), Restarted("in_process", 1))),
    # A rank process respawned twice.
    (SEEN_ROUND_1, book(process_restarts=2), T, (Restarted("process", 2),)),
    # A step 2.5 s after a fault the agent saw running again 2 s after it: 2 s resume, 0.5 s to the step.
    (replace(SEEN_ROUND_1, faulted=0, running=((1, 1), T + 2.0)),
     book(faulted=0, ranks=(rank(1, first_step_time=T + 2.5),), failure=fault(T)), T + 2.6,
     (Recovered("exception", 2.5, resume=2.0, first_step=0.5),)),
    # The step came before the agent saw the rank running: the total only.
    (replace(SEEN_ROUND_1, faulted=0), book(faulted=0, ranks=(rank(1, first_step_time=T + 2.5),),
                                            failure=fault(T, kind=None)), T + 2.6,
     (Recovered("unknown", 2.5),)),
    # That failure's recovery was counted already: nothing again.
    (replace(SEEN_ROUND_1, faulted=0, recovered=T), book(faulted=0, ranks=(rank(1, first_step_time=T + 2.5),),
                                                         failure=fault(T)), T + 9, ()),
    # The steps shown are older than the failure: not recovered yet.
    (replace(SEEN_ROUND_1, faulted=0), book(faulted=0, ranks=(rank(0, first_step_time=T - 5),), failure=fault(T)),
     T + 1, ()),
], ids=["first-round", "nothing", "two-faults", "one-more", "new-round-kept", "respawned", "recovered-phases",
        "recovered-total-only", "counted-once", "not-yet"])
def test_events(state: MetricsState, the_book: ProgressBook, wall: float, expected: tuple[object, ...]) -> None:
    assert events(state, the_book, wall=wall)[1] == expected


def test_the_agent_notes_when_a_rank_runs_again_and_measures_the_recovery_from_it() -> None:
    # Looked at on three ticks: the fault, the rank seen running in iteration 1 at T+1.2, its first step at T+1.5.
    state = MetricsState()
    state, _ = events(state, book(failure=fault(T)), wall=T + 0.1)
    state, seen = events(state, book(faulted=0, ranks=(rank(1),), failure=fault(T)), wall=T + 1.2)
    assert seen == (Restarted("in_process", 1),)
    state, seen = events(state, book(faulted=0, ranks=(rank(1, first_step_time=T + 1.5),), failure=fault(T)),
                         wall=T + 1.6)
    [r] = seen
    assert isinstance(r, Recovered)
    assert r.seconds == pytest.approx(1.5) and r.resume == pytest.approx(1.2) and r.first_step == pytest.approx(0.3)
    assert state.running is None and state.recovered == T


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()  # type: ignore[no-any-return]


def test_the_counters_are_served_and_the_server_ends_on_close() -> None:
    metrics = AgentMetrics()
    port = free_port("127.0.0.1")
    metrics.serve(port, addr="127.0.0.1")
    thread = metrics._thread
    assert thread is not None and thread.is_alive()
    b = respawned(book(faulted=1, failure=fault(T)), 0, 200)
    metrics.observe(b, wall=T + 1)
    metrics.observe(replace(b, ranks=(rank(2, first_step_time=T + 3),)), wall=T + 4)
    text = scrape(port)
    assert 'stalwart_agent_rendezvous_rounds_total{kept="false"} 1.0' in text
    assert 'stalwart_agent_restarts_total{tier="in_process"} 2.0' in text
    assert 'stalwart_agent_restarts_total{tier="process"} 1.0' in text
    assert 'stalwart_agent_recovery_seconds_count{kind="exception"} 1.0' in text
    assert 'stalwart_agent_recovery_seconds_sum{kind="exception"} 3.0' in text
    metrics.close()
    thread.join(5)
    assert not thread.is_alive()
    assert not any(t is thread for t in threading.enumerate())
    with pytest.raises(urllib.error.URLError):  # nothing listens any more: refused
        scrape(port)


@pytest.mark.integration
def test_a_running_agent_serves_its_recovery_and_stops_serving_when_it_exits(etcd: EtcdServer,
                                                                              tmp_path: Path) -> None:
    # Two ranks; rank 1 raises at step 3 and both restart in process. While the job goes on, the agent's
    # endpoint shows one in-process restart of each rank's iteration and one recovery from an exception.
    port = free_port("127.0.0.1")
    agent, _ = start_agent(etcd, tmp_path, "--steps", "40", "--step-sleep", "0.2", "--fault", "exception",
                           "--fault-step", "3", extra_env={"STALWART_METRICS_PORT": str(port)})
    text = ""
    deadline = time.monotonic() + TIMEOUT
    while 'stalwart_agent_recovery_seconds_count{kind="exception"} 1.0' not in text:
        assert agent.poll() is None, f"the agent ended first:\n{text}"
        assert time.monotonic() < deadline, text
        with contextlib.suppress(urllib.error.URLError):
            text = scrape(port)
        time.sleep(0.2)
    assert 'stalwart_agent_rendezvous_rounds_total{kept="false"} 1.0' in text
    assert 'stalwart_agent_restarts_total{tier="in_process"} 1.0' in text
    assert 'stalwart_agent_restarts_total{tier="process"}' not in text  # no process was started again
    _, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == 0, err[-3000:]
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def snapshotted(slot: int, step: int | None, at: float | None) -> RankReport:
    return RankReport(local_rank=slot, slot=slot, rank=slot, pid=100 + slot, state="running",
                      snapshot_step=step, snapshot_time=at)


@pytest.mark.parametrize(("ranks", "expected"), [
    ((), None),
    ((snapshotted(0, 40, T + 5), snapshotted(1, 39, T + 4)), (39, T + 4)),  # the oldest: every rank has it
    ((snapshotted(0, 40, T + 5), snapshotted(1, None, None)), None),        # a rank without one yet
])
def test_the_pods_peer_snapshot_is_its_oldest_ranks(ranks: tuple[RankReport, ...],
                                                    expected: tuple[int, float] | None) -> None:
    the_book = replace(book(), ranks=ranks)
    assert pod_snapshot(the_book) == expected
    metrics = AgentMetrics()
    metrics.observe(the_book, wall=T + 6)
    step = metrics.registry.get_sample_value("stalwart_agent_peer_snapshot_step")
    when = metrics.registry.get_sample_value("stalwart_agent_peer_snapshot_timestamp_seconds")
    assert (step, when) == ((float(expected[0]), expected[1]) if expected else (0.0, 0.0))
