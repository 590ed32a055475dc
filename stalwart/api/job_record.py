"""``JobRecord``: the operator's record of a job for its agents, kept as JSON at ``JobKeys.job``.

The agents read everything they need about the job from here (not from the Kubernetes API, which they have no
access to): who is expected to join, the elastic bounds, and every timeout. The operator rewrites it when the
TrainingJob's spec or its set of pods changes; readers take the record with the highest etcd mod_revision.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from stalwart.api.base import ApiModel, Rule, RuleViolation, check_rules
from stalwart.api.failure_rules import FailureRule
from stalwart.api.restart_settings import RESTART_SETTINGS, order_rules
from stalwart.api.spec import PeerSnapshotPolicy, SuccessPolicy
from stalwart.api.trainingjob import TrainingJob

RECORD_VERSION = 1


def _distinct(what: str, names: list[str]) -> list[str]:
    seen: set[str] = set()
    for index, name in enumerate(names):
        if not name:
            raise RuleViolation([(f"[{index}]", "must not be empty")])
        if name in seen:
            raise RuleViolation([(f"[{index}]", f"{name!r} is listed twice in {what}")])
        seen.add(name)
    return names


class JobRecord(ApiModel):
    """What the agents of one job know about it. Times are seconds (floats unless etcd needs an integer)."""

    version: int = Field(default=RECORD_VERSION, ge=1, description="Schema version of this record.")
    job_name: str = Field(min_length=1, description="metadata.name of the TrainingJob.")
    namespace: str = Field(min_length=1, description="metadata.namespace of the TrainingJob.")
    uid: str = Field(min_length=1, description="metadata.uid of the TrainingJob (also in the etcd prefix).")
    generation: int = Field(default=0, ge=0, description="metadata.generation the record was written from.")
    members: list[str] = Field(
        description="Node ids (pod names) of the worker pods expected to join, in index order.")
    spares: list[str] = Field(
        default_factory=list, description="Node ids (pod names) of the spare pods, in index order.")
    min_nodes: int = Field(ge=1, description="Fewest nodes a round may have (spec.minReplicas).")
    max_nodes: int = Field(ge=1, description="Most nodes a round may have (spec.maxReplicas).")
    nproc_per_node: int = Field(ge=1, description="Rank processes per node (spec.nprocPerNode).")
    join_timeout_seconds: float = Field(gt=0, description="rendezvous.joinTimeoutSeconds.")
    last_call_seconds: float = Field(ge=0, description="rendezvous.lastCallSeconds.")
    lease_ttl_seconds: int = Field(ge=1, alias="leaseTTLSeconds", description="rendezvous.leaseTTLSeconds.")
    max_restarts: int = Field(ge=0, description="restartPolicy.inProcess.maxRestarts.")
    soft_timeout_seconds: float = Field(gt=0, description="restartPolicy.inProcess.softTimeoutSeconds.")
    hard_timeout_seconds: float = Field(gt=0, description="restartPolicy.inProcess.hardTimeoutSeconds.")
    barrier_timeout_seconds: float = Field(gt=0, description="restartPolicy.inProcess.barrierTimeoutSeconds.")
    warm_spares: bool | None = Field(
        default=None, description="restartPolicy.inProcess.warmSpares as the job sets it (None: unset).")
    peer_snapshots: PeerSnapshotPolicy = Field(
        default_factory=PeerSnapshotPolicy, description="restartPolicy.inProcess.peerSnapshots.")
    backoff_limit: int = Field(ge=0, description="restartPolicy.backoffLimit.")
    rules: list[FailureRule] = Field(default_factory=list, description="restartPolicy.rules, in order.")
    success_policy: SuccessPolicy = Field(
        default=SuccessPolicy.ALL_WORKERS, description="spec.successPolicy.")
    fault_injection: bool = Field(
        default=False, description="spec.faultInjection.enabled: agents carry out authenticated fault drills.")

    @field_validator("members")
    @classmethod
    def _members(cls, names: list[str]) -> list[str]:
        return _distinct("members", names)

    @field_validator("spares")
    @classmethod
    def _spares(cls, names: list[str]) -> list[str]:
        return _distinct("spares", names)

    __rules__: ClassVar[list[Rule]] = [
        Rule(field="minNodes", cel="self.minNodes <= self.maxNodes",
             message="minNodes must be less than or equal to maxNodes",
             check=lambda r: None if r.min_nodes <= r.max_nodes else
             f"must be less than or equal to maxNodes ({r.max_nodes}), got {r.min_nodes}"),
        *order_rules(),
        Rule(field="spares", cel="!self.spares.exists(s, s in self.members)",
             message="a node cannot be both a member and a spare",
             check=lambda r: next((f"{name!r} is also in members" for name in r.spares
                                   if name in set(r.members)), None)),
    ]

    @model_validator(mode="after")
    def _rules(self) -> JobRecord:
        check_rules(self, self.__rules__)
        return self

    @property
    def world_size_max(self) -> int:
        """The largest world size a round can have."""
        return self.max_nodes * self.nproc_per_node

    @classmethod
    def from_job(cls, job: TrainingJob, members: list[str], spares: list[str] | None = None,
                 uid: str | None = None) -> JobRecord:
        """The record for ``job`` with the given expected pods. ``uid`` defaults to ``job.metadata.uid``;
        the namespace defaults to ``default`` when the manifest has none (as the API server does)."""
        job_uid = uid if uid is not None else job.metadata.uid
        if not job_uid:
            raise ValueError("uid: the job has no metadata.uid; pass uid=")
        spec = job.spec
        in_process = spec.restart_policy.in_process
        return cls(
            job_name=job.metadata.name,
            namespace=job.metadata.namespace or "default",
            uid=job_uid,
            generation=job.metadata.generation or 0,
            members=list(members),
            spares=list(spares or []),
            min_nodes=spec.min_nodes,
            max_nodes=spec.max_nodes,
            nproc_per_node=spec.nproc_per_node,
            join_timeout_seconds=spec.rendezvous.join_timeout_seconds,
            last_call_seconds=spec.rendezvous.last_call_seconds,
            lease_ttl_seconds=spec.rendezvous.lease_ttl_seconds,
            **{s.field: getattr(in_process, s.field) for s in RESTART_SETTINGS},
            warm_spares=in_process.warm_spares,
            peer_snapshots=in_process.peer_snapshots,
            backoff_limit=spec.restart_policy.backoff_limit,
            rules=list(spec.restart_policy.rules),
            success_policy=spec.success_policy,
            fault_injection=spec.fault_injection.enabled,
        )
