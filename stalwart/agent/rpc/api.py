"""The torch-like module-level API over one process-wide default agent.

``init_rpc`` starts the agent and joins a membership (etcd-backed when given a store); ``rpc_sync``,
``rpc_async``, ``remote`` and ``shutdown`` then act on it, as ``torch.distributed.rpc`` does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from stalwart.agent.rpc.agent import RpcAgent, RpcFuture, ShutdownReport
from stalwart.agent.rpc.errors import RpcShutdown
from stalwart.agent.rpc.membership import EtcdMembership, Membership, WorkerInfo
from stalwart.agent.rref.handle import RRef
from stalwart.keys import JobKeys
from stalwart.store import Store

_lock = threading.Lock()
_agent: RpcAgent | None = None
_own_membership: Membership | None = None


def init_rpc(name: str, rank: int, *, membership: Membership | None = None, store: Store | None = None,
             keys: JobKeys | None = None, epoch: int | None = None, world_size: int | None = None,
             timeout: float = 60.0, lease_ttl: int = 10, **agent_options: Any) -> RpcAgent:
    """Start this process's agent and join the job's RPC membership.

    Either pass a ``membership``, or ``store`` + ``keys`` + ``epoch`` (the rendezvous round's epoch): the
    worker then registers in etcd under a lease of ``lease_ttl`` seconds (peers learn of its death that long
    after it) and, with ``world_size``, waits up to ``timeout`` seconds for that many workers.
    ``agent_options`` go to :class:`RpcAgent` (``token``, ``host``, ``port``...).
    """
    global _agent, _own_membership
    with _lock:
        if _agent is not None:
            raise RuntimeError("init_rpc: the RPC agent of this process is already running")
        agent = RpcAgent(name, rank, **agent_options)
        agent.start()
        own: Membership | None = None
        _agent = agent  # functions peers call as soon as we are visible may need current_agent()
        try:
            if membership is None:
                if store is None or keys is None or epoch is None:
                    raise ValueError("init_rpc: pass membership=, or store=, keys= and epoch=")
                etcd = EtcdMembership(store, keys, epoch=epoch, lease_ttl=lease_ttl)
                own = etcd
                agent.join(etcd)  # be in the round before peers can see us: their first call is in epoch
                etcd.register(agent.member)
                if world_size is not None:
                    etcd.wait_for(world_size, timeout)
            else:
                agent.join(membership)
        except BaseException:
            _agent = None
            agent.shutdown(graceful=False)
            if own is not None:
                own.close()
            raise
        _agent, _own_membership = agent, own
        return agent


def current_agent() -> RpcAgent:
    agent = _agent
    if agent is None:
        raise RpcShutdown("RPC is not initialised in this process (call init_rpc)")
    return agent


def rpc_sync(to: str | int | WorkerInfo, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
             kwargs: dict[str, Any] | None = None, **options: Any) -> Any:
    """See :meth:`RpcAgent.rpc_sync`."""
    return current_agent().rpc_sync(to, fn, args, kwargs, **options)


def rpc_async(to: str | int | WorkerInfo, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
              kwargs: dict[str, Any] | None = None, **options: Any) -> RpcFuture[Any]:
    """See :meth:`RpcAgent.rpc_async`."""
    return current_agent().rpc_async(to, fn, args, kwargs, **options)


def remote(to: str | int | WorkerInfo, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
           kwargs: dict[str, Any] | None = None, **options: Any) -> RRef[Any]:
    """See :meth:`RpcAgent.remote`."""
    return current_agent().remote(to, fn, args, kwargs, **options)


def get_worker_info(to: str | int | None = None) -> WorkerInfo:
    """This worker's (or ``to``'s) name and rank."""
    return current_agent().worker_info(to)


def shutdown(graceful: bool = True, timeout: float = 30.0) -> ShutdownReport:
    """Shut the process's agent down (see :meth:`RpcAgent.shutdown`) and leave the membership."""
    global _agent, _own_membership
    with _lock:
        agent, own = _agent, _own_membership
        _agent, _own_membership = None, None
    if agent is None:
        return ShutdownReport(graceful)
    try:
        return agent.shutdown(graceful=graceful, timeout=timeout)
    finally:
        if own is not None:
            own.close()
