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

pytestmark = pytest.mark.integration


def _events(membership: EtcdMembership) -> list[Any]:
    seen: list[Any] = []
    membership.subscribe(seen.append)
    return seen


def test_workers_register_and_a_revoked_lease_reports_the_death(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as s1, Store([etcd.endpoint]) as s2:
        a = EtcdMembership(s1, keys, epoch=3, lease_ttl=5)
        b = EtcdMembership(s2, keys, epoch=3, lease_ttl=5)
        try:
            seen = _events(a)
            a.register(Worker("a", 0, "127.0.0.1:1001", "i1"), node="node-a")
            b.register(Worker("b", 1, "127.0.0.1:1002", "i2"), node="node-b")
            view = a.wait_for(2, timeout=30)
            assert view.epoch == 3 and view.members["b"].address == "127.0.0.1:1002"
            b.close()  # revokes b's lease: its record goes at once
            wait_for(lambda: any(isinstance(e, WorkerLeft) and e.name == "b" for e in seen), what="b gone")
            assert "b" not in a.view().members
        finally:
            a.close()
            b.close()


def test_a_new_round_moves_the_epoch_and_excludes_other_nodes(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as s1, Store([etcd.endpoint]) as s2:
        a = EtcdMembership(s1, keys, epoch=1, lease_ttl=5)
        b = EtcdMembership(s2, keys, epoch=1, lease_ttl=5)
        try:
            seen = _events(a)
            a.register(Worker("a", 0, "127.0.0.1:1001", "i1"), node="node-a")
            b.register(Worker("b", 1, "127.0.0.1:1002", "i2"), node="node-b")
            a.wait_for(2, timeout=30)
            a.advance(7, keep_nodes={"node-a"})
            assert WorkerLeft("b", "not a member of the round of epoch 7", "i2") in seen
            assert a.view().epoch == 7 and "b" not in a.view().members

            def reregistered() -> bool:
                kv = s1.get(keys.rpc + "workers/a")
                return kv is not None and RpcWorkerRecord.from_json_bytes(kv.value).epoch == 7

            wait_for(reregistered, what="a's record in epoch 7")
            with pytest.raises(ValueError, match="epoch"):
                a.advance(6)
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
