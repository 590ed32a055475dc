"""The TrainingJob status: what the operator observed. Written only by the operator (status subresource)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field, model_validator

from stalwart.api.base import ApiModel


class Phase(StrEnum):
    """The job's phase, as ``kubectl get tj`` shows it."""

    PENDING = "Pending"  # accepted; pods not yet created or not yet scheduled
    STARTING = "Starting"  # pods exist; the first rendezvous round is not sealed yet
    RUNNING = "Running"  # a round is sealed and the ranks are training
    RESTARTING = "Restarting"  # a fault is being handled: in-process restart or a spare taking over
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


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One aspect of the job's state (Kubernetes condition conventions)."""

    type: str = Field(description="Condition type: Created, Running, Restarting, Succeeded, Failed, Suspended.",
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
    """Restarts so far."""

    in_process: int = Field(default=0, ge=0, description="In-process restarts of the job's ranks.")
    pod_replacements: int = Field(default=0, ge=0, description="Pods replaced after failures.")

    @property
    def total(self) -> int:
        return self.in_process + self.pod_replacements


class FailureRecord(ApiModel):
    """The most recent failure."""

    rank: int | None = Field(default=None, ge=0, description="Global rank that failed, when known.")
    pod: str | None = Field(default=None, description="Pod that failed, when known.")
    reason: str | None = Field(
        default=None, description="Why: Exception, Hang, ProcessExited, OOMKilled, Evicted, PodLost...")
    message: str | None = Field(default=None, max_length=32768,
                                description="Details, e.g. the exception or the exit code.")
    time: datetime | None = Field(default=None, description="When the failure was detected.")


class Progress(ApiModel):
    """Training progress as reported by the ranks."""

    step: int | None = Field(default=None, ge=0, description="Latest training step reported.")
    updated: datetime | None = Field(default=None, description="When the step was last reported.")


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
    spare_replicas: int | None = Field(default=None, ge=0, description="Hot spare pods that are ready.")
    world_size: int | None = Field(
        default=None, ge=0, description="Ranks in the current rendezvous round (nodes x nprocPerNode).")
    round: int | None = Field(default=None, ge=0, description="Current rendezvous round.")
    restarts: RestartCounts | None = Field(default=None, description="Restarts so far.")
    total_restarts: int | None = Field(
        default=None, ge=0,
        description=("restarts.inProcess + restarts.podReplacements, the RESTARTS printer column (derived "
                     "from restarts by the model)."))
    last_failure: FailureRecord | None = Field(default=None, description="The most recent failure.")
    progress: Progress | None = Field(default=None, description="Training progress.")
    start_time: datetime | None = Field(default=None, description="When the job first started running.")
    completion_time: datetime | None = Field(default=None, description="When the job finished.")
    selector: str | None = Field(
        default=None, description="Label selector of the worker pods (for the scale subresource).")
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
