"""The scratch of one reconcile and the small helpers every part of the decision shares: conditions, times,
the reasons the operator sets, and the outcomes that end a job (failed, succeeded).

:class:`Work` is mutable, but it lives only inside one call of :func:`~stalwart.operator.reconcile.reconcile`
and never escapes it: the decision stays a pure function of the observation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from stalwart.api.status import (
    Condition,
    ConditionStatus,
    ConditionType,
    Phase,
    RestartCounts,
    TrainingJobStatus,
)
from stalwart.operator.ledger import advance, round_facts
from stalwart.operator.model import (
    Action,
    EmitEvent,
    Observation,
    PodView,
    ReconcileSettings,
    RevokeLease,
    WriteFence,
)

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


def to_time(t: float) -> datetime:
    """Unix seconds as an aware UTC datetime, truncated to whole seconds as Kubernetes timestamps are."""
    return datetime.fromtimestamp(int(t), UTC)


def from_time(t: datetime | None) -> float | None:
    return None if t is None else t.timestamp()


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


def is_live(pod: PodView, lost: Mapping[str, str]) -> bool:
    """A pod that counts towards replicas + spares: not finished, not being deleted, not lost."""
    return not pod.deleting and not pod.finished and pod.name not in lost


@dataclass
class Work:
    """Mutable scratch of one reconcile (local to the function; never escapes it)."""

    obs: Observation
    settings: ReconcileSettings
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
        """Fence ``pod_name``: its fence record (when its uid is known: a pod still in the API; once: the view
        shows the records written), which no lease expiry undoes, and the revocation of its lease (when it holds
        one), which ends its round at once. Nothing while etcd cannot be read."""
        pod = next((p for p in self.obs.pods if p.name == pod_name and p.uid), None)
        if pod is not None and self.obs.etcd.reachable and pod.uid not in self.obs.etcd.fenced and not any(
                isinstance(a, WriteFence) and a.pod_uid == pod.uid for a in self.actions):
            unreachable = pod.node is not None and pod.node in self.obs.unreachable_nodes
            why = f"its node {pod.node} is unreachable" if unreachable else (pod.reason or "deleted by the operator")
            self.actions.append(WriteFence(pod_name, pod.uid, why))
        lease = self.obs.etcd.leases.get(pod_name)
        if lease is not None and not any(isinstance(a, RevokeLease) and a.node_id == pod_name
                                         for a in self.actions):
            self.actions.append(RevokeLease(pod_name, lease))


def fail(w: Work, reason: str, message: str) -> None:
    tally(w)  # a failed job is not looked at again: count what its ranks ran up to now
    w.status.phase = Phase.FAILED
    w.status.completion_time = to_time(w.now)
    w.cond(ConditionType.FAILED, ConditionStatus.TRUE, reason, message)
    w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, reason, message)
    w.cond(ConditionType.RESTARTING, ConditionStatus.FALSE, reason, message)


def tally(w: Work) -> None:
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


def succeed(w: Work, message: str) -> None:
    w.status.phase = Phase.SUCCEEDED
    w.status.completion_time = to_time(w.now)
    w.cond(ConditionType.SUCCEEDED, ConditionStatus.TRUE, REASON_SUCCEEDED, message)
    w.cond(ConditionType.RUNNING, ConditionStatus.FALSE, REASON_SUCCEEDED, message)
    w.cond(ConditionType.RESTARTING, ConditionStatus.FALSE, REASON_SUCCEEDED, message)
