"""A manifest larger than one etcd record: a header and buckets written in one fenced transaction; a full view
reads it whole or not at all, a light view reads only its own nodes' buckets (pure tables, then the real etcd)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from stalwart.agent.rendezvous import RendezvousSettings
from stalwart.agent.rendezvous.protocol import KeyDeleted, KeyPut, Seal, View, apply, role_of
from stalwart.agent.rendezvous.reading import buckets_to_read, full_view
from stalwart.agent.rendezvous.sealing import seal_txn
from stalwart.api.base import MAX_RECORD_BYTES
from stalwart.api.manifest import (
    MAX_BUCKETS,
    MAX_MANIFEST_BYTES,
    WHOLE_MANIFEST_BYTES,
    ManifestHeader,
    bucket_of,
    decode_manifest,
    decode_round,
    encode_manifest,
    manifest_part_key,
)
from stalwart.api.rendezvous import Manifest, Member, NodeRecord, SealerRecord
from stalwart.drill.session import DrillSession
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Compare, Put, Store

Parts = dict[str, tuple[bytes, int]]


def manifest(n: int, spares: int = 0) -> Manifest:
    """A round of ``n`` members with pod-like names (about 100 bytes of JSON each) and some spares."""
    members = [Member(node_id=f"trainjob-worker-{i}", address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                      group_rank=i, rank_offset=8 * i, nproc=8) for i in range(n)]
    return Manifest(round=1, members=members, spares=[f"trainjob-spare-{i}" for i in range(spares)],
                    world_size=8 * n, master_addr=members[0].address, sealed_by="trainjob-worker-0",
                    reason="first round", view_revision=3)


SMALL, LARGE = manifest(40, spares=2), manifest(3000, spares=3)


def written(parts: list[bytes], revision: int) -> Parts:
    return {manifest_part_key(i): (p, revision) for i, p in enumerate(parts)}


# -- the encoding ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "part_bytes", "buckets"), [
    (SMALL, WHOLE_MANIFEST_BYTES, 0),  # 4 KB: the manifest itself, as before buckets existed
    (manifest(400), WHOLE_MANIFEST_BYTES, 5),  # 40 KB: buckets of about 8 KiB
    (LARGE, MAX_RECORD_BYTES, 38),  # ~300 KB
    (SMALL, 1024, 4),  # any record size works alike
    # a later round names the members it lost, in the header of a large one
    (manifest(400).model_copy(update={"round": 2, "lost": ["trainjob-worker-400"]}), WHOLE_MANIFEST_BYTES, 5),
])
def test_encode_then_decode_gives_the_same_manifest(m: Manifest, part_bytes: int, buckets: int) -> None:
    value, parts = encode_manifest(m, part_bytes)
    assert len(parts) == buckets and len(value) <= part_bytes
    if buckets:
        header = ManifestHeader.from_json_bytes(value)
        assert len(header.buckets) == buckets and (header.members, header.spares) == (len(m.members), len(m.spares))
        assert max(map(len, parts)) < 3 * sum(map(len, parts)) / buckets  # the hash spreads the nodes
    assert decode_manifest(value, 7, written(parts, 7)) == m


def test_a_manifest_over_the_transaction_limit_is_refused_naming_the_limit() -> None:
    with pytest.raises(ValueError, match=f"the limit is {MAX_MANIFEST_BYTES}"):
        encode_manifest(manifest(16000))
    with pytest.raises(ValueError, match="part_bytes: expected 1024"):
        encode_manifest(SMALL, 100)
    assert len(encode_manifest(manifest(12000))[1]) == MAX_BUCKETS


def _of_another_round(parts: Parts) -> Parts:
    # The next round after a spare left: the bucket that held it differs (a bucket the same in both rounds is
    # the same data, and is rightly taken).
    other = written(encode_manifest(manifest(3000, spares=2))[1], 6)
    key = next(k for k in parts if other[k][0] != parts[k][0])
    return {**parts, key: other[key]}


def _tampered(parts: Parts) -> Parts:
    key = manifest_part_key(0)
    return {**parts, key: (parts[key][0].replace(b"10.", b"11.", 1), 7)}


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: {k: v for k, v in p.items() if k != manifest_part_key(1)}, "bucket 2 of 38 .* is missing"),
    (_of_another_round, r"bucket \d+ of 38 .* of another round"),  # never mixes two rounds
    (_tampered, "bucket 1 of 38 .* of another round"),
])
def test_a_header_without_its_own_buckets_is_refused_whole(damage: Callable[[Parts], Parts], message: str) -> None:
    value, parts = encode_manifest(LARGE)
    with pytest.raises(ValueError, match=message):
        decode_manifest(value, 7, damage(written(parts, 7)))


def test_a_node_reads_its_place_from_its_own_bucket_alone() -> None:
    value, parts = encode_manifest(LARGE)
    count = len(parts)
    for node_id, role in (("trainjob-worker-1234", "member"), ("trainjob-spare-2", "spare"),
                          ("trainjob-late", "neither")):
        key = manifest_part_key(bucket_of(node_id, count))
        part = decode_round(value, {key: dict(written(parts, 7))[key]}, need=frozenset({node_id}))
        assert part.manifest is None and part.knows(node_id) and part.held == {bucket_of(node_id, count)}
        assert (node_id in part.members, node_id in part.spares) == (role == "member", role == "spare")
        if role == "member":
            assert part.members[node_id] == LARGE.members[1234]
        if role == "spare":
            assert part.spares[node_id] == 2
        assert (part.header.members, part.header.world_size) == (3000, 24000)
    with pytest.raises(ValueError, match="is missing"):
        decode_round(value, {}, need=frozenset({"trainjob-worker-1"}))


# -- the view ---------------------------------------------------------------------------------------------------


def seal_events(m: Manifest, revision: int) -> list[KeyPut]:
    value, parts = encode_manifest(m)
    return [*(KeyPut(manifest_part_key(i), c, revision, revision) for i, c in enumerate(parts)),
            KeyPut("manifest", value, revision, revision)]


def test_a_full_view_assembles_the_buckets_in_watch_order_and_in_a_reads_key_order() -> None:
    events = seal_events(LARGE, 9)
    watch = apply(View(), events)  # a transaction's events: buckets first, header last
    assert watch.sealed is not None and watch.sealed.manifest == LARGE and watch.epoch == 9
    read = apply(View(), sorted(events, key=lambda e: e.key))  # "manifest" sorts before its buckets
    assert read.sealed == watch.sealed and not read.problems
    split = apply(apply(View(), events[:5]), events[5:])  # some buckets in one batch, the rest in the next
    assert split.sealed == watch.sealed


def test_a_light_view_is_sent_the_header_and_reads_only_its_own_buckets() -> None:
    node = "trainjob-worker-77"
    entry = NodeRecord(node_id=node, address="10.0.0.77", nproc=8)
    light = apply(View(full=False), [KeyPut("nodes/" + node, entry.to_json_bytes(), 2, 2)])
    events = seal_events(LARGE, 9)
    header = apply(light, events[-1:])  # a light watch is not sent the buckets
    assert header.sealed is not None and header.sealed.manifest is None and header.epoch == 9
    assert not header.sealed.knows(node) and header.sealed.header.members == 3000
    [key] = buckets_to_read(header, {node})
    bucket = next(e for e in events if e.key == key)
    held = apply(header, [bucket])
    assert held.sealed is not None and held.sealed.knows(node) and role_of(held, node) == "member"
    assert held.sealed.members[node].group_rank == 77 and buckets_to_read(held, {node}) == []
    # The next round moves no one in this bucket: the bucket held is still the header's, nothing to read.
    moved = LARGE.model_copy(update={"round": 2, "reason": "again"})
    again = apply(held, seal_events(moved, 12)[-1:])
    assert again.sealed is not None and again.sealed.header.round == 2 and again.sealed.knows(node)
    assert buckets_to_read(again, {node}) == []


def test_a_full_view_keeps_the_last_whole_round_when_a_header_lacks_its_buckets() -> None:
    first = apply(View(), seal_events(LARGE, 9))
    value, _ = encode_manifest(manifest(2900))
    broken = apply(first, [KeyPut("manifest", value, 9, 12)])  # its buckets are not there
    assert broken.sealed == first.sealed
    assert "bucket 1 of 36 of round 1 is of another round" in broken.problems["manifest"]
    # A later whole round clears the problem; a small manifest after a large one leaves old buckets unused.
    small = apply(broken, seal_events(SMALL, 14))
    assert small.sealed is not None and small.sealed.manifest == SMALL and not small.problems
    assert small.parts.keys() == first.parts.keys()
    gone = apply(small, [KeyDeleted(manifest_part_key(0), 15), KeyDeleted("manifest", 16)])
    assert gone.sealed is None and manifest_part_key(0) not in gone.parts


# -- the seal's transaction --------------------------------------------------------------------------------------


def test_the_seal_writes_buckets_then_the_header_in_one_fenced_transaction_within_etcds_limits() -> None:
    prefix = "/j/rdzv/"
    seal = Seal(manifest(12000), 5, "trainjob-worker-0", 3, 40)
    compares, puts = seal_txn(prefix, seal)
    assert compares == [Compare(prefix + "manifest", "mod", "==", 5),
                        Compare(prefix + "closed", "create", "==", 0),
                        Compare(prefix + "nodes/trainjob-worker-0", "create", "==", 3),
                        Compare(prefix + "nodes/", "create", "<", 41, prefix=True)]
    assert [p.key for p in puts] == [prefix + manifest_part_key(i) for i in range(len(puts) - 1)] + [
        prefix + "manifest"]
    assert len(puts) + len(compares) <= 128  # etcd's --max-txn-ops
    assert sum(len(p.key) + len(p.value) for p in puts) < 1572864 - 4096  # --max-request-bytes, with room
    assert all(p.lease == 0 for p in puts)
    _, small = seal_txn(prefix, Seal(SMALL, 0, "trainjob-worker-0", 3, 40))
    assert small == [Put(prefix + "manifest", SMALL.model_dump_json(by_alias=True, exclude_none=True).encode())]


# -- on the real etcd ---------------------------------------------------------------------------------------------


def test_a_large_manifest_is_sealed_fenced_and_read_whole_or_by_bucket_on_etcd(make_rdzv, store: Store,
                                                                               job_keys: JobKeys) -> None:
    prefix = job_keys.rendezvous
    settings = RendezvousSettings(min_nodes=2, max_nodes=3000)
    sealer = NodeRecord(node_id="trainjob-worker-0", address="10.0.0.0", nproc=8)
    rev = store.put(prefix + "nodes/trainjob-worker-0", sealer.to_json_bytes())
    # Another process holds the sealer's key, so this one's view stays light.
    store.put(prefix + "sealer", SealerRecord(node_id=sealer.node_id).to_json_bytes())
    light = make_rdzv(settings)
    member = light.node(NodeRecord(node_id="trainjob-worker-77", address="10.0.0.77", nproc=8))
    assert light.wait_loaded(10)
    member._register(time.monotonic() + 10)
    assert not light.view().full
    planned = store.revision()
    big = manifest(3000)
    res = store.txn(*seal_txn(prefix, Seal(big, 0, sealer.node_id, rev, planned)))
    assert res.succeeded
    epoch = res.revision
    kvs, _ = store.get_prefix(prefix + "manifest")
    assert len(kvs) == 39 and {kv.mod_revision for kv in kvs} == {epoch}
    # A light node learns its place from the header and its own bucket.
    info = member.join(timeout=10)
    assert info.epoch == epoch and info.role == "member" and info.member == big.members[77]
    assert info.manifest is None and info.header.members == 3000 and info.world_size == 24000
    assert len(light.view().parts) == 1
    # A fresh full read, the fence and the drill CLI's reader all see the whole round of this epoch.
    kvs, revision = store.get_prefix(prefix)
    view = full_view(prefix, kvs, revision)
    assert view.sealed is not None and view.sealed.manifest == big and view.epoch == epoch and not view.problems
    Fence(store, job_keys, epoch, holder=(sealer.node_id, rev)).check()
    drill = DrillSession(api=None, namespace=job_keys.namespace, job="trainjob", store=store, uid=job_keys.uid)
    assert drill.manifest() == big
    # The same seal again is refused by its compares (the epoch moved on): nothing is written.
    again = store.txn(*seal_txn(prefix, Seal(manifest(2900), 0, sealer.node_id, rev, rev)))
    assert not again.succeeded
    assert store.get(prefix + "manifest") is not None and store.get(prefix + "manifest").mod_revision == epoch
    # A node key created after the planned view also refuses the seal (the node-set compare).
    store.put(prefix + "nodes/late", NodeRecord(node_id="late", address="10.9.9.9").to_json_bytes())
    late = store.txn(*seal_txn(prefix, Seal(manifest(2900), epoch, sealer.node_id, rev, epoch)))
    assert not late.succeeded
