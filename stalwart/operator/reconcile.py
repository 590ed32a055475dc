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

from collections.abc import Iterable, Sequence
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
from stalwart.operator.rank_failures import rank_verdict

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
REASON_DISAPPEARED = "PodDisappeared"


def to_time(t: float) -> datetime:
    """Unix seconds as an aware UTC datetime, truncated to whole seconds as Kubernetes timestamps are."""
    return datetime.fromtimestamp(int(t), UTC)


def from_time(t: datetime | None) -> float | None:
    return None if t is None else t.timestamp()


# -- failure classification ----------------------------------------------------------------------------------


def failure_reason(pod: PodView) -> FailureReason:
    """The FailureReason of a failed or lost pod."""
    if pod.reason in ("Evicted", "Preempting", "Preempted", "DeadlineExceeded"):
        return FailureReason.EVICTED
    if pod.reason == "OOMKilled":
        return FailureReason.OOM_KILLED
    if pod.reason == "NodeLost" or pod.unreachable_since is not None or pod.deleting:
        return FailureReason.POD_LOST
    return FailureReason.PROCESS_EXITED


def _rule_matches(rule: FailureRule, reason: FailureReason, exit_code: int | None) -> bool:
    """A rule matches when any of its matchers does (onExitCodes needs a known exit code)."""
    if rule.on_reasons is not None and reason in rule.on_reasons:
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


def _is_live(pod: PodView, now: float, settings: OperatorSettings) -> bool:
    """A pod that counts towards replicas + spares: not finished, not being deleted, and its node not
    unreachable for longer than ``node_lost_after``."""
    lost = pod.unreachable_since is not None and now - pod.unreachable_since >= settings.node_lost_after
    return not pod.deleting and not pod.finished and not lost


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
    # Re-validate so derived fields (totalRestarts) follow the counters.
    status = TrainingJobStatus.model_validate(status.model_dump())
    actions: list[Action] = [*w.actions, *w.events]
    written = w.obs.written_status if w.obs.written_status is not None else old
    changed = status != written
    if changed:
        last = w.obs.last_status_patch
        wait = 0.0 if last is None else w.settings.status_interval - (w.now - last)
        # A new replacement is written at once: an operator that restarts reads the counter and the tracked
        # pods from the API, and the longer they lag, the likelier a replacement goes uncounted.
        replaced = _replacements(status) != _replacements(written)
        if wait <= 0 or replaced:
            actions.append(PatchStatus(status))
        else:
            w.wake_in(wait)
    requeue = min(w.requeue) if w.requeue else None
    actions.sort(key=lambda a: _APPLY_ORDER.index(type(a)))
    return Decision(tuple(actions), status, requeue)


def _replacements(status: TrainingJobStatus) -> int:
    return status.restarts.pod_replacements if status.restarts is not None else 0


#: The order actions are applied in: owned objects before pods that mount the Secret; fences before any pod is
#: created (a lost pod is fenced before its replacement can join); the record before the pods that read it;
#: the status after the changes it describes. The sort is stable, so pods keep their decided order.
_APPLY_ORDER: tuple[type, ...] = (EnsureOwnedObjects, RevokeLease, DeletePod, WriteJobRecord, CreatePod,
                                  CloseRendezvous, PatchStatus, EmitEvent, DeleteJob)


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
    w.status.phase = Phase.FAILED
    w.status.completion_time = to_time(w.now)
    w.cond(ConditionType.FAILED, ConditionStatus.TRUE, reason, message)
    w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, reason, message)
    w.cond(ConditionType.RESTARTING, ConditionStatus.FALSE, reason, message)


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
    for name in vanished:
        w.fence(name)

    # Failed and lost pods: fence, delete, decide. ``leaving`` are pods being deleted (by someone else, or by
    # us for a scale-down or a suspension): they count as losses only once the job has started.
    casualties: list[str] = []
    leaving: list[str] = []
    for pod in obs.pods:
        lost_node = pod.unreachable_since is not None and not pod.finished
        if lost_node and pod.unreachable_since is not None \
                and w.now - pod.unreachable_since < w.settings.node_lost_after:
            w.wake_in(pod.unreachable_since + w.settings.node_lost_after - w.now)
            continue
        if pod.deleting and not pod.finished:
            w.fence(pod.name)
            leaving.append(pod.name)
            continue
        if pod.phase != "Failed" and not lost_node:
            continue
        if pod.deleting:
            continue
        reason = failure_reason(pod)
        action = failure_action(spec.restart_policy.rules, reason, pod.exit_code)
        detail = f"exit code {pod.exit_code}" if pod.exit_code is not None else (pod.message or reason.value)
        st.last_failure = FailureRecord(pod=pod.name, reason=reason.value, message=detail, time=to_time(w.now))
        w.fence(pod.name)
        # A node that is gone cannot confirm a graceful deletion.
        node_gone = lost_node or pod.reason == "NodeLost"
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
    live = [p for p in obs.pods if _is_live(p, w.now, w.settings)]
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
            st.restarts = RestartCounts(in_process=restarts.in_process,
                                        pod_replacements=restarts.pod_replacements + counted)
            lost = ", ".join(casualties[:counted])
            news = ", ".join(c.name for c in created[:counted])
            w.event("Normal", "PodReplaced", f"replaced {lost} with {news}")
        w.actions.extend(created)
        if created and st.start_time is None:
            st.start_time = to_time(w.now)
        if created and condition(st, ConditionType.CREATED) is None:
            w.cond(ConditionType.CREATED, ConditionStatus.TRUE, "PodsCreated",
                   f"{len(created)} pod(s) created")

    if not obs.owned_objects_ready:
        w.actions.insert(0, EnsureOwnedObjects())

    if vanished and not deferred:
        _disappeared(w, vanished, job_started)
    # A vanished pod whose replacement waits for etcd stays tracked, so it is counted when etcd is back.
    _track(w, vanished if deferred else ())
    _record(w, live, created)
    _phase(w, spec, live, bool(casualties or leaving), set(vanished))


def _disappeared(w: _Work, vanished: Sequence[str], job_started: bool) -> None:
    """The Events (and, once the job started, the last failure) for pods that disappeared."""
    for name in vanished:
        w.event("Warning", REASON_DISAPPEARED,
                f"pod {name} disappeared from the API without a deletion the operator saw (force-deleted?)")
    if job_started:
        w.status.last_failure = FailureRecord(
            pod=vanished[-1], reason=FailureReason.POD_LOST.value,
            message="the pod disappeared (deleted without a termination the operator saw)", time=to_time(w.now))


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
    """Round, world size, progress, in-process restarts and the last failure from the agents' records."""
    etcd = w.obs.etcd
    st = w.status
    if not etcd.reachable:
        return
    if etcd.manifest is not None:
        st.round = etcd.manifest.round
        st.world_size = etcd.manifest.world_size
    steps = [p.step for p in etcd.progress if p.step is not None]
    if steps:
        newest = max(p.updated for p in etcd.progress if p.step is not None)
        st.progress = Progress(step=max(steps), updated=to_time(newest))
    restarts = st.restarts or RestartCounts()
    in_process = max([restarts.in_process, *[p.restarts_in_process for p in etcd.progress]])
    if in_process > restarts.in_process:
        failures = [p.last_failure for p in etcd.progress if p.last_failure is not None]
        last = max(failures, key=lambda f: f.time) if failures else None
        if last is not None:
            st.last_failure = FailureRecord(rank=last.rank, pod=last.pod or None, reason=last.reason or None,
                                            time=to_time(last.time))
        w.event("Normal", "RestartedInProcess",
                f"in-process restart #{in_process}" + (f" after {last.reason} on pod {last.pod}"
                                                        if last is not None and last.reason else ""))
        st.restarts = RestartCounts(in_process=in_process, pod_replacements=restarts.pod_replacements)


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


def _phase(w: _Work, spec: TrainingJobSpec, live: Sequence[PodView], lost_now: bool,
           vanished: set[str]) -> None:
    st = w.status
    etcd = w.obs.etcd
    running = [p for p in live if p.phase == "Running"]
    st.replicas = sum(1 for p in live if p.role == naming.ROLE_WORKER)
    ready = [p for p in running if p.ready]
    manifest = etcd.manifest
    if manifest is not None:
        in_round = {m.node_id for m in manifest.members}
        st.ready_replicas = sum(1 for p in ready if p.name in in_round)
        st.spare_replicas = sum(1 for p in ready if p.name not in in_round)
    else:
        st.ready_replicas = sum(1 for p in ready if p.role == naming.ROLE_WORKER)
        st.spare_replicas = sum(1 for p in ready if p.role != naming.ROLE_WORKER)
    unschedulable = [p.name for p in live if p.unschedulable]
    min_nodes = spec.min_nodes

    restarting_reason = ""
    disappeared = False
    if manifest is not None:
        live_running = {p.name for p in running}
        gone = [m.node_id for m in manifest.members if m.node_id not in live_running]
        if gone and (lost_now or vanished or any(n not in {p.name for p in live} for n in gone)):
            restarting_reason = f"member(s) {', '.join(gone[:5])} lost"
            # The reason stays PodDisappeared for the rest of that restart (the pod is untracked by then).
            before = condition(w.obs.job.status, ConditionType.RESTARTING)
            disappeared = any(n in vanished for n in gone) or (
                before is not None and before.status == ConditionStatus.TRUE
                and before.reason == REASON_DISAPPEARED and st.last_failure is not None
                and st.last_failure.pod in gone)
        current = [p for p in etcd.progress if p.epoch == etcd.epoch]
        if any(p.state == "restarting" and p.restarts_in_process > 0 for p in current):
            restarting_reason = restarting_reason or "in-process restart"
        if any(p.epoch < etcd.epoch and p.state == "joining" for p in etcd.progress) and not current:
            restarting_reason = restarting_reason or "new rendezvous round"

    if manifest is None or (not running and st.phase in (None, Phase.PENDING)):
        phase = Phase.STARTING if running else Phase.PENDING
    elif len(running) < min_nodes and not restarting_reason and st.phase not in (Phase.RUNNING,
                                                                                  Phase.RESTARTING):
        phase = Phase.STARTING
    elif restarting_reason or len(running) < min_nodes:
        phase = Phase.RESTARTING
    else:
        phase = Phase.RUNNING
    if phase in (Phase.PENDING, Phase.STARTING) and st.phase in (Phase.RUNNING, Phase.RESTARTING):
        phase = Phase.RESTARTING  # once started, a job that lost its round is restarting, not starting
        restarting_reason = restarting_reason or "waiting for the next rendezvous round"
    st.phase = phase

    if phase == Phase.RUNNING:
        w.cond(ConditionType.RUNNING, ConditionStatus.TRUE, "RoundSealed",
               f"round {manifest.round if manifest else '?'} with world size "
               f"{manifest.world_size if manifest else '?'}")
        w.cond(ConditionType.RESTARTING, ConditionStatus.FALSE, "RoundSealed", "training")
    elif phase == Phase.RESTARTING:
        w.cond(ConditionType.RESTARTING, ConditionStatus.TRUE,
               REASON_DISAPPEARED if disappeared else "PodLost" if "lost" in restarting_reason
               else "InProcessRestart", restarting_reason)
        w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, "Restarting", restarting_reason)
    elif phase == Phase.STARTING and unschedulable and len(live) - len(unschedulable) < min_nodes:
        w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, REASON_UNSCHEDULABLE,
               f"{len(unschedulable)} pod(s) cannot be scheduled ({', '.join(unschedulable[:5])}); "
               f"the job needs minReplicas={min_nodes}")
    elif phase == Phase.STARTING:
        w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, "GangStarting",
               f"{len(running)} of minReplicas={min_nodes} pod(s) running; waiting for the first round")
