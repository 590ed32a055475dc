"""The TrainingJob status: what the operator observed. Written only by the operator (status subresource)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field, model_validator

from stalwart.api.base import ApiModel


class Phase(StrEnum):
    """The job's phase, as ``kubectl get tj`` shows it."""

    PENDING = "Pending"  # accepted; pods not yet created or not yet scheduled
    STARTING = "Starting"  # pods exist; no training step has completed yet
    RUNNING = "Running"  # steps complete: the ranks reported progress within the soft timeout
    RESTARTING = "Restarting"  # a fault is known and training has not completed a step since
    SUCCEEDED = "Succeeded"  # finished per successPolicy
    FAILED = "Failed"  # budget exhausted, a FailJob rule, or the deadline passed
    SUSPENDED = "Suspended"  # runPolicy.suspend is true

    @property
    def finished(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class ConditionType(StrEnum):
    """The condition types the operator sets (Kubernetes convention: one condition per type)."""

    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    #: Nothing progressed for longer than the soft timeout (reason NoProgress; the message names the ranks).
    STALLED = "Stalled"
    #: The operator cannot reach the job's etcd; training may go on undisturbed, but its progress is unseen.
    COORDINATION_DEGRADED = "CoordinationDegraded"
    #: False while the job's etcd cannot be used with its credentials (the reason and message name the Secret's
    #: missing key or etcd's refusal); set True again once it can. No pod is created meanwhile.
    ETCD_ACCESS = "EtcdAccess"
    #: True while an object the job needs (its Secret, Service, a pod) has its name but is not the job's (the
    #: message names it); the operator leaves such an object alone.
    OWNERSHIP_CONFLICT = "OwnershipConflict"
    #: True when every rank the success policy names returned and a pod of theirs was still alive past the
    #: operator's linger limit (reason PodLingering; the message names the pods and whether they were
    #: deleted); False once no pod of the job is left running (reason LingeringPodsGone).
    PODS_LINGERING = "PodsLingering"
    #: True while a live pod reports that a parked process of it (a warm spare's, or its standby) ended before a
    #: round took it, its prepare hook having raised (reason PrepareHookRaised; the message names the pod and the
    #: exception); False once none does (reason NoPrepareFailure). The running job is not affected.
    PREPARE_FAILED = "PrepareFailed"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One aspect of the job's state (Kubernetes condition conventions)."""

    type: str = Field(description=("Condition type: Created, Running, Restarting, Succeeded, Failed, Suspended, "
                                   "Stalled, CoordinationDegraded, EtcdAccess, OwnershipConflict, PodsLingering, "
                                   "PrepareFailed."),
                      min_length=1, max_length=316)
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str | None = Field(
        default=None, max_length=1024,
        description="Machine-readable CamelCase reason for the last transition.")
    message: str | None = Field(
        default=None, max_length=32768, description="Human-readable details of the last transition.")
    last_transition_time: datetime | None = Field(
        default=None, description="When the status last changed.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation that the condition was set from.")


class RestartCounts(ApiModel):
    """Recoveries and pod replacements so far. One fault is one recovery, counted once: in ``inProcess`` when
    every surviving rank kept its process, else in ``processRestarts``."""

    in_process: int = Field(
        default=0, ge=0,
        description="Recoveries in which every surviving rank re-ran the training function in its own process.")
    process_restarts: int = Field(
        default=0, ge=0,
        description=("Recoveries that needed new rank processes: a rank process respawned, or every rank started "
                     "again in a new rendezvous round."))
    pod_replacements: int = Field(
        default=0, ge=0, description="Pods replaced after failures, whatever the recovery.")

    @property
    def total(self) -> int:
        """The recoveries (the RESTARTS column)."""
        return self.in_process + self.process_restarts


class SecondaryFailure(ApiModel):
    """An error seen during the same fault that did not cause it (e.g. a survivor's connection reset)."""

    rank: int | None = Field(default=None, ge=0, description="Global rank that saw it, when known.")
    pod: str | None = Field(default=None, description="Pod of that rank, when known.")
    reason: str | None = Field(default=None, description="What it was: Exception, Hang, ProcessExited...")
    message: str | None = Field(default=None, max_length=2048, description="Details.")


#: Most secondary errors kept in ``lastFailure.secondary``.
MAX_SECONDARY = 8


class FailureRecord(ApiModel):
    """The most recent fault, one record per fault, naming the culprit: the rank or pod that failed first."""

    rank: int | None = Field(default=None, ge=0, description="Global rank that failed, when known.")
    pod: str | None = Field(default=None, description="Pod that failed, when known.")
    reason: str | None = Field(
        default=None,
        description=("The kind of fault: Exception, Hang, ProcessExited, PodLost, NodeLost, PeerLost, OOMKilled, "
                     "Evicted, Unhealthy."))
    message: str | None = Field(default=None, max_length=32768,
                                description="Details, e.g. the exception's message or the exit code.")
    exception_type: str | None = Field(default=None, max_length=256,
                                       description="The exception's type name, for reason Exception.")
    exit_code: int | None = Field(default=None, description="Exit code of the process or container that ended.")
    signal: str | None = Field(default=None, max_length=16,
                               description="The signal that ended the process (e.g. SIGKILL), when one did.")
    detected_by: str | None = Field(
        default=None,
        description=("How the fault was detected: Pod (the operator saw the pod fail or go), Process (an agent "
                     "saw a rank process end), Heartbeat (a rank's heartbeat lease or the pod's agent's rendezvous "
                     "lease ran out), Peer (a survivor's collective error pointed at this lost peer), Rank (a rank "
                     "reported it), Progress (nothing progressed past the soft timeout)."))
    round: int | None = Field(default=None, ge=0, description="Rendezvous round in which it happened.")
    iteration: int | None = Field(default=None, ge=0,
                                  description="In-process restart iteration in which it happened.")
    time: datetime | None = Field(default=None, description="When the failure happened (or was detected).")
    peer: str | None = Field(
        default=None,
        description=("For a Hang on a link that stopped carrying data (sent bytes left unacknowledged: the network "
                     "between two pods, not either process): the pod at the link's other end. The fault is then "
                     "the link between ``pod`` and ``peer``."))
    secondary: list[SecondaryFailure] | None = Field(
        default=None, max_length=MAX_SECONDARY,
        description="Errors other ranks saw during the same fault (consequences, not the cause).")


class Position(ApiModel):
    """Where training stands: a rendezvous round and an in-process restart iteration within it."""

    round: int = Field(ge=0, description="Rendezvous round.")
    iteration: int = Field(ge=0, description="In-process restart iteration within the round (0 before any).")

    def key(self) -> tuple[int, int]:
        return (self.round, self.iteration)


class Progress(ApiModel):
    """Training progress as reported by the ranks."""

    step: int | None = Field(default=None, ge=0, description="Latest training step reported.")
    updated: datetime | None = Field(default=None, description="When that step completed.")


class PeerSnapshotStatus(ApiModel):
    """The job's peer snapshots (stalwart.restart.PeerSnapshots), as its ranks report them."""

    step: int | None = Field(
        default=None, ge=0,
        description="The newest step of which every rank's snapshot has landed on its buddy: a lost pod costs "
                    "the steps since. None: not every rank has one yet.")
    time: datetime | None = Field(default=None, description="When the last of those copies landed.")
    fallback: str | None = Field(
        default=None, max_length=300,
        description="Why the ranks' last restore found no peer snapshot covering every shard and left the state "
                    "to the checkpoint (a rank and its buddy both lost, another world size).")


class TrainingJobStatus(ApiModel):
    """The observed state of a TrainingJob."""

    phase: Phase | None = Field(
        default=None,
        description="Pending, Starting, Running, Restarting, Succeeded, Failed or Suspended.")
    conditions: list[Condition] | None = Field(
        default=None, description="Conditions, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation of the spec that this status reflects.")
    replicas: int | None = Field(default=None, ge=0, description="Worker pods that exist.")
    ready_replicas: int | None = Field(default=None, ge=0, description="Worker pods that are ready.")
    spare_replicas: int | None = Field(default=None, ge=0, description="Spare pods that are ready.")
    world_size: int | None = Field(
        default=None, ge=0, description="Ranks in the current rendezvous round (nodes x nprocPerNode).")
    round: int | None = Field(default=None, ge=0, description="Current rendezvous round.")
    restarts: RestartCounts | None = Field(default=None, description="Recoveries and pod replacements so far.")
    total_restarts: int | None = Field(
        default=None, ge=0,
        description=("restarts.inProcess + restarts.processRestarts (the recoveries), the RESTARTS printer "
                     "column (derived from restarts by the model)."))
    last_failure: FailureRecord | None = Field(default=None, description="The most recent failure.")
    progress: Progress | None = Field(default=None, description="Training progress.")
    peer_snapshot: PeerSnapshotStatus | None = Field(
        default=None, description="Peer snapshots of the ranks' state, when the training function takes them.")
    position: Position | None = Field(
        default=None,
        description=("Round and in-process iteration up to which the restart counters account for what the "
                     "ranks ran: each restart is counted once, as training moves past it (kept in the status so "
                     "that an operator that restarts neither loses nor repeats a count)."))
    start_time: datetime | None = Field(default=None, description="When the job first started running.")
    completion_time: datetime | None = Field(default=None, description="When the job finished.")
    selector: str | None = Field(
        default=None, description="Label selector of the worker pods (for the scale subresource).")
    promoted_spares: list[str] | None = Field(
        default=None,
        description=("Spare pods that have taken a lost worker's ranks, sorted: each is announced once, by the "
                     "SpareTookOver Event of the first round it is a member of."))
    tracked_pods: list[str] | None = Field(
        default=None,
        description=("Names of the job's pods the operator has seen alive and has not deleted itself, sorted. "
                     "One that disappears from the API (e.g. force-deleted) while the job runs counts once "
                     "in restarts.podReplacements."))

    @model_validator(mode="after")
    def _total(self) -> TrainingJobStatus:
        # Derived here so that the printer column can never disagree with restarts.
        self.total_restarts = self.restarts.total if self.restarts is not None else None
        return self
