"""The training part of a decision: faults, recoveries, progress, and the phase and conditions they give
(see :mod:`.incidents`). Pure over the reconcile's :class:`~stalwart.operator.work.Work`.
"""

from __future__ import annotations

from collections.abc import Sequence

from stalwart.api.spec import TrainingJobSpec
from stalwart.api.status import ConditionStatus, ConditionType, Phase, Progress
from stalwart.operator.failures import Fact
from stalwart.operator.incidents import assess
from stalwart.operator.model import PodView
from stalwart.operator.takeover import REASON_SPARE_TOOK_OVER, takeovers
from stalwart.operator.work import REASON_UNSCHEDULABLE, Work, condition, to_time

__all__ = ["training"]


def training(w: Work, spec: TrainingJobSpec, live: Sequence[PodView], facts: Sequence[tuple[str, Fact]],
              vanished: frozenset[str]) -> None:
    """Faults, recoveries, progress and the phase (see :mod:`.incidents`)."""
    st = w.status
    manifest = w.obs.etcd.manifest if w.obs.etcd.reachable else None
    members = {m.node_id for m in manifest.members} if manifest is not None else set()
    in_round = [f for name, f in facts if name in members]
    outside = [f for name, f in facts if name not in members]
    a = assess(st, w.obs.etcd, pod_facts=in_round, side_facts=outside, vanished=vanished, now=w.now,
               soft_timeout=spec.restart_policy.in_process.soft_timeout_seconds)
    st.last_failure = a.last_failure
    st.restarts = a.restarts
    st.position = a.position
    if a.evidence.step is not None:
        st.progress = Progress(step=a.evidence.step, updated=to_time(a.evidence.step_time or w.now))
    for type_, reason, message in a.events:
        w.event(type_, reason, message)
    took = takeovers(w.obs.job.status.round, manifest, w.obs.etcd.record, w.obs.etcd.progress, st.last_failure,
                     warm=spec.restart_policy.in_process.warm_spares, announced=st.promoted_spares or ())
    for _, message in took:
        w.event("Normal", REASON_SPARE_TOOK_OVER, message)
    if took:
        st.promoted_spares = sorted({*(st.promoted_spares or ()), *(spare for spare, _ in took)})

    if a.degraded:
        w.cond(ConditionType.COORDINATION_DEGRADED, ConditionStatus.TRUE, "EtcdUnreachable",
               "the operator cannot read the job's etcd: progress and faults are unseen until it can")
        w.wake_in(w.settings.status_interval)
    elif condition(st, ConditionType.COORDINATION_DEGRADED) is not None:
        w.cond(ConditionType.COORDINATION_DEGRADED, ConditionStatus.FALSE, "EtcdReachable",
               "the operator reads the job's etcd")
    if not a.degraded:
        if a.stalled is not None:
            w.cond(ConditionType.STALLED, ConditionStatus.TRUE, "NoProgress", a.stalled)
        elif condition(st, ConditionType.STALLED) is not None:
            w.cond(ConditionType.STALLED, ConditionStatus.FALSE, "Progressing", "the ranks make progress")

    running = [p for p in live if p.phase == "Running"]
    unschedulable = [p.name for p in live if p.unschedulable]
    min_nodes = spec.min_nodes
    # Training runs when a step completed in the current round (not only in an earlier one: a resumed job's
    # new round has not stepped yet).
    stepping = manifest is not None and a.stepped is not None and a.stepped.round >= manifest.round
    if a.restarting is not None:
        phase = Phase.RESTARTING
    elif a.degraded:
        phase = st.phase if st.phase is not None else Phase.PENDING  # unseen: keep what was known
    elif not stepping:
        phase = Phase.STARTING if running else Phase.PENDING
    else:
        phase = Phase.RUNNING
    st.phase = phase

    if phase == Phase.RUNNING:
        step = f"step {a.evidence.step}, " if a.evidence.step is not None else ""
        w.cond(ConditionType.RUNNING, ConditionStatus.TRUE, "StepsCompleting",
               f"{step}round {st.round if st.round is not None else '?'} with world size "
               f"{st.world_size if st.world_size is not None else '?'}")
        w.cond(ConditionType.RESTARTING, ConditionStatus.FALSE, "Recovered" if st.last_failure else "Training",
               "training")
    elif phase == Phase.RESTARTING and a.restarting is not None:
        w.cond(ConditionType.RESTARTING, ConditionStatus.TRUE, a.restarting, a.restarting_message)
        w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, "Restarting", a.restarting_message)
    elif phase == Phase.STARTING and unschedulable and len(live) - len(unschedulable) < min_nodes:
        w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, REASON_UNSCHEDULABLE,
               f"{len(unschedulable)} pod(s) cannot be scheduled ({', '.join(unschedulable[:5])}); "
               f"the job needs minReplicas={min_nodes}")
    elif phase == Phase.STARTING and manifest is not None:
        w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, "WaitingForFirstStep",
               f"round {manifest.round} sealed with world size {manifest.world_size}; no step completed yet")
    elif phase == Phase.STARTING:
        w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, "GangStarting",
               f"{len(running)} of minReplicas={min_nodes} pod(s) running; waiting for the first round")
