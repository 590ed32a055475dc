"""A large manifest in etcd: a header in the ``manifest`` key and the member list in buckets.

A round of a thousand nodes has a manifest of 100 KiB, of ten thousand 1 MiB. Sending it whole to every node costs
N times its size on every round (10 GB at 10,000 nodes), and a node needs only its own place in it. So a
manifest larger than one record is written, in the seal's one transaction, as:

* a :class:`ManifestHeader` in the ``manifest`` key: the round without its member list, and the digest of
  each bucket;
* up to :data:`MAX_BUCKETS` :class:`ManifestBucket` records under ``manifest-parts/``: the members and spares
  whose node ids hash (:func:`bucket_of`) to that bucket.

Every node is sent the header and reads only its own bucket; a bucket whose digest did not change since the
node's last round need not be read again. A reader takes a bucket only when its digest is the header's, so it
never mixes two rounds. A smaller manifest stays one :class:`~stalwart.api.rendezvous.Manifest` document, as
every manifest was before.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import Field

from stalwart.api.base import MAX_RECORD_BYTES, ApiModel
from stalwart.api.rendezvous import MAX_LOST, Manifest, Member

__all__ = [
    "BUCKET_BYTES",
    "MANIFEST_PARTS",
    "MAX_BUCKETS",
    "MAX_MANIFEST_BYTES",
    "WHOLE_MANIFEST_BYTES",
    "ManifestBucket",
    "ManifestHeader",
    "RoundPart",
    "SpareSlot",
    "bucket_of",
    "decode_manifest",
    "decode_round",
    "digest",
    "encode_manifest",
    "manifest_part_key",
]

#: The key of a bucket of a large manifest, relative to the rendezvous prefix.
MANIFEST_PARTS = "manifest-parts/"
#: The most buckets: with the header and the seal's compares the transaction stays within etcd's default of
#: 128 operations (``--max-txn-ops``).
MAX_BUCKETS = 120
#: About how many bytes of the member list go in one bucket: what one node reads to learn its place.
BUCKET_BYTES = 8 * 1024
#: The largest manifest kept as one document (about 300 members). Every node is sent it on every round, so
#: past this a header and one bucket per node cost less (at 1,000 nodes: 9 KB instead of 100 KB per node).
WHOLE_MANIFEST_BYTES = 32 * 1024
#: The most bytes of member list a round may have: one transaction must stay under etcd's default request limit
#: (``--max-request-bytes``, 1.5 MiB) with room for the keys and the compares; about 12,000 members of 100 bytes.
MAX_MANIFEST_BYTES = 5 * MAX_RECORD_BYTES


def manifest_part_key(index: int) -> str:
    """The key of bucket ``index`` of a large manifest, relative to the rendezvous prefix."""
    return f"{MANIFEST_PARTS}{index:04d}"


def bucket_of(node_id: str, buckets: int) -> int:
    """The bucket of ``node_id`` among ``buckets`` (CRC-32 of its UTF-8 bytes: stable across processes)."""
    return zlib.crc32(node_id.encode()) % buckets


def digest(data: bytes) -> str:
    """A bucket's digest as the header holds it: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(data).hexdigest()[:16]


class SpareSlot(ApiModel):
    """A spare of a round and its place among the spares (spares take ranks in this order)."""

    node_id: str = Field(description="The spare's node id.")
    index: int = Field(ge=0, description="Its position in the manifest's list of spares.")


class ManifestBucket(ApiModel):
    """The members and spares of a large manifest whose node ids fall in one bucket."""

    members: list[Member] = Field(default_factory=list, description="Members of this bucket, by group rank.")
    spares: list[SpareSlot] = Field(default_factory=list, description="Spares of this bucket, by index.")


class ManifestHeader(ApiModel):
    """A round without its member list: the ``manifest`` key's value for a large manifest, and what every
    node knows of any round."""

    round: int = Field(ge=1, description="Round number.")
    world_size: int = Field(ge=1, description="Total rank processes.")
    master_addr: str = Field(description="Address of group rank 0 (MASTER_ADDR).")
    master_port: int | None = Field(default=None, description="MASTER_PORT offered by group rank 0, if any.")
    sealed_by: str = Field(description="Id of the node that sealed the round.")
    reason: str = Field(default="", max_length=1024, description="Why this round started.")
    lost: list[str] = Field(default_factory=list, max_length=MAX_LOST,
                            description="Members of the previous round whose registration went before this seal.")
    view_revision: int = Field(default=0, ge=0, description="The revision the round was planned over.")
    members: int = Field(ge=1, description="How many members the round has.")
    spares: int = Field(default=0, ge=0, description="How many spares it has.")
    buckets: list[str] = Field(default_factory=list, max_length=MAX_BUCKETS,
                               description="The digest of each bucket (manifest-parts/0000 ...); empty when the "
                                           "manifest is one document.")

    @classmethod
    def of(cls, m: Manifest, buckets: list[str] | None = None) -> ManifestHeader:
        return cls(round=m.round, world_size=m.world_size, master_addr=m.master_addr, master_port=m.master_port,
                   sealed_by=m.sealed_by, reason=m.reason, lost=m.lost, view_revision=m.view_revision,
                   members=len(m.members), spares=len(m.spares), buckets=buckets or [])


def encode_manifest(manifest: Manifest, part_bytes: int = WHOLE_MANIFEST_BYTES) -> tuple[bytes, list[bytes]]:
    """The ``manifest`` key's value and the buckets to write with it, in the same transaction.

    A manifest of at most ``part_bytes`` is its own JSON document with no buckets. A larger one is a
    :class:`ManifestHeader` and buckets of about ``min(part_bytes, BUCKET_BYTES)`` each, at least 2 and at
    most :data:`MAX_BUCKETS`. Raises ``ValueError`` above :data:`MAX_MANIFEST_BYTES` or when a bucket would
    exceed one record.
    """
    if not 1024 <= part_bytes <= MAX_RECORD_BYTES:
        raise ValueError(f"part_bytes: expected 1024 to {MAX_RECORD_BYTES}, got {part_bytes}")
    data = manifest.model_dump_json(by_alias=True, exclude_none=True).encode()
    if len(data) <= part_bytes:
        return data, []
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"Manifest is {len(data)} bytes as JSON ({len(manifest.members)} members); the limit "
                         f"is {MAX_MANIFEST_BYTES}")
    count = min(MAX_BUCKETS, max(2, math.ceil(len(data) / min(part_bytes, BUCKET_BYTES))))
    buckets = [ManifestBucket() for _ in range(count)]
    for member in manifest.members:
        buckets[bucket_of(member.node_id, count)].members.append(member)
    for index, node_id in enumerate(manifest.spares):
        buckets[bucket_of(node_id, count)].spares.append(SpareSlot(node_id=node_id, index=index))
    encoded = [b.to_json_bytes() for b in buckets]
    if (largest := max(len(e) for e in encoded)) > MAX_RECORD_BYTES:
        raise ValueError(f"Manifest bucket of {largest} bytes; the limit is {MAX_RECORD_BYTES}")
    return ManifestHeader.of(manifest, [digest(e) for e in encoded]).to_json_bytes(), encoded


@dataclass(frozen=True, slots=True)
class RoundPart:
    """What a reader holds of a round: its header, and the members and spares of the buckets it holds
    (``held``: their indices; ``None`` when it holds the whole manifest, which is then ``manifest``)."""

    header: ManifestHeader
    members: Mapping[str, Member]
    spares: Mapping[str, int]
    held: frozenset[int] | None
    manifest: Manifest | None

    def knows(self, node_id: str) -> bool:
        """Whether this part tells the place of ``node_id`` in the round (member, spare, or neither)."""
        return self.held is None or bucket_of(node_id, len(self.header.buckets)) in self.held


def _document(value: bytes) -> Manifest | ManifestHeader:
    if len(value) > MAX_RECORD_BYTES:
        raise ValueError(f"manifest document is {len(value)} bytes; the limit is {MAX_RECORD_BYTES}")
    doc = json.loads(value)
    if isinstance(doc, dict) and "buckets" in doc:
        header = ManifestHeader.model_validate(doc)
        if len(header.buckets) < 2:
            raise ValueError(f"buckets: a manifest header has at least 2 buckets, got {len(header.buckets)}")
        return header
    return Manifest.model_validate(doc)


def decode_round(value: bytes, parts: Mapping[str, tuple[bytes, int]], *, need: frozenset[str] = frozenset(),
                 whole: bool = False) -> RoundPart:
    """The round held by the ``manifest`` key's ``value`` and the buckets in ``parts`` (relative key ->
    ``(value, mod_revision)``): a bucket counts only if its digest is the header's.

    With ``whole``, every bucket must be there and the result holds the whole manifest; otherwise the buckets
    of the node ids in ``need`` must be there. Raises ``ValueError`` naming what is missing or wrong.
    """
    doc = _document(value)
    if isinstance(doc, Manifest):
        return RoundPart(ManifestHeader.of(doc), {m.node_id: m for m in doc.members},
                         {n: i for i, n in enumerate(doc.spares)}, None, doc)
    header, count = doc, len(doc.buckets)
    wanted = range(count) if whole else sorted({bucket_of(n, count) for n in need})
    members: dict[str, Member] = {}
    spares: dict[str, int] = {}
    held: set[int] = set()
    for i in range(count):
        part = parts.get(manifest_part_key(i))
        if part is None or digest(part[0]) != header.buckets[i]:
            if i in wanted:
                found = "missing" if part is None else f"of another round (revision {part[1]})"
                raise ValueError(f"{manifest_part_key(i)}: bucket {i + 1} of {count} of round {header.round} "
                                 f"is {found}")
            continue
        bucket = ManifestBucket.from_json_bytes(part[0])
        members.update((m.node_id, m) for m in bucket.members)
        spares.update((s.node_id, s.index) for s in bucket.spares)
        held.add(i)
    if len(held) < count:
        return RoundPart(header, members, spares, frozenset(held), None)
    ordered = sorted(members.values(), key=lambda m: m.group_rank)
    manifest = Manifest(round=header.round, members=ordered, spares=sorted(spares, key=spares.__getitem__),
                        world_size=header.world_size, master_addr=header.master_addr,
                        master_port=header.master_port, sealed_by=header.sealed_by, reason=header.reason,
                        lost=header.lost, view_revision=header.view_revision)
    if len(manifest.members) != header.members or len(manifest.spares) != header.spares:
        raise ValueError(f"manifest buckets of round {header.round} hold {len(manifest.members)} members and "
                         f"{len(manifest.spares)} spares; the header says {header.members} and {header.spares}")
    return RoundPart(header, {m.node_id: m for m in ordered}, {n: i for i, n in enumerate(manifest.spares)},
                     None, manifest)


def decode_manifest(value: bytes, epoch: int, parts: Mapping[str, tuple[bytes, int]]) -> Manifest:
    """The whole manifest held by the ``manifest`` key's ``value`` (written at revision ``epoch``) and its
    buckets in ``parts``. Raises ``ValueError`` naming what is missing or wrong."""
    try:
        whole = decode_round(value, parts, whole=True).manifest
    except ValueError as e:
        raise ValueError(f"manifest of epoch {epoch}: {e}") from None
    assert whole is not None
    return whole
