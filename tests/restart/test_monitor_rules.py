"""What a rank's monitor decides (the pure :mod:`stalwart.restart.monitor_rules`): the faults it reports, whether an
interrupt still belongs to the running iteration, its limits, and what it does about a main thread blocked after
its interrupt."""

from __future__ import annotations

import pytest

from stalwart.api.restart import FaultKind, FaultRecord
from stalwart.restart.monitor_rules import (
    interrupts_current,
    kill_limit,
    link_report,
    lost_peer_report,
    stall_limit,
    when_stuck,
)
from stalwart.restart.protocol import Participant, Report

ME = Participant(slot=1, node_id="n", slots=3, target_world=2)
FAR = ("10.0.0.2:40001",)


@pytest.mark.parametrize(("slot", "active", "expected"), [
    (0, frozenset({0, 1}), Report(5, 1, "peer_lost", "the heartbeat lease of slot 0 ended", (0,))),
    (1, frozenset({0, 1}), None),  # its own lease: not a peer
    (2, frozenset({0, 1}), None),  # a spare's: not in the iteration
])
def test_a_lost_peer(slot: int, active: frozenset[int], expected: Report | None) -> None:
    assert lost_peer_report(slot, ME.slot, iteration=5, rank=1, active=active) == expected


@pytest.mark.parametrize(("about", "current", "interrupts"), [
    (3, 3, True),      # a hang or a peer's fault of the running iteration
    (3, 4, False),     # seen in 3, acted on once 4 had begun (a slow report): 4 is not interrupted
    (None, 4, True),   # a new round took over: whatever runs ends
])
def test_interrupts_current(about: int | None, current: int, interrupts: bool) -> None:
    assert interrupts_current(about, current) is interrupts


@pytest.mark.parametrize(("soft", "startup", "pinged", "limit"), [
    (5.0, 60.0, True, 5.0),    # training has stepped: the soft timeout
    (5.0, 60.0, False, 60.0),  # still in the first collectives, a peer may be starting: the barrier's allowance
    (90.0, 60.0, False, 90.0),  # never shorter than the soft timeout
])
def test_stall_limit(soft: float, startup: float, pinged: bool, limit: float) -> None:
    assert stall_limit(soft, startup, pinged=pinged) == limit


@pytest.mark.parametrize(("soft", "hard", "startup", "pinged", "limit"), [
    (4.0, 8.0, 60.0, True, 8.0),     # training has stepped: the hard timeout
    (4.0, 8.0, 60.0, False, 64.0),   # waiting for a slower peer: the agent gives as much more as the rank does
    (90.0, 120.0, 60.0, False, 120.0),  # the startup allowance shorter than the soft timeout adds nothing
])
def test_kill_limit(soft: float, hard: float, startup: float, pinged: bool, limit: float) -> None:
    assert kill_limit(soft, hard, startup, pinged=pinged) == limit


@pytest.mark.parametrize(("stuck_for", "spilled", "action"), [
    (None, False, "wait"),    # the main thread is not blocked after an interrupt
    (0.5, False, "wait"),     # blocked for a moment: shutting its connections down frees it within milliseconds
    (2.0, False, "spill"),    # still blocked: a transfer gloo does not fail; what it holds is written out
    (5.0, True, "wait"),      # written out; a native call of a step may still return
    (10.0, False, "spill"),   # never abandoned before its copies are written
    (10.0, True, "abandon"),  # given up: the agent starts a new process, which takes the copies
])
def test_when_stuck(stuck_for: float | None, spilled: bool, action: str) -> None:
    assert when_stuck(stuck_for, spilled=spilled) == action


def hang(slot: int, *, iteration: int = 5, kind: FaultKind = "soft_timeout") -> FaultRecord:
    return FaultRecord(slot=slot, rank=slot, node_id=f"n{slot}", iteration=iteration, kind=kind,
                       reason="no progress for 5.1s (soft timeout 5s)", time=1.0)


@pytest.mark.parametrize(("peer", "reported", "unreachable", "says"), [
    (hang(0), False, FAR, True),         # a peer hung; this end's bytes to it went unanswered: the link is down
    (hang(0), False, (), False),         # every byte acknowledged: this end knows nothing of the link
    (hang(0), True, FAR, False),         # its own soft timeout already reported the link
    (hang(1), False, FAR, False),        # its own record
    (hang(0, iteration=4), False, FAR, False),  # another iteration's
    (hang(0, kind="exception"), False, FAR, False),  # a peer's error, not a hang: its connections say nothing
    (hang(0, kind="link_down"), False, FAR, False),  # the other end's word on the link: nothing to add
])
def test_a_link_seen_down_from_the_end_a_peer_s_hang_interrupted(peer: FaultRecord, reported: bool,
                                                                  unreachable: tuple[str, ...], says: bool) -> None:
    report = link_report(peer, ME.slot, iteration=5, rank=1, reported=reported, unreachable=unreachable)
    if not says:
        assert report is None
        return
    assert report is not None and (report.iteration, report.rank, report.kind, report.unreachable) == (
        5, 1, "link_down", FAR)
    assert "slot 0" in report.reason and FAR[0] in report.reason
