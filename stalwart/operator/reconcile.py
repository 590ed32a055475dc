"""The operator's decision: one pure function from an :class:`Observation` to a :class:`Decision`.

``reconcile(obs, settings)`` looks at the job, its pods, its etcd records and the clock, and returns the
actions that move the world towards the spec plus the status that describes it. It never does I/O and never
reads the clock itself, so every phase transition and failure path is a table row in the unit tests.

Rules it implements, in the order it applies them:

1. A job being deleted is left to the finalizer (which deletes the etcd prefix).
2. A spec that does not validate ends the job ``Failed`` with an ``InvalidSpec`` condition and one Event.
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
7. ``successPolicy`` decides success from pods that exited 0.
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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from stalwart.api import naming
from stalwart.api.exit_codes import Disposition, disposition
from stalwart.api.spec import (
    CleanPodPolicy,
    ExitCodeOperator,
    FailureAction,
    FailureReason,
    FailureRule,
    SuccessPolicy,
    TrainingJobSpec,
)
from stalwart.api.status import (
    Condition,
    ConditionStatus,
    ConditionType,
    FailureRecord,
    Phase,
    Progress,
    RestartCounts,
    TrainingJobStatus,
)
from stalwart.operator.failures import Fact
from stalwart.operator.incidents import REASON_DISAPPEARED, assess
from stalwart.operator.ledger import advance, round_facts
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
    OperatorSettings,
    PatchStatus,
    PodView,
    RevokeLease,
    WriteJobRecord,
)
from stalwart.operator.node_loss import lost_pods, on_unreachable_node, recheck_in, strangers
from stalwart.operator.rank_failures import rank_verdict
from stalwart.operator.takeover import REASON_SPARE_TOOK_OVER, takeovers

#: Condition reasons the operator sets (the ``reason`` of conditions and Events).
REASON_INVALID_SPEC = "InvalidSpec"
REASON_DEADLINE = "DeadlineExceeded"
REASON_BACKOFF = "BackoffLimitExceeded"
REASON_FAIL_RULE = "FailJobRule"
REASON_NON_RETRYABLE = "NonRetryableExit"
REASON_SUCCEEDED = "SucceededPerPolicy"
REASON_SUSPENDED = "Suspended"
REASON_RESUMED = "Resumed"
REASON_UNSCHEDULABLE = "Unschedulable"
__all__ = ["REASON_DISAPPEARED", "condition", "failure_action", "failure_reason", "reconcile", "set_condition"]


def to_time(t: float) -> datetime:
    """Unix seconds as an aware UTC datetime, truncated to whole seconds as Kubernetes timestamps are."""
    return datetime.fromtimestamp(int(t), UTC)


def from_time(t: datetime | None) -> float | None:
    return None if t is None else t.timestamp()


# -- failure classification ----------------------------------------------------------------------------------


def failure_reason(pod: PodView, lost: bool = False, node_lost: bool = False) -> FailureReason:
    """The FailureReason of a failed pod, or of one ``lost`` (see ``node_loss.lost_pods``; ``node_lost``: its node
    is unreachable)."""
    if pod.reason in ("Evicted", "Preempting", "Preempted", "DeadlineExceeded"):
        return FailureReason.EVICTED
    if pod.reason == "OOMKilled":
        return FailureReason.OOM_KILLED
    if pod.reason == "NodeLost" or node_lost:
        return FailureReason.NODE_LOST
    if lost or pod.deleting:
        return FailureReason.POD_LOST
    return FailureReason.PROCESS_EXITED


def _rule_matches(rule: FailureRule, reason: FailureReason, exit_code: int | None) -> bool:
    """A rule matches when any of its matchers does (onExitCodes needs a known exit code)."""
    if rule.on_reasons is not None and (reason in rule.on_reasons or (
            reason == FailureReason.NODE_LOST and FailureReason.POD_LOST in rule.on_reasons)):
        return True
    if rule.on_exit_codes is not None and exit_code is not None:
        listed = exit_code in rule.on_exit_codes.values
        return listed if rule.on_exit_codes.operator == ExitCodeOperator.IN else not listed
    return False


def failure_action(rules: Sequence[FailureRule], reason: FailureReason,
                   exit_code: int | None) -> FailureAction:
    """What to do about a pod that failed or was lost: the first matching rule's action; without one, the
    agent's exit code decides (codes that mean "retrying cannot help", e.g. restarts exhausted or
    NonRetryable, fail the job) and everything else replaces the pod."""
    for rule in rules:
        if _rule_matches(rule, reason, exit_code):
            return rule.action
    if reason == FailureReason.PROCESS_EXITED and exit_code in _EXPLICIT_JOB_FAILURES:
        return FailureAction.FAIL_JOB
    return FailureAction.REPLACE_POD


def _explicit_job_failures() -> frozenset[int]:
    from stalwart.api.exit_codes import ExitCode

    return frozenset(c.value for c in ExitCode
                     if c is not ExitCode.FAILED and disposition(c.value) == Disposition.JOB_FAILURE)


#: Exit codes documented as job failures (restarts exhausted, NonRetryable). Other codes, FAILED (1) among
#: them, fall to JOB_FAILURE in ``disposition`` only because the agent retried them locally first; at the pod
#: level they still deserve a new pod while backoffLimit lasts.
_EXPLICIT_JOB_FAILURES = _explicit_job_failures()


# -- small helpers -------------------------------------------------------------------------------------------


def set_condition(conditions: list[Condition], type_: str, status: ConditionStatus, *, reason: str,
                  message: str, now: float, generation: int) -> list[Condition]:
    """``conditions`` with ``type_`` set; lastTransitionTime moves only when the status changes."""
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type != type_:
            out.append(c)
            continue
        found = True
        changed = c.status != status
        out.append(Condition(
            type=type_, status=status, reason=reason, message=message,
            last_transition_time=to_time(now) if changed or c.last_transition_time is None
            else c.last_transition_time,
            observed_generation=generation))
    if not found:
        out.append(Condition(type=type_, status=status, reason=reason, message=message,
                             last_transition_time=to_time(now), observed_generation=generation))
    return out


def condition(status: TrainingJobStatus, type_: str) -> Condition | None:
    for c in status.conditions or []:
        if c.type == type_:
            return c
    return None


def _is_live(pod: PodView, lost: Mapping[str, str]) -> bool:
    """A pod that counts towards replicas + spares: not finished, not being deleted, not lost."""
    return not pod.deleting and not pod.finished and pod.name not in lost


@dataclass
class _Work:
    """Mutable scratch of one reconcile (local to the function; never escapes it)."""

    obs: Observation
    settings: OperatorSettings
    status: TrainingJobStatus
    actions: list[Action] = field(default_factory=list)
    events: list[EmitEvent] = field(default_factory=list)
    requeue: list[float] = field(default_factory=list)

    @property
    def now(self) -> float:
        return self.obs.now

    def cond(self, type_: str, status: ConditionStatus, reason: str, message: str) -> None:
        self.status.conditions = set_condition(list(self.status.conditions or []), type_, status,
                                               reason=reason, message=message, now=self.now,
                                               generation=self.obs.job.generation)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(EmitEvent("Warning" if type_ == "Warning" else "Normal", reason, message))

    def wake_in(self, seconds: float) -> None:
        self.requeue.append(max(0.0, seconds))

    def fence(self, pod_name: str) -> None:
        lease = self.obs.etcd.leases.get(pod_name)
        if lease is not None and not any(isinstance(a, RevokeLease) and a.node_id == pod_name
                                         for a in self.actions):
            self.actions.append(RevokeLease(pod_name, lease))


# -- the decision --------------------------------------------------------------------------------------------


def reconcile(obs: Observation, settings: OperatorSettings | None = None) -> Decision:
    """Decide the actions and the new status for one job. Pure: same observation, same decision."""
    settings = settings or OperatorSettings()
    job = obs.job
    old = job.status
    status = old.model_copy(deep=True)
    w = _Work(obs, settings, status)
    if job.deleting:
        return Decision((), old, None)
    if naming.job_name_problem(job.name) is None:
        status.selector = naming.selector(job.name)

    if job.spec is None:
        _invalid_spec(w)
    elif old.phase is not None and old.phase.finished:
        _finished(w, job.spec)
    else:
        _active(w, job.spec)

    return _finish(w)


def _finish(w: _Work) -> Decision:
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
#: created (a lost pod is fenced before its replacement can join); the record before the pods that read it;
#: the status after the changes it describes. The sort is stable, so pods keep their decided order.
_APPLY_ORDER: tuple[type, ...] = (EnsureOwnedObjects, RevokeLease, DeletePod, WriteJobRecord, CreatePod,
                                  CloseRendezvous, PatchStatus, EmitEvent, DeleteJob)
#: The order when the decision counts new pod replacements: the status (the count) before the pods.
_APPLY_ORDER_COUNTED: tuple[type, ...] = (EnsureOwnedObjects, RevokeLease, DeletePod, WriteJobRecord, PatchStatus,
                                          CreatePod, CloseRendezvous, EmitEvent, DeleteJob)


def _invalid_spec(w: _Work) -> None:
    field_, message = w.obs.job.spec_problem or ("spec", "does not validate")
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


def _finished(w: _Work, spec: TrainingJobSpec) -> None:
    policy = spec.run_policy.clean_pod_policy
    w.status.tracked_pods = None  # nothing counts once the job is over
    # The pod counts keep following the pods (finished pods are not ready), and nothing is stalled any more.
    _count_pods(w, [p for p in w.obs.pods if not p.deleting])
    if condition(w.status, ConditionType.STALLED) is not None:
        w.cond(ConditionType.STALLED, ConditionStatus.FALSE, "Finished", "the job is over")
    for pod in w.obs.pods:
        if pod.deleting:
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


def _fail(w: _Work, reason: str, message: str) -> None:
    _tally(w)  # a failed job is not looked at again: count what its ranks ran up to now
    w.status.phase = Phase.FAILED
    w.status.completion_time = to_time(w.now)
    w.cond(ConditionType.FAILED, ConditionStatus.TRUE, reason, message)
    w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, reason, message)
    w.cond(ConditionType.RESTARTING, ConditionStatus.FALSE, reason, message)


def _tally(w: _Work) -> None:
    """Add the restarts the ranks ran since the counted position (see :mod:`.ledger`)."""
    etcd = w.obs.etcd
    if not etcd.reachable or w.obs.job.spec is None:
        return
    st = w.status
    t = advance(st.position, round_facts(etcd.progress), None, False)
    restarts = st.restarts or RestartCounts()
    st.restarts = restarts.model_copy(update={"in_process": restarts.in_process + t.in_process,
                                              "process_restarts": restarts.process_restarts + t.process_restarts})
    st.position = t.position


def _succeed(w: _Work, message: str) -> None:
    w.status.phase = Phase.SUCCEEDED
    w.status.completion_time = to_time(w.now)
    w.cond(ConditionType.SUCCEEDED, ConditionStatus.TRUE, REASON_SUCCEEDED, message)
    w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, REASON_SUCCEEDED, message)
    w.cond(ConditionType.RESTARTING, ConditionStatus.FALSE, REASON_SUCCEEDED, message)


def _active(w: _Work, spec: TrainingJobSpec) -> None:
    """A job that is neither finished nor invalid."""
    obs = w.obs
    st = w.status
    _fold_etcd(w)

    # Deadline, counted from startTime (reset by suspension, as for Kubernetes Jobs).
    deadline = spec.run_policy.active_deadline_seconds
    started = from_time(st.start_time)
    if deadline is not None and started is not None and not spec.run_policy.suspend:
        left = started + deadline - w.now
        if left <= 0:
            _fail(w, REASON_DEADLINE, f"the job ran longer than activeDeadlineSeconds ({deadline}s)")
            _finished(w, spec)
            return
        w.wake_in(left)

    if spec.run_policy.suspend:
        _suspend(w)
        return
    if st.phase == Phase.SUSPENDED:
        st.phase = Phase.PENDING
        w.cond(ConditionType.SUSPENDED, ConditionStatus.FALSE, REASON_RESUMED, "runPolicy.suspend is false")
        w.event("Normal", REASON_RESUMED, "the job was resumed; recreating its pods")

    # Pods stuck terminating: force-delete them (their node is likely gone).
    for pod in obs.pods:
        if pod.deleting_since is not None and not pod.finished:
            if pod.deletion_grace > 0 and on_unreachable_node(pod, obs):
                _force_delete_unreachable(w, pod)
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
        message = lost_alive.get(pod.name) or _pod_message(pod, reason)
        facts.append((pod.name, _pod_fact(w, pod.name, reason.value, message, pod.exit_code)))
        w.fence(pod.name)
        # A node that is gone cannot confirm a graceful deletion.
        node_gone = on_unreachable_node(pod, obs) or pod.reason == "NodeLost"
        w.actions.append(DeletePod(pod.name, 0 if node_gone else w.settings.delete_grace_seconds,
                                   reason.value))
        if action == FailureAction.FAIL_JOB:
            by_rule = any(_rule_matches(r, reason, pod.exit_code) for r in spec.restart_policy.rules)
            verdict = None if by_rule else rank_verdict(pod.name, pod.exit_code, w.obs.etcd.progress, w.now)
            if verdict is not None:  # the ranks gave up: say why, with the failure they last saw
                st.last_failure = verdict.last_failure
                _fail(w, verdict.reason, verdict.message)
                w.event("Warning", verdict.reason, verdict.message)
            else:
                st.last_failure = FailureRecord(pod=pod.name, reason=reason.value,
                                                message=_pod_message(pod, reason), exit_code=pod.exit_code,
                                                detected_by="Pod", time=to_time(w.now))
                _fail(w, REASON_FAIL_RULE if by_rule else REASON_NON_RETRYABLE,
                      f"pod {pod.name} failed ({reason.value}, {detail})")
            _finished(w, spec)
            return
        w.event("Warning", "PodFailed", f"pod {pod.name} failed ({reason.value}, {detail}); "
                f"{'replacing it' if action == FailureAction.REPLACE_POD else 'restarting in process'}")
        # RestartInProcess: the survivors restart in process (the agents count it against maxRestarts);
        # the pod is still replaced through the deficit below, without counting against backoffLimit.
        if action != FailureAction.RESTART_IN_PROCESS:
            casualties.append(pod.name)

    # Success.
    if _succeeded(w, spec):
        _finished(w, spec)
        return
    any_succeeded = any(p.phase == "Succeeded" for p in obs.pods)

    # Scale: delete the surplus, create the deficit.
    live = [p for p in obs.pods if _is_live(p, lost_alive)]
    desired = spec.replicas + spec.spares
    if len(live) > desired:
        surplus = sorted(live, key=lambda p: _keep_rank(w, p))[: len(live) - desired]
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
            _fail(w, REASON_BACKOFF,
                  f"replacing {counted} more pod(s) would exceed backoffLimit "
                  f"({spec.restart_policy.backoff_limit}); {restarts.pod_replacements} replaced so far")
            _finished(w, spec)
            return
        created = _new_pods(w, spec, deficit, counted)
        if counted:
            st.restarts = restarts.model_copy(update={"pod_replacements": restarts.pod_replacements + counted})
            for name in casualties[:counted]:
                if name in leaving:
                    grace = next((p.deletion_grace for p in obs.pods if p.name == name), 0.0)
                    facts.append((name, _pod_fact(w, name, FailureReason.POD_LOST.value,
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
                facts.append((name, _pod_fact(
                    w, name, FailureReason.POD_LOST.value,
                    "the pod disappeared (deleted without a termination the operator saw)")))
    # A vanished pod whose replacement waits for etcd stays tracked, so it is counted when etcd is back.
    _track(w, vanished if deferred else ())
    _record(w, live, created)
    _count_pods(w, live)
    _training(w, spec, live, facts, frozenset(vanished) if not deferred else frozenset())


def _pod_fact(w: _Work, pod: str, reason: str, message: str, exit_code: int | None = None) -> Fact:
    return Fact("Pod", reason, w.now, pod=pod, message=message, exit_code=exit_code)


def _pod_message(pod: PodView, reason: FailureReason) -> str:
    if reason == FailureReason.NODE_LOST:
        return f"its node {pod.node or ''} was lost ({pod.message or pod.reason or 'unreachable'})".replace("  ", " ")
    if pod.exit_code is not None:
        return f"the pod's trainer exited with code {pod.exit_code}" + (f": {pod.message}" if pod.message else "")
    return pod.message or pod.reason or reason.value


def _force_delete_unreachable(w: _Work, pod: PodView) -> None:
    """A pod Terminating on an unreachable node: no kubelet there will confirm the deletion, so it is fenced
    and force-deleted at once (its processes may live on behind a partition; the fence keeps them out)."""
    w.fence(pod.name)
    w.actions.append(DeletePod(pod.name, 0, "NodeUnreachable"))
    w.event("Warning", "ForceDeleted", f"pod {pod.name} was terminating on unreachable node {pod.node}; "
                                       "force-deleted")


def _track(w: _Work, keep: Iterable[str]) -> None:
    """``status.trackedPods``: the pods seen in the watch, alive, and not deleted by this decision, plus
    ``keep``."""
    deleted = {a.name for a in w.actions if isinstance(a, DeletePod)}
    names = {p.name for p in w.obs.pods if not p.assumed and not p.deleting and not p.finished
             and p.name not in deleted}
    names.update(keep)
    w.status.tracked_pods = sorted(names) or None


def _keep_rank(w: _Work, pod: PodView) -> tuple[int, int, int, int]:
    """Sort key: the pods to delete first on scale-down come first (not in the round, not running,
    highest index)."""
    manifest = w.obs.etcd.manifest
    member = manifest is not None and manifest.member(pod.name) is not None
    return (int(member), int(pod.phase == "Running"), int(pod.role == naming.ROLE_WORKER), -pod.index)


def _new_pods(w: _Work, spec: TrainingJobSpec, deficit: int, replacements: int) -> list[CreatePod]:
    """Names for ``deficit`` new pods: the first ``replacements`` are fresh spares (a replacement joins as a
    spare); the rest fill free worker slots 0..replicas-1, then free spare slots, then fresh spares."""
    taken = {p.name for p in w.obs.pods}
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


def _succeeded(w: _Work, spec: TrainingJobSpec) -> bool:
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
        _succeed(w, message)
    return ok


def _suspend(w: _Work) -> None:
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


def _fold_etcd(w: _Work) -> None:
    """Round and world size from the sealed manifest."""
    etcd = w.obs.etcd
    if etcd.reachable and etcd.manifest is not None:
        w.status.round = etcd.manifest.round
        w.status.world_size = etcd.manifest.world_size


def _record(w: _Work, live: Iterable[PodView], created: Sequence[CreatePod]) -> None:
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


def _count_pods(w: _Work, live: Sequence[PodView]) -> None:
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


def _training(w: _Work, spec: TrainingJobSpec, live: Sequence[PodView], facts: Sequence[tuple[str, Fact]],
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
    for message in takeovers(w.obs.job.status.round, manifest, w.obs.etcd.record, w.obs.etcd.progress,
                             st.last_failure, warm=spec.restart_policy.in_process.warm_spares):
        w.event("Normal", REASON_SPARE_TOOK_OVER, message)

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
