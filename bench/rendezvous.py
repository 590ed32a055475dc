"""Rendezvous benchmark: stalwart's rendezvous vs torch's DynamicRendezvousHandler, side by side.

N simulated nodes (threads of one process; each implementation in its own fresh process) rendezvous on one
real etcd server on this machine, with min = max = N:

* ``stalwart``: :class:`stalwart.agent.rendezvous.Rendezvous` (one Store, one watch for the process);
* ``torch-c10d``: torch's DynamicRendezvousHandler with its C10d backend (one TCPStore server, a client per
  node);
* ``torch-etcd-v3``: torch's DynamicRendezvousHandler with stalwart's etcd-v3 backend (one shared Store);
* ``stalwart-tls``: ``stalwart`` against a second etcd that serves clients over TLS only (client certificates
  required) with authentication on, logged in as a job's own etcd user limited to its prefix (as the operator
  sets up a job): what TLS and auth cost.

Metrics per implementation and N: ``seconds`` from the start signal until every node has its rank;
``writes_per_node``: etcd raft proposals committed during the run / N (stalwart, torch-etcd-v3), or
compare-and-set attempts on the TCPStore / N (torch-c10d, which has no etcd); ``cas_failures`` for the torch
anchors. A run whose nodes are not all through ``--cap`` seconds after the start signal is stopped and
reported with ``"capped": true``, the cap as value and how many nodes were through (``nodes_done``).
Also ``rerendezvous_seconds`` for stalwart at ``--rerdzv-nodes``: one member's lease expires; measured from
etcd's deletion of its key (the expiry as the watch sees it) to the next round's manifest, with a spare
standing by to take its place; ``rerendezvous_all_seconds`` is until every node has the new round.

Prints one JSON object per line, e.g.
``{"bench": "rendezvous", "impl": "stalwart", "nodes": 1024, "metric": "seconds", "value": 1.9}``.
Usage: ``python bench/rendezvous.py [--nodes 16 64 256 1024] [--cap 120] [--impls stalwart torch-c10d ...]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stalwart.local.etcd import EtcdServer  # noqa: E402
from stalwart.net import free_port  # noqa: E402

IMPLS = ["stalwart", "stalwart-tls", "torch-c10d", "torch-etcd-v3"]


def proposals(endpoint: str) -> int:
    """etcd's count of committed raft proposals: every write (put, txn, lease grant/revoke) is one."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("etcd_server_proposals_committed_total"):
                return int(float(line.split()[-1]))
    raise RuntimeError("etcd_server_proposals_committed_total not found in /metrics")


@dataclass(frozen=True)
class SecureEtcd:
    """How a worker reaches the TLS+auth etcd: the mounted-Secret directory, the job uid its user may use,
    and the plain-HTTP metrics endpoint."""

    secret_dir: str
    uid: str
    metrics: str


def job_login(server: EtcdServer) -> SecureEtcd:
    """A job's etcd user on ``server`` (as the operator makes it), written out as a mounted Secret would be."""
    from stalwart.etcd.admin import ensure_job_login, new_password
    from stalwart.etcd.client import connect
    from stalwart.etcd.keys import JobKeys

    uid = uuid.uuid4().hex[:12]
    with connect([server.endpoint], server.credentials()) as root:
        login = ensure_job_login(root, JobKeys("bench", uid), new_password())
    creds = server.credentials(login.user, login.password)
    secret = Path(tempfile.mkdtemp(prefix="bench-etcd-login-", dir=server.data_dir))
    for name, data in {"ca.crt": creds.ca_cert, "tls.crt": creds.client_cert, "tls.key": creds.client_key,
                       "username": login.user.encode(), "password": login.password.encode()}.items():
        (secret / name).write_bytes(data or b"")
    return SecureEtcd(str(secret), uid, server.metrics_endpoint)


def join_within(threads: list[threading.Thread], deadline: float) -> bool:
    """Join every thread by ``deadline``; ``False`` if some are still running then (the cap was reached)."""
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            return False
    return True


def start_together(n: int, target: Any) -> tuple[list[threading.Thread], threading.Event]:
    go = threading.Event()
    threads = [threading.Thread(target=target, args=(i, go), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads, go


# -- workers (one fresh process each) ------------------------------------------------------------------------


def worker_stalwart(n: int, endpoint: str, cap: float, secure: SecureEtcd | None = None) -> dict[str, Any]:
    from stalwart.agent.rendezvous import Rendezvous, RendezvousSettings
    from stalwart.api.rendezvous import NodeRecord
    from stalwart.etcd.client import EtcdCredentials, connect
    from stalwart.etcd.keys import JobKeys

    uid = secure.uid if secure else uuid.uuid4().hex[:12]
    credentials = EtcdCredentials.from_dir(secure.secret_dir, tls=True) if secure else None
    store = connect([endpoint], credentials, timeout=30)
    metrics = secure.metrics if secure else endpoint
    rdzv = Rendezvous(store, JobKeys("bench", uid),
                      RendezvousSettings(min_nodes=n, max_nodes=n, node_ttl=60, join_timeout=300))
    rdzv.wait_loaded(30)
    handles = [rdzv.node(NodeRecord(node_id=f"node-{i}", address="127.0.0.1")) for i in range(n)]
    ranks: dict[int, int] = {}

    def node(i: int, go: threading.Event) -> None:
        go.wait()
        info = handles[i].join()
        assert info.member is not None
        ranks[i] = info.member.group_rank

    threads, go = start_together(n, node)
    before = proposals(metrics)
    t0 = time.monotonic()
    go.set()
    if not join_within(threads, t0 + cap):
        return {"capped": True, "done": len(ranks)}
    seconds = time.monotonic() - t0
    writes = proposals(metrics) - before
    assert sorted(ranks.values()) == list(range(n)), "ranks are not 0..N-1"
    for h in handles:
        h.leave()
    rdzv.shutdown()
    store.close()
    return {"seconds": seconds, "writes_per_node": writes / n}


def worker_stalwart_rerdzv(n: int, endpoint: str) -> dict[str, Any]:
    from stalwart.agent.rendezvous import Rendezvous, RendezvousSettings
    from stalwart.api.rendezvous import NodeRecord
    from stalwart.etcd.client import connect
    from stalwart.etcd.keys import MANIFEST, NODES, JobKeys

    keys = JobKeys("bench", uuid.uuid4().hex[:12])
    settings = RendezvousSettings(min_nodes=n, max_nodes=n, node_ttl=60, join_timeout=300)
    store = connect([endpoint], timeout=30)
    rdzv = Rendezvous(store, keys, settings)
    victim_store = connect([endpoint], timeout=30)
    victim_rdzv = Rendezvous(victim_store, keys, RendezvousSettings(
        min_nodes=n, max_nodes=n, node_ttl=2, join_timeout=300))
    victim_id = f"node-{n // 2}"
    handles = [(victim_rdzv if f"node-{i}" == victim_id else rdzv).node(
        NodeRecord(node_id=f"node-{i}", address="127.0.0.1")) for i in range(n)]
    handles.append(rdzv.node(NodeRecord(node_id="hot-spare", address="127.0.0.1", spare=True)))
    infos: dict[str, int] = {}
    second: dict[str, float] = {}

    def node(i: int, go: threading.Event) -> None:
        go.wait()
        h = handles[i]
        first = h.join()
        infos[h.node_id] = first.epoch
        if h.node_id == victim_id:
            return
        end = h.wait_round_end(300)
        assert end is not None
        h.join()
        second[h.node_id] = time.monotonic()

    threads, go = start_together(len(handles), node)
    go.set()
    while len(infos) < len(handles):
        time.sleep(0.05)
    # Watch for the victim's key deletion and the next manifest, as etcd orders them.
    watch = store.watch(keys.rendezvous, prefix=True, start_revision=store.revision() + 1)
    # The victim's process dies: keep-alives stop; etcd expires its lease after the TTL.
    victim_rdzv.shutdown()
    victim_store.close()
    deleted_at = sealed_at = None
    while sealed_at is None:
        ev = watch.next(60)
        if ev is None:
            raise RuntimeError("no lease expiry or new round within 60 s")
        now = time.monotonic()
        if ev.type == "delete" and ev.kv.key == keys.rendezvous + NODES + victim_id:
            deleted_at = now
        elif ev.type == "put" and ev.kv.key == keys.rendezvous + MANIFEST and deleted_at is not None:
            sealed_at = now
    watch.cancel()
    for t in threads:
        t.join()
    assert deleted_at is not None
    result = {"rerendezvous_seconds": sealed_at - deleted_at,
              "rerendezvous_all_seconds": max(second.values()) - deleted_at}
    for h in handles:
        if h.node_id != victim_id:
            h.leave()
    rdzv.shutdown()
    store.close()
    return result


class _Counting:
    """Counts set_state calls and refusals of a torch RendezvousBackend (instrumentation, not a fake)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts = 0
        self.failures = 0

    def wrap(self, backend: Any) -> Any:
        original = backend.set_state

        def set_state(state: bytes, token: Any = None) -> Any:
            result = original(state, token)
            with self.lock:
                self.attempts += 1
                if result is None or not result[2]:
                    self.failures += 1
            return result

        backend.set_state = set_state
        return backend


def worker_torch(impl: str, n: int, endpoint: str, cap: float) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from stalwart.agent.rendezvous.torch_backend import EtcdV3RendezvousBackend
    from stalwart.etcd.client import connect
    from stalwart.etcd.torch_store import EtcdTorchStore

    run_id = uuid.uuid4().hex[:12]
    counting = _Counting()
    params = RendezvousParameters(backend="bench", endpoint=endpoint, run_id=run_id, min_nodes=n, max_nodes=n,
                                  join_timeout=str(int(cap) + 60), last_call_timeout="1",
                                  local_addr="127.0.0.1")
    shared: Any = None
    if impl == "torch-c10d":
        port = free_port()
        shared = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=cap + 60), multi_tenant=True)
    else:
        shared = connect([endpoint], timeout=30)
    handlers: list[Any] = []
    for _ in range(n):
        if impl == "torch-c10d":
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cap + 60))
            backend = counting.wrap(C10dRendezvousBackend(client, run_id))
            handlers.append(create_handler(client, backend, params))
        else:
            # The backend signs its state with the job's secret; every worker process of the run derives the same.
            secret = hashlib.sha256(f"bench secret {run_id}".encode()).digest()
            backend = counting.wrap(EtcdV3RendezvousBackend(shared, f"/bench/torch/{run_id}/state", secret=secret))
            store = EtcdTorchStore.unfenced(shared, f"/bench/torch/{run_id}/store/", timeout=cap + 60)
            handlers.append(create_handler(store, backend, params))
    ranks: dict[int, int] = {}

    def node(i: int, go: threading.Event) -> None:
        go.wait()
        ranks[i] = handlers[i].next_rendezvous().rank

    threads, go = start_together(n, node)
    before = proposals(endpoint) if impl == "torch-etcd-v3" else 0
    t0 = time.monotonic()
    go.set()
    if not join_within(threads, t0 + cap):
        return {"capped": True, "done": len(ranks), "cas_failures": counting.failures}
    seconds = time.monotonic() - t0
    assert sorted(ranks.values()) == list(range(n)), "ranks are not 0..N-1"
    writes = (proposals(endpoint) - before) if impl == "torch-etcd-v3" else counting.attempts
    return {"seconds": seconds, "writes_per_node": writes / n, "cas_failures": counting.failures}


def worker_main(args: argparse.Namespace) -> int:
    if args.worker == "stalwart":
        result = worker_stalwart(args.worker_nodes, args.endpoint, args.cap)
    elif args.worker == "stalwart-tls":
        secure = SecureEtcd(args.secret_dir, args.uid, args.metrics)
        result = worker_stalwart(args.worker_nodes, args.endpoint, args.cap, secure)
    elif args.worker == "stalwart-rerdzv":
        result = worker_stalwart_rerdzv(args.worker_nodes, args.endpoint)
    else:
        result = worker_torch(args.worker, args.worker_nodes, args.endpoint, args.cap)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # torch handlers keep non-daemon keep-alive threads; the result is out


# -- the driver ----------------------------------------------------------------------------------------------


def run_worker(mode: str, n: int, endpoint: str, cap: float,
               secure: SecureEtcd | None = None) -> tuple[dict[str, Any] | None, str]:
    cmd = [sys.executable, __file__, "--worker", mode, "--worker-nodes", str(n), "--endpoint", endpoint,
           "--cap", str(cap)]
    if secure is not None:
        cmd += ["--secret-dir", secure.secret_dir, "--uid", secure.uid, "--metrics", secure.metrics]
    # Room on top of the cap for the process to start and build its nodes.
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=cap + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None, "cap reached"
        out.seek(0)
        text = out.read().decode(errors="replace")
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), ""
    return None, text[-2000:]


def emit(impl: str, nodes: int, metric: str, value: float, **extra: Any) -> None:
    print(json.dumps({"bench": "rendezvous", "impl": impl, "nodes": nodes, "metric": metric,
                      "value": round(value, 4), **{k: v for k, v in extra.items() if v is not None}}),
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    parser.add_argument("--cap", type=float, default=120.0, help="seconds before a run is stopped")
    parser.add_argument("--rerdzv-nodes", type=int, default=256, help="N of the re-rendezvous run (0: skip)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-nodes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--secret-dir", help=argparse.SUPPRESS)
    parser.add_argument("--uid", help=argparse.SUPPRESS)
    parser.add_argument("--metrics", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)
    # A terminated run still stops its etcd server (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    etcd = EtcdServer()
    etcd.start()
    secure_etcd = EtcdServer(tls=True, auth=True) if "stalwart-tls" in args.impls else None
    try:
        if secure_etcd is not None:
            secure_etcd.start()
        for n in args.nodes:
            for impl in args.impls:
                if impl == "stalwart-tls":
                    assert secure_etcd is not None
                    result, why = run_worker(impl, n, secure_etcd.endpoint, args.cap, job_login(secure_etcd))
                else:
                    result, why = run_worker(impl, n, etcd.endpoint, args.cap)
                if result is None:
                    emit(impl, n, "seconds", args.cap, capped=True, note=why)
                    continue
                if result.get("capped"):
                    emit(impl, n, "seconds", args.cap, capped=True, nodes_done=result["done"])
                    if "cas_failures" in result:
                        emit(impl, n, "cas_failures", result["cas_failures"], capped=True)
                    continue
                emit(impl, n, "seconds", result["seconds"])
                emit(impl, n, "writes_per_node", result["writes_per_node"],
                     source="etcd proposals" if impl != "torch-c10d" else "TCPStore compare_set calls")
                if "cas_failures" in result:
                    emit(impl, n, "cas_failures", result["cas_failures"])
        if args.rerdzv_nodes and "stalwart" in args.impls:
            n = args.rerdzv_nodes
            result, why = run_worker("stalwart-rerdzv", n, etcd.endpoint, args.cap)
            if result is None:
                emit("stalwart", n, "rerendezvous_seconds", args.cap, capped=True, note=why)
            else:
                emit("stalwart", n, "rerendezvous_seconds", result["rerendezvous_seconds"])
                emit("stalwart", n, "rerendezvous_all_seconds", result["rerendezvous_all_seconds"])
    finally:
        etcd.cleanup()
        if secure_etcd is not None:
            secure_etcd.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
