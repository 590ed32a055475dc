"""The scale simulator charges the project's code its CPU time: a simulated process's work advances the clock
by what it took, before the requests it then makes, one piece of work at a time per process; the simulator's
own work (the model etcd) costs nobody anything."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

from bench.scalesim.sim import Background, Costs, Sim, TimedStore
from stalwart.api.pacing import PROGRESS_WRITES_PER_SECOND
from stalwart.etcd.store import WatchEvent, WatchRange

COSTS = Costs(rtt=0.001, write=0.002, read=0.001, event=0.0001)


def burn(seconds: float) -> None:
    """A deliberately slow function: ``seconds`` of this thread's CPU."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_a_slow_function_costs_what_it_took_and_delays_the_request_after_it() -> None:
    sim = Sim(COSTS)
    store, owner = TimedStore(sim), object()
    sim.now = 5.0
    with sim.working(owner, "plan"):
        burn(0.05)
        store.put("k", b"v")
    took = sim.cpu_seconds["plan"]
    assert 0.05 <= took < 0.5
    # The put was sent after the computation: it reached the server half a round trip later and took a write.
    assert sim.committed_at[-1] >= 5.0 + 0.05 + COSTS.rtt / 2 + COSTS.write - 1e-9
    assert sim.now >= sim.committed_at[-1] + COSTS.rtt / 2 - 1e-9
    # The process is one: its next work, due before it was free, starts when it is.
    free = sim.now
    sim.now = 5.0
    with sim.working(owner, "plan"):
        pass
    assert sim.now >= free


def test_without_charging_the_same_work_takes_no_simulated_time_but_is_still_measured() -> None:
    sim = Sim(COSTS, cpu=False)
    store = TimedStore(sim)
    with sim.working(object(), "plan"):
        burn(0.03)
        store.put("k", b"v")
    assert sim.cpu_seconds["plan"] >= 0.03
    assert sim.committed_at[-1] == COSTS.rtt / 2 + COSTS.write


def test_the_model_etcds_own_work_is_not_charged() -> None:
    sim = Sim(COSTS)
    for i in range(20000):
        sim.mem.put(f"p/{i:06d}", b"x" * 40)
    store = TimedStore(sim)
    start = time.thread_time()
    with sim.working(object(), "read"):
        kvs, _ = store.get_prefix("p/")
    spent = time.thread_time() - start
    assert len(kvs) == 20000
    # Reading 20,000 keys from the model costs the simulator CPU, and the process only the modelled read.
    assert spent > 0.002 and sim.cpu_seconds["read"] < spent / 4


def test_batches_that_arrive_while_a_process_computes_are_handled_as_one_when_it_is_free() -> None:
    sim = Sim(COSTS)
    owner = object()
    handled: list[tuple[list[str], float]] = []

    def handle(events: list[WatchEvent], when: float) -> None:
        handled.append(([ev.kv.key for ev in events], when))
    deliver = sim.serial(owner, handle)
    sim.subscribe((WatchRange("k", prefix=True),), 1, deliver)
    store = TimedStore(sim)
    with sim.working(owner, "busy"):
        burn(0.05)
    free = sim.now
    sim.now = 0.0
    for key in ("k1", "k2", "k3"):  # committed while the owner computes
        store.put(key, b"v")
    sim.run(10.0)
    assert [keys for keys, _ in handled] == [["k1", "k2", "k3"]]
    assert handled[0][1] >= free


def test_the_background_load_is_served_at_its_rate() -> None:
    # 3,000 ranks and 375 pods: the ranks' liveness on their pod's own lease (stalwart.agent.rank_liveness, the
    # TTLs equal), 112.5 refreshes a second, and the progress writes as the agents pace them
    # (stalwart.agent.progress.progress_interval): 375 pods write every 375/256 s, 256 writes a second.
    load = replace(Background(ranks=3000, nodes=375), ranks_on_node_lease=False)
    assert load.rates() == pytest.approx({"rank_lease_refresh": 112.5, "node_lease_refresh": 112.5,
                                          "progress_write": PROGRESS_WRITES_PER_SECOND})
    shared = Background(ranks=3000, nodes=375)
    assert shared.rates() == pytest.approx({"rank_lease_refresh": 0.0, "node_lease_refresh": 112.5,
                                            "progress_write": PROGRESS_WRITES_PER_SECOND})
    # A heartbeat TTL other than the node's: a lease of the pod's own beside the node's.
    assert Background(ranks=3000, nodes=375, rank_ttl=20.0).rates()["rank_lease_refresh"] == pytest.approx(56.25)
    sim = Sim(COSTS)
    sim.background(load, 0.0, 10.0)
    sim.run(10.0)
    assert sim.background_requests / 10.0 == pytest.approx(112.5 + 112.5 + PROGRESS_WRITES_PER_SECOND, rel=0.01)
    # They occupy the server as they would: a request sent now waits behind what the load has queued.
    assert sim.server.busy_total == pytest.approx(10.0 * load.busy_per_second(COSTS), rel=0.01)
    assert load.busy_per_second(COSTS) == pytest.approx((112.5 + 112.5) * COSTS.read
                                                        + PROGRESS_WRITES_PER_SECOND * COSTS.write)
    # With a lease per rank (ranks without an agent), every rank's: 3,000 over its TTL/3, whatever the node's.
    assert Background(ranks=3000, nodes=375, ranks_per_lease=1).rates()["rank_lease_refresh"] == 900.0
    # A job that sets its own interval is charged that.
    assert Background(ranks=3000, nodes=375, progress_interval=1.0).rates()["progress_write"] == 375.0


def test_a_barrier_under_background_load_takes_longer_than_without() -> None:
    from bench.scalesim.restart import RestartRun

    quiet = RestartRun(200, COSTS, cpu=False).restart()
    # The server busy 33% of the time with the load alone (125 pods' two leases and progress writes at these costs;
    # 59% with a lease per rank; 29% with the ranks on the node's lease).
    load = Background(ranks=1000, nodes=125, ranks_on_node_lease=False)
    assert load.busy_per_second(COSTS) == pytest.approx(0.325)
    assert Background(ranks=1000, nodes=125).busy_per_second(COSTS) == pytest.approx(0.2875)
    assert replace(load, ranks_per_lease=1).busy_per_second(COSTS) == pytest.approx(0.5875)
    busy = RestartRun(200, COSTS, cpu=False, background=load).restart()
    assert quiet["released"] == busy["released"] == 200
    assert busy["seconds"] > quiet["seconds"]


def test_on_threads_a_process_computes_one_thing_at_a_time_but_its_waits_on_etcd_hold_no_one() -> None:
    sim = Sim(Costs(rtt=0.01, write=0.0, read=0.0), threads=True)
    store, owner = TimedStore(sim), object()
    with sim.working(owner, "a"):  # thread A: computes, waits 10 ms on etcd, computes
        burn(0.02)
        store.revision()
        burn(0.02)
    a_done = sim.now
    sim.now = 0.0
    with sim.working(owner, "b"):  # thread B, ready at 0: runs in A's wait, not after A's second burn
        burn(0.005)
    took_a, took_b = sim.cpu_seconds["a"], sim.cpu_seconds["b"]
    assert sim.now < a_done - took_a / 2
    # Its CPU still waited for A's first burn (20 ms of CPU at least, as burn() spends; half of A's two burns
    # once fell 3 us short of the first): one interpreter lock.
    assert sim.now >= 0.02 + took_b - 1e-9
