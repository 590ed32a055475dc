"""The one restart write that a rank process and its agent both make: a fault record of a slot, fenced by the
round's epoch (the key is :meth:`~stalwart.etcd.keys.RestartKeys.fault`, the record
:class:`~stalwart.api.restart.FaultRecord`)."""

from __future__ import annotations

from stalwart.api.restart import FaultRecord
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Compare, Put, Store

__all__ = ["record_fault"]


def record_fault(store: Store, keys: JobKeys, epoch: int, rec: FaultRecord) -> bool:
    """Publish ``rec`` as the fault of slot ``rec.slot`` in its iteration, fenced by ``epoch``, unless that slot
    recorded one there already (which says more: e.g. the exception before the process died): what an agent
    does for a rank process it found dead, stopped or hung. Returns whether it was written."""
    key = keys.restart_round(epoch).fault(rec.iteration, rec.slot)
    return Fence(store, keys, epoch).txn([Compare(key, "create", "==", 0)], [Put(key, rec.to_json_bytes())]).succeeded
