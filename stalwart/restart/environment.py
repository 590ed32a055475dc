"""What a rank process learns from its agent through the environment: the pod contract's
:class:`~stalwart.api.pod_env.RankEnvironment` (read and checked there, errors naming the variable), with the
job's etcd keys."""

from __future__ import annotations

from stalwart.api import pod_env
from stalwart.etcd.keys import JobKeys

__all__ = ["RankEnvironment"]


class RankEnvironment(pod_env.RankEnvironment):
    """The rank process's place in the job (:class:`stalwart.api.pod_env.RankEnvironment`) and its etcd keys."""

    @property
    def keys(self) -> JobKeys:
        return JobKeys(self.namespace, self.job_uid)
