"""A manifest larger than one etcd record: split into parts written with their header in one fenced
transaction, read back whole or not at all (pure tables, then the real etcd)."""

from __future__ import annotations

import hashlib
import time

import pytest

from stalwart.agent.rendezvous import RendezvousSettings
from stalwart.agent.rendezvous.protocol import KeyDeleted, KeyPut, Seal, View, apply
from stalwart.agent.rendezvous.sealing import seal_txn
from stalwart.api.rendezvous import (
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    Manifest,
    ManifestParts,
    Member,
    NodeRecord,
    decode_manifest,
    encode_manifest,
    manifest_part_key,
)
from stalwart.drill.session import DrillSession
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Compare, Put, Store


def manifest(n: int) -> Manifest:
    """A round of ``n`` members with pod-like names (about 100 bytes of JSON each)."""
    members = [Member(node_id=f"trainjob-worker-{i}", address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                      group_rank=i, rank_offset=8 * i, nproc=8) for i in range(n)]
    return Manifest(round=1, members=members, world_size=8 * n, master_addr=members[0].address,
                    sealed_by="trainjob-worker-0", reason="first round")


SMALL, LARGE = manifest(40), manifest(3000)


def written(parts: list[bytes], revision: int) -> dict[str, tuple[bytes, int]]:
    return {manifest_part_key(i): (p, revision) for i, p in enumerate(parts)}


# -- the encoding ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "part_bytes", "parts"), [
    (SMALL, MAX_RECORD_BYTES, 0),  # fits one record: the manifest itself, as before parts existed
    (LARGE, MAX_RECORD_BYTES, 2),  # ~300 KB: two parts
    (SMALL, 1024, 4),  # any part size works alike
])
def test_encode_then_decode_gives_the_same_manifest(m: Manifest, part_bytes: int, parts: int) -> None:
    header, chunks = encode_manifest(m, part_bytes)
    assert len(chunks) == parts and all(len(c) <= part_bytes for c in chunks)
    if parts:
        h = ManifestParts.from_json_bytes(header)
        assert h.parts == parts and h.size == sum(map(len, chunks))
    assert decode_manifest(header, 7, written(chunks, 7)) == m


def test_a_manifest_over_the_transaction_limit_is_refused_naming_the_limit() -> None:
    with pytest.raises(ValueError, match=f"the limit is {MAX_MANIFEST_BYTES}"):
        encode_manifest(manifest(16000))
    with pytest.raises(ValueError, match="part_bytes: expected 1024"):
        encode_manifest(SMALL, 100)


def _stale(parts: dict[str, tuple[bytes, int]]) -> dict[str, tuple[bytes, int]]:
    key = manifest_part_key(1)
    return {**parts, key: (parts[key][0], 6)}


def _tampered(parts: dict[str, tuple[bytes, int]]) -> dict[str, tuple[bytes, int]]:
    key = manifest_part_key(0)
    return {**parts, key: (parts[key][0].replace(b"worker-1", b"worker-X", 1), 7)}


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: {k: v for k, v in p.items() if k != manifest_part_key(1)}, "part 2 of 2 .* is missing"),
    (_stale, "part 2 of 2 .* is written at revision 6"),  # a part of another round never mixes in
    (_tampered, "do not match the header's size .* and sha256"),
])
def test_a_header_without_its_own_whole_parts_is_refused(damage, message: str) -> None:
    header, chunks = encode_manifest(LARGE)
    with pytest.raises(ValueError, match=message):
        decode_manifest(header, 7, damage(written(chunks, 7)))


# -- the view ---------------------------------------------------------------------------------------------------


def seal_events(m: Manifest, revision: int) -> list[KeyPut]:
    header, chunks = encode_manifest(m)
    return [*(KeyPut(manifest_part_key(i), c, revision, revision) for i, c in enumerate(chunks)),
            KeyPut("manifest", header, revision, revision)]


def test_the_view_assembles_parts_in_watch_order_and_in_a_full_reads_key_order() -> None:
    events = seal_events(LARGE, 9)
    assert len(events) == 3
    watch = apply(View(), events)  # a transaction's events: parts first, header last
    assert watch.sealed is not None and watch.sealed.manifest == LARGE and watch.epoch == 9
    full = apply(View(), sorted(events, key=lambda e: e.key))  # "manifest" sorts before its parts
    assert full.sealed == watch.sealed and not full.problems
    split = apply(apply(View(), events[:2]), events[2:])  # the parts in one batch, the header in the next
    assert split.sealed == watch.sealed


def test_the_view_keeps_the_last_whole_round_when_a_header_lacks_its_parts() -> None:
    first = apply(View(), seal_events(LARGE, 9))
    header, _ = encode_manifest(manifest(2900))
    broken = apply(first, [KeyPut("manifest", header, 9, 12)])  # the parts at revision 12 are not there
    assert broken.sealed == first.sealed
    assert "part 1 of 2" in broken.problems["manifest"]
    # A later whole round clears the problem; a small manifest after a large one leaves old parts unused.
    small = apply(broken, seal_events(SMALL, 14))
    assert small.sealed is not None and small.sealed.manifest == SMALL and not small.problems
    assert small.parts.keys() == first.parts.keys()
    gone = apply(small, [KeyDeleted(manifest_part_key(0), 15), KeyDeleted("manifest", 16)])
    assert gone.sealed is None and manifest_part_key(0) not in gone.parts


# -- the seal's transaction --------------------------------------------------------------------------------------


def test_the_seal_writes_parts_then_the_header_in_one_fenced_transaction_within_etcds_limits() -> None:
    prefix = "/j/rdzv/"
    seal = Seal(manifest(12000), 5, "trainjob-worker-0", 3, 40)
    compares, puts = seal_txn(prefix, seal)
    assert compares == [Compare(prefix + "manifest", "mod", "==", 5),
                        Compare(prefix + "closed", "create", "==", 0),
                        Compare(prefix + "nodes/trainjob-worker-0", "create", "==", 3),
                        Compare(prefix + "nodes/", "create", "<", 41, prefix=True)]
    assert [p.key for p in puts] == [prefix + manifest_part_key(i) for i in range(len(puts) - 1)] + [
        prefix + "manifest"]
    assert len(puts) <= 128  # etcd's --max-txn-ops
    assert sum(len(p.key) + len(p.value) for p in puts) < 1572864 - 4096  # --max-request-bytes, with room
    assert all(p.lease == 0 for p in puts)
    _, small = seal_txn(prefix, Seal(SMALL, 0, "trainjob-worker-0", 3, 40))
    assert small == [Put(prefix + "manifest", SMALL.model_dump_json(by_alias=True, exclude_none=True).encode())]


# -- on the real etcd ---------------------------------------------------------------------------------------------


def test_a_large_manifest_is_sealed_fenced_and_read_whole_on_etcd(make_rdzv, store: Store,
                                                                   job_keys: JobKeys) -> None:
    prefix = job_keys.rendezvous
    watching = make_rdzv(RendezvousSettings(min_nodes=2, max_nodes=3000))
    assert watching.wait_loaded(10)
    sealer = NodeRecord(node_id="trainjob-worker-0", address="10.0.0.0", nproc=8)
    rev = store.put(prefix + "nodes/trainjob-worker-0", sealer.to_json_bytes())
    big = manifest(3000)
    res = store.txn(*seal_txn(prefix, Seal(big, 0, sealer.node_id, rev, rev)))
    assert res.succeeded
    epoch = res.revision
    kvs, _ = store.get_prefix(prefix + "manifest")
    assert len(kvs) == 3 and {kv.mod_revision for kv in kvs} == {epoch}
    header = next(kv for kv in kvs if kv.key == prefix + "manifest")
    assert hashlib.sha256(b"".join(kv.value for kv in kvs if kv is not header)).hexdigest() == \
        ManifestParts.from_json_bytes(header.value).sha256
    # A reader that was watching, a fresh reader (a full read) and the fence all see the round of this epoch.
    deadline = time.monotonic() + 10
    while watching.view().epoch != epoch and time.monotonic() < deadline:
        time.sleep(0.05)
    fresh = make_rdzv(RendezvousSettings(min_nodes=2, max_nodes=3000))
    assert fresh.wait_loaded(10)
    for rdzv in (watching, fresh):
        view = rdzv.view()
        assert view.sealed is not None and view.sealed.manifest == big and view.epoch == epoch
        assert not view.problems
    Fence(store, job_keys, epoch, holder=(sealer.node_id, rev)).check()
    drill = DrillSession(api=None, namespace=job_keys.namespace, job="trainjob", store=store, uid=job_keys.uid)
    assert drill.manifest() == big  # the drill CLI's reader assembles it too
    # The same seal again is refused by its compares (the epoch moved on): nothing is written.
    again = store.txn(*seal_txn(prefix, Seal(manifest(2900), 0, sealer.node_id, rev, rev)))
    assert not again.succeeded
    assert store.get(prefix + "manifest") is not None and store.get(prefix + "manifest").mod_revision == epoch
    # A node key created after the planned view also refuses the seal (the node-set compare).
    store.put(prefix + "nodes/late", NodeRecord(node_id="late", address="10.9.9.9").to_json_bytes())
    late = store.txn(*seal_txn(prefix, Seal(manifest(2900), epoch, sealer.node_id, rev, epoch)))
    assert not late.succeeded
