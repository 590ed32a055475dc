"""stalwart's rendezvous against a real etcd server: rounds, spares, lease expiry, close, fencing, restarts."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace

import pytest
from rdzv_helpers import JOIN_TIMEOUT, infos, join_all, record

from stalwart.agent.rendezvous import (
    DuplicateNode,
    Fence,
    Fenced,
    RendezvousClosed,
    RendezvousSettings,
    RendezvousTimeout,
    RoundEnded,
    RoundEvent,
    RoundSealed,
    StaleEpoch,
)
from stalwart.api.rendezvous import ClosedRecord, FenceRecord, Manifest
from stalwart.etcd.keys import CLOSED, MANIFEST, NODES, JobKeys
from stalwart.etcd.store import MAX_VALUE_BYTES, Store, ValueTooLarge
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration

ROUND_END_WAIT = 60.0


def test_nodes_get_unique_ranks_in_one_sealed_round(make_rdzv, store: Store, job_keys: JobKeys) -> None:
    n = 16
    r = make_rdzv(RendezvousSettings(min_nodes=n, max_nodes=n, node_ttl=30))
    got = infos(join_all([r.node(record(f"node-{i}", nproc=2, master_port=29500)) for i in range(n)]))
    epochs = {i.epoch for i in got.values()}
    assert len(epochs) == 1
    kv = store.get(job_keys.rendezvous + MANIFEST)
    assert kv is not None and kv.mod_revision == epochs.pop()
    manifest = Manifest.from_json_bytes(kv.value)
    assert sorted(i.member.group_rank for i in got.values() if i.member) == list(range(n))
    assert sorted(i.member.rank_offset for i in got.values() if i.member) == list(range(0, 2 * n, 2))
    assert manifest.world_size == 2 * n and manifest.round == 1 and manifest.spares == []
    assert manifest.master_port == 29500 and all(i.role == "member" for i in got.values())


def test_between_min_and_max_the_round_seals_after_the_last_call(make_rdzv) -> None:
    r = make_rdzv(RendezvousSettings(min_nodes=2, max_nodes=4, last_call_timeout=0.5, node_ttl=30))
    got = infos(join_all([r.node(record(f"n{i}")) for i in range(3)]))
    assert {i.role for i in got.values()} == {"member"}
    assert next(iter(got.values())).manifest.world_size == 3  # sealed by the last call, below max


def test_nodes_beyond_max_are_spares(make_rdzv) -> None:
    r = make_rdzv(RendezvousSettings(min_nodes=3, max_nodes=3, last_call_timeout=30, node_ttl=30))
    handles = [r.node(record(f"n{i}")) for i in range(3)]
    spare = r.node(record("hot", spare=True))
    spare_result: queue.Queue[object] = queue.Queue()
    # The spare registers first, so it is the oldest node (the sealer) and still ends up a spare.
    t = threading.Thread(target=lambda: spare_result.put(spare.join(timeout=JOIN_TIMEOUT)))
    t.start()
    while r.view().nodes.get("hot") is None:
        spare._wake.wait(0.05)
    got = infos(join_all(handles))
    t.join(JOIN_TIMEOUT)
    sp = spare_result.get(timeout=5)
    assert {i.role for i in got.values()} == {"member"}
    assert getattr(sp, "role", None) == "spare"
    assert next(iter(got.values())).manifest.spares == ["hot"]


def test_late_joiner_waits_for_the_next_round(make_rdzv) -> None:
    r = make_rdzv(RendezvousSettings(min_nodes=2, max_nodes=3, last_call_timeout=0.3, node_ttl=30))
    a, b = r.node(record("a")), r.node(record("b"))
    first = infos(join_all([a, b]))
    assert first["a"].world_size == 2
    late = r.node(record("late"))
    info = late.join(timeout=JOIN_TIMEOUT)
    assert info.role == "waiting" and info.epoch == first["a"].epoch
    assert a.waiting_nodes() == ["late"]
    # A member admits it by asking for a new round (as torch's agent does when nodes are waiting).
    a.request_rerendezvous("scale up: 1 node waiting")
    for h in (a, b, late):
        end = h.wait_round_end(ROUND_END_WAIT)
        assert end is not None and "requested by a" in end.reason
    second = infos(join_all([a, b, late]))
    kept = {k: v.member.group_rank for k, v in first.items() if v.member}
    assert {k: v.member.group_rank for k, v in second.items() if v.member} == {**kept, "late": 2}
    assert second["late"].round == 2 and second["late"].epoch > first["a"].epoch


def test_lease_expiry_removes_a_dead_node_and_starts_a_new_round(make_rdzv, etcd: EtcdServer) -> None:
    # Only the doomed node has a short lease, so a loaded machine cannot expire a survivor's by accident.
    settings = RendezvousSettings(min_nodes=2, max_nodes=3, last_call_timeout=0.3, node_ttl=30)
    r = make_rdzv(settings)
    doomed_store = Store([etcd.endpoint])
    doomed_rdzv = make_rdzv(replace(settings, node_ttl=2), on=doomed_store)
    events: queue.Queue[RoundEvent] = queue.Queue()
    r.subscribe(events.put)
    a, b, c = r.node(record("a")), r.node(record("b")), doomed_rdzv.node(record("c"))
    first = infos(join_all([a, b, c]))
    assert first["a"].world_size == 3
    # c's process dies: its keep-alives stop and etcd expires its lease after the TTL.
    doomed_rdzv.shutdown()
    doomed_store.close()
    end = a.wait_round_end(ROUND_END_WAIT)
    assert end is not None and end.lost == ("c",)
    second = infos(join_all([a, b]))
    assert second["a"].round == 2 and second["a"].world_size == 2
    assert sorted(v.member.group_rank for v in second.values() if v.member) == [0, 1]
    seen: list[RoundEvent] = []
    while not events.empty():
        seen.append(events.get())
    assert any(isinstance(e, RoundEnded) and e.lost == ("c",) for e in seen)
    assert [e.header.round for e in seen if isinstance(e, RoundSealed)][-1] == 2


def test_a_fenced_incarnation_can_never_register_again(make_rdzv, store: Store, job_keys: JobKeys) -> None:
    # The operator fenced pod uid-b (it counted it lost): its fence record outlives the revoked lease, so the
    # zombie's next registration is refused in the same transaction and says why; another incarnation of the
    # same pod name (a new pod, a new uid) registers as usual.
    settings = RendezvousSettings(min_nodes=2, max_nodes=2, last_call_timeout=0.3, node_ttl=30)
    r = make_rdzv(settings)
    a, b = r.node(record("a"), incarnation="uid-a"), r.node(record("b"), incarnation="uid-b")
    first = infos(join_all([a, b]))
    assert first["b"].round == 1
    store.put(job_keys.fenced("uid-b"), FenceRecord(node_id="b", pod_uid="uid-b",
                                                   reason="its node n1 is unreachable").to_json_bytes())
    assert b.lease is not None
    store.lease_revoke(b.lease)
    end = b.wait_round_end(ROUND_END_WAIT)
    assert end is not None and end.self_lost
    with pytest.raises(Fenced, match=r"node b: fenced by the operator \(its node n1 is unreachable\)"):
        b.join(timeout=JOIN_TIMEOUT)
    assert store.get(job_keys.node("b")) is None and b.lease is None  # nothing written, no lease left behind
    r2 = make_rdzv(settings)
    b2 = r2.node(record("b"), incarnation="uid-b2")
    second = infos(join_all([a, b2]))
    assert second["b"].round == 2


def test_when_the_sealers_node_goes_a_light_process_claims_the_key_and_seals_the_next_round(
        make_rdzv, etcd: EtcdServer) -> None:
    settings = RendezvousSettings(min_nodes=2, max_nodes=3, last_call_timeout=0.3, node_ttl=30)
    doomed_store = Store([etcd.endpoint])
    doomed_rdzv = make_rdzv(replace(settings, node_ttl=2), on=doomed_store)
    sealer = doomed_rdzv.node(record("s"))
    assert doomed_rdzv.wait_loaded(10)
    sealer._register(time.monotonic() + 10)  # the first to register claims the sealer's key with its node key
    r = make_rdzv(settings)
    a, b = r.node(record("a")), r.node(record("b"))
    first = infos(join_all([sealer, a, b]))
    assert first["a"].header.sealed_by == "s" and first["a"].world_size == 3
    assert doomed_rdzv.view().full and not r.view().full  # only the sealer's process watches every node
    assert set(r.view().nodes) == {"a", "b"}  # a light view holds its own nodes' keys only
    # The sealer's process dies: its lease expires, its node key and the sealer's key with it.
    doomed_rdzv.shutdown()
    doomed_store.close()
    end = a.wait_round_end(ROUND_END_WAIT)
    assert end is not None and end.lost == ("s",)
    second = infos(join_all([a, b]))
    view = r.view()
    assert view.full and view.sealer is not None and view.sealer.node_id in ("a", "b")
    assert second["a"].round == 2 and second["a"].world_size == 2
    assert second["a"].header.sealed_by == view.sealer.node_id


def test_leave_ends_the_round_for_the_others(make_rdzv) -> None:
    r = make_rdzv(RendezvousSettings(min_nodes=1, max_nodes=2, last_call_timeout=0.3, node_ttl=30))
    a, b = r.node(record("a")), r.node(record("b"))
    infos(join_all([a, b]))
    b.leave()
    end = a.wait_round_end(ROUND_END_WAIT)
    assert end is not None and end.lost == ("b",)
    assert a.join(timeout=JOIN_TIMEOUT).world_size == 1


def test_a_zombie_of_an_older_round_cannot_close_the_rendezvous(make_rdzv, store: Store,
                                                                 job_keys: JobKeys) -> None:
    r = make_rdzv(RendezvousSettings(min_nodes=2, max_nodes=2, node_ttl=30))
    a, zombie = r.node(record("a")), r.node(record("zombie"))
    first = infos(join_all([a, zombie]))["zombie"]
    a.request_rerendezvous("a newer round")
    second = a.join(timeout=JOIN_TIMEOUT)  # the zombie's key is still there: it is in round 2 too, unaware
    assert second.epoch > first.epoch and zombie.info is not None and zombie.info.epoch == first.epoch
    before = store.get_prefix(job_keys.rendezvous)[0]
    with pytest.raises(StaleEpoch) as err:
        zombie.close_rendezvous("a late close from round 1")
    assert (err.value.epoch, err.value.current) == (first.epoch, second.epoch)
    after = store.get_prefix(job_keys.rendezvous)[0]
    assert [(kv.key, kv.mod_revision) for kv in after] == [(kv.key, kv.mod_revision) for kv in before]
    assert store.get(job_keys.rendezvous + CLOSED) is None and a.round_end() is None
    a.close_rendezvous("job finished")  # the live round's member may
    closed = store.get(job_keys.rendezvous + CLOSED)
    assert closed is not None and ClosedRecord.from_json_bytes(closed.value).reason == "job finished"


def test_close_stops_new_rounds_and_spares_leave(make_rdzv) -> None:
    r = make_rdzv(RendezvousSettings(min_nodes=2, max_nodes=2, node_ttl=30))
    a, b, c = r.node(record("a")), r.node(record("b")), r.node(record("c"))
    got = infos(join_all([a, b, c]))
    # The third is a spare, or "waiting" if it registered just after the seal: either way outside the round.
    spare = next(h for h in (a, b, c) if got[h.node_id].role != "member")
    member = next(h for h in (a, b, c) if got[h.node_id].role == "member")
    member.close_rendezvous("job finished")
    end = spare.wait_round_end(ROUND_END_WAIT)
    assert end is not None and end.closed
    with pytest.raises(RendezvousClosed):
        spare.join(timeout=JOIN_TIMEOUT)
    assert member.round_end() is None  # the running round goes on
    spare.leave()
    other = next(h for h in (a, b, c) if h is not member and h is not spare)
    other.leave()
    end = member.wait_round_end(ROUND_END_WAIT)
    assert end is not None and end.lost
    with pytest.raises(RendezvousClosed):
        member.join(timeout=JOIN_TIMEOUT)


def test_a_zombie_from_an_older_round_writes_nothing(make_rdzv, store: Store, job_keys: JobKeys) -> None:
    r = make_rdzv(RendezvousSettings(min_nodes=1, max_nodes=1, node_ttl=30))
    a = r.node(record("a"))
    first = a.join(timeout=JOIN_TIMEOUT)
    zombie = a.fence()
    target = job_keys.restart + "barrier"
    zombie.put(target, b"round 1")
    a.request_rerendezvous("test")
    assert a.wait_round_end(ROUND_END_WAIT) is not None
    second = a.join(timeout=JOIN_TIMEOUT)
    assert second.epoch > first.epoch
    with pytest.raises(StaleEpoch) as err:
        zombie.put(target, b"zombie")
    assert err.value.epoch == first.epoch and err.value.current == second.epoch
    kv = store.get(target)
    assert kv is not None and kv.value == b"round 1"
    a.fence().put(target, b"round 2")
    # A node whose own key is gone is fenced out even before any new round is sealed.
    unregistered = Fence(store, job_keys, second.epoch, holder=("a", second.node_revision + 10_000))
    with pytest.raises(StaleEpoch, match="no longer registered"):
        unregistered.put(target, b"zombie")
    kv = store.get(target)
    assert kv is not None and kv.value == b"round 2"


def test_duplicate_node_id_is_refused(make_rdzv, etcd: EtcdServer) -> None:
    settings = RendezvousSettings(min_nodes=2, max_nodes=2, node_ttl=30)
    r = make_rdzv(settings)
    other_store = Store([etcd.endpoint])
    try:
        other = make_rdzv(settings, on=other_store)
        first = r.node(record("same"))
        outcome: queue.Queue[BaseException | None] = queue.Queue()

        def join_first() -> None:
            try:
                first.join(timeout=5.0)
                outcome.put(None)
            except BaseException as e:
                outcome.put(e)

        t = threading.Thread(target=join_first)
        t.start()
        while r.view().nodes.get("same") is None:
            first._wake.wait(0.05)
        with pytest.raises(DuplicateNode, match="held by another live node"):
            other.node(record("same")).join(timeout=1.0)
        t.join(30)
        assert isinstance(outcome.get(timeout=5), RendezvousTimeout)  # alone, below min
    finally:
        other_store.close()


def test_join_times_out_below_min_and_leaves(make_rdzv, store: Store, job_keys: JobKeys) -> None:
    r = make_rdzv(RendezvousSettings(min_nodes=2, max_nodes=2, node_ttl=30))
    h = r.node(record("alone"))
    with pytest.raises(RendezvousTimeout, match="1 nodes present, min 2"):
        h.join(timeout=1.0)
    assert store.get(job_keys.rendezvous + NODES + "alone") is None


def test_corrupt_and_oversized_values_give_clear_errors(make_rdzv, store: Store, job_keys: JobKeys) -> None:
    store.put(job_keys.rendezvous + NODES + "garbage", b"\x80\x04\x95 pickled?")
    r = make_rdzv(RendezvousSettings(min_nodes=1, max_nodes=1, node_ttl=30))
    info = r.node(record("a")).join(timeout=JOIN_TIMEOUT)  # one bad record does not stop the rendezvous
    assert info.role == "member" and info.world_size == 1
    problem = r.view().problems[NODES + "garbage"]
    assert "corrupt record at 'nodes/garbage'" in problem and "NodeRecord" in problem
    with pytest.raises(ValueTooLarge, match="limit"):
        Fence(store, job_keys, info.epoch).put(job_keys.restart + "big", b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(ValueError, match="limit"):
        Manifest.from_json_bytes(b" " * (MAX_VALUE_BYTES + 1))


def test_etcd_restarted_during_a_rendezvous(private_etcd: EtcdServer) -> None:
    from stalwart.agent.rendezvous import Rendezvous

    store = Store([private_etcd.endpoint], timeout=2.0)
    keys = JobKeys("test", "restart")
    r = Rendezvous(store, keys, RendezvousSettings(min_nodes=3, max_nodes=3, node_ttl=30))
    try:
        handles = [r.node(record(f"n{i}")) for i in range(3)]
        results: dict[str, object] = {}
        threads = [threading.Thread(target=lambda h=h: results.__setitem__(h.node_id, h.join(timeout=90)))
                   for h in handles[:2]]
        for t in threads:
            t.start()
        while len(r.view().nodes) < 2:
            handles[0]._wake.wait(0.05)
        private_etcd.stop()
        # The third node starts joining while etcd is down; it retries until etcd is back.
        last = threading.Thread(target=lambda: results.__setitem__("n2", handles[2].join(timeout=90)))
        last.start()
        private_etcd.start()
        for t in [*threads, last]:
            t.join(120)
        got = {k: v for k, v in results.items()}
        assert set(got) == {"n0", "n1", "n2"}, results
        ranks = sorted(v.member.group_rank for v in got.values())  # type: ignore[attr-defined]
        assert ranks == [0, 1, 2]
        assert len({v.epoch for v in got.values()}) == 1  # type: ignore[attr-defined]
    finally:
        r.shutdown()
        store.close()


def test_the_operators_expected_set_seals_without_the_last_call(make_rdzv) -> None:
    r = make_rdzv(RendezvousSettings(min_nodes=1, max_nodes=8, last_call_timeout=600, node_ttl=30))
    r.set_expected(["a", "b"])
    got = infos(join_all([r.node(record("a")), r.node(record("b"))]))
    assert {i.world_size for i in got.values()} == {2}


def test_a_restarted_node_waits_out_its_dead_incarnation(make_rdzv, etcd: EtcdServer) -> None:
    settings = RendezvousSettings(min_nodes=1, max_nodes=1, node_ttl=30)
    old_store = Store([etcd.endpoint])
    old = make_rdzv(replace(settings, node_ttl=2), on=old_store).node(record("pod-0"))
    first = old.join(timeout=JOIN_TIMEOUT)
    # The pod's process dies without leaving; the new process registers the same id at once.
    old.rdzv.shutdown()
    old_store.close()
    again = make_rdzv(settings).node(record("pod-0"))
    second = again.join(timeout=JOIN_TIMEOUT)
    assert second.epoch > first.epoch and second.node_revision > first.node_revision
