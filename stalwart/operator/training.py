"""The training part of a decision: faults, recoveries, progress, and the phase and conditions they give
(see :mod:`.incidents`). Pure over the reconcile's :class:`~stalwart.operator.work.Work`.
"""

from __future__ import annotations

from collections.abc import Sequence

from stalwart.api.spec import TrainingJobSpec, warm_spares_on
from stalwart.api.status import ConditionStatus, ConditionType, Phase, Progress
from stalwart.operator.culprits import Peer, silent_limit
from stalwart.operator.failures import Fact
from stalwart.operator.incidents import assess
from stalwart.operator.lease_loss import lease_facts
from stalwart.operator.model import PodView
from stalwart.operator.parked_status import REASON_PREPARE_FAILED, parked_failures, prepare_verdict
from stalwart.operator.snapshot_status import peer_snapshot
from stalwart.operator.takeover import REASON_SPARE_TOOK_OVER, takeovers
from stalwart.operator.work import REASON_UNSCHEDULABLE, Work, condition, to_time

__all__ = ["peers", "training"]


def peers(w: Work, members: Sequence[str], *, limit: float) -> list[Peer]:
    """The round's member pods as a survivor's symptom may point at them (see :mod:`.culprits`); ``limit``: the
    silence after which a member's agent counts as gone."""
    obs = w.obs
    pods = {p.name: p for p in obs.pods}
    records = {r.node_id: r for r in obs.etcd.progress if obs.etcd.epoch and r.epoch == obs.etcd.epoch}
    out = []
    for name in members:
        pod = pods.get(name)
        rec = records.get(name)
        ranks = tuple((r.rank, r.progress_time if r.progress_time is not None else r.step_time)
                      for r in rec.ranks if r.state == "running") if rec is not None else ()
        out.append(Peer(
            name, pod.node if pod else None, pod.ip if pod else None,
            unreachable=pod is not None and pod.node is not None and pod.node in obs.unreachable_nodes,
            gone=pod is None or pod.deleting or pod.phase == "Failed",
            silent_for=w.now - rec.updated if rec is not None else None, ranks=ranks,
            host_ip=pod.host_ip if pod else None, silent_limit=limit))
    return out


def training(w: Work, spec: TrainingJobSpec, live: Sequence[PodView], facts: Sequence[tuple[str, Fact]],
              vanished: frozenset[str]) -> None:
    """Faults, recoveries, progress and the phase (see :mod:`.incidents`)."""
    st = w.status
    manifest = w.obs.etcd.manifest if w.obs.etcd.reachable else None
    members = {m.node_id for m in manifest.members} if manifest is not None else set()
    in_round = [f for name, f in facts if name in members]
    outside = [f for name, f in facts if name not in members]
    staying = {p.name for p in w.obs.pods if not p.deleting}
    soft_timeout = spec.restart_policy.in_process.soft_timeout_seconds
    limit = silent_limit(len(manifest.members) + len(manifest.spares) if manifest is not None else 0, soft_timeout)
    a = assess(st, w.obs.etcd, pod_facts=in_round, side_facts=outside, vanished=vanished, now=w.now,
               soft_timeout=soft_timeout, peers=peers(w, sorted(members), limit=limit),
               lease_facts=lease_facts(manifest, w.obs.etcd.progress, staying, w.now))
    st.last_failure = a.last_failure
    st.restarts = a.restarts
    st.position = a.position
    if a.evidence.step is not None:
        st.progress = Progress(step=a.evidence.step, updated=to_time(a.evidence.step_time or w.now))
    if manifest is not None:
        st.peer_snapshot = peer_snapshot(w.obs.etcd.progress, members, w.obs.etcd.epoch,
                                         manifest.world_size) or st.peer_snapshot
    for type_, reason, message in a.events:
        w.event(type_, reason, message)
    if w.obs.etcd.reachable:
        prepared = prepare_verdict(parked_failures(w.obs.etcd.progress, {p.name for p in live}),
                                   condition(st, ConditionType.PREPARE_FAILED))
        if prepared is not None:
            w.cond(ConditionType.PREPARE_FAILED, prepared.status, prepared.reason, prepared.message)
            if prepared.event:
                w.event("Warning", REASON_PREPARE_FAILED, prepared.message)
    warm = warm_spares_on(spec.restart_policy.in_process.warm_spares, spec.spares)
    took = takeovers(w.obs.job.status.round, manifest, w.obs.etcd.record, w.obs.etcd.progress, st.last_failure,
                     warm=warm, announced=st.promoted_spares or ())
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
