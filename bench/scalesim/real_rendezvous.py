"""The first rendezvous on a real etcd: thousands of nodes' real rendezvous drivers in a few processes.

:func:`run_rendezvous` does on a real etcd what :class:`.rendezvous.RendezvousRun` with ``processes``
simulates: ``nodes`` nodes (min = max = nodes, no spare) in ``processes`` worker processes, contiguous and
as even as can be; each process has one etcd connection and one real
:class:`~stalwart.agent.rendezvous.Rendezvous` (its driver, its one watch) for its nodes, and each node a
thread in the real ``NodeHandle.join``, as ``bench/rendezvous.py`` runs one process. Every process is set up
(its driver's first read done) before one word starts every node; seconds are from that word to the last
node holding round 1 (one clock: this machine's monotonic clock, shared by its processes).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from bench.scalesim.real_etcd import (
    Access,
    add_worker_arguments,
    admin,
    busy_share,
    counters,
    cpu_seconds,
    job_access,
    machine_busy,
    say,
    workers,
)
from stalwart.agent.rendezvous import Rendezvous, RendezvousSettings
from stalwart.api.rendezvous import NodeRecord
from stalwart.etcd.client import EtcdCredentials
from stalwart.etcd.keys import JobKeys


def node_record(i: int) -> NodeRecord:
    """Node ``i`` as the simulator names and addresses it (8 ranks a node)."""
    return NodeRecord(node_id=f"trainjob-worker-{i}", address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", nproc=8)


def worker(args: argparse.Namespace) -> int:
    access = Access(args.endpoint, args.secret_dir, args.tls)
    try:
        store = access.connect()
    except Exception as e:
        say("FAILED", f"etcd at {args.endpoint}: {e}")
        return 1
    rdzv = Rendezvous(store, JobKeys(args.namespace, args.uid),
                      RendezvousSettings(min_nodes=args.nodes, max_nodes=args.nodes, node_ttl=60, join_timeout=300))
    try:
        if not rdzv.wait_loaded(30):
            say("FAILED", "the rendezvous driver did not load within 30 s")
            return 1
        handles = [rdzv.node(node_record(i)) for i in range(args.lo, args.hi)]
        go = threading.Event()
        held: list[float] = []
        errors: list[str] = []

        def node(i: int) -> None:
            go.wait()
            try:
                info = handles[i].join()
            except Exception as e:  # reported, not raised: the run names it
                errors.append(f"{handles[i].node_id}: {type(e).__name__}: {e}")
                return
            assert info.member is not None
            held.append(time.monotonic())
        threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(len(handles))]
        for t in threads:
            t.start()
        say("READY")
        if sys.stdin.readline().strip() != "GO":
            go.set()
            return 0
        cpu0 = cpu_seconds()
        go.set()
        deadline = time.monotonic() + args.cap
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if errors or len(held) < len(handles):
            say("FAILED", errors[0] if errors else f"{len(held)} of {len(handles)} nodes held round 1 within "
                f"{args.cap:g} s")
            return 1
        say("DONE", {"last": max(held), "held": len(held), "cpu_seconds": cpu_seconds() - cpu0})
        sys.stdin.readline()  # STOP
        for h in handles:
            h.leave()
        return 0
    except Exception as e:  # the run says which worker failed, and why
        say("FAILED", f"{type(e).__name__}: {e}")
        return 1
    finally:
        rdzv.shutdown()
        store.close()


def run_rendezvous(endpoint: str, credentials: EtcdCredentials | None, metrics: Sequence[str], nodes: int,
                   processes: int, *, timeout: float = 300.0) -> dict[str, Any]:
    """The first round of ``nodes`` nodes in ``processes`` processes on the etcd at ``endpoint`` (its root login
    in ``credentials``; the nodes log in as the job's own user); what it measured. Raises
    :class:`~.real_etcd.ValidationError` (naming the endpoint and the cause) when etcd cannot be reached or
    refuses the client, or naming the worker when one fails."""
    if not 1 <= processes <= nodes:
        raise ValueError(f"processes: expected 1 to {nodes} (a node at least each), got {processes}")
    store = admin(endpoint, credentials)
    keys = JobKeys("validate", uuid.uuid4().hex[:12])
    bounds = [nodes * p // processes for p in range(processes + 1)]
    try:
        with job_access(store, endpoint, credentials, keys) as access:
            specs = [(f"rendezvous worker {p} (nodes {bounds[p]}-{bounds[p + 1] - 1})",
                      ["-m", "bench.scalesim.real_rendezvous", *access.args(), "--namespace", keys.namespace,
                       "--uid", keys.uid, "--nodes", str(nodes), "--lo", str(bounds[p]), "--hi", str(bounds[p + 1]),
                       "--cap", str(timeout)]) for p in range(processes)]
            deadline = time.monotonic() + timeout
            with workers(specs) as ws:
                for w in ws:
                    w.expect("READY", deadline)
                counters0, busy0 = counters(metrics), machine_busy()
                t0 = time.monotonic()
                for w in ws:
                    w.send("GO")
                done = [json.loads(w.expect("DONE", deadline + timeout)) for w in ws]
                busy1, counters1 = machine_busy(), counters(metrics)
    finally:
        store.delete_prefix(keys.prefix)
        store.close()
    return {"seconds": max(d["last"] for d in done) - t0, "held": sum(d["held"] for d in done),
            "writes": counters1["proposals"] - counters0["proposals"],
            "client_cpu_seconds": [round(d["cpu_seconds"], 3) for d in done],
            "machine_busy": busy_share(busy0, busy1)}


def main() -> int:
    p = argparse.ArgumentParser(description="a worker process of the real-etcd rendezvous validation")
    add_worker_arguments(p)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--cap", type=float, default=300.0)
    return worker(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
