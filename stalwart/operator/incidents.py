"""Faults, recoveries and the phase they imply: the training half of the operator's status, as a pure function.

An *incident* is one fault from the moment it is known until training completes a step past it. While one is
open the job is ``Restarting`` (its condition names the fault's kind); the record of it is
``status.lastFailure`` (:mod:`.failures` picks the culprit), and closing it counts the recovery once
(:mod:`.ledger`). Evidence, not claims: ``Running`` needs a completed step and progress within the soft timeout;
a round that is sealed but has not stepped yet is ``Starting``; ranks that stop progressing past the soft timeout
make the ``Stalled`` condition (and an incident of kind ``Hang``, which a step ends). When the operator cannot
read etcd it says so in the ``CoordinationDegraded`` condition and keeps the phase: an etcd outage that does not
stop training is not a restart.

The incident's state lives in the status itself (the ``Restarting`` condition, ``lastFailure``'s round and
iteration, ``position``), so an operator that restarts picks it up where the last one wrote it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from stalwart.api.restart import ProgressRecord
from stalwart.api.status import (
    ConditionStatus,
    ConditionType,
    FailureRecord,
    Position,
    RestartCounts,
    TrainingJobStatus,
)
from stalwart.operator.culprits import Peer, link_facts, peer_facts
from stalwart.operator.evidence import Evidence, gather
from stalwart.operator.failures import Fact, at_or_after, compose, exit_facts, rank_facts, with_position
from stalwart.operator.ledger import advance, round_facts
from stalwart.operator.model import EtcdView

__all__ = ["REASON_DISAPPEARED", "Assessment", "assess", "describe", "lost_members"]

REASON_DISAPPEARED = "PodDisappeared"


@dataclass(frozen=True, slots=True)
class Assessment:
    """What :func:`assess` decided. ``restarting`` is the open incident's condition reason (None: no incident);
    ``started``: training ran; ``stepped``: the furthest (round, iteration) that completed a step; ``stalled``:
    the Stalled condition's message (None: not stalled); ``degraded``: etcd could not be read."""

    last_failure: FailureRecord | None
    restarts: RestartCounts
    position: Position | None
    restarting: str | None = None
    restarting_message: str = ""
    started: bool = False
    stepped: Position | None = None
    stalled: str | None = None
    degraded: bool = False
    evidence: Evidence = field(default_factory=Evidence)
    events: tuple[tuple[str, str, str], ...] = ()


def describe(record: FailureRecord | None) -> str:
    """One line about a failure record: what, where."""
    if record is None:
        return "unknown failure"
    where = []
    if record.rank is not None:
        where.append(f"rank {record.rank}")
    if record.pod:
        where.append(f"pod {record.pod}")
    if record.peer:
        where.append(f"link to pod {record.peer}")
    what = record.reason or "failure"
    if record.exception_type:
        what += f" {record.exception_type}"
    detail = f": {record.message}" if record.message else ""
    return f"{what} on {', '.join(where) or 'the job'}{detail}"[:1024]


def _open_incident(status: TrainingJobStatus) -> bool:
    for c in status.conditions or []:
        if c.type == ConditionType.RESTARTING:
            return c.status == ConditionStatus.TRUE
    return False


def _restarting_reason(status: TrainingJobStatus) -> str | None:
    for c in status.conditions or []:
        if c.type == ConditionType.RESTARTING and c.status == ConditionStatus.TRUE:
            return c.reason
    return None


def _etcd_back_since(status: TrainingJobStatus) -> float:
    """When the operator could read etcd again after its last outage (0: none known)."""
    for c in status.conditions or []:
        if c.type == ConditionType.COORDINATION_DEGRADED and c.last_transition_time is not None:
            return c.last_transition_time.timestamp() if c.status == ConditionStatus.FALSE else float("inf")
    return 0.0


def _incident_position(record: FailureRecord | None, position: Position | None) -> Position | None:
    if record is not None and record.round is not None:
        return Position(round=record.round, iteration=record.iteration or 0)
    return position


def lost_members(side_facts: Sequence[Fact], progress: Sequence[ProgressRecord], round_: int | None,
                 position: Position | None) -> tuple[list[Fact], list[Fact]]:
    """Split the facts of pods outside the current round into training faults and side facts.

    A pod that ran ranks in an earlier round, no earlier than the last counted step (``position``), and is
    missing from the current round was lost from training: the round that replaced it was sealed before the
    operator saw the pod go (its agent left the rendezvous on its way out, or its lease ran out first). Its
    loss is the fault behind the new round, placed where the pod last ran, not news about a spare. The rest
    (spares, pods of rounds already counted past) stay side facts."""
    last: dict[str, Position] = {}
    for rec in progress:
        if rec.history:
            s = rec.history[-1]
            ran = [i for i in (s.stepped, s.faulted) if i is not None]
            last[rec.node_id] = Position(round=s.round, iteration=max(ran, default=0))
    training: list[Fact] = []
    side: list[Fact] = []
    for f in side_facts:
        at = last.get(f.pod or "")
        if at is not None and round_ is not None and at.round < round_ and (
                position is None or at.key() >= position.key()):
            training.append(f if f.position is not None else replace(f, position=at))
        else:
            side.append(f)
    return training, side


def assess(status: TrainingJobStatus, etcd: EtcdView, *, pod_facts: Sequence[Fact] = (),
           side_facts: Sequence[Fact] = (), vanished: frozenset[str] = frozenset(), now: float,
           soft_timeout: float, peers: Sequence[Peer] = (), lease_facts: Sequence[Fact] = ()) -> Assessment:
    """Decide the training half of the status. ``status`` is the status decided so far in this reconcile;
    ``pod_facts`` are faults of pods of the current round the operator saw in it (they open an incident),
    ``side_facts`` faults of other pods (spares: recorded, but training goes on); ``vanished`` the pods that
    disappeared in it; ``peers`` the round's member pods as seen now, which a survivor's symptom may point at
    (:mod:`.culprits`); ``lease_facts`` the members whose lease ran out while their pod ran on
    (:mod:`.lease_loss`): a fault of the round they were in, until a step past it is counted."""
    restarts = status.restarts or RestartCounts()
    position = status.position
    last = status.last_failure
    open_ = _open_incident(status)
    incident = _incident_position(last, position) if open_ else None
    events: list[tuple[str, str, str]] = []
    manifest = etcd.manifest
    round_ = manifest.round if manifest is not None else None
    here = position or (Position(round=round_, iteration=0) if round_ is not None else None)
    gone, side_facts = lost_members(side_facts, etcd.progress, round_, position)
    leased, _counted = lost_members(lease_facts, etcd.progress, round_, position)
    pods = [*gone, *leased, *(with_position(f, here) for f in pod_facts)]

    if not etcd.reachable:
        if pods:
            if not open_:
                open_, incident = True, here
                last = compose(pods)
                events.append(("Warning", "Fault", describe(last)))
            else:
                last = compose(pods, last)
        elif side_facts and not open_:
            last = compose(side_facts)
        return Assessment(last, restarts, position, _reason(last, open_, vanished, status), describe(last),
                          position is not None, None, None, True, Evidence(), tuple(events))

    evidence = gather(etcd.progress, epoch=etcd.epoch, members=[m.node_id for m in manifest.members]
                      if manifest else [], now=now, soft_timeout=soft_timeout, seen_since=_etcd_back_since(status))
    exits = [(rec.node_id, ex) for rec in etcd.progress for ex in rec.exits]
    seen = exit_facts(exits)
    if round_ is not None:
        ended = [(ex.slot, ex.iteration) for _, ex in exits if ex.round == round_]
        seen = link_facts([*seen, *rank_facts(etcd.faults, round_, evidence.places or {}, ended)], peers)
        seen += peer_facts(seen, peers)
    fresh = [f for f in seen if position is None or f.position is None or f.position.key() >= position.key()]

    if (pods or fresh) and not open_:
        open_ = True
        places = [f.position for f in [*pods, *fresh] if f.position is not None]
        incident = min(places, key=Position.key) if places else here
        last = compose(at_or_after([*pods, *fresh], incident))
        events.append(("Warning", "Fault", describe(last)))
    elif open_:
        last = compose(at_or_after([*pods, *fresh], incident), last)
    elif side_facts:
        last = compose(side_facts)

    tally = advance(position, round_facts(etcd.progress), incident, open_)
    restarts = RestartCounts(in_process=restarts.in_process + tally.in_process,
                             process_restarts=restarts.process_restarts + tally.process_restarts,
                             pod_replacements=restarts.pod_replacements)
    position = tally.position
    if tally.recovered:
        open_ = False
        how = "in process" if tally.in_process and not tally.process_restarts else "with new processes"
        reason = "RestartedInProcess" if how == "in process" else "RestartedProcesses"
        step = f" at step {evidence.step}" if evidence.step is not None else ""
        events.append(("Normal", reason, f"training resumed {how}{step} after {describe(last)}"))
    if not open_ and last is not None and last.round is not None:
        # Facts of the last fault that arrived after its recovery (an agent reports a little later) refine it.
        at = Position(round=last.round, iteration=last.iteration or 0)
        late = [f for f in seen if f.position is not None and f.position.key() == at.key()]
        if late:
            last = compose(late, last)

    stalled = None
    if evidence.stalled:
        ranks = ", ".join(f"rank {r} (pod {p})" if r is not None else f"pod {p}" for r, p in evidence.stalled[:8])
        limit = evidence.soft_timeout or soft_timeout
        stalled = (f"no progress for {evidence.stalled_for:.0f}s ({evidence.limit_name} {limit:g}s) on "
                   f"{ranks}" + (f" and {len(evidence.stalled) - 8} more" if len(evidence.stalled) > 8 else ""))
        # A rank silent since before the last fault was recorded waits on that fault's culprit (a survivor in its
        # collective until the respawned peer starts): no new incident, whether or not the last one still counts.
        began = now - evidence.stalled_for
        caused = last is not None and last.time is not None and began <= last.time.timestamp()
        if not open_ and not caused:
            rank, pod = evidence.stalled[0]
            open_, incident = True, position or here
            last = compose([Fact("Progress", "Hang", now - evidence.stalled_for, incident, 0, rank, pod, None,
                                 stalled)])
            events.append(("Warning", "Stalled", stalled))
    elif open_ and last is not None and last.detected_by == "Progress" and evidence.step_time is not None \
            and last.time is not None and evidence.step_time > last.time.timestamp():
        open_ = False  # the stall ended without a restart: steps went on
        events.append(("Normal", "Progressing", f"training went on at step {evidence.step} after {describe(last)}"))

    return Assessment(last, restarts, position, _reason(last, open_, vanished, status), describe(last),
                      position is not None, tally.stepped, stalled, False, evidence, tuple(events))


def _reason(last: FailureRecord | None, open_: bool, vanished: frozenset[str], status: TrainingJobStatus) -> str | None:
    """The Restarting condition's reason: the fault's kind (PodDisappeared for a pod that vanished, for the rest
    of its restart)."""
    if not open_:
        return None
    if last is not None and last.pod is not None and (
            last.pod in vanished or (_restarting_reason(status) == REASON_DISAPPEARED and last.detected_by == "Pod")):
        return REASON_DISAPPEARED
    return (last.reason if last is not None else None) or "Fault"
