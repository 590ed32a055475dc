"""What a process reads and watches of the rendezvous prefix (full or light), as pure functions: no etcd."""

from __future__ import annotations

import pytest

from stalwart.agent.rendezvous.protocol import role_of, round_status
from stalwart.agent.rendezvous.reading import full_ranges, light_ranges, light_read, light_view
from stalwart.api.rendezvous import Manifest, Member, NodeRecord, SealerRecord
from stalwart.etcd.store import Get, KeyValue, TxnResult, WatchRange

P = "/j/rdzv/"
EPOCH = 20


def kv(key: str, value: bytes, create: int, mod: int | None = None, lease: int = 0) -> KeyValue:
    return KeyValue(P + key, value, create, create if mod is None else mod, 1, lease)


def manifest() -> bytes:
    members = [Member(node_id=n, address="h", group_rank=i, rank_offset=i, nproc=1) for i, n in enumerate("ab")]
    return Manifest(round=1, members=members, spares=["c"], world_size=2, master_addr="h", sealed_by="a",
                    view_revision=15).to_json_bytes()


def answer(node_keys: list[KeyValue] | None, own: KeyValue | None = None) -> TxnResult:
    """The answer to ``light_read(P, {"b"})``: ``node_keys`` is the keys-only read (``None``: no manifest)."""
    control = [[kv("manifest", manifest(), EPOCH)] if node_keys is not None else [], [], [], [],
               [kv("sealer", SealerRecord(node_id="a").to_json_bytes(), 3, lease=9)]]
    reads = [*control, [own] if own else []]
    if node_keys is not None:
        reads.append(node_keys)
    return TxnResult(node_keys is None, 30, reads, [len(r) for r in reads])


def test_a_light_read_asks_for_every_node_key_only_once_a_round_is_sealed() -> None:
    [compare], reads, reads_if_sealed = light_read(P, {"b"})
    assert (compare.key, compare.target, compare.value) == (P + "manifest", "create", 0)
    assert Get(P + "nodes/b") in reads
    assert not any(g.key.startswith(P + "manifest-parts/") for g in reads)  # its own buckets come after
    assert reads_if_sealed == [*reads, Get(P + "nodes/", prefix=True, keys_only=True)]


def test_a_light_watch_is_sent_the_control_keys_and_only_the_deletions_of_node_keys() -> None:
    ranges = light_ranges(P)
    assert WatchRange(P + "nodes/", prefix=True, no_put=True) in ranges
    assert {r.key for r in ranges} == {P + k for k in ("manifest", "request", "closed", "expected", "sealer",
                                                       "nodes/")}
    assert full_ranges(P) == (WatchRange(P, prefix=True),)


@pytest.mark.parametrize(("keys", "lost"), [
    ([kv("nodes/a", b"", 5), kv("nodes/b", b"", 6), kv("nodes/c", b"", 7)], ()),  # all there
    ([kv("nodes/a", b"", 5), kv("nodes/c", b"", 7)], ("b",)),  # b's key went before the read
    ([kv("nodes/a", b"", 5), kv("nodes/b", b"", 25)], ("b",)),  # b came back: another incarnation
    ([kv("nodes/a", b"", 5), kv("nodes/b", b"", 6)], ()),  # the spare c went: the round lives on
])
def test_a_light_view_read_after_a_loss_knows_the_round_ended(keys: list[KeyValue], lost: tuple[str, ...]) -> None:
    own = kv("nodes/b", NodeRecord(node_id="b", address="h").to_json_bytes(), 6, lease=4)
    view = light_view(P, answer(keys, own))
    assert not view.full and view.revision == 30 and view.epoch == EPOCH
    assert view.sealer is not None and (view.sealer.node_id, view.sealer.lease) == ("a", 9)
    status = round_status(view)
    assert status.live == (not lost) and status.lost == lost
    assert set(view.nodes) == {"b"} and role_of(view, "b") == "member"


def test_a_light_view_before_any_round_holds_the_control_keys_and_its_own_nodes() -> None:
    view = light_view(P, answer(None))
    assert view.sealed is None and view.gone == {} and view.nodes == {}
    assert round_status(view).reason == "first round"
