"""What a rank process's monitor decides, as pure functions: which events are faults to report (a peer's lost
lease, a link seen down), whether an interrupt still belongs to the running iteration, how long an iteration
may go without progress before it counts as hung and before its agent kills it, and what to do about a main
thread that stays blocked after its interrupt. :class:`stalwart.restart.monitor.Monitor` is the shell."""

from __future__ import annotations

from typing import Literal

from stalwart.api.restart import FaultRecord
from stalwart.restart.protocol import Report

__all__ = [
    "ABANDON_AFTER",
    "SPILL_AFTER",
    "interrupts_current",
    "kill_limit",
    "link_report",
    "lost_peer_report",
    "stall_limit",
    "when_stuck",
]


def lost_peer_report(slot: int, own_slot: int, *, iteration: int, rank: int | None,
                     active: frozenset[int]) -> Report | None:
    """A running iteration's peer ``slot`` lost its heartbeat lease: the fault to report, when it is one (a
    slot of the iteration other than this process's)."""
    if slot == own_slot or slot not in active:
        return None
    return Report(iteration, rank, "peer_lost", f"the heartbeat lease of slot {slot} ended", (slot,))


def interrupts_current(about: int | None, current: int) -> bool:
    """Whether what happened in iteration ``about`` (None: in whatever iteration runs, e.g. a new round took
    over) interrupts the ``current`` one. A hang seen in one iteration and acted on after the next began (its
    report was slow to write) would otherwise end the next one inside its group's construction, where peers
    wait in native code that no interrupt frees."""
    return about is None or about == current


def stall_limit(soft_timeout: float, startup_timeout: float, *, pinged: bool) -> float:
    """Seconds without progress after which a running iteration counts as hung: the soft timeout once the
    training code has pinged in this iteration, the longer startup allowance before."""
    return soft_timeout if pinged else max(soft_timeout, startup_timeout)


def kill_limit(soft_timeout: float, hard_timeout: float, startup_timeout: float, *, pinged: bool) -> float:
    """Seconds without progress after which the agent kills the process (the status file's ``hard_timeout``):
    the hard timeout, lengthened before the iteration's first ping by as much as :func:`stall_limit` lengthens
    the soft one. A rank that waits in its first collectives for a slower peer (a respawned one still building
    its model) is not hung: its own monitor gives it the startup allowance, and its agent must not kill it
    sooner."""
    return hard_timeout + stall_limit(soft_timeout, startup_timeout, pinged=pinged) - soft_timeout


#: Seconds a main thread may stay blocked after its interrupt was delivered before its snapshots are spilled:
#: shutting the group's connections down frees a blocked collective within milliseconds, so one still blocked
#: after this waits on a transfer gloo does not fail (see :mod:`stalwart.restart.snapshot_spill`).
SPILL_AFTER = 2.0
#: ... and before the process ends itself (exit code ABANDONED) for its agent to start a new one: such a wait
#: lasts the group's timeout (30 minutes), and the hard timeout (90 s by default) is far longer than a native
#: call of a training step that an interrupt merely has to wait for.
ABANDON_AFTER = 10.0


def when_stuck(stuck_for: float | None, *, spilled: bool) -> Literal["wait", "spill", "abandon"]:
    """What the monitor does about a main thread blocked ``stuck_for`` seconds since its interrupt was
    delivered (None: it is not blocked): write the held snapshots out once, then end the process."""
    if stuck_for is None or stuck_for < SPILL_AFTER:
        return "wait"
    if not spilled:
        return "spill"
    return "abandon" if stuck_for >= ABANDON_AFTER else "wait"


def link_report(peer: FaultRecord, own_slot: int, *, iteration: int, rank: int | None, reported: bool,
                unreachable: tuple[str, ...]) -> Report | None:
    """A peer's hang report (``peer``) interrupts this process, whose own connections were retransmitting bytes
    to ``unreachable`` unacknowledged: the report to add, naming the link from this end. A one-peer cut is seen
    by whichever end had bytes in flight; when that is not the end whose soft timeout fired first, only this
    report says the network is at fault. Nothing when this process already reported in the iteration
    (``reported``: its own timeout said it), the record is its own or of another iteration, it is no hang, or
    every byte sent was acknowledged."""
    if (reported or not unreachable or peer.slot == own_slot or peer.iteration != iteration
            or peer.kind != "soft_timeout"):
        return None
    return Report(iteration, rank, "link_down",
                  f"interrupted by the hang of slot {peer.slot} (rank {peer.rank}); bytes sent to "
                  f"{', '.join(unreachable[:4])} are retransmitted unacknowledged: the link to it carries nothing",
                  unreachable=unreachable)
