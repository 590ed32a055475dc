"""The one restart write that a rank process and its agent both make: a fault record of a slot, fenced by the
round's epoch (the key is :meth:`~stalwart.etcd.keys.RestartKeys.fault`, the record
:class:`~stalwart.api.restart.FaultRecord`); and the rule that an iteration ends once.

An iteration ends either done (its END record: every active process returned) or faulted (a fault record).
Each of the two is written only while the other is absent, checked in the writing transaction, so etcd holds
at most one of them and every process learns the same outcome. Without the rule a process could exit on the
END record while a peer that had not read it yet saw that process's heartbeat go, reported it lost, and
restarted alone into a barrier the finished process would never reach."""

from __future__ import annotations

from stalwart.api.restart import FaultRecord
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import FAULT, JobKeys, RestartKeys
from stalwart.etcd.store import Compare, Put, Store

__all__ = ["end_guard", "fault_guard", "record_fault"]


def fault_guard(keys: RestartKeys, iteration: int) -> Compare:
    """The condition of a fault record of ``iteration``: its END record is absent (no process can fault an
    iteration whose every process returned)."""
    return Compare(keys.end(iteration), "create", "==", 0)


def end_guard(keys: RestartKeys, iteration: int) -> Compare:
    """The condition of the END record of ``iteration``: none of its fault records exists."""
    return Compare(keys.of_iteration(FAULT, iteration), "create", "==", 0, prefix=True)


def record_fault(store: Store, keys: JobKeys, epoch: int, rec: FaultRecord) -> bool:
    """Publish ``rec`` as the fault of slot ``rec.slot`` in its iteration, fenced by ``epoch``, unless that slot
    recorded one there already (which says more: e.g. the exception before the process died) or the iteration
    ended done: what an agent does for a rank process it found dead, stopped or hung. Returns whether it was
    written."""
    round_keys = keys.restart_round(epoch)
    key = round_keys.fault(rec.iteration, rec.slot)
    return Fence(store, keys, epoch).txn([Compare(key, "create", "==", 0), fault_guard(round_keys, rec.iteration)],
                                         [Put(key, rec.to_json_bytes())]).succeeded
