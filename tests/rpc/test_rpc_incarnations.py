"""A rank process respawned within its round registers a new incarnation under the same name: its peers must
learn that the old one died (its calls fail, its values are lost), and keep reaching the name."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from typing import Any

import mp_ranks
import pytest
from rpc_helpers import TOKEN, sealed, wait_for, world

from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer
from stalwart.rpc import (
    EtcdMembership,
    MembershipView,
    OwnerDied,
    RetryOptions,
    RpcAgent,
    Worker,
    WorkerDied,
    WorkerLeft,
)
from stalwart.rref import RRefRuntime

pytestmark = pytest.mark.integration

#: Long enough that no lease expires during the test: only the new incarnation's record tells of the death.
LEASE_TTL = 120


def incarnation_main(endpoint: str, job: tuple[str, str], stop: Any) -> None:
    """Worker ``b`` (rank 1): registers in the job's RPC membership and serves until told to stop."""
    from rpc_helpers import StreamTransport  # registers the test functions in this process

    from stalwart.rpc import init_rpc, shutdown

    store = Store([endpoint], timeout=5.0)
    init_rpc("b", 1, store=store, keys=JobKeys(*job), epoch=sealed(store, JobKeys(*job)), lease_ttl=LEASE_TTL,
             transport=StreamTransport(TOKEN))
    with contextlib.suppress(EOFError):
        stop.recv()
    shutdown(graceful=False)
    store.close()


def test_a_respawned_incarnation_reports_the_old_one_dead(etcd: EtcdServer) -> None:
    ctx = mp_ranks.context()
    job = ("test", uuid.uuid4().hex[:12])
    pipes: list[Any] = []
    procs: list[Any] = []

    def start_b() -> Any:
        receiver, sender = ctx.Pipe(duplex=False)
        p = ctx.Process(target=incarnation_main, args=(etcd.endpoint, job, receiver), name="rpc-b")
        p.start()
        receiver.close()
        pipes.append(sender)
        procs.append(p)
        return p

    store = Store([etcd.endpoint], timeout=5.0)
    driver = RpcAgent("a", 0, token=TOKEN)
    driver.start()
    membership = EtcdMembership(store, JobKeys(*job), epoch=sealed(store, JobKeys(*job)), lease_ttl=LEASE_TTL)
    try:
        driver.join(membership)
        membership.register(driver.member)
        first = start_b()
        membership.wait_for(2, timeout=120)
        rref = RRefRuntime.of(driver).remote("b", "t.value", ("x",), timeout=60)
        assert rref.to_here(timeout=60)["pid"] == first.pid
        retry = RetryOptions(max_retries=10_000, initial_delay=0.05, max_delay=0.5, deadline=120)
        pending = driver.rpc_async("b", "t.wait_gate", ("held",), timeout=120, idempotent=True, retry=retry)
        old = membership.view().members["b"].incarnation

        os.kill(first.pid, signal.SIGKILL)  # the process dies; its lease (and record) would outlive the test
        first.join()
        second = start_b()  # its agent respawns it: same name, new incarnation

        start = time.monotonic()
        with pytest.raises(WorkerDied):
            pending.wait(90)  # the call to the dead incarnation fails, not retried into the void
        with pytest.raises(OwnerDied):
            rref.to_here(timeout=90)  # the value died with its owner
        assert time.monotonic() - start < 60, "the peers learnt of the death only from timeouts"
        # The name lives on: calls reach the new incarnation, once its record is in the driver's view (a call
        # made between the news of the death and the successor's record fails WorkerDied, as it should).
        def successor_in_view() -> bool:
            current = driver._peers.view.members.get("b")
            return current is not None and current.incarnation != old and "b" not in driver.debug_state()["dead"]

        wait_for(successor_in_view, what="the new incarnation of b in the driver's view")
        assert driver.rpc_sync("b", "t.value", ("y",), timeout=60)["pid"] == second.pid
        assert membership.view().members["b"].incarnation != old
    finally:
        driver.shutdown(graceful=False)
        membership.close()
        store.close()
        for sender in pipes:
            with contextlib.suppress(OSError):
                sender.send("stop")
            sender.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


def test_news_of_an_old_incarnation_that_comes_late_does_not_kill_the_new_one() -> None:
    # Membership events come from several threads: the view holding the new incarnation may be applied
    # before the news that the old one left. Only the old one is dead then; the name stays reachable.
    agents, membership = world(2)
    caller, callee = agents
    try:
        old = callee.member
        new = Worker(old.name, old.rank, old.address, old.incarnation + "-respawned")
        membership.set_view(MembershipView.of(membership.view().epoch, [caller.member, new]))
        membership._emit(WorkerLeft(old.name, "restarted", old.incarnation))  # the late news
        assert caller.rpc_sync("w1", "t.echo", ("still here",), timeout=30) == "still here"
    finally:
        for a in agents:
            a.shutdown(graceful=False)
