"""What TLS and etcd authentication cost RPC: its membership in etcd, plain vs secured, side by side.

RPC calls themselves never touch etcd (they go over stalwart's own connections, authenticated by the job's
token), so ``bench/rpc.py``'s latency and throughput do not change with etcd's security. What does is joining
the RPC world: each worker logs in, takes a lease, registers its record in the round (a fenced transaction) and
waits until every rank is registered. Measured here for a world of ``--world`` workers (threads, one Store
each, as separate processes would have), on one etcd started plain and one started with client TLS
(certificates required) and authentication on, logged in as a job's own user (as the operator sets it up),
with the bcrypt cost stalwart gives etcd (4: ``stalwart-tls``) and etcd's default (10:
``stalwart-tls-bcrypt10``; each login then costs ~0.1 s of etcd's CPU, one login at a time):

* ``membership_join_ms`` -- from connecting until every worker sees the whole world (median over rounds);
* ``etcd_put_us`` -- one sequential put's round trip (the unit cost under every fenced write).

Prints one JSON object per line, e.g. ``{"bench": "rpc", "impl": "stalwart-tls", "metric":
"membership_join_ms", "value": 12.3}``, and the ratios secured/plain. Run by ``bench/rpc.py`` (``--etcd``) or
alone: ``python bench/rpc_etcd.py [--world 8] [--rounds 7] [--puts 500]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stalwart.etcd.admin import ensure_job_login, new_password
from stalwart.etcd.client import EtcdCredentials, connect
from stalwart.etcd.keys import JobKeys
from stalwart.local.etcd import EtcdServer
from stalwart.rpc import EtcdMembership, Worker


def _join(endpoint: str, creds: EtcdCredentials | None, keys: JobKeys, world: int) -> float:
    start = threading.Barrier(world + 1)
    done: list[float] = []
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            start.wait(30)
            with connect([endpoint], creds, timeout=30) as store:
                membership = EtcdMembership(store, keys, epoch=1, lease_ttl=30)
                try:
                    membership.register(Worker(f"worker{rank}", rank, f"127.0.0.1:{20000 + rank}", "i"))
                    membership.wait_for_ranks(world, timeout=60)
                    done.append(time.perf_counter())
                finally:
                    membership.close()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    start.wait(30)
    t0 = time.perf_counter()
    for t in threads:
        t.join(120)
    if errors or len(done) != world:
        raise RuntimeError(f"membership join failed: {errors[:1]}")
    return (max(done) - t0) * 1000


def _puts(endpoint: str, creds: EtcdCredentials | None, keys: JobKeys, n: int) -> float:
    with connect([endpoint], creds, timeout=30) as store:
        store.put(keys.prefix + "warm", b"x")
        t0 = time.perf_counter()
        for i in range(n):
            store.put(keys.prefix + f"k{i % 16}", b"x" * 64)
        return (time.perf_counter() - t0) / n * 1e6


def run(world: int, rounds: int, puts: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with EtcdServer() as plain, EtcdServer(tls=True, auth=True) as secured, \
            EtcdServer(tls=True, auth=True, bcrypt_cost=None) as slow_hash:
        sides: dict[str, tuple[str, EtcdCredentials | None, str]] = {}
        sides["stalwart"] = (plain.endpoint, None, uuid.uuid4().hex[:12])
        for impl, server in (("stalwart-tls", secured), ("stalwart-tls-bcrypt10", slow_hash)):
            uid = uuid.uuid4().hex[:12]
            with connect([server.endpoint], server.credentials()) as root:
                login = ensure_job_login(root, JobKeys("bench", uid), new_password())
            sides[impl] = (server.endpoint, server.credentials(login.user, login.password), uid)
        got: dict[str, dict[str, list[float]]] = {impl: {"membership_join_ms": [], "etcd_put_us": []}
                                                 for impl in sides}
        for r in range(rounds):  # alternate the sides, so drift on a shared machine hits both alike
            for impl in (list(sides) if r % 2 == 0 else list(reversed(sides))):
                endpoint, creds, job_uid = sides[impl]
                keys = JobKeys("bench", job_uid)
                got[impl]["membership_join_ms"].append(_join(endpoint, creds, keys, world))
                got[impl]["etcd_put_us"].append(_puts(endpoint, creds, keys, puts))
        for metric in ("membership_join_ms", "etcd_put_us"):
            medians = {impl: statistics.median(got[impl][metric]) for impl in sides}
            for impl, value in medians.items():
                rows.append({"bench": "rpc", "impl": impl, "metric": metric, "value": round(value, 2),
                             "world": world, "rounds": rounds,
                             "each": [round(v, 1) for v in got[impl][metric]]})
            for impl in ("stalwart-tls", "stalwart-tls-bcrypt10"):
                rows.append({"bench": "rpc", "impl": f"{impl}/stalwart", "metric": metric + "_ratio",
                             "value": round(medians[impl] / medians["stalwart"], 2)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8, help="RPC workers joining (default 8)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per side (default 7)")
    parser.add_argument("--puts", type=int, default=500, help="sequential puts timed per round (default 500)")
    args = parser.parse_args()
    for row in run(args.world, args.rounds, args.puts):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
