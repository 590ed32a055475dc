"""The seal's transaction, as data: what the sealer compares and writes to seal a round.

Pure: :func:`seal_txn` turns the protocol's :class:`~.protocol.Seal` into the compares and puts that the
driver sends as one etcd transaction.
"""

from __future__ import annotations

from stalwart.agent.rendezvous.protocol import Seal
from stalwart.api.manifest import encode_manifest, manifest_part_key
from stalwart.etcd.keys import CLOSED, MANIFEST, NODES
from stalwart.etcd.store import Compare, Put


def seal_txn(prefix: str, seal: Seal) -> tuple[list[Compare], list[Put]]:
    """The compares and puts of ``seal`` under the rendezvous ``prefix``.

    The compares fence the seal: the manifest is still the one of ``seal.over_epoch``, the rendezvous is not
    closed, the sealer's node key is the incarnation that planned the round, and no node key was created
    after the view the round was planned over. A manifest larger than 32 KiB is written as buckets and
    their header (the ``manifest`` key, :mod:`stalwart.api.manifest`) in this same transaction: all of them get
    the transaction's revision, the round's epoch, and a reader takes only buckets whose digest is the
    header's. Raises ``ValueError`` when the manifest exceeds
    :data:`~stalwart.api.manifest.MAX_MANIFEST_BYTES`.
    """
    key = prefix + MANIFEST
    header, parts = encode_manifest(seal.manifest)
    compares = [Compare(key, "mod", "==", seal.over_epoch),
                Compare(prefix + CLOSED, "create", "==", 0),
                Compare(prefix + NODES + seal.sealer, "create", "==", seal.sealer_revision),
                Compare(prefix + NODES, "create", "<", seal.view_revision + 1, prefix=True)]
    puts = [Put(prefix + manifest_part_key(i), part) for i, part in enumerate(parts)]
    return compares, [*puts, Put(key, header)]
