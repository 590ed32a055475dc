"""The barrier relay on a real etcd: what the hop to the agent costs a rank, and what a pod's barrier costs etcd.

One pod of ``--ranks`` rank processes' coordinators (threads of this process, each with its own relay client;
the relay is the agent's real :class:`~stalwart.agent.relay.BarrierRelay` on a Unix socket) goes through
``--barriers`` restart barriers: every rank reads the interrupted iteration's faults (the cause) and arrives
at the next, with the read of the seal's key, as ``stalwart/restart/wrapper.py`` does. Side by side, the
same ranks without the relay (the anchor: each rank asks etcd itself, as before the relay).

    python bench/relay.py [--ranks 8] [--barriers 200] [--linger SECONDS]

Rows (one JSON object per line):
``{"bench": "relay", "impl": "stalwart-relay" | "stalwart-direct", "metric": ..., "value": ...}`` with
``etcd_requests_per_barrier`` (what etcd was asked, counted by the relay or the ranks), ``barrier_ms`` (median
seconds from the ranks' start to the last rank's arrival answered, in ms) and ``round_trip_ms`` (median of
one rank alone reading the cause: the hop's own cost on top of etcd's round trip).
The ranks are threads of one process, so the relay's thread competes with them for the interpreter: the
relay's figures are pessimistic against separate rank processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stalwart.agent.rank_liveness import PodLease
from stalwart.agent.relay import DEFAULT_LINGER, BarrierRelay
from stalwart.api.restart import ArrivalRecord
from stalwart.etcd.client import connect
from stalwart.etcd.keys import SEAL, JobKeys
from stalwart.etcd.store import Store, WatchRange
from stalwart.local.etcd import EtcdServer
from stalwart.restart.coordination import Coordinator
from stalwart.restart.relay import RelayClient


def emit(impl: str, metric: str, value: float, **extra: object) -> None:
    print(json.dumps({"bench": "relay", "impl": impl, "metric": metric, "value": round(value, 4), **extra}),
          flush=True)


class Counting:
    """Counts the etcd requests the ranks make themselves (reads and transactions)."""

    def __init__(self, store: Store) -> None:
        self.store, self.calls, self.lock = store, 0, threading.Lock()
        for name in ("txn", "get_prefix", "get"):
            setattr(self, name, self._counted(getattr(store, name)))

    def _counted(self, fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            with self.lock:
                self.calls += 1
            return fn(*args, **kwargs)
        return call

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


def barrier(coords: list[Coordinator], it: int) -> float:
    """Seconds of one barrier: every rank reads the cause of ``it`` and arrives at ``it + 1``, all at once."""
    go = threading.Barrier(len(coords) + 1)
    done: list[float] = []

    def rank(c: Coordinator) -> None:
        go.wait(30)
        c.faults(it, pod=True)
        c.arrive(it + 1, ArrivalRecord(slot=c.slot, node_id="node-0"), [WatchRange(f"{SEAL}{it + 1}")])
        done.append(time.perf_counter())

    threads = [threading.Thread(target=rank, args=(c,)) for c in coords]
    for t in threads:
        t.start()
    go.wait(30)
    t0 = time.perf_counter()
    for t in threads:
        t.join(60)
    if len(done) != len(coords):
        raise RuntimeError(f"{len(coords) - len(done)} ranks did not arrive within 60 s")
    return max(done) - t0


def round_trips(c: Coordinator, count: int) -> list[float]:
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        c.faults(0, pod=True)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--barriers", type=int, default=200)
    p.add_argument("--linger", type=float, default=DEFAULT_LINGER,
                   help=f"the relay's linger in seconds (default {DEFAULT_LINGER:g}, the agent's)")
    args = p.parse_args()
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp:
        store = connect([etcd.endpoint], timeout=10.0)
        keys = JobKeys("bench", uuid.uuid4().hex[:12])
        epoch = store.put(keys.rendezvous + "manifest", b"{}")
        counting = Counting(store)
        # The bench's ranks are threads of one process, each connecting once, in slot order: the n-th
        # connection is slot n - 1 (an agent binds a connection by its peer's process instead).
        pod = PodLease(store, context="bench")
        relay = BarrierRelay(store, keys, Path(tmp) / "relay.sock", slot_of=lambda peer: peer.ident - 1,
                             linger=args.linger, context="bench",
                             lend=lambda ttl, gone, within: pod.lend(ttl, gone, timeout=within))
        if not relay.start():
            raise SystemExit("the relay did not start")
        try:
            for impl in ("stalwart-direct", "stalwart-relay"):
                clients = [RelayClient(str(relay.path), timeout=10.0) for _ in range(args.ranks)] \
                    if impl == "stalwart-relay" else [None] * args.ranks
                coords = [Coordinator(counting, keys, epoch, slot=s, node_id="node-0",  # type: ignore[arg-type]
                                      relay=client) for s, client in enumerate(clients)]
                for c in coords:
                    c.start()  # through the relay: it lends the pod's lease, and every client is connected after
                counting.calls, relay.transactions = 0, 0
                first = 0 if impl == "stalwart-direct" else 10 * args.barriers
                seconds = [barrier(coords, it) for it in range(first, first + args.barriers)]
                requests = counting.calls + relay.transactions
                emit(impl, "etcd_requests_per_barrier", requests / args.barriers, ranks=args.ranks)
                emit(impl, "barrier_ms", statistics.median(seconds) * 1e3, ranks=args.ranks, barriers=args.barriers)
                for c in coords:
                    c.stop()
                # One rank alone, the others gone: its request is sent at once.
                for client in clients:
                    if client is not None:
                        client.close()
                alone = Coordinator(store, keys, epoch, slot=0, node_id="node-0",
                                    relay=RelayClient(str(relay.path), timeout=10.0)
                                    if impl == "stalwart-relay" else None)
                alone.faults(0, pod=True)
                emit(impl, "round_trip_ms", statistics.median(round_trips(alone, args.barriers)) * 1e3,
                     what="one rank reading the cause")
                if alone.relay is not None:
                    alone.relay.close()  # type: ignore[attr-defined]
        finally:
            relay.stop()
            pod.revoke()
            store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
