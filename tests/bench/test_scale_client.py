"""The scale simulator charges each simulated process its etcd client's CPU (gRPC, TLS, protobuf): a request
costs its sender ``client_request`` after the answer, each watch event its receiver ``client_event`` before it
can act on it; calibrated rows without those figures charge nothing, as the runs before them did."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

from bench.scalesim.sim import Costs, Sim, TimedStore
from stalwart.etcd.store import Put, WatchEvent, WatchRange

BASE = Costs(rtt=0.002, write=0.001, read=0.0005)
CLIENT = Costs(rtt=0.002, write=0.001, read=0.0005, client_request=0.004, client_event=0.003)


def put_once(costs: Costs) -> Sim:
    sim = Sim(costs)
    with sim.working(object(), "plan"):
        TimedStore(sim).put("k", b"v")
    return sim


def test_a_request_costs_its_sender_the_clients_cpu_after_the_answer() -> None:
    without, charged = put_once(BASE), put_once(CLIENT)
    # The same answer at the same time (the server's work is etcd's; the scope's own CPU is measured, microseconds),
    # then the client's 4 ms on the sender.
    assert charged.committed_at == pytest.approx(without.committed_at, abs=5e-4)
    assert charged.cpu_seconds["client"] == pytest.approx(0.004)
    assert "client" not in without.cpu_seconds
    # Less each scope's own measured CPU (the simulator's bookkeeping, microseconds), 4 ms later.
    assert (charged.now - charged.cpu_seconds["plan"]) - (without.now - without.cpu_seconds["plan"]) == \
        pytest.approx(0.004, abs=1e-4)


def test_a_request_outside_any_process_costs_no_one() -> None:
    sim = Sim(CLIENT)
    TimedStore(sim).put("k", b"v")  # the model's own (a fault it injects): nobody's client
    assert "client" not in sim.cpu_seconds
    assert sim.now == pytest.approx(CLIENT.rtt + CLIENT.write)


def watched(costs: Costs, puts: int) -> tuple[Sim, list[float]]:
    """One process watching a prefix while ``puts`` keys are written in one transaction; when it acts on them."""
    sim = Sim(costs)
    owner = object()
    handled: list[float] = []

    def handle(events: list[WatchEvent], when: float) -> None:
        with sim.working(owner, "wait"):
            handled.append(sim.now)
    sim.subscribe((WatchRange("/p/", prefix=True),), 1, sim.serial(owner, handle), owner=owner, created_now=False)
    TimedStore(sim).txn([], [Put(f"/p/{i}", b"v") for i in range(puts)])  # one revision: one batch
    sim.run(10.0)
    return sim, handled


def test_watch_events_cost_their_receiver_before_it_acts_on_them() -> None:
    _, at = watched(BASE, 5)
    charged, later = watched(CLIENT, 5)
    assert charged.cpu_seconds["client"] == pytest.approx(5 * 0.003)
    # Its process was busy decoding: the handler runs when the 5 events are decoded.
    assert len(at) == len(later) == 1
    assert later[0] - at[0] == pytest.approx(5 * 0.003, abs=1e-3)
    assert later[0] - at[0] >= 5 * 0.003 - 1e-9


def test_watch_events_of_a_watch_no_process_owns_cost_no_one() -> None:
    sim = Sim(CLIENT)
    got: list[int] = []
    sim.subscribe((WatchRange("/p/", prefix=True),), 1, lambda evs, when: got.append(len(evs)))
    TimedStore(sim).put("/p/a", b"v")
    sim.run(10.0)
    assert got == [1]
    assert "client" not in sim.cpu_seconds


def test_a_row_calibrated_before_the_client_was_measured_charges_it_nothing() -> None:
    row = {"rtt": 0.002, "write": 0.001, "read": 0.0005, "read_key": 0.0, "read_byte": 0.0, "event": 0.0,
           "event_byte": 0.0, "write_batched": [], "read_batched": []}
    costs = Costs(**json.loads(json.dumps(row)))
    assert costs.client_request == costs.client_event == 0.0
    assert Costs(**json.loads(json.dumps(CLIENT.as_dict()))) == CLIENT


@pytest.mark.parametrize("field", ["client_request", "client_event"])
def test_a_negative_client_cost_is_refused_naming_it(field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: expected CPU seconds >= 0"):
        Costs(**{field: -1e-4})


def test_a_watch_created_now_costs_its_owner_a_request_one_set_up_before_costs_nothing() -> None:
    sim = Sim(CLIENT)
    owner, earlier = object(), object()
    sim.subscribe((WatchRange("/p/", prefix=True),), 1, lambda evs, when: None, owner=owner)
    sim.subscribe((WatchRange("/p/", prefix=True),), 1, lambda evs, when: None, owner=earlier, created_now=False)
    assert sim.busy[id(owner)] == pytest.approx(CLIENT.client_request)
    assert id(earlier) not in sim.busy
    assert sim.cpu_seconds["client"] == pytest.approx(CLIENT.client_request)


def test_a_process_decodes_its_watches_answers_one_after_another_each_reaching_its_code_when_decoded() -> None:
    # Eight watches of one process (a pod's ranks in one worker, as the validation lays them out) sent one change:
    # each is handed its event once the client has decoded its answer, 3 ms apart, not all at one instant; a
    # process of its own decodes its answer at once.
    sim = Sim(CLIENT)
    shared, alone = object(), object()
    got: list[tuple[str, float]] = []
    for i in range(8):
        sim.subscribe((WatchRange("/f/", prefix=True),), 1, lambda evs, when, i=i: got.append((f"rank{i}", when)),
                      owner=shared, created_now=False)
    sim.subscribe((WatchRange("/f/", prefix=True),), 1, lambda evs, when: got.append(("alone", when)),
                  owner=alone, created_now=False)
    TimedStore(sim).put("/f/0", b"fault")
    sim.run(10.0)
    times = dict(got)
    assert len(got) == 9 and len(times) == 9
    shared_times = sorted(t for name, t in got if name != "alone")
    first = shared_times[0]
    assert shared_times == pytest.approx([first + k * CLIENT.client_event for k in range(8)])
    assert times["alone"] == pytest.approx(first)
    assert sim.cpu_seconds["client"] == pytest.approx(9 * CLIENT.client_event)


def test_a_watch_opened_after_the_change_it_asks_for_was_sent_is_sent_it_too() -> None:
    # etcd replays history from a watch's start revision: a rank that read before the seal and opens its watch
    # after the seal went out to the others still gets it.
    sim = Sim(BASE)
    early: list[int] = []
    sim.subscribe((WatchRange("/s/", prefix=True),), 1, lambda evs, when: early.append(len(evs)))
    revision = TimedStore(sim).put("/s/seal", b"sealed")
    sim.run(10.0)
    assert early == [1]
    late: list[tuple[str, float]] = []
    sim.subscribe((WatchRange("/s/", prefix=True),), revision,
                  lambda evs, when: late.extend((ev.kv.key, when) for ev in evs))
    sim.subscribe((WatchRange("/s/", prefix=True),), revision + 1, lambda evs, when: late.append(("none", when)))
    sim.run(20.0)
    assert [key for key, _ in late] == ["/s/seal"]
    assert late[0][1] > 0
