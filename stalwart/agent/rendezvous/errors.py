"""Typed errors of the rendezvous, the fence and the etcd torch Store."""

from __future__ import annotations


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


class StaleEpoch(RendezvousError):
    """A round-bound write was refused: the round of ``epoch`` is over (a newer round was sealed, or the
    writer's own node key is gone). Nothing was written."""

    def __init__(self, epoch: int, current: int | None, detail: str = "") -> None:
        self.epoch = epoch
        #: The epoch now in etcd (``None`` when no round is sealed); may equal ``epoch`` when it was the
        #: writer's node key that was gone.
        self.current = current
        msg = f"epoch {epoch} is stale (current epoch: {current})"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class CorruptRecord(RendezvousError):
    """A value under the rendezvous prefix is not a valid JSON record of the expected model (or too large)."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        super().__init__(f"corrupt record at {key!r}: {detail}")
