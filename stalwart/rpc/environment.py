"""What ``init_rpc()`` with no arguments reads from a rank process's environment, validated.

A rank process started by ``stalwart agent`` gets torchrun's variables (``RANK``, ``WORLD_SIZE``...), the
``STALWART_*`` variables of :class:`~stalwart.restart.environment.RankEnvironment` (etcd endpoints, job,
node, round epoch), and inherits the pod's own environment: ``STALWART_POD_IP`` (the downward API's
``status.podIP``, where the RPC server listens and what peers are told) and ``STALWART_RPC_TOKEN`` (the
job's Secret). Every problem is reported in one :class:`~stalwart.restart.environment.EnvironmentError_`
whose message names each bad or missing variable.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from stalwart.etcd.keys import JobKeys
from stalwart.restart.environment import EnvironmentError_, RankEnvironment
from stalwart.rpc.agent import TOKEN_ENV

__all__ = ["DEFAULT_HOST", "POD_IP_ENV", "RANK_ENV", "TOKEN_ENV", "WORLD_SIZE_ENV", "RpcEnvironment"]

RANK_ENV = "RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
POD_IP_ENV = "STALWART_POD_IP"
#: Where the RPC server listens when the pod's IP is not given (a rank run outside a pod, e.g. by hand).
DEFAULT_HOST = "127.0.0.1"


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
        return self.rank_env.keys

    @property
    def epoch(self) -> int:
        """The rendezvous round this process was launched in (``STALWART_EPOCH``)."""
        return self.rank_env.epoch

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, need_rank: bool = True,
                 need_world_size: bool = True, need_token: bool = True) -> RpcEnvironment:
        """Read and check the variables; raises :class:`EnvironmentError_` naming every bad or missing one
        (a variable not needed is still checked when it is set)."""
        env = os.environ if environ is None else environ
        problems: list[str] = []
        rank_env: RankEnvironment | None = None
        try:
            rank_env = RankEnvironment.from_env(env)
        except EnvironmentError_ as e:
            problems.append(str(e))
        rank = _int(env, RANK_ENV, 0, need_rank, problems)
        world_size = _int(env, WORLD_SIZE_ENV, 1, need_world_size, problems)
        host = DEFAULT_HOST
        pod_ip = env.get(POD_IP_ENV, "").strip()
        if pod_ip:
            try:
                host = str(ipaddress.ip_address(pod_ip))
            except ValueError:
                problems.append(f"{POD_IP_ENV}: expected the pod's IP address (status.podIP), got {pod_ip!r}")
        token = env.get(TOKEN_ENV) or None
        if token is None and need_token:
            problems.append(f"{TOKEN_ENV}: is required (the job's RPC token, from its Secret)")
        if problems or rank_env is None:
            raise EnvironmentError_("; ".join(problems))
        return cls(rank_env, rank, world_size, host, token)


def _int(env: Mapping[str, str], var: str, minimum: int, needed: bool, problems: list[str]) -> int | None:
    raw = env.get(var, "").strip()
    if not raw:
        if needed:
            problems.append(f"{var}: is required (set by `stalwart agent`, as torchrun does)")
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        problems.append(f"{var}: expected an integer >= {minimum}, got {raw!r}")
        return None
    return value
