"""The simulator's costs, measured on a real etcd server of this machine through stalwart's own Store.

Every figure is measured with the Python gRPC client on the same cores as the server, so it is an upper
bound of etcd's own cost (the client's time is counted as the server's): the simulator errs towards slow.

* ``rtt``: the mean latency of a small read, one at a time;
* ``write``: wall seconds per proposal while 16 threads create keys together (the server's throughput);
* ``write_batched``: wall seconds per proposal with ``C`` create-if-absent transactions kept in flight at once
  (gRPC futures sent from one thread, a new one as soon as one is answered), for each ``C`` of
  :data:`CONCURRENCY`: etcd's raft loop puts every proposal that arrived while it was busy into one append and
  one fsync, so the more are in flight the less each costs (the simulator's server charges a proposal the
  row of the proposals in flight when it arrives);
* ``read_batched``: the same for linearizable reads of one small key (etcd serves the reads waiting at once
  from one read index: one round to the followers for all of them);
* ``read``: a read of one small key, less the round trip; ``read_key``, ``read_byte``: prefix reads of
  1,000 small keys and of 1,000 keys of 2 KiB, solved for a per-key and a per-byte part;
* ``event``, ``event_byte``: 4 watchers (``etcdctl watch``, etcd's Go client) replaying 3,000 changes of
  one prefix, small values then 16 KiB values: wall seconds until every watcher holds every event, per event
  per watcher, solved the same way;
* ``client_request``: CPU seconds of this process (every thread of it: gRPC's own too) per request while
  the ``write_batched`` and ``read_batched`` rows are measured, the median of those rows: what the calling
  process's client spends to send a request and read its answer;
* ``client_event``: CPU seconds of this process per watch event its client (stalwart's ``Store.watch``) is
  sent, one event to an answer, as a fault reaches a process of many ranks: 500 watches of one key on one
  stream, then 4 puts of it (2,000 answers in 4 bursts; the 4 puts' own CPU is counted too, a few tenths of
  a percent of it).

Each figure comes from one of the etcds of :data:`CALIBRATIONS`, started here on loopback: ``plain-1`` (one
member without fsync, TLS or authentication: what the tests and the local cluster run), ``fsync-1`` (etcd's
default, every write on disk before it is acknowledged), ``tls-1`` (and TLS with client certificates and
authentication on, as the chart runs it) and ``tls-3`` (and three members in one raft group: a write is
acknowledged once two have it on disk). The client reaches one member (the first), as an agent given that
member's endpoint would: stalwart's client cannot yet reach several endpoints over TLS (see
:mod:`stalwart.local.etcd_cluster`). An etcd that cannot be reached, or that refuses the TLS settings, raises
:class:`CalibrationError` naming the endpoint and the cause.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from pyetcd.etcdrpc import rpc_pb2 as rpc

from bench.scalesim.sim import Costs
from stalwart.etcd.client import EtcdCredentials, connect
from stalwart.etcd.errors import StoreError
from stalwart.etcd.store import Compare, Put, Store, WatchRange
from stalwart.local.etcd import find_etcd_binary
from stalwart.local.etcd_cluster import EtcdCluster

#: The proposals in flight at which ``write_batched`` is measured: from the 16 writers of ``write`` to a pod's
#: arrivals at the barrier of 16,384 ranks (2,048 transactions).
CONCURRENCY = (16, 64, 256, 1024, 2048)


class CalibrationError(Exception):
    """A calibration's etcd cannot be reached or refuses the client; the message names its endpoint and why."""


@dataclass(frozen=True)
class Calibration:
    """One kind of etcd to measure: its members, and whether it writes to disk, speaks TLS and logs clients in."""

    name: str
    members: int
    fsync: bool
    tls: bool
    auth: bool


CALIBRATIONS = {c.name: c for c in (Calibration("plain-1", 1, fsync=False, tls=False, auth=False),
                                    Calibration("fsync-1", 1, fsync=True, tls=False, auth=False),
                                    Calibration("tls-1", 1, fsync=True, tls=True, auth=True),
                                    Calibration("tls-3", 3, fsync=True, tls=True, auth=True))}


@dataclass(frozen=True)
class Target:
    """Where a calibration measures: the endpoint, the client's credentials, etcdctl's flags for the same, and
    where every member's plain-HTTP ``/metrics`` are (the endpoint's own when not given)."""

    endpoint: str
    credentials: EtcdCredentials | None = None
    etcdctl_flags: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()

    @property
    def metrics_endpoints(self) -> tuple[str, ...]:
        return self.metrics or (self.endpoint,)


@contextmanager
def started(calibration: Calibration) -> Iterator[Target]:
    """The etcd of ``calibration`` on loopback for the block's time; every process of it ended after."""
    group = EtcdCluster(calibration.members, tls=calibration.tls, auth=calibration.auth, fsync=calibration.fsync)
    group.start()
    try:
        first = group.members[0]
        flags: list[str] = []
        if calibration.tls:
            flags += ["--cacert", str(first.pki_dir / "ca.crt"), "--cert", str(first.pki_dir / "tls.crt"),
                      "--key", str(first.pki_dir / "tls.key")]
        if calibration.auth:
            flags += ["--user", f"root:{first.root_password}"]
        yield Target(first.endpoint, first.credentials(), tuple(flags),
                     tuple(m.metrics_endpoint for m in group.members))
    finally:
        group.cleanup()


def _timed(fn: Callable[[], object], repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def _fill(store: Store, prefix: str, n: int, size: int) -> None:
    value = b"x" * size
    for i in range(n):
        store.put(f"{prefix}{i:06d}", value)


def _writes(store: Store, prefix: str, threads: int, each: int) -> float:
    def work(t: int) -> None:
        for i in range(each):
            key = f"{prefix}{t}/{i}"
            store.txn([Compare(key, "create", "==", 0)], [Put(key, b'{"nodeId":"n","address":"10.0.0.1"}')])
    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return (time.perf_counter() - t0) / (threads * each)


def _in_flight(store: Store, prefix: str, concurrency: int, total: int, *,
               reads: bool = False) -> tuple[float, float]:
    """Wall seconds per proposal with ``concurrency`` create-if-absent transactions kept in flight (``reads``:
    per linearizable read of one small key): sent as gRPC futures from this thread (with the store's login), the
    next as soon as one is answered; and this process's CPU seconds per request meanwhile."""
    member = store._members.current()
    metadata = member.calls.metadata("calibrate")
    slots = threading.Semaphore(concurrency)
    failed: list[str] = []
    value = b'{"slot":1,"pid":12345,"node":"node-00001","healthy":true}'

    def done(future: grpc.Future) -> None:
        try:
            if not reads and not future.result().succeeded:
                failed.append("a create-if-absent transaction found its key present")
            future.result()
        except grpc.RpcError as e:
            failed.append(f"{e.code()}: {e.details()}")
        finally:
            slots.release()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(total):
        slots.acquire()
        if reads:
            member.kv.Range.future(rpc.RangeRequest(key=f"{prefix}{i % 1000:06d}".encode()), timeout=60,
                                   metadata=metadata).add_done_callback(done)
            continue
        key = f"{prefix}{i}".encode()
        req = rpc.TxnRequest(compare=[rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                                                  create_revision=0)],
                             success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))])
        member.kv.Txn.future(req, timeout=60, metadata=metadata).add_done_callback(done)
    for _ in range(concurrency):  # every answer in
        if not slots.acquire(timeout=120):
            raise RuntimeError(f"calibration: requests at concurrency {concurrency} not answered in 120 s")
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if failed:
        raise StoreError(f"calibration at concurrency {concurrency}: {failed[0]}")
    return elapsed / total, cpu / total


def _client_events(store: Store, prefix: str, watches: int = 500, puts: int = 4) -> float:
    """This process's CPU seconds per watch event its client is sent, as a restart's fault reaches a process's
    ranks: ``watches`` watches of one key on one stream (each a watch of its own in etcd, sent its own
    response), then ``puts`` puts of that key, each a burst of ``watches`` responses of one event."""
    key = prefix + "fault"
    value = b'{"slot":1,"rank":1,"nodeId":"node-00001","iteration":0,"kind":"exception","reason":"calibration"}'
    wanted = watches * puts
    with store.watch_ranges([WatchRange(key)] * watches) as watch:
        cpu0 = time.process_time()
        for _ in range(puts):
            store.put(key, value)
        for held in range(wanted):
            if watch.next(30) is None:
                raise RuntimeError(f"calibration: client events: {held} of {wanted} watch events in, then none "
                                   "for 30 s")
        return (time.process_time() - cpu0) / wanted


def _fanout(target: Target, store: Store, prefix: str, *, watchers: int, events: int, size: int) -> float:
    """Wall seconds per event per watcher for etcd to send ``events`` changes to each of ``watchers``
    watchers. The changes are written first and the watchers replay them from their revision, so only the
    sending is timed; the watchers are etcd's own Go client (``etcdctl watch``), so it is etcd's sending,
    not a Python client's decoding. A watcher process's start is timed too (an upper bound)."""
    start = store.revision() + 1
    _fill(store, prefix, events, size)
    lines = [0] * watchers

    def count(w: int, proc: subprocess.Popen[bytes]) -> None:
        out = proc.stdout
        assert out is not None
        while lines[w] < 3 * events:  # etcdctl prints the event type, the key and the value
            chunk = os.read(out.fileno(), 1 << 16)
            if not chunk:
                return
            lines[w] += chunk.count(b"\n")
    t0 = time.perf_counter()
    procs = [subprocess.Popen([etcdctl(), "--endpoints", target.endpoint, *target.etcdctl_flags, "watch", "--prefix",
                               prefix, "--rev", str(start)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
             for _ in range(watchers)]
    ts = [threading.Thread(target=count, args=(w, p)) for w, p in enumerate(procs)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.kill()
        p.wait()
    if min(lines) < 3 * events:
        raise RuntimeError(f"calibration: watchers printed {lines} of {3 * events} lines")
    return elapsed / (watchers * events)


def etcdctl() -> str:
    return str(Path(find_etcd_binary()).with_name("etcdctl"))


def calibrate(target: Target) -> Costs:
    """Measure the cost model on the etcd at ``target``."""
    try:
        store = connect([target.endpoint], target.credentials, timeout=30)
    except StoreError as e:
        raise CalibrationError(f"calibration: etcd at {target.endpoint}: {e}") from None
    try:
        return _measure(target, store)
    except StoreError as e:  # without a login, connect() asks nothing: the first read finds a closed port
        raise CalibrationError(f"calibration: etcd at {target.endpoint}: {e}") from None
    finally:
        store.close()


def _measure(target: Target, store: Store) -> Costs:
    base = f"/calibrate/{uuid.uuid4().hex[:8]}/"
    rtt = _timed(store.revision, 300)
    write = _writes(store, base + "w/", 16, 60)
    writes = [(float(c), *_in_flight(store, f"{base}b{c}/", c, max(2048, 2 * c))) for c in CONCURRENCY]
    batched = tuple((c, wall) for c, wall, _ in writes)
    small, large = 40, 2048
    _fill(store, base + "rs/", 1000, small)
    _fill(store, base + "rl/", 1000, large)
    read = max(0.0, _timed(lambda: store.get(base + "rs/000000"), 100) - rtt)
    reads = [(float(c), *_in_flight(store, base + "rs/", c, max(2048, 2 * c), reads=True)) for c in CONCURRENCY]
    read_batched = tuple((c, wall) for c, wall, _ in reads)
    client_request = statistics.median(cpu for _, _, cpu in writes + reads)
    client_event = _client_events(store, base + "ce/")
    t_small = _timed(lambda: store.get_prefix(base + "rs/"), 10) - rtt - read
    t_large = _timed(lambda: store.get_prefix(base + "rl/"), 10) - rtt - read
    key_bytes = len(base) + 9
    b_small, b_large = 1000 * (key_bytes + small), 1000 * (key_bytes + large)
    read_byte = max(0.0, (t_large - t_small) / (b_large - b_small))
    read_key = max(0.0, (t_small - read_byte * b_small) / 1000)
    e_small = _fanout(target, store, base + "fs/", watchers=4, events=3000, size=small)
    # Values of 16 KiB, so that the per-byte part stands out of the noise of a shared machine.
    e_large = _fanout(target, store, base + "fl/", watchers=4, events=3000, size=16 * 1024)
    event_byte = max(0.0, (e_large - e_small) / (16 * 1024 - small))
    event = max(0.0, e_small - event_byte * (key_bytes + small))
    store.delete_prefix(base)
    return Costs(rtt=rtt, write=write, read=read, read_key=read_key, read_byte=read_byte, event=event,
                 event_byte=event_byte, write_batched=batched, read_batched=read_batched,
                 client_request=client_request, client_event=client_event)
