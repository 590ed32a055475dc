"""The TrainingJob resource: ``stalwart.dev/v1alpha1``, kind ``TrainingJob``."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field, field_validator

from stalwart.api.base import ApiModel
from stalwart.api.naming import job_name_problem
from stalwart.api.spec import TrainingJobSpec
from stalwart.api.status import TrainingJobStatus

GROUP = "stalwart.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ["tj"]
CATEGORIES = ["all"]


class ObjectMeta(ApiModel):
    """The Kubernetes ObjectMeta of a TrainingJob. Every ObjectMeta field is accepted; the ones stalwart
    reads are typed. ``name`` must be a DNS-1035 label short enough for the pod names derived from it."""

    name: str = Field(description="Name of the TrainingJob.")
    namespace: str | None = Field(default=None, description="Namespace of the TrainingJob.")
    labels: dict[str, str] | None = Field(default=None, description="Labels.")
    annotations: dict[str, str] | None = Field(default=None, description="Annotations.")
    uid: str | None = Field(default=None, description="Set by the API server.")
    resource_version: str | None = Field(default=None, description="Set by the API server.")
    generation: int | None = Field(default=None, description="Set by the API server.")
    creation_timestamp: datetime | None = Field(default=None, description="Set by the API server.")
    deletion_timestamp: datetime | None = Field(default=None, description="Set by the API server.")
    deletion_grace_period_seconds: int | None = Field(default=None, description="Set by the API server.")
    generate_name: str | None = Field(default=None, description="Prefix for a generated name.")
    finalizers: list[str] | None = Field(default=None, description="Finalizers.")
    owner_references: list[dict[str, Any]] | None = Field(default=None, description="Owners.")
    managed_fields: list[dict[str, Any]] | None = Field(default=None, description="Set by the API server.")
    self_link: str | None = Field(default=None, description="Deprecated; set by old API servers.")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        problem = job_name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        return name


class TrainingJob(ApiModel):
    """A fault-tolerant distributed PyTorch training job: worker pods (and spares) that meet in an etcd
    rendezvous and restart in process after faults."""

    api_version: Literal["stalwart.dev/v1alpha1"] = Field(
        description="stalwart.dev/v1alpha1.", alias="apiVersion")
    kind: Literal["TrainingJob"] = Field(description="TrainingJob.")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: TrainingJobSpec = Field(description="The desired state of the job.")
    status: TrainingJobStatus | None = Field(
        default=None, description="The observed state of the job, written by the operator.")

