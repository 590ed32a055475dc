"""What one process reads of a job's rendezvous prefix when its watch (re)starts, and what it then watches.

Pure: the driver sends the reads and opens the watch. A **full** view (the sealer's process) reads and watches
the whole prefix. A **light** view (every other process) reads the control keys and its own nodes' keys, and
watches the control keys and only the deletions of node keys; when a round is sealed it also reads which node
keys exist (keys only, no values), so that a member lost before the read counts as lost. Of a large manifest
(:mod:`stalwart.api.manifest`) it reads only the buckets of its own nodes (:func:`buckets_to_read`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from stalwart.agent.rendezvous.protocol import KeyPut, View, apply
from stalwart.api.manifest import bucket_of, manifest_part_key
from stalwart.etcd.keys import CLOSED, EXPECTED, MANIFEST, NODES, REQUEST, SEALER
from stalwart.etcd.store import Compare, Get, KeyValue, TxnResult, WatchRange

__all__ = ["buckets_to_read", "full_ranges", "full_view", "key_puts", "light_ranges", "light_read", "light_view"]

#: The keys a light view reads and watches (relative to the prefix) besides the manifest's parts.
_CONTROL = (MANIFEST, REQUEST, CLOSED, EXPECTED, SEALER)


def key_puts(prefix: str, kvs: Iterable[KeyValue]) -> list[KeyPut]:
    """The keys read under ``prefix`` as the protocol's puts (keys relative to the prefix)."""
    return [KeyPut(kv.key[len(prefix):], kv.value, kv.create_revision, kv.mod_revision, kv.lease) for kv in kvs]


def full_ranges(prefix: str) -> tuple[WatchRange, ...]:
    return (WatchRange(prefix, prefix=True),)


def light_ranges(prefix: str) -> tuple[WatchRange, ...]:
    return (*(WatchRange(prefix + key) for key in _CONTROL), WatchRange(prefix + NODES, prefix=True, no_put=True))


def full_view(prefix: str, kvs: Sequence[KeyValue], revision: int) -> View:
    """The full view of a read of the whole prefix at ``revision``."""
    return replace(apply(View(), key_puts(prefix, kvs)), revision=revision, memo={})


def light_read(prefix: str, local: Iterable[str]) -> tuple[list[Compare], list[Get], list[Get]]:
    """The transaction of a light read: the control keys and the keys of the ``local`` nodes; and, only when a
    manifest exists, every node key without its value (its last read, one per node)."""
    reads = [*(Get(prefix + key) for key in _CONTROL), *(Get(prefix + NODES + node_id) for node_id in sorted(local))]
    return [Compare(prefix + MANIFEST, "create", "==", 0)], reads, [*reads, Get(prefix + NODES, prefix=True,
                                                                                keys_only=True)]


def light_view(prefix: str, result: TxnResult) -> View:
    """The light view of the answer to :func:`light_read`. Members of the sealed round whose key is missing,
    or was created after the round's epoch (another incarnation), are recorded as gone at the read."""
    reads = result.responses
    if result.succeeded:
        records, keys = reads, None
    else:
        records, keys = reads[:-1], reads[-1]
    # The manifest's header first and its parts after it, as a read of the prefix lists them.
    view = replace(apply(View(full=False), key_puts(prefix, (kv for r in records for kv in r))),
                   revision=result.revision, memo={})
    sealed = view.sealed
    if keys is None or sealed is None:
        return view
    present = {kv.key[len(prefix + NODES):]: kv.create_revision for kv in keys}
    lost = {node_id: result.revision for node_id in sealed.members
            if present.get(node_id, sealed.epoch + 1) > sealed.epoch}
    return replace(view, gone=lost) if lost else view


def buckets_to_read(view: View, local: Iterable[str]) -> list[str]:
    """The buckets of a large manifest (keys relative to the prefix) that a light ``view`` needs and does not
    hold: those of its ``local`` nodes (a bucket held from an earlier round counts while its digest is the
    header's)."""
    sealed = view.sealed
    if view.full or sealed is None or not sealed.bucketed:
        return []
    count = len(sealed.header.buckets)
    return sorted({manifest_part_key(bucket_of(n, count)) for n in local if not sealed.knows(n)})
