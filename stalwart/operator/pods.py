"""The pods' part of a decision: names for new pods, which pods to keep on scale-down, the tracked pods, the
JobRecord that follows the live pods, the pod counts, success from exited pods, and suspension.
Pure functions over the reconcile's :class:`~stalwart.operator.work.Work`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from stalwart.api import naming
from stalwart.api.failure_rules import FailureReason
from stalwart.api.spec import CleanPodPolicy, SuccessPolicy, TrainingJobSpec
from stalwart.api.status import ConditionStatus, ConditionType, Phase, RestartCounts
from stalwart.operator.failures import Fact
from stalwart.operator.lingering import ranks_returned
from stalwart.operator.model import CreatePod, DeletePod, PodView, WriteJobRecord
from stalwart.operator.work import REASON_SUSPENDED, Work, condition, succeed

__all__ = ["REASON_LINGERING", "count_pods", "follow_record", "force_delete_unreachable", "keep_rank", "lingered",
           "lingering_over", "new_pods", "pod_fact", "pod_message", "succeeded", "suspend", "track"]

#: The reason of the PodsLingering condition and of the Event naming each lingering pod.
REASON_LINGERING = "PodLingering"


def pod_fact(w: Work, pod: str, reason: str, message: str, exit_code: int | None = None) -> Fact:
    return Fact("Pod", reason, w.now, pod=pod, message=message, exit_code=exit_code)


def pod_message(pod: PodView, reason: FailureReason) -> str:
    if reason == FailureReason.NODE_LOST:
        return f"its node {pod.node or ''} was lost ({pod.message or pod.reason or 'unreachable'})".replace("  ", " ")
    if pod.exit_code is not None:
        return f"the pod's trainer exited with code {pod.exit_code}" + (f": {pod.message}" if pod.message else "")
    return pod.message or pod.reason or reason.value


def force_delete_unreachable(w: Work, pod: PodView) -> None:
    """A pod Terminating on an unreachable node: no kubelet there will confirm the deletion, so it is fenced
    and force-deleted at once (its processes may live on behind a partition; the fence keeps them out)."""
    w.fence(pod.name)
    w.actions.append(DeletePod(pod.name, 0, "NodeUnreachable"))
    w.event("Warning", "ForceDeleted", f"pod {pod.name} was terminating on unreachable node {pod.node}; "
                                       "force-deleted")


def track(w: Work, keep: Iterable[str]) -> None:
    """``status.trackedPods``: the pods seen in the watch, alive, and not deleted by this decision, plus
    ``keep``."""
    deleted = {a.name for a in w.actions if isinstance(a, DeletePod)}
    names = {p.name for p in w.obs.pods if not p.assumed and not p.deleting and not p.finished
             and p.name not in deleted}
    names.update(keep)
    w.status.tracked_pods = sorted(names) or None


def keep_rank(w: Work, pod: PodView) -> tuple[int, int, int, int]:
    """Sort key: the pods to delete first on scale-down come first (not in the round, not running,
    highest index)."""
    manifest = w.obs.etcd.manifest
    member = manifest is not None and manifest.member(pod.name) is not None
    return (int(member), int(pod.phase == "Running"), int(pod.role == naming.ROLE_WORKER), -pod.index)


def new_pods(w: Work, spec: TrainingJobSpec, deficit: int, replacements: int) -> list[CreatePod]:
    """Names for ``deficit`` new pods: the first ``replacements`` are fresh spares (a replacement joins as a
    spare); the rest fill free worker slots 0..replicas-1, then free spare slots, then fresh spares."""
    # A pod name held by a pod that is not the job's stays out of use (see guards.ownership).
    taken = {p.name for p in w.obs.pods} | {c.name for c in w.obs.conflicts if c.kind == "Pod"}
    spare_indices = [p.index for p in w.obs.pods if p.role == naming.ROLE_SPARE]
    restarts = w.status.restarts or RestartCounts()
    # Fresh spare indices never reuse a name: they grow with the replacement count, which only grows.
    next_spare = max([spec.spares + restarts.pod_replacements, *[i + 1 for i in spare_indices]])
    out: list[CreatePod] = []

    def fresh_spare() -> CreatePod:
        nonlocal next_spare
        while naming.spare_pod_name(w.obs.job.name, next_spare) in taken:
            next_spare += 1
        pod = CreatePod(naming.spare_pod_name(w.obs.job.name, next_spare), naming.ROLE_SPARE, next_spare)
        taken.add(pod.name)
        next_spare += 1
        return pod

    for _ in range(replacements):
        out.append(fresh_spare())
    slots: list[CreatePod] = []
    for i in range(spec.replicas):
        name = naming.worker_pod_name(w.obs.job.name, i)
        if name not in taken:
            slots.append(CreatePod(name, naming.ROLE_WORKER, i))
    for i in range(spec.spares):
        name = naming.spare_pod_name(w.obs.job.name, i)
        if name not in taken:
            slots.append(CreatePod(name, naming.ROLE_SPARE, i))
    rest = deficit - replacements
    for pod in slots[:rest]:
        taken.add(pod.name)
        out.append(pod)
    while len(out) < deficit:
        out.append(fresh_spare())
    return out


def succeeded(w: Work, spec: TrainingJobSpec) -> bool:
    pods = {p.name: p for p in w.obs.pods}
    done = [p for p in w.obs.pods if p.phase == "Succeeded"]
    if not done:
        return False
    manifest = w.obs.etcd.manifest
    if spec.success_policy == SuccessPolicy.RANK_ZERO:
        if manifest is not None:
            rank0 = manifest.members[0].node_id
            ok = rank0 in pods and pods[rank0].phase == "Succeeded"
            message = f"pod {rank0} (rank 0) exited 0"
        else:
            ok, message = True, f"pod {done[0].name} exited 0"
    else:
        members = [m.node_id for m in manifest.members] if manifest is not None else \
            [p.name for p in w.obs.pods if p.role == naming.ROLE_WORKER and not p.deleting]
        ok = bool(members) and all(m in pods and pods[m].phase == "Succeeded" for m in members)
        message = f"all {len(members)} worker pod(s) of the last round exited 0"
    if ok:
        succeed(w, message)
    return ok


def lingered(w: Work, spec: TrainingJobSpec) -> bool:
    """Success from the ranks' reports (:mod:`.lingering`): every rank the success policy names returned and
    the limit for their pods to exit passed. Then each pod still alive gets a ``PodLingering`` Event, the
    ``PodsLingering`` condition names them all, and the job succeeds; the caller finishes it. The pods are
    deleted (to free their nodes: their work is done) unless ``cleanPodPolicy`` is ``None``, the user's word
    that no pod of a finished job is to be deleted. False (and a wake-up at the limit) until then."""
    verdict = ranks_returned(w.obs.pods, w.obs.etcd, policy=spec.success_policy, now=w.now,
                             limit=w.settings.linger_limit)
    if verdict is None:
        return False
    if not verdict.past_limit:
        w.wake_in(verdict.due_in)
        return False
    policy = spec.run_policy.clean_pod_policy
    keep = policy == CleanPodPolicy.NONE
    after = f"{w.now - verdict.returned_at:.0f}s after every rank of round {verdict.round} returned"
    fate = "left running (cleanPodPolicy None)" if keep else f"deleted (cleanPodPolicy {policy.value})"
    for pod in verdict.alive:
        w.event("Warning", REASON_LINGERING, f"pod {pod.pod} still running {after} ({pod.evidence}); "
                f"{'left running: cleanPodPolicy None keeps every pod' if keep else 'deleting it'}")
        if not keep:
            w.actions.append(DeletePod(pod.pod, w.settings.delete_grace_seconds, REASON_LINGERING))
    names = ", ".join(p.pod for p in verdict.alive)
    if verdict.alive:
        w.cond(ConditionType.PODS_LINGERING, ConditionStatus.TRUE, REASON_LINGERING,
               f"pod(s) {names} still running {after}, past the limit of {w.settings.linger_limit:g}s; {fate}")
    ended = [f"{', '.join(verdict.exited)} exited 0"] if verdict.exited else []
    ended += [f"{names} did not exit within {w.settings.linger_limit:g}s"] if verdict.alive else []
    succeed(w, f"every rank of round {verdict.round} returned" + (f" ({'; '.join(ended)})" if ended else ""))
    return True


def lingering_over(w: Work) -> None:
    """A finished job whose ``PodsLingering`` condition is True: False once no pod of the job is running."""
    c = condition(w.status, ConditionType.PODS_LINGERING)
    if c is not None and c.status == ConditionStatus.TRUE and not any(not p.finished for p in w.obs.pods):
        w.cond(ConditionType.PODS_LINGERING, ConditionStatus.FALSE, "LingeringPodsGone",
               f"no pod of the job is running any more; was: {c.message}")


def suspend(w: Work) -> None:
    st = w.status
    st.tracked_pods = None  # every pod goes by the operator's own hand: none may count as vanished
    for pod in w.obs.pods:
        if not pod.deleting and not pod.finished:
            w.actions.append(DeletePod(pod.name, w.settings.delete_grace_seconds, REASON_SUSPENDED))
    if st.phase != Phase.SUSPENDED:
        st.phase = Phase.SUSPENDED
        st.start_time = None  # the deadline counts again from the resume
        w.cond(ConditionType.SUSPENDED, ConditionStatus.TRUE, REASON_SUSPENDED, "runPolicy.suspend is true")
        w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, REASON_SUSPENDED, "runPolicy.suspend is true")
    st.replicas = sum(1 for p in w.obs.pods if not p.finished and p.role == naming.ROLE_WORKER)
    st.ready_replicas = 0
    st.spare_replicas = 0


def follow_record(w: Work, live: Iterable[PodView], created: Sequence[CreatePod]) -> None:
    """Keep the JobRecord and the expected nodes in step with the spec and the live pods."""
    etcd = w.obs.etcd
    if not etcd.reachable:
        return
    pods = [(p.name, p.role, p.index, p.unschedulable) for p in live]
    pods += [(c.name, c.role, c.index, False) for c in created]
    pods.sort(key=lambda t: (t[1] != naming.ROLE_WORKER, t[2]))
    members = tuple(n for n, role, _, _ in pods if role == naming.ROLE_WORKER)
    spares = tuple(n for n, role, _, _ in pods if role != naming.ROLE_WORKER)
    expected = tuple(n for n, _, _, unschedulable in pods if not unschedulable)
    record = etcd.record
    stale = (record is None or record.generation != w.obs.job.generation
             or tuple(record.members) != members or tuple(record.spares) != spares
             or (expected and etcd.expected != expected))
    if stale and (members or spares):
        w.actions.append(WriteJobRecord(members, spares, expected))


def count_pods(w: Work, live: Sequence[PodView]) -> None:
    """replicas (members of the round, and workers waiting to join it), readyReplicas (ready members) and
    spareReplicas (ready pods outside the round). A replacement that took over a lost worker's ranks is a
    member, whatever the role it was created with."""
    st = w.status
    ready = [p for p in live if p.phase == "Running" and p.ready]
    manifest = w.obs.etcd.manifest
    in_round = {m.node_id for m in manifest.members} if manifest is not None else set()
    st.replicas = sum(1 for p in live if p.name in in_round or p.role == naming.ROLE_WORKER)
    if manifest is not None:
        st.ready_replicas = sum(1 for p in ready if p.name in in_round)
        st.spare_replicas = sum(1 for p in ready if p.name not in in_round)
    else:
        st.ready_replicas = sum(1 for p in ready if p.role == naming.ROLE_WORKER)
        st.spare_replicas = sum(1 for p in ready if p.role != naming.ROLE_WORKER)
