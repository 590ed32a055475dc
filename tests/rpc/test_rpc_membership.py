"""RPC membership in a real etcd: lease-bound worker records, deaths, and the rendezvous adapter."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from rpc_helpers import wait_for

from stalwart.agent.rendezvous import Rendezvous, RendezvousSettings, RoundEnded, RoundSealed
from stalwart.api.rendezvous import NodeRecord
from stalwart.api.rpc import RpcWorkerRecord
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer
from stalwart.rpc import EtcdMembership, ViewChanged, Worker, WorkerLeft
from stalwart.rpc.membership import Fenced, registration_refused

pytestmark = pytest.mark.integration


def _events(membership: EtcdMembership) -> list[Any]:
    seen: list[Any] = []
    membership.subscribe(seen.append)
    return seen


def test_workers_register_and_a_revoked_lease_reports_the_death(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as s1, Store([etcd.endpoint]) as s2:
        epoch = s1.put(keys.manifest, b"{}")  # a sealed round: workers register in it
        a = EtcdMembership(s1, keys, epoch=epoch, lease_ttl=5)
        b = EtcdMembership(s2, keys, epoch=epoch, lease_ttl=5)
        try:
            seen = _events(a)
            a.register(Worker("a", 0, "127.0.0.1:1001", "i1"), node="node-a")
            b.register(Worker("b", 1, "127.0.0.1:1002", "i2"), node="node-b")
            view = a.wait_for(2, timeout=30)
            assert view.epoch == epoch and view.members["b"].address == "127.0.0.1:1002"
            b.close()  # revokes b's lease: its record goes at once
            wait_for(lambda: any(isinstance(e, WorkerLeft) and e.name == "b" for e in seen), what="b gone")
            assert "b" not in a.view().members
        finally:
            a.close()
            b.close()


def test_a_new_round_moves_the_epoch_and_excludes_other_nodes(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as s1, Store([etcd.endpoint]) as s2:
        first = s1.put(keys.manifest, b"{}")
        a = EtcdMembership(s1, keys, epoch=first, lease_ttl=5)
        b = EtcdMembership(s2, keys, epoch=first, lease_ttl=5)
        try:
            seen = _events(a)
            a.register(Worker("a", 0, "127.0.0.1:1001", "i1"), node="node-a")
            b.register(Worker("b", 1, "127.0.0.1:1002", "i2"), node="node-b")
            a.wait_for(2, timeout=30)
            second = s1.put(keys.manifest, b"{}")
            a.advance(second, keep_nodes={"node-a"})
            assert WorkerLeft("b", f"not a member of the round of epoch {second}", "i2") in seen
            assert a.view().epoch == second and "b" not in a.view().members

            def reregistered() -> bool:
                kv = s1.get(keys.rpc + "workers/a")
                return kv is not None and RpcWorkerRecord.from_json_bytes(kv.value).epoch == second

            wait_for(reregistered, what="a's record in the new epoch")
            with pytest.raises(ValueError, match="epoch"):
                a.advance(second - 1)
        finally:
            a.close()
            b.close()


def follow_rendezvous(rendezvous: Rendezvous, membership: EtcdMembership) -> Any:
    """Drive ``membership`` from a rendezvous, as a process that runs both would: a sealed round moves it to
    the round's epoch and excludes workers on nodes outside it; a round that ended because nodes were lost
    reports their workers gone at once. Returns the unsubscriber."""

    def on_event(event: Any) -> None:
        if isinstance(event, RoundSealed):
            membership.advance(event.epoch, {m.node_id for m in event.manifest.members})
        elif isinstance(event, RoundEnded) and event.lost:
            membership.exclude_nodes(tuple(event.lost), f"node lost in the round of epoch {event.epoch}: "
                                                        f"{event.reason}")

    return rendezvous.subscribe(on_event)


def test_follow_rendezvous_takes_the_sealed_epoch(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as store:
        rdzv = Rendezvous(store, keys, RendezvousSettings(min_nodes=2, max_nodes=2, node_ttl=10))
        membership = EtcdMembership(store, keys, epoch=0, lease_ttl=5)
        try:
            seen = _events(membership)
            unsubscribe = follow_rendezvous(rdzv, membership)
            membership.register(Worker("r0", 0, "127.0.0.1:1001", "i1"), node="node-0")
            handles = [rdzv.node(NodeRecord(node_id=f"node-{i}", address="127.0.0.1")) for i in range(2)]
            infos: list[Any] = []
            threads = [threading.Thread(target=lambda h=h: infos.append(h.join(timeout=60))) for h in handles]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            assert len(infos) == 2
            epoch = infos[0].epoch
            wait_for(lambda: membership.view().epoch == epoch, what="the sealed round's epoch")
            assert any(isinstance(e, ViewChanged) and e.view.epoch == epoch for e in seen)
            unsubscribe()
            for h in handles:
                h.leave()
        finally:
            membership.close()
            rdzv.shutdown()


# -- a registration belongs to the round the manifest names (issue 31, finding 5) -----------------------------


def test_a_worker_of_an_old_round_does_not_register_after_the_manifest_moved_on(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as store:
        old = store.put(keys.manifest, b"{}")
        late = EtcdMembership(store, keys, epoch=old, lease_ttl=5)
        try:
            new = store.put(keys.manifest, b"{}")  # the next round is sealed before the old worker registers
            with pytest.raises(Fenced, match=f"of the round of epoch {old} is fenced: the manifest names the "
                                             f"round of epoch {new}"):
                late.register(Worker("w1", 1, "127.0.0.1:1001", "late"), node="node-old")
            assert store.get(keys.rpc + "workers/w1") is None  # nothing written
        finally:
            late.close()


def test_a_record_claiming_a_future_epoch_neither_registers_nor_locks_the_worker_out(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as store:
        epoch = store.put(keys.manifest, b"{}")
        forger = EtcdMembership(store, keys, epoch=10**12, lease_ttl=5)
        real = EtcdMembership(store, keys, epoch=epoch, lease_ttl=5)
        try:
            with pytest.raises(Fenced, match="claims the round of epoch 1000000000000, which is not sealed"):
                forger.register(Worker("w1", 1, "127.0.0.1:6666", "forged"))
            assert store.get(keys.rpc + "workers/w1") is None
            # Written behind the membership's back (a plain put): the real worker still takes its name.
            forged = RpcWorkerRecord(name="w1", rank=1, address="127.0.0.1:6666", epoch=10**12, incarnation="x")
            store.put(keys.rpc + "workers/w1", forged.to_json_bytes())
            real.register(Worker("w1", 1, "127.0.0.1:1001", "real"))
            kv = store.get(keys.rpc + "workers/w1")
            assert kv is not None and kv.lease == real.lease
            assert RpcWorkerRecord.from_json_bytes(kv.value).incarnation == "real"
        finally:
            forger.close()
            real.close()


@pytest.mark.parametrize(("mine", "held", "round_epoch", "refused"), [
    pytest.param(5, None, 5, None, id="the round's worker"),
    pytest.param(5, 5, 5, None, id="respawned within its round"),
    pytest.param(5, 3, 5, None, id="replaces the last round's"),
    pytest.param(5, None, 9, "is fenced: the manifest names the round of epoch 9", id="an old round's"),
    pytest.param(9, None, 5, "claims the round of epoch 9, which is not sealed", id="a round from the future"),
    pytest.param(5, 10**12, 5, None, id="a record from the future holds no round"),
    pytest.param(0, None, 0, None, id="no round sealed yet"),
])
def test_when_a_registration_is_refused(mine: int, held: int | None, round_epoch: int,
                                        refused: str | None) -> None:
    def rec(epoch: int) -> RpcWorkerRecord:
        return RpcWorkerRecord(name="w", rank=0, address="h:1", epoch=epoch, incarnation="i")

    why = registration_refused(rec(mine), None if held is None else rec(held), round_epoch)
    assert why is None if refused is None else (why is not None and refused in why)
