"""What a rank process learns from its agent through the environment, validated with clear errors.

Besides torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), the agent gives every rank
process the ``STALWART_*`` variables below. The restart wrapper reads them once, at its first call.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stalwart.api.pod_env import EtcdEndpoints, JobRef
from stalwart.keys import JobKeys

__all__ = ["ENV", "EnvironmentError_", "RankEnvironment"]

#: Variable -> field name.
ENV = {
    "STALWART_ETCD_ENDPOINTS": "etcd_endpoints",
    "STALWART_JOB": "job",
    "STALWART_JOB_UID": "job_uid",
    "STALWART_NODE_ID": "node_id",
    "STALWART_EPOCH": "epoch",
    "STALWART_SLOT": "slot",
    "STALWART_SLOTS": "slots",
    "STALWART_TARGET_WORLD": "target_world",
    "STALWART_SPARE": "spare",
    "STALWART_STATUS_FILE": "status_file",
    "LOCAL_RANK": "local_rank",
}


class EnvironmentError_(ValueError):
    """A ``STALWART_*`` variable is missing or malformed; the message names the variable."""


class RankEnvironment(BaseModel):
    """The rank process's place in the job: which etcd, which job, which round (epoch), which slot."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    etcd_endpoints: EtcdEndpoints
    job: JobRef
    job_uid: str
    node_id: str = Field(min_length=1)
    epoch: int = Field(ge=1)
    slot: int = Field(ge=0)
    slots: int = Field(ge=1)
    target_world: int = Field(ge=1)
    spare: bool = False
    status_file: str | None = None
    local_rank: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> RankEnvironment:
        if self.slot >= self.slots:
            raise ValueError(f"STALWART_SLOT {self.slot} must be below STALWART_SLOTS {self.slots}")
        if self.target_world > self.slots:
            raise ValueError(f"STALWART_TARGET_WORLD {self.target_world} exceeds STALWART_SLOTS {self.slots}")
        return self

    @property
    def keys(self) -> JobKeys:
        return JobKeys(self.job.partition("/")[0], self.job_uid)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankEnvironment:
        """Read the variables; raises :class:`EnvironmentError_` naming each bad or missing one."""
        env = os.environ if environ is None else environ
        data = {field: env[var] for var, field in ENV.items() if env.get(var, "") != ""}
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            by_field = {f: v for v, f in ENV.items()}
            problems = []
            for err in e.errors():
                loc = err["loc"][0] if err["loc"] else ""
                var = by_field.get(str(loc), "environment")
                what = "is required (set by `stalwart agent`)" if err["type"] == "missing" else err["msg"]
                problems.append(f"{var}: {what}")
            raise EnvironmentError_("; ".join(problems)) from None

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce this environment (the agent uses this to launch ranks)."""
        out: dict[str, str] = {}
        for var, field in ENV.items():
            value = getattr(self, field)
            if value is None:
                continue
            if isinstance(value, list):
                out[var] = ",".join(value)
            elif isinstance(value, bool):
                out[var] = "true" if value else "false"
            else:
                out[var] = str(value)
        return out
