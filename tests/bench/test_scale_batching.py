"""The model etcd charges raft's batching of concurrent proposals: a proposal costs the calibration's row of the
proposals in flight when it arrives (interpolated in the logarithm of the concurrency, held at either end), so
a burst is charged as etcd batches it and a lone proposal as one alone; linearizable reads likewise, apart. Table
tests of the server's arithmetic."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

from bench.scalesim.sim import Costs, Server, Sim, TimedStore
from stalwart.etcd.store import Put, WatchRange

ROWS = ((16.0, 1e-3), (256.0, 2.5e-4), (2048.0, 1e-4))


@pytest.mark.parametrize(("in_flight", "seconds"), [
    (1, 1e-3),            # below the first row: held at it
    (16, 1e-3),
    (64, 5e-4 + 1.25e-4),  # halfway between 16 and 256 in log: halfway between their costs
    (256, 2.5e-4),
    (2048, 1e-4),
    (100000, 1e-4),        # past the last row: held at it
])
def test_a_proposal_costs_the_row_of_its_concurrency(in_flight: float, seconds: float) -> None:
    assert Costs(write_batched=ROWS).write_at(in_flight) == pytest.approx(seconds)


def test_without_rows_every_proposal_costs_write() -> None:
    assert Costs(write=7e-4).write_at(1) == Costs(write=7e-4).write_at(5000) == 7e-4


def _expected(rows: tuple[tuple[float, float], ...], k: float) -> float:
    (c0, s0), (c1, s1) = rows
    return s0 if k <= c0 else s1 if k >= c1 else s0 + (s1 - s0) * math.log(k / c0) / math.log(c1 / c0)


@pytest.mark.parametrize(("arrivals", "proposals", "extra", "done"), [
    # Four proposals at once: the k-th meets k in flight (itself and the k - 1 ahead of it).
    ([0.0] * 4, [1] * 4, [0.0] * 4,
     [sum(_expected(((1, 1e-3), (4, 2.5e-4)), k) for k in range(1, j + 1)) for j in range(1, 5)]),
    # Apart: each arrives after the one before finished, alone, at the cost of one.
    ([0.0, 0.01, 0.02], [1] * 3, [0.0] * 3, [1e-3, 0.011, 0.021]),
    # A read between two proposals is not a proposal in flight; it costs its own time only.
    ([0.0, 0.0, 0.0], [1, 0, 1], [0.0, 5e-4, 0.0],
     [1e-3, 1.5e-3, 1.5e-3 + _expected(((1, 1e-3), (4, 2.5e-4)), 2)]),
    # A transaction that also reads pays for its read beside its proposal.
    ([0.0], [1], [3e-4], [1.3e-3]),
    # A background tick of 4 proposals at once is charged as 4 in flight.
    ([0.0], [4], [0.0], [4 * 2.5e-4]),
])
def test_the_server_charges_each_proposal_at_the_concurrency_it_meets(
        arrivals: list[float], proposals: list[int], extra: list[float], done: list[float]) -> None:
    server = Server(Costs(write_batched=((1, 1e-3), (4, 2.5e-4))))
    got = [server.serve(a, e, proposals=float(p)) for a, p, e in zip(arrivals, proposals, extra, strict=True)]
    assert got == pytest.approx(done)


def test_reads_are_batched_apart_from_proposals() -> None:
    server = Server(Costs(read=9.0, write=1e-3, read_batched=((1, 4e-4), (4, 1e-4))))
    # Four reads at once: the k-th meets k reads in flight; the proposal among them meets none of its kind.
    got = [server.serve(0.0, 0.0, reads=1.0) for _ in range(2)] + [server.serve(0.0, 0.0, proposals=1.0)] + \
        [server.serve(0.0, 0.0, reads=1.0) for _ in range(2)]
    r = [_expected(((1, 4e-4), (4, 1e-4)), k) for k in range(1, 5)]
    assert got == pytest.approx([r[0], r[0] + r[1], r[0] + r[1] + 1e-3, r[0] + r[1] + 1e-3 + r[2],
                                 r[0] + r[1] + 1e-3 + r[2] + r[3]])
    assert Costs(read=3e-4).read_at(100) == 3e-4  # without rows, ``read``


def test_in_flight_counts_the_proposals_not_finished_when_one_arrives() -> None:
    server = Server(Costs(write=1e-3))
    for _ in range(3):
        server.serve(0.0, 0.0, proposals=1.0)  # finish at 1, 2 and 3 ms
    assert server.in_flight(0.0) == 3
    assert server.in_flight(0.0015) == 2
    assert server.in_flight(0.003) == 0


def test_a_burst_of_transactions_through_the_store_costs_less_than_as_many_alone() -> None:
    costs = Costs(rtt=0.0, write=1e-3, read=0.0, write_batched=ROWS)
    sim = Sim(costs, cpu=False)
    store = TimedStore(sim)
    for i in range(1000):
        sim.now = 0.0
        store.put(f"k/{i}", b"v")
    burst = sim.server.busy_until
    assert burst == pytest.approx(sum(costs.write_at(k) for k in range(1, 1001)))
    assert burst < 1000 * 1e-3 / 2


def test_the_rows_survive_a_round_trip_through_json_and_bad_rows_are_named() -> None:
    costs = Costs(write_batched=ROWS, read_batched=ROWS[:2])
    assert Costs(**json.loads(json.dumps(costs.as_dict()))) == costs
    with pytest.raises(ValueError, match=r"write_batched: expected .* rising concurrency"):
        Costs(write_batched=((256, 1e-4), (16, 1e-3)))
    with pytest.raises(ValueError, match="read_batched"):
        Costs(read_batched=((0, 1e-4),))


def test_the_what_if_of_one_watch_per_pod_charges_a_pods_watches_once_and_a_transaction_as_one_event() -> None:
    costs = Costs(rtt=0.0, write=1e-3, read=0.0, event=1e-4, event_byte=0.0)
    sim = Sim(costs, cpu=False)
    store = TimedStore(sim)
    got: list[tuple[str, float]] = []
    pod = object()
    for name, group in (("a", pod), ("b", pod), ("c", None)):
        sim.subscribe((WatchRange("k/", prefix=True),), 1, lambda evs, when, n=name: got.append((n, when)),
                      group=group, hop=0.001 if group is pod else 0.0)
    sim.subscribe((WatchRange("k/", prefix=True),), 1, lambda evs, when: got.append(("d", when)),
                  per_transaction=True)
    store.txn((), [Put("k/1", b""), Put("k/2", b"")])  # one transaction, two keys
    sim.run(1.0)
    # Two events to the pod's one watch, two to c's, one (the transaction) to d's: 5 events' time, once.
    assert sim.events_sent == 5
    assert sim.server.busy_until == pytest.approx(1e-3 + 5 * 1e-4)
    assert sorted(n for n, _ in got) == ["a", "b", "c", "d"]  # each watch is handed its batch
    when = dict(got)
    assert when["a"] == when["b"] == pytest.approx(when["c"] + 0.001)  # the agent's hop


def test_the_server_serves_by_arrival_a_request_issued_later_takes_the_gap_an_earlier_one_left() -> None:
    # A process's second request (arriving at 10 ms, after its first's answer and a round trip) is issued before
    # another process's first (arriving at 1 ms): the second takes the idle stretch before 10 ms, as a real etcd
    # serves what reaches it first; one that does not fit there goes after.
    server = Server(Costs(write=1e-3))
    assert server.serve(0.010, 0.0, proposals=1.0) == pytest.approx(0.011)
    assert server.serve(0.001, 0.0, proposals=1.0) == pytest.approx(0.002)
    assert server.serve(0.001, 0.0085, proposals=1.0) == pytest.approx(0.0205)  # 9.5 ms: not before 10 ms
    assert server.busy_until == pytest.approx(0.0205)
    assert server.busy_total == pytest.approx(0.0115)
    # In flight: arrived and not finished, whatever the order they were placed in (the long one waits from 1 ms).
    assert server.in_flight(0.0005) == 0
    assert server.in_flight(0.0015) == 2
    assert server.in_flight(0.0105) == 2
    assert server.in_flight(0.012) == 1
    assert server.in_flight(0.021) == 0
