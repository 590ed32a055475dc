"""What ``init_rpc()`` with no arguments reads from a rank process's environment: the pod contract's
:class:`~stalwart.api.pod_env.RankEnvironment` (etcd endpoints, job, node, round epoch) and
:class:`~stalwart.api.pod_env.RpcVariables` (``RANK``, ``WORLD_SIZE``, ``STALWART_POD_IP``: the downward API's
``status.podIP``, where the RPC server listens and what peers are told; ``STALWART_RPC_TOKEN``: the job's
Secret). Every problem is reported in one :class:`~stalwart.api.pod_env.PodEnvError` whose message names each
bad or missing variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from stalwart.api import pod_env
from stalwart.api.pod_env import RANK_VARIABLES, RPC_VARIABLES, PodEnvError, RankEnvironment, RpcVariables, try_read
from stalwart.etcd.keys import JobKeys

__all__ = ["DEFAULT_HOST", "RpcEnvironment"]

#: Where the RPC server listens when the pod's IP is not given (a rank run outside a pod, e.g. by hand).
DEFAULT_HOST = "127.0.0.1"
_AS_TORCHRUN = "set by `stalwart agent`, as torchrun does"


@dataclass(frozen=True, slots=True)
class RpcEnvironment:
    """The rank's place in the job as RPC needs it.

    ``rank``/``world_size``/``token`` are ``None`` only when the caller said it does not need them (it
    passes its own). ``host`` is the pod IP, or :data:`DEFAULT_HOST` when ``STALWART_POD_IP`` is unset.
    """

    rank_env: RankEnvironment
    rank: int | None
    world_size: int | None
    host: str
    token: str | None = field(default=None, repr=False)

    @property
    def keys(self) -> JobKeys:
        return JobKeys(self.rank_env.namespace, self.rank_env.job_uid)

    @property
    def epoch(self) -> int:
        """The rendezvous round this process was launched in (``STALWART_EPOCH``)."""
        return self.rank_env.epoch

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, need_rank: bool = True,
                 need_world_size: bool = True, need_token: bool = True) -> RpcEnvironment:
        """Read and check the variables; raises :class:`PodEnvError` naming every bad or missing one (a
        variable not needed is still checked when it is set)."""
        env = os.environ if environ is None else environ
        problems: list[str] = []
        rank_env = try_read(RankEnvironment, RANK_VARIABLES, env, pod_env.BY_AGENT, problems)
        rpc = try_read(RpcVariables, RPC_VARIABLES, env, _AS_TORCHRUN, problems)
        for var, needed, why in ((pod_env.RANK, need_rank, _AS_TORCHRUN),
                                 (pod_env.WORLD_SIZE, need_world_size, _AS_TORCHRUN),
                                 (pod_env.RPC_TOKEN, need_token, "the job's RPC token, from its Secret")):
            if needed and not env.get(var, "").strip():
                problems.append(f"{var}: is required ({why})")
        if problems or rank_env is None or rpc is None:
            raise PodEnvError(problems)
        token = None if rpc.rpc_token is None else rpc.rpc_token.get_secret_value()
        return cls(rank_env, rpc.rank, rpc.world_size, rpc.pod_ip or DEFAULT_HOST, token)
