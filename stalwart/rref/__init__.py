"""Remote references (RRef) with distributed reference counting, fenced by round and fate-sharing with owners.

:mod:`.book` is the protocol's bookkeeping (pure); :mod:`.handle` the handles user code holds;
:mod:`.runtime` and :mod:`.owner` carry the protocol over the RPC agent's messages, as a layer on RPC
(:mod:`stalwart.rpc.extension`). Importing this package makes every RPC agent created afterwards host the
runtime: import it before ``init_rpc`` in every process that makes or receives RRefs.

:func:`remote` runs a function on a worker and keeps its result there, as ``torch.distributed.rpc.remote``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stalwart.rpc import RpcAgent, WorkerInfo, current_agent
from stalwart.rpc.errors import NotOwner, OwnerDied, RRefCreationFailed, RRefDeleted, RRefError
from stalwart.rpc.extension import register_extension
from stalwart.rref.book import RRefBook
from stalwart.rref.handle import OwnerRRef, RRef, UserRRef
from stalwart.rref.runtime import RRefRuntime

register_extension(RRefRuntime)


def remote(to: str | int | WorkerInfo, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
           kwargs: dict[str, Any] | None = None, *, agent: RpcAgent | None = None, **options: Any) -> RRef[Any]:
    """Run the registered function ``fn`` on ``to`` and keep the result there; returns an RRef to it at once.

    ``agent`` defaults to the process's agent (``init_rpc``). ``options`` are those of ``rpc_async``
    (``timeout``, ``idempotent``, ``retry``): the creation request is a user call (retried only if
    ``idempotent``); a failure of the call or of the function surfaces from ``to_here`` as
    :class:`~stalwart.rpc.errors.RRefCreationFailed`.
    """
    return RRefRuntime.of(agent if agent is not None else current_agent()).remote(to, fn, args, kwargs, **options)


__all__ = ["NotOwner", "OwnerDied", "OwnerRRef", "RRef", "RRefBook", "RRefCreationFailed", "RRefDeleted",
           "RRefError", "RRefRuntime", "UserRRef", "remote"]
