"""Round-bound (fenced) writes: a transaction that holds only while the writer's round is the current one.

A :class:`Fence` carries the epoch of a sealed round (the manifest key's mod_revision) and, optionally, the
writer's node key and its ``create_revision``. Every write through it is one etcd transaction whose first
comparisons are ``mod_revision(manifest) == epoch`` and ``create_revision(node key) == that revision``; when
either fails nothing is written and :class:`StaleEpoch` is raised. So a zombie from an older round, or a node
whose lease expired, cannot act in a newer round, however late its write arrives.
"""

from __future__ import annotations

from collections.abc import Sequence

from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Compare, Delete, Get, Op, Put, Store, TxnResult


class StaleEpoch(Exception):
    """A round-bound write was refused: the round of ``epoch`` is over (a newer round was sealed, or the
    writer's own node key is gone). Nothing was written."""

    def __init__(self, epoch: int, current: int | None, detail: str = "") -> None:
        self.epoch = epoch
        #: The epoch now in etcd (``None`` when no round is sealed); may equal ``epoch`` when it was the
        #: writer's node key that was gone.
        self.current = current
        msg = f"epoch {epoch} is stale (current epoch: {current})"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class Fence:
    """Makes writes that belong to the round of ``epoch``.

    ``holder`` is ``(node_id, create_revision)`` of the writer's node key; when given, the write also fails
    once that key is gone or re-created. Thread-safe (it holds no mutable state).
    """

    def __init__(self, store: Store, keys: JobKeys, epoch: int, *,
                 holder: tuple[str, int] | None = None) -> None:
        if epoch < 1:
            raise ValueError(f"epoch: must be the mod_revision of a sealed manifest (>= 1), got {epoch}")
        self.store = store
        self.keys = keys
        self.epoch = epoch
        self.holder = holder
        self._manifest_key = keys.manifest
        self._guards = [Compare(self._manifest_key, "mod", "==", epoch)]
        if holder is not None:
            node_id, revision = holder
            if revision < 1:
                raise ValueError(f"holder: create_revision must be >= 1, got {revision}")
            self._guards.append(Compare(keys.node(node_id), "create", "==", revision))

    def txn(self, compare: Sequence[Compare] = (), success: Sequence[Op] = (),
            failure: Sequence[Get] = (), *, timeout: float | None = None) -> TxnResult:
        """Run ``success`` if the round is still current and every comparison in ``compare`` holds.

        If the round is over, raises :class:`StaleEpoch` and nothing ran. If only ``compare`` failed, returns
        a result with ``succeeded=False`` whose ``responses`` are those of the ``failure`` reads. ``failure``
        may hold reads only: a write there would not be fenced by the round.
        """
        for op in failure:
            if not isinstance(op, Get):
                raise TypeError(f"failure: only Get ops are allowed in a fenced txn, got {type(op).__name__}")
        guard_reads: list[Op] = [Get(self._manifest_key)]
        if self.holder is not None:
            guard_reads.append(Get(self.keys.node(self.holder[0])))
        res = self.store.txn([*self._guards, *compare], success, [*guard_reads, *failure], timeout=timeout)
        if res.succeeded:
            return res
        manifest = res.responses[0]
        current = manifest[0].mod_revision if manifest else None
        if current != self.epoch:
            raise StaleEpoch(self.epoch, current, "a newer round was sealed" if current else "no round is sealed")
        if self.holder is not None:
            node = res.responses[1]
            if not node or node[0].create_revision != self.holder[1]:
                raise StaleEpoch(self.epoch, current, f"node {self.holder[0]} is no longer registered")
        return TxnResult(False, res.revision, res.responses[len(guard_reads):], res.counts[len(guard_reads):])

    def check(self, *, timeout: float | None = None) -> None:
        """Raise :class:`StaleEpoch` unless the round is still current (a read-only transaction)."""
        self.txn(timeout=timeout)

    def put(self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None) -> int:
        """Write ``key`` in this round; returns the revision. Raises :class:`StaleEpoch` if the round is over."""
        return self.txn(success=[Put(key, value, lease)], timeout=timeout).revision

    def delete(self, key: str, *, prefix: bool = False, timeout: float | None = None) -> int:
        """Delete ``key`` (or every key under it) in this round; raises :class:`StaleEpoch` if it is over."""
        return self.txn(success=[Delete(key, prefix)], timeout=timeout).revision
