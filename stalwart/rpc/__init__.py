"""RPC between the processes of a job: calls with retries, remote references, fenced by rendezvous round.

Public API (close to ``torch.distributed.rpc``): :func:`init_rpc`, :func:`rpc_sync`, :func:`rpc_async`,
:func:`shutdown`; :func:`rpc_function` registers the functions peers may call (calls name functions; nothing
is pickled). :class:`RpcAgent` is the same API on an explicit agent object. Remote references
(``remote`` -> ``RRef``) are a layer on RPC, in :mod:`stalwart.rref`, which RPC does not import.

Parts: :mod:`.agent` (puts them together), :mod:`.calls` (the calling side: attempts, retries, deadlines),
:mod:`.server` (fencing, dedup, running functions), :mod:`.peers` (the use of the membership),
:mod:`.shutdown`, :mod:`.reactor` (the loop and the one timer heap), :mod:`.extension` and :mod:`.host`
(the interface for layers above RPC), :mod:`.streams` (the transport: length-prefixed frames over TCP with
a token hello -- why not gRPC is explained there) over :mod:`.framing` (the records both halves of a
connection speak), :mod:`.transport` (the Transport interface), :mod:`.codec` (frames: JSON + raw tensor
bytes), :mod:`.dedup` (completion records), :mod:`.retry`, :mod:`.membership`, :mod:`.faults` (fault
injection).
"""

from stalwart.rpc.agent import RpcAgent, RpcFuture
from stalwart.rpc.api import current_agent, get_worker_info, init_rpc, rpc_async, rpc_sync, shutdown
from stalwart.rpc.environment import RpcEnvironment
from stalwart.rpc.errors import (
    EpochAhead,
    NotOwner,
    OwnerDied,
    PayloadError,
    RemoteError,
    RpcError,
    RpcShutdown,
    RpcTimeout,
    RRefCreationFailed,
    RRefDeleted,
    RRefError,
    StaleEpoch,
    TransportError,
    UnknownFunction,
    UnknownWorker,
    WorkerDied,
)
from stalwart.rpc.membership import (
    EtcdMembership,
    Membership,
    MembershipView,
    StaticMembership,
    ViewChanged,
    Worker,
    WorkerInfo,
    WorkerLeft,
)
from stalwart.rpc.registry import REGISTRY, Registry, rpc_function
from stalwart.rpc.retry import CONTROL_RETRY, RetryOptions
from stalwart.rpc.shutdown import ShutdownReport

__all__ = [
    "CONTROL_RETRY",
    "REGISTRY",
    "EpochAhead",
    "EtcdMembership",
    "Membership",
    "MembershipView",
    "NotOwner",
    "OwnerDied",
    "PayloadError",
    "RRefCreationFailed",
    "RRefDeleted",
    "RRefError",
    "Registry",
    "RemoteError",
    "RetryOptions",
    "RpcAgent",
    "RpcEnvironment",
    "RpcError",
    "RpcFuture",
    "RpcShutdown",
    "RpcTimeout",
    "ShutdownReport",
    "StaleEpoch",
    "StaticMembership",
    "TransportError",
    "UnknownFunction",
    "UnknownWorker",
    "ViewChanged",
    "Worker",
    "WorkerDied",
    "WorkerInfo",
    "WorkerLeft",
    "current_agent",
    "get_worker_info",
    "init_rpc",
    "rpc_async",
    "rpc_function",
    "rpc_sync",
    "shutdown",
]
