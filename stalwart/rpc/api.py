"""The torch-like module-level API over one process-wide default agent.

``init_rpc`` starts the agent and joins a membership: in a rank process launched by ``stalwart agent`` it
needs no arguments (everything comes from the rank's environment, see :mod:`.environment`); elsewhere it
takes a store or a membership. ``rpc_sync``, ``rpc_async`` and ``shutdown`` (and
:func:`stalwart.rref.remote`) then act on it, as
``torch.distributed.rpc`` does.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from typing import Any

from stalwart import exits
from stalwart.etcd.client import EtcdCredentials, connect
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.rpc.agent import RpcAgent, RpcFuture
from stalwart.rpc.environment import RpcEnvironment
from stalwart.rpc.errors import RpcShutdown
from stalwart.rpc.membership import EtcdMembership, Membership, WorkerInfo
from stalwart.rpc.shutdown import ShutdownReport

log = logging.getLogger(__name__)

_lock = threading.Lock()
_agent: RpcAgent | None = None
_own_membership: Membership | None = None
_own_store: Store | None = None
_shutting_down = False
_atexit_registered = False


def init_rpc(name: str | None = None, rank: int | None = None, *, membership: Membership | None = None,
             store: Store | None = None, keys: JobKeys | None = None, epoch: int | None = None,
             world_size: int | None = None, timeout: float = 60.0, lease_ttl: int = 10,
             **agent_options: Any) -> RpcAgent:
    """Start this process's agent and join the job's RPC membership; returns the agent.

    **In a rank process launched by** ``stalwart agent`` call it with no arguments (or only ``name=``):

    * the worker is named ``worker{RANK}`` (unless ``name`` is given) with rank ``$RANK``;
    * its server listens on ``$STALWART_POD_IP`` (``127.0.0.1`` only when that is unset) on a free port, and
      that address is what peers are told; peers authenticate with ``$STALWART_RPC_TOKEN``;
    * it registers in etcd (``$STALWART_ETCD_ENDPOINTS``, the job of ``$STALWART_JOB``/``$STALWART_JOB_UID``)
      in the round ``$STALWART_EPOCH``, bound to a lease of ``lease_ttl`` seconds (peers learn of the
      process's death that long after it at most), with ``$STALWART_NODE_ID`` as its node;
    * it waits up to ``timeout`` seconds until workers of every rank below ``$WORLD_SIZE`` (or
      ``world_size``) have registered in this round; TimeoutError names the missing ranks.

    A missing or malformed variable raises :class:`~stalwart.api.pod_env.PodEnvError` (a
    ValueError) naming it, before anything starts. :func:`shutdown` stops the agent, revokes the lease (the
    record goes at once) and closes the etcd client; so does interpreter exit if it was not called.

    Contract with rounds and in-process restarts -- RPC is initialised **once per rank process**, and its
    epoch is the round the process was launched in:

    * call it before (outside) a ``@stalwart.restartable`` function. In-process restart iterations stay in
      the round, so the agent, the RRefs it owns, its name and its rank live on across them. That rank is
      the ``RANK`` the process was launched with (its slot): RPC names are process identities, not the
      rank an iteration assigns (``CallWrapper.rank``);
    * a new rendezvous round stops the rank processes and the agent respawns them with the new
      ``STALWART_EPOCH``: they register in the new round, messages of the old one are rejected as stale,
      and records the old processes left behind (until their lease expires) do not count towards the wait;
    * a rank process respawned within the round registers a new incarnation under the same name (its
      record replaces the old one): peers reach the new process by that name from then on, and values the
      old process owned are gone with it (references to them are not to be used);
    * calling ``init_rpc`` again while the agent runs raises RuntimeError: a function that calls it in every
      iteration must :func:`shutdown` in a ``finally``.

    **Explicitly** (tests, tools, code outside ``stalwart agent``): pass ``name`` and ``rank`` with either a
    ``membership``, or ``store`` + ``keys`` + ``epoch`` (the rendezvous round's epoch): the worker then
    registers in etcd under a lease of ``lease_ttl`` seconds and, with ``world_size``, waits up to
    ``timeout`` seconds for that many workers. The store stays the caller's.

    ``agent_options`` go to :class:`RpcAgent` (``token``, ``host``, ``port``...) and win over the
    environment.
    """
    global _agent, _own_membership, _own_store, _atexit_registered
    explicit = membership is not None or store is not None or keys is not None or epoch is not None
    env: RpcEnvironment | None = None
    if explicit:
        if name is None or rank is None:
            raise ValueError("init_rpc: name= and rank= are required with membership= or store=")
    else:
        env = RpcEnvironment.from_env(
            need_rank=rank is None, need_world_size=world_size is None,
            need_token="token" not in agent_options and "transport" not in agent_options)
        rank = env.rank if rank is None else rank
        assert rank is not None  # from_env checked it
        name = f"worker{rank}" if name is None else name
        world_size = env.world_size if world_size is None else world_size
        agent_options.setdefault("host", env.host)
        if env.token is not None:
            agent_options.setdefault("token", env.token)
    with _lock:
        if _agent is not None:
            raise RuntimeError("init_rpc: the RPC agent of this process is already running (RPC is "
                               "initialised once per process; call shutdown() first)")
        agent = RpcAgent(name, rank, **agent_options)
        own: Membership | None = None
        own_store: Store | None = None
        _agent = agent  # functions peers call as soon as we are visible may need current_agent()
        try:
            agent.start()
            if env is not None:
                own_store = connect(env.rank_env.etcd_endpoints, EtcdCredentials.from_env())
                # each round has processes of its own: the records an older round's processes left
                # (until their lease expires) are neither peers nor count towards the wait
                etcd = EtcdMembership(own_store, env.keys, epoch=env.epoch, lease_ttl=lease_ttl,
                                      older_rounds=False)
                own = etcd
                agent.join(etcd)  # be in the round before peers can see us: their first call is in epoch
                etcd.register(agent.member, node=env.rank_env.node_id)
                log.info("job=%s node=%s rank=%d epoch=%d: RPC worker %s at %s; waiting for %s workers",
                         env.rank_env.job, env.rank_env.node_id, rank, env.epoch, name, agent.address,
                         world_size)
                if world_size is not None:
                    etcd.wait_for_ranks(world_size, timeout)
                    # The agent applies membership views on its own loop, and resolves ranks with the view
                    # it applied; one round trip through that loop lets the view we waited for in first.
                    agent.debug_state()
            elif membership is None:
                if store is None or keys is None or epoch is None:
                    raise ValueError("init_rpc: pass membership=, or store=, keys= and epoch=")
                etcd = EtcdMembership(store, keys, epoch=epoch, lease_ttl=lease_ttl)
                own = etcd
                agent.join(etcd)
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
            if own_store is not None:
                own_store.close()
            raise
        _agent, _own_membership, _own_store = agent, own, own_store
        if own_store is not None and not _atexit_registered:
            # The guard first: atexit runs last-registered first, so RPC's own shutdown still has its store
            # when it runs, and the guard then closes what is left and bounds the rest of the exit.
            exits.guard_exit()
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
        return agent


def _shutdown_at_exit() -> None:
    # Only for what init_rpc() built from the environment (it owns that etcd client): without it the
    # worker's record would stay visible to its peers for a lease TTL after the process ended.
    if _agent is not None and _own_store is not None:
        shutdown(graceful=False, timeout=5.0)


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


def get_worker_info(to: str | int | None = None) -> WorkerInfo:
    """This worker's (or ``to``'s) name and rank."""
    return current_agent().worker_info(to)


def shutdown(graceful: bool = True, timeout: float = 30.0) -> ShutdownReport:
    """Shut the process's agent down (see :meth:`RpcAgent.shutdown`) and leave the membership (and close
    the etcd client ``init_rpc()`` opened from the environment).

    The agent stays this process's :func:`current_agent` until it has stopped: a graceful shutdown still
    serves its peers' calls until they are done too, and the functions it runs may use it. A second call
    while one is under way returns at once with an empty report."""
    global _agent, _own_membership, _own_store, _shutting_down
    with _lock:
        agent, own, own_store = _agent, _own_membership, _own_store
        if agent is None or _shutting_down:
            return ShutdownReport(graceful)
        _shutting_down = True
    try:
        return agent.shutdown(graceful=graceful, timeout=timeout)
    finally:
        with _lock:
            _agent, _own_membership, _own_store, _shutting_down = None, None, None, False
        try:
            if own is not None:
                own.close()
        finally:
            if own_store is not None:
                own_store.close()
