"""The barrier relay: when a batch goes (a table), what one fenced transaction writes and answers (real etcd),
and that a rank whose relay fails in any way makes its request itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.agent import relay as relay_module
from stalwart.agent.rank_liveness import PodLease
from stalwart.agent.relay import (
    DEFAULT_LINGER,
    MAX_BATCH,
    BarrierRelay,
    Step,
    Waiting,
    admit,
    due,
    execute,
    linger_left,
    transactions,
)
from stalwart.agent.socket_peers import Peer, peer_pid, rank_slot, slot_of_ranks
from stalwart.agent.tuning import AgentTuning
from stalwart.api.relay import MAX_FRAME_BYTES, RelayAnswer, RelayRange, RelayRequest
from stalwart.api.restart import ArrivalRecord, FaultRecord, SealRecord
from stalwart.etcd.fence import StaleEpoch
from stalwart.etcd.keys import FAULT, SEAL, JobKeys
from stalwart.etcd.store import Store, WatchRange
from stalwart.restart.coordination import Coordinator
from stalwart.restart.relay import RelayClient


def _slots(requests: list[RelayRequest]) -> list[int | None]:
    """The slot each request's connection is bound to, for tests where each rank asks for its own slot."""
    return [None if r.arrival is None else r.arrival.slot for r in requests]


def _by_order(peer: Peer) -> int | None:
    """The test's ranks share one process: its n-th connection is bound to slot n - 1."""
    return peer.ident - 1


def _read(epoch: int = 5, iteration: int = 1) -> RelayRequest:
    return RelayRequest(epoch=epoch, iteration=iteration, reads=[RelayRange(key=f"{FAULT}0/", prefix=True)])


def _arrive(slot: int, epoch: int = 5, iteration: int = 1) -> RelayRequest:
    return RelayRequest(epoch=epoch, iteration=iteration, arrival=ArrivalRecord(slot=slot, node_id="n"), lease=7,
                        reads=[RelayRange(key=f"{SEAL}{iteration}")])


ARRIVE1: Step = ("arrive", 5, 1)
READ1: Step = ("read", 5, 1)


@pytest.mark.parametrize(("waiting", "connected", "served", "now", "expected"), [
    pytest.param([], frozenset({1, 2}), {}, 0.0, False, id="nothing waits"),
    pytest.param([Waiting(1, _arrive(0), 0.0)], frozenset({1, 2}), {}, 0.001, False,
                 id="one of two ranks asked: wait for the other"),
    pytest.param([Waiting(1, _arrive(0), 0.0)], frozenset({1, 2}), {}, 0.005, True,
                 id="the linger is over"),
    pytest.param([Waiting(1, _arrive(0), 0.0), Waiting(2, _arrive(1), 0.0)], frozenset({1, 2}), {}, 0.0, True,
                 id="every connected rank asked"),
    pytest.param([Waiting(1, _arrive(0), 0.0)], frozenset({1, 2}), {ARRIVE1: frozenset({2})}, 0.0, True,
                 id="a late rank: the other already arrived through the relay"),
    pytest.param([Waiting(1, _arrive(0), 0.0)], frozenset({1, 2}), {READ1: frozenset({2})}, 0.0, False,
                 id="the other read the cause but has not arrived yet"),
    pytest.param([Waiting(1, _arrive(0), 0.0), Waiting(2, _read(), 0.0)], frozenset({1, 2}), {}, 0.0, True,
                 id="everyone asked, for different steps: one transaction for both"),
    pytest.param([Waiting(1, _arrive(0), 0.0)], frozenset({1}), {}, 0.0, True, id="a pod of one rank"),
    pytest.param([Waiting(1, _arrive(0), 0.0)], frozenset({1, 2}), {("arrive", 5, 0): frozenset({2})}, 0.0,
                 False, id="served at an older barrier does not count"),
])
def test_when_a_batch_goes(waiting: list[Waiting], connected: frozenset[int], served: dict[Step, frozenset[int]],
                           now: float, expected: bool) -> None:
    assert due(waiting, connected, served, now, linger=0.005) is expected


def test_linger_left() -> None:
    assert linger_left([], 1.0, 0.005) is None
    assert linger_left([Waiting(1, _read(), 1.0), Waiting(2, _read(), 0.998)], 1.0, 0.005) == pytest.approx(0.003)
    assert linger_left([Waiting(1, _read(), 0.0)], 1.0, 0.005) == 0.0


def test_requests_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="lease: an arrival must be bound"):
        RelayRequest(epoch=1, iteration=0, arrival=ArrivalRecord(slot=0, node_id="n"))
    with pytest.raises(ValueError, match="reads: a request without an arrival must read something"):
        RelayRequest(epoch=1, iteration=0)
    with pytest.raises(ValueError, match="relative to the round's restart prefix"):
        RelayRange(key="../other-job/")
    with pytest.raises(ValueError, match="lease_ttl: a request for the pod's lease may not arrive or read as well"):
        RelayRequest(epoch=1, iteration=0, lease_ttl=10, reads=[RelayRange(key="seal/1")])
    assert RelayRequest(epoch=1, iteration=0, lease_ttl=10).op == "lease"


# -- against a real etcd ----------------------------------------------------------------------------------------

def _coords(store: Store, keys: JobKeys, epoch: int, n: int) -> list[Coordinator]:
    coords = [Coordinator(store, keys, epoch, slot=s, node_id="node-0", lease_ttl=10, retry_for=5.0)
              for s in range(n)]
    for c in coords:
        c.start()
    return coords


@pytest.mark.integration
def test_one_transaction_writes_every_arrival_bound_to_its_own_lease(store: Store,
                                                                     job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    coords = _coords(store, keys, epoch, 3)
    coords[0].report_fault(FaultRecord(slot=0, node_id="node-0", iteration=0, kind="exception", reason="x",
                                       time=time.time()))
    requests = [c.arrival_request(1, ArrivalRecord(slot=c.slot, node_id="node-0"), [WatchRange(f"{SEAL}1")])
                for c in coords] + [coords[0].faults_request(0)]
    before = store.revision()
    answers = execute(store, keys, requests, _slots(requests))
    assert all(a.ok for a in answers)
    # One proposal: every arrival has the same mod_revision, the next one after ``before``.
    assert {a.revision for a in answers} == {before + 1}
    arrivals = coords[0].view().arrivals[1]
    assert sorted(arrivals) == [0, 1, 2]
    # Each rank is answered its own reads: the seal's key (absent) or the faults of iteration 0.
    assert [len(v) for a in answers for v in a.values] == [0, 0, 0, 1]
    assert coords[0].answered(answers[3]).cause(0) is not None
    # Each arrival is bound to its own rank's heartbeat: one rank's lease ends, its arrival alone goes.
    coords[1].stop()
    assert sorted(coords[0].view().arrivals[1]) == [0, 2]
    for c in coords:
        c.stop()


@pytest.mark.integration
def test_a_refused_transaction_is_answered_no_and_the_rank_goes_itself(store: Store,
                                                                       job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    coords = _coords(store, keys, epoch, 2)
    store.lease_revoke(coords[1].lease)  # etcd lost one rank's lease; its keepalive has not noticed yet
    requests = [c.arrival_request(1, ArrivalRecord(slot=c.slot, node_id="node-0"), [WatchRange(f"{SEAL}1")])
                for c in coords]
    answers = execute(store, keys, requests, _slots(requests))
    assert [a.ok for a in answers] == [False, False]
    assert "lease is not its slot's heartbeat lease" in answers[0].reason
    assert coords[0].view().arrivals == {}  # all or nothing: the transaction wrote no arrival
    # Through a relay that refuses, the rank arrives itself (and re-grants its lease, as without a relay: it asks the
    # relay for the pod's lease first, which this one does not lend).
    refusing = _Fixed(answers[1])
    coords[1].relay = refusing
    coords[1].arrive(1, ArrivalRecord(slot=1, node_id="node-0"), [WatchRange(f"{SEAL}1")])
    assert refusing.asked == 2 and coords[1].lent_lease == 0
    coords[1].faults(0)  # a read a rank makes alone (a peer's fault, before its own report) goes itself
    assert refusing.asked == 2
    coords[1].faults(0, pod=True)
    assert refusing.asked == 3
    assert sorted(coords[0].view().arrivals[1]) == [1]
    # A newer round: the relay says no, and the rank's own request raises the fence's error.
    store.put(keys.rendezvous + "manifest", b"{}")
    stale = execute(store, keys, [coords[0].faults_request(0)], [0])
    assert not stale[0].ok and "StaleEpoch" in stale[0].reason
    coords[0].relay = _Fixed(stale[0])
    with pytest.raises(StaleEpoch):
        coords[0].arrive(1, ArrivalRecord(slot=0, node_id="node-0"), [WatchRange(f"{SEAL}1")])
    for c in coords:
        c.stop()


class _Fixed:
    """A relay that gives one answer, and counts the requests, or answers nothing (``None``)."""

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.asked = 0

    def ask(self, request: RelayRequest) -> object:
        self.asked += 1
        return self.answer if getattr(self.answer, "ok", False) else None


@pytest.fixture
def relay(store: Store, job: tuple[JobKeys, int], tmp_path: Path) -> Iterator[BarrierRelay]:
    keys, _ = job
    # A linger far past every wait below: a batch that waited for it would fail the test, not slow it.
    r = BarrierRelay(store, keys, tmp_path / "relay.sock", slot_of=_by_order, linger=60.0, context="test")
    assert r.start()
    yield r
    r.stop()


@pytest.mark.integration
def test_the_ranks_of_a_pod_arrive_in_one_transaction(store: Store, job: tuple[JobKeys, int],
                                                      relay: BarrierRelay) -> None:
    keys, epoch = job
    coords = _coords(store, keys, epoch, 4)
    clients = [RelayClient(str(relay.path), timeout=20.0, context=f"slot {c.slot}") for c in coords]
    for c, client in zip(coords, clients, strict=True):
        c.relay = client
    # Every client connects first (the relay then expects a request from each), as ranks do at their start.
    for client in clients:
        client.ask(_read_of(epoch))
    relay.transactions = relay.requests = 0
    views: dict[int, object] = {}
    start = threading.Barrier(4)

    def rank(c: Coordinator) -> None:
        start.wait(10)
        c.faults(0, pod=True)
        views[c.slot] = c.arrive(1, ArrivalRecord(slot=c.slot, node_id="node-0"), [WatchRange(f"{SEAL}1")])

    threads = [threading.Thread(target=rank, args=(c,)) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # Answered long before the linger, because every connected rank asked: no client gave up and went alone.
    assert sorted(views) == [0, 1, 2, 3] and not any(client.off for client in clients)
    assert relay.requests == 8
    assert relay.transactions == 2  # one read of the cause and one write of the four arrivals
    assert sorted(coords[0].view().arrivals[1]) == [0, 1, 2, 3]
    assert len({v.revision for v in views.values()}) == 1  # type: ignore[attr-defined]
    # A rank that comes late (the others were served at this barrier) is sent at once, alone.
    late_client = RelayClient(str(relay.path), timeout=20.0, context="slot 4")  # the fifth connection: slot 4
    late = Coordinator(store, keys, epoch, slot=4, node_id="node-0", lease_ttl=10, relay=late_client)
    late.start()
    late.arrive(1, ArrivalRecord(slot=4, node_id="node-0"), [WatchRange(f"{SEAL}1")])
    assert relay.transactions == 3 and not late_client.off
    late_client.close()
    seal = SealRecord(iteration=1, world_size=5, ranks={str(s): s for s in range(5)}, sealed_by=0)
    assert coords[0].try_seal(seal) == seal
    for c in [*coords, late]:
        c.stop()
    for client in clients:
        client.close()


def _read_of(epoch: int) -> RelayRequest:
    # A step of no barrier the test goes through: its being served does not count for theirs.
    return RelayRequest(epoch=epoch, iteration=9, reads=[RelayRange(key=f"{SEAL}9")])


@pytest.mark.integration
def test_no_agent_listening_the_rank_arrives_itself(store: Store, job: tuple[JobKeys, int], tmp_path: Path) -> None:
    keys, epoch = job
    client = RelayClient(str(tmp_path / "absent.sock"), timeout=1.0)
    [c] = _coords(store, keys, epoch, 1)
    c.relay = client
    c.arrive(0, ArrivalRecord(slot=0, node_id="node-0"), [WatchRange(f"{SEAL}0")])
    assert client.off
    assert list(c.view().arrivals[0]) == [0]
    c.stop()


@pytest.mark.integration
def test_an_agent_that_does_not_answer_costs_one_timeout(store: Store, job: tuple[JobKeys, int],
                                                         tmp_path: Path) -> None:
    keys, epoch = job
    path = tmp_path / "mute.sock"
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(path))
    mute.listen(1)  # accepts (the kernel does) and never answers
    client = RelayClient(str(path), timeout=0.3)
    [c] = _coords(store, keys, epoch, 1)
    c.relay = client
    c.arrive(0, ArrivalRecord(slot=0, node_id="node-0"), [WatchRange(f"{SEAL}0")])
    assert client.off and list(c.view().arrivals[0]) == [0]
    c.faults(0)  # the relay is off: no second connection, no second wait
    mute.setblocking(False)
    mute.accept()[0].close()
    with pytest.raises(BlockingIOError):
        mute.accept()
    c.stop()
    mute.close()


@pytest.mark.integration
def test_the_relay_lends_the_pods_lease_to_its_ranks_and_without_it_a_rank_takes_its_own(
        store: Store, job: tuple[JobKeys, int], relay: BarrierRelay, tmp_path: Path) -> None:
    keys, epoch = job
    pod = PodLease(store, context="test")
    lending = BarrierRelay(store, keys, tmp_path / "lending.sock", slot_of=_by_order, linger=60.0, context="test",
                           lend=lambda ttl, gone, within: pod.lend(ttl, gone, timeout=within))
    assert lending.start()
    try:
        clients = [RelayClient(str(r.path), timeout=10.0, context="slot 0") for r in (lending, relay)]
        coords = [Coordinator(store, keys, epoch, slot=0, node_id="node-0", lease_ttl=10, retry_for=5.0, relay=c)
                  for c in clients]
        for c in coords:
            c.start()
        assert coords[0].lent_lease == coords[0].lease == pod.lease > 0
        # The relay that lends nothing says so; the rank takes a lease of its own, as without an agent.
        assert coords[1].lent_lease == 0 and coords[1].lease not in (0, pod.lease)
        assert not any(c.off for c in clients) and lending.transactions == 0
        alive = store.get(keys.restart_round(epoch).alive(0))
        assert alive is not None and alive.lease == coords[1].lease  # the second start's key: one slot, here
        for c in coords:
            c.stop()
        for client in clients:
            client.close()
    finally:
        lending.stop()
        pod.revoke()


@pytest.mark.integration
def test_an_invalid_request_is_answered_with_the_field(relay: BarrierRelay) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(relay.path))
        s.sendall(b'{"epoch": 0, "iteration": 1, "reads": [{"key": "seal/1"}]}\n')
        line = s.makefile("rb").readline()
    assert b'"ok":false' in line and b"epoch" in line


@pytest.mark.integration
def test_a_stopping_relay_answers_what_waits_at_once(store: Store, job: tuple[JobKeys, int],
                                                     tmp_path: Path) -> None:
    keys, epoch = job
    relay = BarrierRelay(store, keys, tmp_path / "relay.sock", slot_of=_by_order, linger=60.0, context="test")
    assert relay.start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as asking:
        for s in (idle, asking):
            s.settimeout(10)
        idle.connect(str(relay.path))
        idle.sendall(_read_of(epoch).model_dump_json().encode() + b"\n")
        idle.makefile("rb").readline()  # served alone; now two connect, and the next request waits for both
        asking.connect(str(relay.path))
        asking.sendall(_read(epoch, 0).model_dump_json().encode() + b"\n")
        time.sleep(0.2)  # it arrives at the relay and waits there (the linger is a minute)
        relay.stop()
        line = asking.makefile("rb").readline()
    assert b'"ok":false' in line and b"the agent is stopping" in line
    assert not relay.path.exists()


@pytest.mark.integration
def test_a_batch_across_epochs_and_past_the_transaction_size_is_answered_in_order(
        store: Store, job: tuple[JobKeys, int]) -> None:
    keys, old = job
    epoch = store.put(keys.rendezvous + "manifest", b"{}")  # a newer round: ``old`` is stale
    coords = _coords(store, keys, epoch, MAX_BATCH + 4)
    requests = [c.arrival_request(1, ArrivalRecord(slot=c.slot, node_id="node-0"), [WatchRange(f"{SEAL}1")])
                for c in coords]
    requests.insert(3, _read(old, 0))
    assert [len(t) for t in transactions(requests)] == [1, MAX_BATCH, 4]  # by epoch, the oldest first
    answers = execute(store, keys, requests, _slots(requests))
    assert not answers[3].ok and "StaleEpoch" in answers[3].reason
    mine = answers[:3] + answers[4:]
    assert all(a.ok for a in mine)
    # Two transactions for the current epoch, the first of MAX_BATCH arrivals: two revisions, in that order.
    revisions = [a.revision for a in mine]
    assert revisions == sorted(revisions) and len(set(revisions)) == 2
    assert revisions.count(revisions[0]) == MAX_BATCH
    assert sorted(coords[0].view().arrivals[1]) == list(range(MAX_BATCH + 4))
    for c in coords:
        c.stop()


@pytest.mark.integration
def test_of_two_arrivals_for_one_slot_in_a_batch_only_the_later_is_told_ok(store: Store,
                                                                          job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    first, second = _coords(store, keys, epoch, 1) + _coords(store, keys, epoch, 1)
    rec = ArrivalRecord(slot=0, node_id="node-0")
    answers = execute(store, keys, [first.arrival_request(1, rec, []), second.arrival_request(1, rec, [])], [0, 0])
    assert [a.ok for a in answers] == [False, True]
    assert "same slot" in answers[0].reason
    [kv] = store.get_prefix(first.round_keys.of_iteration("arrive/", 1))[0]
    assert kv.lease == second.lease  # "ok" means written with that rank's lease
    first.stop()
    second.stop()


def _lines(sock: socket.socket, count: int) -> list[bytes]:
    f = sock.makefile("rb")
    return [f.readline() for _ in range(count)]


@pytest.mark.integration
def test_lines_are_framed_by_newlines_whatever_the_reads(relay: BarrierRelay, job: tuple[JobKeys, int]) -> None:
    _, epoch = job
    one, two = (_read(epoch, 0).model_dump_json().encode() + b"\n",
                _read_of(epoch).model_dump_json().encode() + b"\n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(relay.path))
        s.sendall(one + two)  # two requests in one read: both answered, in order
        answers = [RelayAnswer.model_validate_json(line) for line in _lines(s, 2)]
        assert [len(a.values) for a in answers] == [1, 1] and all(a.ok for a in answers)
        s.sendall(one[:10])  # a request split across reads
        time.sleep(0.1)
        s.sendall(one[10:])
        assert RelayAnswer.model_validate_json(_lines(s, 1)[0]).ok
        s.sendall(b"x" * (MAX_FRAME_BYTES + 1))  # no newline within the frame limit: refused, then closed
        refused = _lines(s, 2)
    assert b"longer than" in refused[0] and refused[1] == b""


@pytest.mark.integration
def test_the_relay_thread_survives_a_failing_batch(relay: BarrierRelay, job: tuple[JobKeys, int],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _, epoch = job
    real = relay_module.execute
    calls: list[int] = []

    def failing_once(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(relay_module, "execute", failing_once)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(relay.path))
        s.sendall(_read(epoch, 0).model_dump_json().encode() + b"\n")
        failed = RelayAnswer.model_validate_json(_lines(s, 1)[0])
        s.sendall(_read(epoch, 0).model_dump_json().encode() + b"\n")
        served = RelayAnswer.model_validate_json(_lines(s, 1)[0])
    assert (failed.ok, failed.reason) == (False, "the relay failed")
    assert served.ok and len(calls) == 2


def test_the_agents_linger_is_checked_and_its_cli_default_is_the_relays() -> None:
    with pytest.raises(ValueError, match="relay_linger: expected seconds in"):
        AgentTuning(relay_linger=-0.1)
    assert AgentTuning().relay_linger == DEFAULT_LINGER
    out = subprocess.run([sys.executable, "-m", "stalwart", "agent", "--help"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert f"(default {DEFAULT_LINGER:g};" in " ".join(out.split())


# -- the relay binds each request to the rank that sent it (issue 31, finding 6) -------------------------------


@pytest.mark.parametrize(("request_", "slot", "refused"), [
    pytest.param(_arrive(1), 1, None, id="its own slot"),
    pytest.param(_arrive(1), 0, "refused: an arrival for slot 1 from the rank of slot 0", id="another slot"),
    pytest.param(_arrive(1), None, "refused: this connection is not one of this agent's ranks",
                 id="not one of the agent's ranks"),
    pytest.param(_read(), None, None, id="a read names what it reads, from any connection"),
    pytest.param(RelayRequest(epoch=5, iteration=0, lease_ttl=10), 2, None, id="the pod's lease, to its rank"),
    pytest.param(RelayRequest(epoch=5, iteration=0, lease_ttl=10), None,
                 "refused: the pod's lease is lent to this agent's ranks only", id="the pod's lease, to no rank"),
])
def test_who_may_send_what(request_: RelayRequest, slot: int | None, refused: str | None) -> None:
    why = admit(request_, slot)
    assert why is None if refused is None else (why is not None and why.startswith(refused))


@pytest.mark.parametrize(("pid", "expected"), [
    pytest.param(100, 3, id="the rank's own process"),
    pytest.param(102, 3, id="a process under a shell the agent started"),
    pytest.param(200, None, id="a process of no rank"),
    pytest.param(1, None, id="init"),
])
def test_which_rank_a_process_is(pid: int, expected: int | None) -> None:
    parents = {102: 101, 101: 100, 100: 50, 200: 50, 50: 1}
    assert rank_slot(pid, {100: 3}, parents.get) == expected


def test_a_connection_is_known_by_its_peers_process() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_pid(a) == os.getpid()
        assert slot_of_ranks(lambda: {os.getpid(): 2})(Peer(1, peer_pid(a))) == 2
        assert slot_of_ranks(lambda: {os.getpid() + 10**6: 2})(Peer(1, peer_pid(a))) is None


@pytest.mark.integration
def test_a_rank_cannot_arrive_for_another_slot_through_the_relay(store: Store, job: tuple[JobKeys, int],
                                                                 relay: BarrierRelay) -> None:
    keys, epoch = job
    coords = _coords(store, keys, epoch, 2)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # the first connection: slot 0's rank
        s.settimeout(10)
        s.connect(str(relay.path))
        # Rank 0 writes rank 1's arrival, bound to rank 0's lease: refused at once, nothing sent to etcd.
        forged = coords[0].arrival_request(1, ArrivalRecord(slot=1, node_id="node-0"), [])
        s.sendall(forged.model_dump_json().encode() + b"\n")
        answer = RelayAnswer.model_validate_json(_lines(s, 1)[0])
    assert not answer.ok
    assert answer.reason.startswith("refused: an arrival for slot 1 from the rank of slot 0")
    assert relay.transactions == 0
    assert coords[0].view().arrivals == {}
    for c in coords:
        c.stop()


@pytest.mark.integration
def test_an_arrival_bound_to_another_ranks_lease_is_not_written(store: Store, job: tuple[JobKeys, int]) -> None:
    keys, epoch = job
    coords = _coords(store, keys, epoch, 2)
    # Rank 1's own slot, but rank 0's lease: its arrival would outlive rank 1 and go with rank 0.
    forged = RelayRequest(epoch=epoch, iteration=1, arrival=ArrivalRecord(slot=1, node_id="node-0"),
                          lease=coords[0].lease)
    [answer] = execute(store, keys, [forged], [1])
    assert not answer.ok and "lease is not its slot's heartbeat lease" in answer.reason
    assert coords[0].view().arrivals == {}
    for c in coords:
        c.stop()


def test_a_batch_is_answered_within_the_bound_in_all(store: Store, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    keys = JobKeys("t", uuid.uuid4().hex[:12])
    # Each transaction takes longer than what is left (a store that logs in again makes its call twice).
    calls: list[float | None] = []

    def slow_txn(*args: object, timeout: float | None = None, **kwargs: object) -> object:
        calls.append(timeout)
        time.sleep(0.4)
        raise TimeoutError("etcd is slow")

    monkeypatch.setattr(store, "txn", slow_txn)
    requests = [_read(epoch, 0) for epoch in (5, 6, 7)]  # three transactions, one per epoch
    t0 = time.monotonic()
    answers = execute(store, keys, requests, _slots(requests), timeout=0.3)
    assert time.monotonic() - t0 < 0.6  # not 3 x 0.3: the bound is for the batch, not per transaction
    assert calls[0] == pytest.approx(0.3, abs=0.05) and len(calls) == 1
    assert [a.ok for a in answers] == [False, False, False]
    assert answers[2].reason == "the relay could not send it in time"
    # Through the relay, a store that overruns its own timeout still has the rank answered at the bound.
    monkeypatch.setattr(relay_module, "execute", lambda *a, **k: time.sleep(3))
    relay = BarrierRelay(store, keys, tmp_path / "relay.sock", slot_of=_by_order, linger=0.0, answer_within=0.3,
                         context="test")
    assert relay.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(relay.path))
            t0 = time.monotonic()
            s.sendall(_read(5, 0).model_dump_json().encode() + b"\n")
            answer = RelayAnswer.model_validate_json(_lines(s, 1)[0])
            waited = time.monotonic() - t0
    finally:
        relay.stop()
    assert (answer.ok, answer.reason) == (False, "the relay could not send it in time")
    assert waited < 1.0
