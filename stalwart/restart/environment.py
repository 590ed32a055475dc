"""What a rank process learns from its agent through the environment, validated with clear errors.

Besides torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), the agent gives every rank
process the ``STALWART_*`` variables below. The restart wrapper reads them once, at its first call. The last
four carry the TrainingJob's ``restartPolicy.inProcess`` settings when the job has a record in etcd (a job of
the operator); the wrapper uses them for the options its decorator leaves out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stalwart.api.pod_env import EtcdEndpoints, JobRef
from stalwart.etcd.keys import JobKeys

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
    "STALWART_MAX_RESTARTS": "max_restarts",
    "STALWART_SOFT_TIMEOUT": "soft_timeout",
    "STALWART_HARD_TIMEOUT": "hard_timeout",
    "STALWART_BARRIER_TIMEOUT": "barrier_timeout",
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
    max_restarts: int | None = Field(default=None, ge=0)
    soft_timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    hard_timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    barrier_timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _consistent(self) -> RankEnvironment:
        if self.slot >= self.slots:
            raise ValueError(f"STALWART_SLOT {self.slot} must be below STALWART_SLOTS {self.slots}")
        if self.target_world > self.slots:
            raise ValueError(f"STALWART_TARGET_WORLD {self.target_world} exceeds STALWART_SLOTS {self.slots}")
        if self.soft_timeout is not None and self.hard_timeout is not None \
                and self.hard_timeout <= self.soft_timeout:
            raise ValueError(f"STALWART_HARD_TIMEOUT {self.hard_timeout:g} must exceed STALWART_SOFT_TIMEOUT "
                             f"{self.soft_timeout:g}")
        return self

    def job_settings(self) -> dict[str, float | int]:
        """The job's in-process restart settings that the agent passed, by RestartConfig option name."""
        settings = {"max_restarts": self.max_restarts, "soft_timeout": self.soft_timeout,
                    "hard_timeout": self.hard_timeout, "barrier_timeout": self.barrier_timeout}
        return {name: value for name, value in settings.items() if value is not None}

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
