"""A rank process's liveness where its pod's lease holds it: ending it is deleting its keys, not revoking a lease.

A rank's ``alive`` key and its barrier arrivals are bound to a lease. When each rank had a lease of its own,
its death or a stop longer than the TTL ended that lease and so its keys. Where the pod's agent lends its ranks
one lease for all of them (one keep-alive per pod rather than per rank: :mod:`stalwart.agent.rank_liveness`),
the lease outlives a rank, and whoever sees the rank go deletes what the lease's end would have deleted: the
rank itself on its way out, or its agent when it dies or stops writing its status file.

The deletion is guarded by the ``alive`` key's value, which names the process (slot, node, pid): a process of
the same slot started since (a respawn) has written its own, and nothing of it is deleted. Not fenced by the
round: a process's own keys are what it, and its agent, may always take back.
"""

from __future__ import annotations

from collections.abc import Iterable

from stalwart.api.restart import AliveRecord
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.records import Compare, Delete
from stalwart.etcd.store import Store

__all__ = ["alive_value", "end_liveness", "liveness_iterations"]


def alive_value(slot: int, node_id: str, pid: int) -> bytes:
    """The ``alive`` key's value for process ``pid`` of ``slot`` on ``node_id`` (what its Coordinator writes)."""
    return AliveRecord(slot=slot, node_id=node_id, pid=pid).to_json_bytes()


def liveness_iterations(iteration: int) -> range:
    """The iterations whose arrival a process last seen in ``iteration`` may hold: the one before (its barrier's
    record of who took part), its own and the next (it may have arrived there since)."""
    return range(max(0, iteration - 1), iteration + 2)


def end_liveness(store: Store, keys: JobKeys, epoch: int, *, slot: int, node_id: str, pid: int,
                 iterations: Iterable[int], timeout: float | None = None) -> bool:
    """Delete process ``pid``'s ``alive`` key of ``slot`` in the round of ``epoch`` and its arrivals at
    ``iterations``, if that key is still its own. Returns whether it was (``False``: gone already, or another
    process's now)."""
    round_keys = keys.restart_round(epoch)
    alive = round_keys.alive(slot)
    deletes = [Delete(alive), *(Delete(round_keys.arrival(i, slot)) for i in sorted(set(iterations)))]
    return store.txn([Compare(alive, "value", "==", alive_value(slot, node_id, pid))], deletes,
                     timeout=timeout).succeeded
