"""stalwart's rendezvous on etcd v3: rounds with fencing tokens, for thousands of nodes.

Public API:

* :class:`Rendezvous` (one per process and job: one watch, one thread) and :class:`NodeHandle` (one per
  node): ``rdzv.node(record).join()`` -> :class:`RoundInfo` (epoch, role, manifest); ``wait_round_end`` ->
  :class:`RoundEnd`; ``request_rerendezvous``; ``close_rendezvous`` (fenced by the round); ``leave``;
  ``Rendezvous.subscribe`` for :class:`RoundSealed` / :class:`RoundEnded` / :class:`Closed` (peer death is a
  ``RoundEnded`` with ``lost``).
* :class:`Fence`: writes bound to a round (a transaction comparing the epoch); :class:`StaleEpoch` otherwise.
* :class:`EtcdTorchStore`: a ``torch.distributed.Store`` namespaced and fenced by the epoch (imports torch).
* :mod:`.torch_backend`: torch's ``RendezvousBackend`` on etcd v3, registered for ``torchrun`` as
  ``--rdzv-backend=stalwart-etcd`` (imports torch).
* :mod:`.protocol`: the pure state machine the driver runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stalwart.agent.rendezvous.driver import Rendezvous
from stalwart.agent.rendezvous.errors import (
    CorruptRecord,
    DuplicateNode,
    Fenced,
    NodeLost,
    RendezvousCancelled,
    RendezvousClosed,
    RendezvousError,
    RendezvousTimeout,
    StaleEpoch,
)
from stalwart.agent.rendezvous.node import NodeHandle
from stalwart.agent.rendezvous.rounds import Closed, RoundEnd, RoundEnded, RoundEvent, RoundInfo, RoundSealed
from stalwart.agent.rendezvous.settings import RendezvousSettings
from stalwart.etcd.fence import Fence

if TYPE_CHECKING:
    from stalwart.etcd.torch_store import EtcdTorchStore

__all__ = [
    "Closed",
    "CorruptRecord",
    "DuplicateNode",
    "EtcdTorchStore",
    "Fence",
    "Fenced",
    "NodeHandle",
    "NodeLost",
    "Rendezvous",
    "RendezvousCancelled",
    "RendezvousClosed",
    "RendezvousError",
    "RendezvousSettings",
    "RendezvousTimeout",
    "RoundEnd",
    "RoundEnded",
    "RoundEvent",
    "RoundInfo",
    "RoundSealed",
    "StaleEpoch",
]


def __getattr__(name: str) -> Any:
    # torch is imported only by the parts that need it, so the operator can use the rest without torch.
    if name == "EtcdTorchStore":
        from stalwart.etcd.torch_store import EtcdTorchStore

        return EtcdTorchStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
