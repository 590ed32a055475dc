"""Typed errors of the rendezvous, the fence and the etcd torch Store."""

from __future__ import annotations

from stalwart.etcd.fence import StaleEpoch

__all__ = [
    "CorruptRecord",
    "DuplicateNode",
    "Fenced",
    "NodeLost",
    "RendezvousCancelled",
    "RendezvousClosed",
    "RendezvousError",
    "RendezvousTimeout",
    "StaleEpoch",
]


class RendezvousError(Exception):
    """Base of every rendezvous error."""


class RendezvousClosed(RendezvousError):
    """The rendezvous is closed: no new round will be sealed (the job is ending)."""


class RendezvousCancelled(RendezvousError):
    """The node's owner asked it to stop (SIGTERM): a blocked join or wait returned without a round."""


class RendezvousTimeout(RendezvousError):
    """No round including this node was sealed before the join deadline."""


class NodeLost(RendezvousError):
    """This node's key is gone (its lease expired or was revoked): it is no longer part of any round.

    Calling :meth:`~stalwart.agent.rendezvous.NodeHandle.join` again registers it anew (a new lease).
    """


class DuplicateNode(RendezvousError):
    """Another live node already holds this node id (its key exists under a different lease)."""


class Fenced(RendezvousError):
    """The operator fenced this node's pod (its fence record exists): it counted the pod lost and went on
    without it. The node may never register again; its agent stops its ranks and exits."""



class CorruptRecord(RendezvousError):
    """A value under the rendezvous prefix is not a valid JSON record of the expected model (or too large)."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        super().__init__(f"corrupt record at {key!r}: {detail}")
