"""The agent's settings, read from the pod environment (design.md) with clear errors naming the variable."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from stalwart.api.pod_env import EtcdEndpoints, JobRef
from stalwart.etcd.client import EtcdCredentials
from stalwart.etcd.keys import JobKeys

__all__ = ["AGENT_ENV", "AgentSettings", "SettingsError"]

#: Variable -> field name.
AGENT_ENV = {
    "STALWART_JOB": "job",
    "STALWART_JOB_UID": "job_uid",
    "STALWART_NODE_ID": "node_id",
    "STALWART_POD_IP": "pod_ip",
    "STALWART_SPARE": "spare",
    "STALWART_NPROC_PER_NODE": "nproc_per_node",
    "STALWART_MIN_NODES": "min_nodes",
    "STALWART_MAX_NODES": "max_nodes",
    "STALWART_ETCD_ENDPOINTS": "etcd_endpoints",
    "STALWART_RPC_TOKEN": "rpc_token",
    "STALWART_ETCD_TLS": "etcd_tls",
    "STALWART_ETCD_SECRET_DIR": "etcd_secret_dir",
}


class SettingsError(ValueError):
    """The pod environment is incomplete or malformed; one ``VARIABLE: problem`` per line."""


class AgentSettings(BaseModel):
    """Where this agent's pod stands in its job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: JobRef
    job_uid: str
    node_id: str = Field(min_length=1, max_length=253)
    pod_ip: str = Field(min_length=1)
    spare: bool = False
    nproc_per_node: int = Field(default=1, ge=1, le=1024)
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int = Field(default=1, ge=1)
    etcd_endpoints: EtcdEndpoints
    rpc_token: SecretStr | None = None
    #: The mounted etcd credentials Secret (stalwart.etcd.client); files, so no secret is in the environment.
    etcd_tls: bool = False
    etcd_secret_dir: str | None = None

    @model_validator(mode="after")
    def _bounds(self) -> AgentSettings:
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"STALWART_MAX_NODES ({self.max_nodes}) must be >= STALWART_MIN_NODES "
                             f"({self.min_nodes})")
        JobKeys(self.namespace, self.job_uid)  # validates both segments
        return self

    @property
    def namespace(self) -> str:
        return self.job.partition("/")[0]

    @property
    def keys(self) -> JobKeys:
        return JobKeys(self.namespace, self.job_uid)

    def etcd_env(self) -> dict[str, str]:
        """The variables that hand the etcd credentials on to rank processes (paths, never the secrets)."""
        if self.etcd_secret_dir is None:
            return {}
        return {"STALWART_ETCD_TLS": "true" if self.etcd_tls else "false",
                "STALWART_ETCD_SECRET_DIR": self.etcd_secret_dir}

    def etcd_credentials(self) -> EtcdCredentials:
        """Read the mounted credentials; raises CredentialsError naming the missing key."""
        return EtcdCredentials.from_env(self.etcd_env())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AgentSettings:
        """Read the pod environment; raises :class:`SettingsError` naming every bad or missing variable."""
        env = os.environ if environ is None else environ
        data = {f: env[var] for var, f in AGENT_ENV.items() if env.get(var, "") != ""}
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            by_field = {f: var for var, f in AGENT_ENV.items()}
            lines = []
            for err in e.errors():
                loc = str(err["loc"][0]) if err["loc"] else ""
                var = by_field.get(loc, "environment")
                what = "is required (set by the operator)" if err["type"] == "missing" else err["msg"]
                lines.append(f"{var}: {what}")
            raise SettingsError("\n".join(lines)) from None
