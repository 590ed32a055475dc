"""The ranks' liveness on the pod's lease: which silent ranks the agent ends (a table), the lease it lends (real
etcd), and ending a rank's keys as the end of a lease of its own would have (real etcd), never a later process's."""

from __future__ import annotations

import os

import pytest

from stalwart.agent.rank_liveness import PodLease, Quiet, RankLiveness, silent
from stalwart.api.relay import RelayAnswer, RelayRequest
from stalwart.api.restart import ArrivalRecord, RankStatus
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.liveness import alive_value, end_liveness, liveness_iterations
from stalwart.etcd.store import Store
from stalwart.restart.coordination import Coordinator

TTL = 10


@pytest.mark.parametrize(("quiet", "ended"), [
    pytest.param(Quiet(0, written=100.0, on_pod_lease=True), [0], id="unwritten for longer than the TTL"),
    pytest.param(Quiet(0, written=105.0, on_pod_lease=True), [], id="written within the TTL"),
    pytest.param(Quiet(0, written=100.0, on_pod_lease=False), [], id="on a lease of its own: etcd ends it"),
    pytest.param(Quiet(0, written=100.0, on_pod_lease=True, ended=True), [], id="ended already for this silence"),
    pytest.param(Quiet(0, written=None, on_pod_lease=True), [], id="a status without its write time"),
])
def test_which_silent_ranks_are_ended(quiet: Quiet, ended: list[int]) -> None:
    assert silent([quiet, Quiet(1, written=110.0, on_pod_lease=True)], now=110.5, ttl=TTL) == ended


def test_liveness_iterations_cover_the_barrier_before_and_the_next() -> None:
    assert list(liveness_iterations(0)) == [0, 1]
    assert list(liveness_iterations(4)) == [3, 4, 5]


# -- against a real etcd ----------------------------------------------------------------------------------------


class _Lender:
    """The agent's relay as far as the lease goes: lends ``lease`` and answers nothing else."""

    def __init__(self, lease: PodLease) -> None:
        self.lease = lease
        self.asked: list[RelayRequest] = []

    def ask(self, request: RelayRequest) -> RelayAnswer | None:
        self.asked.append(request)
        if not request.lease_ttl:
            return None
        return RelayAnswer(ok=True, lease=self.lease.lend(request.lease_ttl, request.lease, timeout=5.0))


@pytest.mark.integration
def test_the_pod_lends_one_lease_and_grants_a_new_one_only_when_etcd_lost_it(store: Store) -> None:
    pod = PodLease(store, context="test")
    with pytest.raises(ValueError, match="ttl: expected seconds >= 1, got 0"):
        pod.lend(0)
    first = pod.lend(TTL)
    assert pod.lend(TTL) == first and pod.lend(TTL, gone=first) == first  # alive: a rank's word is checked
    assert 0 < store.lease_ttl(first) <= TTL
    store.lease_revoke(first)  # etcd lost it (its keep-alive has not noticed yet)
    second = pod.lend(TTL, gone=first)
    assert second != first and store.lease_ttl(second) > 0
    pod.revoke()
    assert store.lease_ttl(second) <= 0 and pod.lease == 0


@pytest.mark.integration
def test_the_pods_rendezvous_lease_is_lent_when_its_ttl_is_the_ranks(store: Store,
                                                                     job: tuple[JobKeys, int]) -> None:
    node: list[int | None] = [store.lease_grant(TTL)]  # the node handle's lease (None between registrations)
    pod = PodLease(store, node=lambda: (node[0], TTL), context="test")
    first = node[0]
    assert pod.lend(TTL) == first and pod.lease == first and pod.ttl == TTL  # one lease for the pod: no grant
    other = PodLease(store, node=lambda: (node[0], TTL), context="test")
    own = other.lend(TTL + 5)  # a rank's heartbeat TTL other than the node's: a lease of its own, at that TTL
    assert own != first and 0 < store.lease_ttl(own) <= TTL + 5
    other.revoke()
    # The node registered again under a new lease: the ranks follow it on their next request.
    node[0] = store.lease_grant(TTL)
    assert pod.lend(TTL, gone=first) == node[0]
    # The node's lease is gone in etcd before its handle noticed: a lease of the pod's own, not the dead one.
    store.lease_revoke(node[0])
    fallback = pod.lend(TTL, gone=node[0])
    assert fallback not in (first, node[0]) and store.lease_ttl(fallback) > 0
    node[0] = None  # and between registrations, the same one of its own
    assert pod.lend(TTL) == fallback
    # A rank that took the lease of its own stays on it once the node has one again: its keys are still the
    # agent's to end when it dies.
    keys, epoch = job
    alive = keys.restart_round(epoch).alive(5)
    store.put(alive, alive_value(5, "node-0", os.getpid()), lease=fallback)
    node[0] = store.lease_grant(TTL)
    assert pod.lend(TTL) == node[0] and pod.lent(fallback) and pod.lent(node[0]) and not pod.lent(own)
    died = RankStatus(slot=5, pid=os.getpid(), state="running", epoch=epoch, iteration=0, lease=fallback,
                      heartbeat=0.0)
    assert RankLiveness(store, keys, "node-0", pod, context="test").end(0, died, "test")
    assert store.get(alive) is None
    # Leaving revokes only the lease of its own: the node's goes when it leaves the rendezvous.
    pod.revoke()
    assert store.lease_ttl(fallback) <= 0 and store.lease_ttl(node[0]) > 0 and pod.lease == 0
    store.lease_revoke(node[0])


@pytest.mark.integration
def test_ranks_on_the_pods_lease_share_it_and_each_takes_back_only_its_own_keys(
        store: Store, job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    pod = PodLease(store, context="test")
    lender = _Lender(pod)
    coords = [Coordinator(store, keys, epoch, slot=s, node_id="node-0", lease_ttl=TTL, retry_for=5.0, relay=lender)
              for s in range(2)]
    for c in coords:
        c.start()
    assert {c.lease for c in coords} == {pod.lease} and all(c.lent_lease == pod.lease for c in coords)
    assert [r.lease_ttl for r in lender.asked] == [TTL, TTL]
    alive = {s: store.get(keys.restart_round(epoch).alive(s)) for s in range(2)}
    assert all(kv is not None and kv.lease == pod.lease for kv in alive.values())
    for c in coords:
        c.arrive(0, ArrivalRecord(slot=c.slot, node_id="node-0"))
    assert sorted(coords[0].view().arrivals[0]) == [0, 1]
    # One rank leaves: its alive key and arrival go, as its own lease's revocation took them; the pod's lease and
    # the other rank's keys stay.
    coords[1].stop()
    view = coords[0].view()
    assert sorted(view.alive) == [0] and sorted(view.arrivals[0]) == [0]
    assert store.lease_ttl(pod.lease) > 0
    coords[0].stop()
    assert coords[0].view().alive == {}
    pod.revoke()


@pytest.mark.integration
def test_the_agent_ends_a_dead_or_silent_ranks_keys_but_never_a_later_process_of_its_slot(
        store: Store, job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    pod = PodLease(store, context="test")
    rank = Coordinator(store, keys, epoch, slot=3, node_id="node-0", lease_ttl=TTL, retry_for=5.0,
                       relay=_Lender(pod))
    rank.start()
    rank.arrive(1, ArrivalRecord(slot=3, node_id="node-0"))
    round_keys = keys.restart_round(epoch)
    me = os.getpid()
    # A later process of the slot (a respawn) wrote its own alive key: the dead one's end takes nothing of it.
    store.put(round_keys.alive(3), alive_value(3, "node-0", me + 1), lease=pod.lease)
    assert not end_liveness(store, keys, epoch, slot=3, node_id="node-0", pid=me, iterations=liveness_iterations(1))
    assert store.get(round_keys.alive(3)) is not None and store.get(round_keys.arrival(1, 3)) is not None
    store.put(round_keys.alive(3), alive_value(3, "node-0", me), lease=pod.lease)

    liveness = RankLiveness(store, keys, "node-0", pod, context="test")
    status = RankStatus(slot=3, pid=me, state="running", epoch=epoch, iteration=1, lease=pod.lease, written=100.0,
                        heartbeat=100.0)
    assert liveness.watch([(0, status)], now=105.0) == []  # within the TTL
    assert liveness.watch([(0, status)], now=111.0) == [0]
    assert store.get(round_keys.alive(3)) is None and store.get(round_keys.arrival(1, 3)) is None
    assert liveness.watch([(0, status)], now=112.0) == []  # once per silence
    # It comes back: its next arrival puts its alive key again, and a later silence ends it again.
    rank.arrive(2, ArrivalRecord(slot=3, node_id="node-0"))
    assert store.get(round_keys.alive(3)) is not None
    later = status.model_copy(update={"iteration": 2, "written": 200.0})
    assert liveness.watch([(0, later)], now=211.0) == [0]
    assert store.get(round_keys.alive(3)) is None and store.get(round_keys.arrival(2, 3)) is None
    # A process on a lease of its own is not the agent's to end.
    own = later.model_copy(update={"lease": None})
    assert not liveness.end(0, own, "test")
    rank.lent_lease = rank.lease = 0  # its keys are gone; nothing to take back
    pod.revoke()


@pytest.mark.integration
def test_a_pods_lease_etcd_lost_is_replaced_when_a_rank_finds_it_gone(store: Store, job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    pod = PodLease(store, context="test")
    lender = _Lender(pod)
    first = pod.lend(TTL)
    store.lease_revoke(first)  # etcd lost it; the agent's keep-alive has not noticed yet
    rank = Coordinator(store, keys, epoch, slot=0, node_id="node-0", lease_ttl=TTL, retry_for=5.0, relay=lender)
    rank.start()  # lent the dead lease, its alive key refused: it says so, and is lent a new one
    assert [r.lease for r in lender.asked] == [0, first]
    assert rank.lent_lease == pod.lease != first and store.lease_ttl(pod.lease) > 0
    # Lost again while the rank runs: its next arrival (alone, no relay to carry it) finds out and takes the new one.
    second = pod.lease
    store.lease_revoke(second)
    rank.arrive(1, ArrivalRecord(slot=0, node_id="node-0"))
    assert rank.lent_lease == pod.lease not in (first, second)
    view = rank.view()
    assert sorted(view.alive) == [0] and sorted(view.arrivals[1]) == [0]  # the alive key came back with it
    rank.stop()
    pod.revoke()
