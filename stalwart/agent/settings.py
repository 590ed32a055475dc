"""The agent's view of its pod: the pod contract's :class:`~stalwart.api.pod_env.AgentEnvironment` (read and
checked there, errors naming the variable) with what the agent derives from it through the etcd layer."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import model_validator

from stalwart.api.pod_env import AGENT_VARIABLES, BY_OPERATOR, AgentEnvironment, read_env
from stalwart.etcd.client import EtcdCredentials
from stalwart.etcd.keys import JobKeys

__all__ = ["PodSettings"]


class PodSettings(AgentEnvironment):
    """Where this agent's pod stands in its job, and its job's etcd keys and credentials."""

    @model_validator(mode="after")
    def _key_segments(self) -> PodSettings:
        JobKeys(self.namespace, self.job_uid)  # validates both segments
        return self

    @property
    def keys(self) -> JobKeys:
        return JobKeys(self.namespace, self.job_uid)

    def etcd_credentials(self) -> EtcdCredentials:
        """Read the mounted credentials; raises CredentialsError naming the missing key."""
        return EtcdCredentials.from_env(self.etcd_env())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PodSettings:
        """Read the pod environment; raises :class:`~stalwart.api.pod_env.PodEnvError` naming every bad or
        missing variable."""
        return read_env(cls, AGENT_VARIABLES, environ, set_by=BY_OPERATOR)
