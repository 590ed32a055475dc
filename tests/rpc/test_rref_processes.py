"""RRefs across real processes with etcd membership: random fork trees under injected faults (hypothesis),
and a worker killed in the middle of the protocol."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mp_ranks
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rpc_helpers import CONTROL, TOKEN, sealed, wait_for, worker_main

from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer
from stalwart.rpc import EtcdMembership, RemoteError, RetryOptions, RpcAgent, WorkerDied

pytestmark = pytest.mark.integration

WORKERS = ("w1", "w2", "w3")


@dataclass
class Cluster:
    driver: RpcAgent
    membership: EtcdMembership
    procs: dict[str, Any]
    stop: Any
    store: Store

    def call(self, worker: str, fn: str, *args: Any) -> Any:
        return self.driver.rpc_sync(worker, fn, args, timeout=90)

    def states(self, workers: tuple[str, ...] = WORKERS) -> dict[str, dict[str, Any]]:
        return {w: self.call(w, "p.state") for w in workers}


def start_cluster(etcd: EtcdServer) -> Cluster:
    ctx = mp_ranks.context()
    uid = uuid.uuid4().hex[:12]
    stop = []  # one pipe per worker: an Event's lock would be left broken by the worker we kill
    procs = {}
    for rank, name in enumerate(WORKERS, start=1):
        receiver, sender = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker_main,
                        args=((name, rank), etcd.endpoint, ("test", uid), len(WORKERS) + 1, receiver),
                        name=f"rpc-{name}")
        p.start()
        receiver.close()
        stop.append(sender)
        procs[name] = p
    store = Store([etcd.endpoint], timeout=5.0)
    driver = RpcAgent("w0", 0, token=TOKEN)
    membership = None
    try:
        driver.start()
        membership = EtcdMembership(store, JobKeys("test", uid), epoch=sealed(store, JobKeys("test", uid)),
                                    lease_ttl=2)
        driver.join(membership)
        membership.register(driver.member)
        membership.wait_for(len(WORKERS) + 1, timeout=120)
        everyone = ["w0", *WORKERS]
        wait_for(lambda: all(driver.rpc_sync(w, "p.sees", (everyone,), timeout=90) for w in WORKERS),
                 timeout=120, what="every worker seeing the whole job")
    except BaseException:
        driver.shutdown(graceful=False)
        if membership is not None:
            membership.close()
        _stop_procs(stop, procs)
        store.close()
        raise
    return Cluster(driver, membership, procs, stop, store)


def _stop_procs(stop: list[Any], procs: dict[str, Any]) -> None:
    for sender in stop:
        with contextlib.suppress(OSError):
            sender.send("stop")
        sender.close()
    for p in procs.values():
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()


def stop_cluster(cluster: Cluster) -> None:
    """Shut the driver and the workers down together: graceful shutdown is a barrier among all of them."""
    driver = threading.Thread(target=cluster.driver.shutdown, kwargs={"graceful": True, "timeout": 20})
    driver.start()
    try:
        _stop_procs(cluster.stop, cluster.procs)
    finally:
        driver.join()
        cluster.membership.close()
        cluster.store.close()


@pytest.fixture(scope="module")
def cluster(etcd_server: EtcdServer) -> Iterator[Cluster]:
    c = start_cluster(etcd_server)
    try:
        faults = {"drop": 0.1, "duplicate": 0.2, "reorder": 0.2, "delay": 0.3, "delay_range": [0.0, 0.03]}
        for i, w in enumerate(WORKERS):
            c.call(w, "p.faults", 1000 + i, dict.fromkeys(CONTROL, faults))
        yield c
    finally:
        stop_cluster(c)


def quiescent(states: dict[str, dict[str, Any]]) -> bool:
    return all(not (s["owners"] or s["parked"] or s["children"] or s["users"] or s["pending"])
               for s in states.values())


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_fork_trees_reach_quiescence_without_early_frees(cluster: Cluster, data: st.DataObject) -> None:
    run = uuid.uuid4().hex[:6]
    handles: dict[str, tuple[str, str]] = {}  # handle key -> (holder, label)
    labels: dict[str, str] = {}  # label -> rref id
    values: dict[str, str] = {}  # label -> the key its value was made with
    freed_before = {w: set(s["freed_log"]) for w, s in cluster.states().items()}
    for n in range(data.draw(st.integers(4, 10), label="steps")):
        ops = ["make", "send", "send", "drop", "get"] if handles else ["make"]
        op = data.draw(st.sampled_from(ops), label="op")
        key = f"{run}-{n}"
        if op == "make":
            holder = data.draw(st.sampled_from(WORKERS), label="holder")
            owner = data.draw(st.sampled_from(WORKERS), label="owner")
            labels[key] = cluster.call(holder, "p.make", key, owner)
            values[key] = key
            handles[key] = (holder, key)
        else:
            victim = data.draw(st.sampled_from(sorted(handles)), label="handle")
            holder, label = handles[victim]
            if op == "send":
                dst = data.draw(st.sampled_from(WORKERS), label="to")
                cluster.call(holder, "p.send", victim, key, dst)
                handles[key] = (dst, label)
            elif op == "drop":
                cluster.call(holder, "p.drop", victim)
                del handles[victim]
            else:
                assert cluster.call(holder, "p.get", victim)["key"] == values[label]
        # no value with a live handle has been freed (the owners' freed logs are the generation record)
        live = {labels[label] for _, label in handles.values()}
        freed = set().union(*(set(s["freed_log"]) for s in cluster.states().values()))
        assert not (live & freed), f"freed while referenced: {live & freed}"
    for w in WORKERS:
        cluster.call(w, "p.drop_all")
    last: list[Any] = [None]

    def settled() -> bool:
        last[0] = cluster.states()
        return quiescent(last[0])

    try:
        wait_for(settled, timeout=60, what="quiescence")
    except AssertionError:
        raise AssertionError(f"not quiescent: {last[0]}") from None
    states = cluster.states()
    freed_now = [r for w, s in states.items() for r in s["freed_log"] if r not in freed_before[w]]
    assert sorted(freed_now) == sorted(labels.values())  # every value freed, exactly once


def test_worker_killed_mid_protocol(etcd_server: EtcdServer) -> None:
    c = start_cluster(etcd_server)
    try:
        a_id = c.call("w1", "p.make", "A", "w2")  # owned by w2, held by w1
        b_id = c.call("w3", "p.make", "B", "w1")  # owned by w1 (the worker about to die), held by w3
        c.call("w3", "p.send", "B", "B2", "w2")  # w2 holds B too
        # w3's acceptance of the fork it gets next is held up, so the kill lands inside the protocol
        c.call("w3", "p.faults", 7, {"accept": {"delay": 1.0, "delay_range": [1.0, 1.5]}})
        c.call("w1", "p.send", "A", "A3", "w3")
        assert c.states(("w1",))["w1"]["children"]  # w1 still keeps A for the unconfirmed child
        # an idempotent call survives the broken stream by retrying, and fails when w1's lease expires
        retry = RetryOptions(max_retries=10_000, initial_delay=0.05, max_delay=0.5, deadline=120)
        slow = c.driver.rpc_async("w1", "t.wait_gate", ("dying",), timeout=120, idempotent=True, retry=retry)
        os.kill(c.procs["w1"].pid, signal.SIGKILL)
        with pytest.raises(WorkerDied):
            slow.wait(60)

        def reclaimed() -> bool:
            owners = c.states(("w2",))["w2"]["owners"]
            return owners.get(a_id) == ["w3"]

        wait_for(reclaimed, timeout=60, what="w2 dropping the fork w1 held")
        for holder, key in (("w3", "B"), ("w2", "B2")):
            with pytest.raises(RemoteError) as e:
                c.call(holder, "p.get", key)
            assert e.value.type == "OwnerDied"
        assert c.call("w3", "p.get", "A3")["key"] == "A"
        for w in ("w2", "w3"):
            c.call(w, "p.drop_all")
        wait_for(lambda: quiescent(c.states(("w2", "w3"))), timeout=60, what="survivors quiescent")
        assert a_id in c.states(("w2",))["w2"]["freed_log"]
        assert b_id not in c.states(("w2",))["w2"]["freed_log"]
    finally:
        stop_cluster(c)
