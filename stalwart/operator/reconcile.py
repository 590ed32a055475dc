"""The operator's decision: one pure function from an :class:`Observation` to a :class:`Decision`.

``reconcile(obs, settings)`` looks at the job, its pods, its etcd records and the clock, and returns the
actions that move the world towards the spec plus the status that describes it. It never does I/O and never
reads the clock itself, so every phase transition and failure path is a table row in the unit tests.

Rules it implements, in the order it applies them:

1. A job being deleted is left to the finalizer (which deletes the etcd prefix).
2. A spec that does not validate ends the job ``Failed`` with an ``InvalidSpec`` condition and one Event; so
   does a template whose pods would break the Pod Security Standards level the operator holds them to
   (``ReconcileSettings.pod_security``, restricted by default; :mod:`.pod_defaults`).
   Credentials the job's etcd refuses (or its Secret lacks) and objects holding the job's Secret or Service
   name without being the job's hold the job back, each with a condition naming the cause (:mod:`.guards`).
3. A finished job gets its pods cleaned up per ``cleanPodPolicy``, its rendezvous closed, and is deleted
   ``ttlSecondsAfterFinished`` after completion.
4. ``activeDeadlineSeconds`` past ``startTime`` fails the job (``DeadlineExceeded``).
5. ``suspend`` deletes every pod and keeps the etcd state; resuming recreates them.
6. A failed or lost pod is fenced (its lease revoked) and deleted; the exit-code rules pick
   RestartInProcess / ReplacePod / FailJob; replacements count against ``backoffLimit``
   (``BackoffLimitExceeded`` when it runs out). A pod stuck Terminating past its grace period plus
   ``terminating_grace_limit`` is force-deleted. A pod that *disappeared* (listed in
   ``status.trackedPods`` but gone from the API, e.g. force-deleted) is fenced and, once the job has
   started, counts as a pod replacement exactly once (``PodDisappeared``).
7. ``successPolicy`` decides success from pods that exited 0, or from the ranks' reports that every rank it
   names returned, once their pods had ``linger_limit`` seconds to exit (:mod:`.lingering`): pods still alive
   then are named (``PodLingering`` Events, the ``PodsLingering`` condition) and deleted unless
   ``cleanPodPolicy`` is ``None``.
8. Pods are created (or surplus ones deleted) so that ``replicas + spares`` pods live. Fences come before
   creations in the action list, so a lost pod is fenced before its replacement can join.
9. The JobRecord and the rendezvous' expected nodes follow the live pods (unschedulable pods are not
   expected, so the round seals with fewer nodes, never below ``minReplicas``).
10. Phase, conditions and counters are computed; the status is patched at most once per
    ``status_interval`` seconds, except that a new pod replacement is patched at once.

How a vanished pod is told from one the operator removed itself: ``status.trackedPods`` lists the pods seen
in the watch (never the ones the operator only assumes it created), alive, and not deleted by the operator.
Every decision that deletes a pod (failure, scale-down, suspension, clean-up) drops it from the list in the
same status, and a pod seen Terminating leaves it too (its loss is handled as a deletion). The list lives in
the status, next to the counter it feeds, so both are written in one patch: an operator that restarts or
takes over reads them together and cannot count a pod twice, and the decided status the next reconcile
starts from no longer lists a pod that was counted.

This module holds the rules' order and the job's life cycle; the parts live beside it, each pure:
:mod:`.failure_rules` (what a failed pod's rules say), :mod:`.pods` (names, counts, the record, success,
suspension), :mod:`.training` (faults, progress and the phase), :mod:`.work` (the scratch of one reconcile,
conditions, and the outcomes that end a job).
"""

from __future__ import annotations

from stalwart.api import naming
from stalwart.api.failure_rules import FailureAction, FailureReason
from stalwart.api.spec import CleanPodPolicy, TrainingJobSpec
from stalwart.api.status import ConditionStatus, ConditionType, FailureRecord, Phase, RestartCounts, TrainingJobStatus
from stalwart.operator.failure_rules import failure_action, failure_reason, rule_matches
from stalwart.operator.failures import Fact
from stalwart.operator.guards import etcd_access, ownership
from stalwart.operator.incidents import REASON_DISAPPEARED
from stalwart.operator.model import (
    Action,
    CloseRendezvous,
    CreatePod,
    Decision,
    DeleteJob,
    DeletePod,
    EmitEvent,
    EnsureOwnedObjects,
    Observation,
    PatchStatus,
    ReconcileSettings,
    RevokeLease,
    SyncPodGroup,
    WriteFence,
    WriteJobRecord,
)
from stalwart.operator.node_loss import lost_pods, on_unreachable_node, recheck_in, strangers
from stalwart.operator.pod_defaults import PodSecurity, pod_security_problems, with_defaults
from stalwart.operator.pods import (
    count_pods,
    follow_record,
    force_delete_unreachable,
    keep_rank,
    lingered,
    lingering_over,
    new_pods,
    pod_fact,
    pod_message,
    succeeded,
    suspend,
    track,
)
from stalwart.operator.rank_failures import rank_verdict
from stalwart.operator.training import training
from stalwart.operator.work import (
    REASON_BACKOFF,
    REASON_DEADLINE,
    REASON_FAIL_RULE,
    REASON_INVALID_SPEC,
    REASON_NON_RETRYABLE,
    REASON_RESUMED,
    Work,
    condition,
    fail,
    from_time,
    is_live,
    set_condition,
    to_time,
)

__all__ = ["REASON_DISAPPEARED", "condition", "failure_action", "failure_reason", "reconcile", "set_condition"]


# -- the decision --------------------------------------------------------------------------------------------


def reconcile(obs: Observation, settings: ReconcileSettings | None = None) -> Decision:
    """Decide the actions and the new status for one job. Pure: same observation, same decision."""
    settings = settings or ReconcileSettings()
    job = obs.job
    old = job.status
    status = old.model_copy(deep=True)
    w = Work(obs, settings, status)
    if job.deleting:
        return Decision((), old, None)
    if naming.job_name_problem(job.name) is None:
        status.selector = naming.selector(job.name)

    if job.spec is None:
        _invalid_spec(w, job.spec_problem)
    elif old.phase is not None and old.phase.finished:
        _finished(w, job.spec)
    elif (refused := refused_template(job.spec, settings)) is not None:
        _invalid_spec(w, refused)
    else:
        # Both conditions are kept up to date; either one holds back every action until it clears.
        blocked = [etcd_access(w), ownership(w)]
        if not any(blocked):
            _active(w, job.spec)

    return _finish(w)


def _finish(w: Work) -> Decision:
    """Append events and the (rate-limited) status patch; pick the requeue time."""
    old = w.obs.job.status
    status = w.status
    if status.phase != old.phase and status.phase is not None:
        detail = ""
        for c in reversed(status.conditions or []):
            if c.status == ConditionStatus.TRUE and c.reason:
                detail = f" ({c.reason}: {c.message})" if c.message else f" ({c.reason})"
                break
        w.event("Warning" if status.phase == Phase.FAILED else "Normal", f"Phase{status.phase.value}",
                f"phase {old.phase.value if old.phase else 'None'} -> {status.phase.value}{detail}")
    if w.obs.job.spec is not None:
        status.observed_generation = w.obs.job.generation
        if status.restarts is None:
            status.restarts = RestartCounts()  # RESTARTS shows 0, not a blank, from the start
    # Re-validate so derived fields (totalRestarts) follow the counters.
    status = TrainingJobStatus.model_validate(status.model_dump())
    actions: list[Action] = [*w.actions, *w.events]
    written = w.obs.written_status if w.obs.written_status is not None else old
    changed = status != written
    order = _APPLY_ORDER
    if changed:
        last = w.obs.last_status_patch
        wait = 0.0 if last is None else w.settings.status_interval - (w.now - last)
        # A new replacement is written at once, and before the replacement pods are created: the count and the
        # tracked pods are durable (or the patch conflicts and nothing is created) before anything depends on
        # them, so an operator that restarts or loses a race can neither miss the replacement nor count it twice.
        replaced = _replacements(status) != _replacements(written)
        if wait <= 0 or replaced:
            actions.append(PatchStatus(status))
        else:
            w.wake_in(wait)
        if replaced:
            order = _APPLY_ORDER_COUNTED
    requeue = min(w.requeue) if w.requeue else None
    actions.sort(key=lambda a: order.index(type(a)))
    return Decision(tuple(actions), status, requeue)


def _replacements(status: TrainingJobStatus) -> int:
    return status.restarts.pod_replacements if status.restarts is not None else 0


#: The order actions are applied in: owned objects before pods that mount the Secret; fences before any pod is
#: created (a lost pod is fenced before its replacement can join; its fence record before its lease's
#: revocation, so an agent that registers again at once already meets the record); the record before the pods
#: that read it; the status after the changes it describes. The sort is stable, so pods keep their decided order.
_APPLY_ORDER: tuple[type, ...] = (EnsureOwnedObjects, SyncPodGroup, WriteFence, RevokeLease, DeletePod,
                                  WriteJobRecord, CreatePod, CloseRendezvous, PatchStatus, EmitEvent, DeleteJob)
#: The order when the decision counts new pod replacements: the status (the count) before the pods.
_APPLY_ORDER_COUNTED: tuple[type, ...] = (EnsureOwnedObjects, SyncPodGroup, WriteFence, RevokeLease, DeletePod,
                                          WriteJobRecord, PatchStatus, CreatePod, CloseRendezvous, EmitEvent,
                                          DeleteJob)


def refused_template(spec: TrainingJobSpec, settings: ReconcileSettings) -> tuple[str, str] | None:
    """``(field path, message)`` when the pods the template makes (with the operator's defaults) break the Pod
    Security Standards level the operator holds them to (the first such field, the others named in the
    message)."""
    if settings.pod_security == PodSecurity.OFF:
        return None
    template = spec.template.model_dump(mode="json", by_alias=True, exclude_none=True)
    pod_spec = with_defaults(template.get("spec") or {}, shm_size=spec.shm_size)
    problems = pod_security_problems(pod_spec, settings.pod_security, template.get("metadata"))
    if not problems:
        return None
    (path, message), others = problems[0], [p for p, _ in problems[1:]]
    return path, message + (f" (also: {', '.join(others)})" if others else "")


def _invalid_spec(w: Work, problem: tuple[str, str] | None) -> None:
    field_, message = problem or ("spec", "does not validate")
    text = f"spec.{field_}: {message}" if not field_.startswith("spec") else f"{field_}: {message}"
    existing = condition(w.status, ConditionType.FAILED)
    if w.status.phase != Phase.FAILED or existing is None or existing.reason != REASON_INVALID_SPEC \
            or existing.message != text:
        w.status.phase = Phase.FAILED
        w.cond(ConditionType.FAILED, ConditionStatus.TRUE, REASON_INVALID_SPEC, text)
        w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, REASON_INVALID_SPEC, text)
        if w.status.completion_time is None:
            w.status.completion_time = to_time(w.now)
        w.event("Warning", REASON_INVALID_SPEC, text)
    w.status.tracked_pods = None
    # Pods of a job whose spec broke after it started cannot be reconciled: stop them.
    for pod in w.obs.pods:
        if not pod.deleting and not pod.finished:
            w.fence(pod.name)
            w.actions.append(DeletePod(pod.name, w.settings.delete_grace_seconds, REASON_INVALID_SPEC))


def _finished(w: Work, spec: TrainingJobSpec) -> None:
    policy = spec.run_policy.clean_pod_policy
    w.status.tracked_pods = None  # nothing counts once the job is over
    # The pod counts keep following the pods (finished pods are not ready), and nothing is stalled any more.
    count_pods(w, [p for p in w.obs.pods if not p.deleting])
    if condition(w.status, ConditionType.STALLED) is not None:
        w.cond(ConditionType.STALLED, ConditionStatus.FALSE, "Finished", "the job is over")
    lingering_over(w)
    deleted = {a.name for a in w.actions if isinstance(a, DeletePod)}  # lingering pods, deleted as such
    for pod in w.obs.pods:
        if pod.deleting or pod.name in deleted:
            continue
        if policy == CleanPodPolicy.ALL or (policy == CleanPodPolicy.RUNNING and not pod.finished):
            w.actions.append(DeletePod(pod.name, w.settings.delete_grace_seconds, "CleanPodPolicy"))
    if w.obs.etcd.reachable and not w.obs.etcd.closed:
        w.actions.append(CloseRendezvous(f"job {w.status.phase.value if w.status.phase else 'finished'}"))
    ttl = spec.run_policy.ttl_seconds_after_finished
    done = from_time(w.status.completion_time)
    if ttl is not None and done is not None:
        left = done + ttl - w.now
        if left <= 0:
            w.actions.append(DeleteJob())
        else:
            w.wake_in(left)


def _active(w: Work, spec: TrainingJobSpec) -> None:
    """A job that is neither finished nor invalid."""
    obs = w.obs
    st = w.status
    _fold_etcd(w)
    # The gang's minimum follows spec.minReplicas as it is edited; spares are not counted (a job runs without
    # them, and a replacement pod joins a group whose other pods are bound already).
    if obs.gang_scheduled and obs.pod_group_min_member != spec.min_nodes:
        w.actions.append(SyncPodGroup(spec.min_nodes))

    # Deadline, counted from startTime (reset by suspension, as for Kubernetes Jobs).
    deadline = spec.run_policy.active_deadline_seconds
    started = from_time(st.start_time)
    if deadline is not None and started is not None and not spec.run_policy.suspend:
        left = started + deadline - w.now
        if left <= 0:
            fail(w, REASON_DEADLINE, f"the job ran longer than activeDeadlineSeconds ({deadline}s)")
            _finished(w, spec)
            return
        w.wake_in(left)

    if spec.run_policy.suspend:
        suspend(w)
        return
    if st.phase == Phase.SUSPENDED:
        st.phase = Phase.PENDING
        w.cond(ConditionType.SUSPENDED, ConditionStatus.FALSE, REASON_RESUMED, "runPolicy.suspend is false")
        w.event("Normal", REASON_RESUMED, "the job was resumed; recreating its pods")

    # Pods stuck terminating: force-delete them (their node is likely gone).
    for pod in obs.pods:
        if pod.deleting_since is not None and not pod.finished:
            if pod.deletion_grace > 0 and on_unreachable_node(pod, obs):
                force_delete_unreachable(w, pod)
                continue
            overdue = pod.deleting_since + pod.deletion_grace + w.settings.terminating_grace_limit - w.now
            if overdue <= 0 and pod.deletion_grace > 0:
                w.fence(pod.name)
                w.actions.append(DeletePod(pod.name, 0, "StuckTerminating"))
                w.event("Warning", "ForceDeleted",
                        f"pod {pod.name} was still terminating {pod.deletion_grace:g}s + "
                        f"{w.settings.terminating_grace_limit:g}s after its deletion; force-deleted")
            elif pod.deletion_grace > 0:
                w.wake_in(overdue)

    # Pods that disappeared: tracked, and now absent from the API altogether (force-deleted with no grace
    # period, or deleted while no operator watched). Fenced at once: a force-deleted pod's processes may
    # outlive its API object.
    present = {p.name for p in obs.pods}
    vanished = [name for name in st.tracked_pods or [] if name not in present]
    for name in [*vanished, *strangers(obs)]:
        w.fence(name)

    # Failed and lost pods: fence, delete, decide. ``leaving`` are pods being deleted (by someone else, or by
    # us for a scale-down or a suspension): they count as losses only once the job has started.
    casualties: list[str] = []
    leaving: list[str] = []
    facts: list[tuple[str, Fact]] = []  # (pod, what happened to it)
    lost_alive = lost_pods(obs)
    if (again := recheck_in(obs)) is not None:
        w.wake_in(again)
    for pod in obs.pods:
        if pod.deleting and not pod.finished:
            w.fence(pod.name)
            leaving.append(pod.name)
            continue
        if pod.phase != "Failed" and pod.name not in lost_alive:
            continue
        if pod.deleting:
            continue
        reason = failure_reason(pod, pod.name in lost_alive, on_unreachable_node(pod, obs))
        action = failure_action(spec.restart_policy.rules, reason, pod.exit_code)
        detail = lost_alive.get(pod.name) or (
            f"exit code {pod.exit_code}" if pod.exit_code is not None else (pod.message or reason.value))
        message = lost_alive.get(pod.name) or pod_message(pod, reason)
        facts.append((pod.name, pod_fact(w, pod.name, reason.value, message, pod.exit_code)))
        w.fence(pod.name)
        # A node that is gone cannot confirm a graceful deletion.
        node_gone = on_unreachable_node(pod, obs) or pod.reason == "NodeLost"
        w.actions.append(DeletePod(pod.name, 0 if node_gone else w.settings.delete_grace_seconds,
                                   reason.value))
        if action == FailureAction.FAIL_JOB:
            by_rule = any(rule_matches(r, reason, pod.exit_code) for r in spec.restart_policy.rules)
            verdict = None if by_rule else rank_verdict(pod.name, pod.exit_code, w.obs.etcd.progress, w.now)
            if verdict is not None:  # the ranks gave up: say why, with the failure they last saw
                st.last_failure = verdict.last_failure
                fail(w, verdict.reason, verdict.message)
                w.event("Warning", verdict.reason, verdict.message)
            else:
                st.last_failure = FailureRecord(pod=pod.name, reason=reason.value,
                                                message=pod_message(pod, reason), exit_code=pod.exit_code,
                                                detected_by="Pod", time=to_time(w.now))
                fail(w, REASON_FAIL_RULE if by_rule else REASON_NON_RETRYABLE,
                      f"pod {pod.name} failed ({reason.value}, {detail})")
            _finished(w, spec)
            return
        w.event("Warning", "PodFailed", f"pod {pod.name} failed ({reason.value}, {detail}); "
                f"{'replacing it' if action == FailureAction.REPLACE_POD else 'restarting in process'}")
        # RestartInProcess: the survivors restart in process (the agents count it against maxRestarts);
        # the pod is still replaced through the deficit below, without counting against backoffLimit.
        if action != FailureAction.RESTART_IN_PROCESS:
            casualties.append(pod.name)

    # Success: from the pods that exited, else from the ranks' reports once the pods had time to exit.
    if succeeded(w, spec) or lingered(w, spec):
        _finished(w, spec)
        return
    any_succeeded = any(p.phase == "Succeeded" for p in obs.pods)

    # Scale: delete the surplus, create the deficit.
    live = [p for p in obs.pods if is_live(p, lost_alive)]
    desired = spec.replicas + spec.spares
    if len(live) > desired:
        surplus = sorted(live, key=lambda p: keep_rank(w, p))[: len(live) - desired]
        for pod in surplus:
            w.fence(pod.name)
            w.actions.append(DeletePod(pod.name, w.settings.delete_grace_seconds, "ScaleDown"))
        live = [p for p in live if p not in surplus]
    deficit = desired - len(live)
    created: list[CreatePod] = []
    deferred = False
    job_started = st.phase in (Phase.STARTING, Phase.RUNNING, Phase.RESTARTING)
    if deficit > 0 and not any_succeeded:
        casualties += [*leaving, *vanished] if job_started else []
        counted = min(deficit, len(casualties))
        if counted and not obs.etcd.reachable:
            # Fencing needs etcd: a replacement must not join while the lost pod may still hold its lease.
            w.wake_in(w.settings.status_interval)
            counted = deficit = 0
            deferred = True
        restarts = st.restarts or RestartCounts()
        if counted and restarts.pod_replacements + counted > spec.restart_policy.backoff_limit:
            fail(w, REASON_BACKOFF,
                  f"replacing {counted} more pod(s) would exceed backoffLimit "
                  f"({spec.restart_policy.backoff_limit}); {restarts.pod_replacements} replaced so far")
            _finished(w, spec)
            return
        created = new_pods(w, spec, deficit, counted)
        if counted:
            st.restarts = restarts.model_copy(update={"pod_replacements": restarts.pod_replacements + counted})
            for name in casualties[:counted]:
                if name in leaving:
                    grace = next((p.deletion_grace for p in obs.pods if p.name == name), 0.0)
                    facts.append((name, pod_fact(w, name, FailureReason.POD_LOST.value,
                                                  f"the pod was deleted (grace period {grace:g}s)")))
            lost = ", ".join(casualties[:counted])
            news = ", ".join(c.name for c in created[:counted])
            w.event("Normal", "PodReplaced", f"replaced {lost} with {news}")
        w.actions.extend(created)
    # From the pods, not only from the decision that created them: a status write refused for a conflict is
    # decided again, when the pods exist already.
    existing = len(created) + sum(1 for p in obs.pods if not p.deleting)
    if existing and st.start_time is None:
        st.start_time = to_time(w.now)
    if existing and condition(st, ConditionType.CREATED) is None:
        w.cond(ConditionType.CREATED, ConditionStatus.TRUE, "PodsCreated", f"{existing} pod(s) created")

    if not obs.owned_objects_ready:
        w.actions.insert(0, EnsureOwnedObjects())

    if vanished and not deferred:
        for name in vanished:
            w.event("Warning", REASON_DISAPPEARED,
                    f"pod {name} disappeared from the API without a deletion the operator saw (force-deleted?)")
            if job_started:
                facts.append((name, pod_fact(
                    w, name, FailureReason.POD_LOST.value,
                    "the pod disappeared (deleted without a termination the operator saw)")))
    # A vanished pod whose replacement waits for etcd stays tracked, so it is counted when etcd is back.
    track(w, vanished if deferred else ())
    follow_record(w, live, created)
    count_pods(w, live)
    training(w, spec, live, facts, frozenset(vanished) if not deferred else frozenset())


def _fold_etcd(w: Work) -> None:
    """Round and world size from the sealed manifest."""
    etcd = w.obs.etcd
    if etcd.reachable and etcd.manifest is not None:
        w.status.round = etcd.manifest.round
        w.status.world_size = etcd.manifest.world_size
