"""What a proposal costs etcd when many are in flight at once, and when one transaction carries several puts.

The simulator's ``write`` cost is measured at 16 concurrent writers (``calibrate.py``). A restart barrier
sends one arrival per rank at nearly the same moment, so this measures, on a real etcd server of this
machine, transactions of ``puts`` create-if-absent puts each (an arrival's shape) at several concurrencies:
the wall seconds per transaction, and etcd's own CPU seconds per transaction (from ``/proc``), which is what
it would cost on cores of its own. The requests are gRPC futures sent from one thread, so the client's share
of the two cores is as small as a Python client makes it.

    python -m bench.scalesim.proposals [--txns 8192] [--repeat 3]

One JSON object per line: ``{"bench": "etcd_proposals", "impl": "etcd", "concurrency": C, "puts_per_txn": P,
"metric": "wall_ms_per_txn" | "etcd_cpu_ms_per_txn", "value": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid

import grpc
from pyetcd.etcdrpc import rpc_pb2 as rpc
from pyetcd.etcdrpc import rpc_pb2_grpc as rpc_grpc

from stalwart.local.etcd import EtcdServer
from stalwart.procfs import stat_fields

# An arrival record's size (slot, pid, health), so that the bytes per put are an arrival's.
VALUE = b'{"slot":1,"pid":12345,"node":"node-00001","healthy":true,"step":1200}'
SHAPES = ((16, 1), (64, 1), (256, 1), (1024, 1), (128, 8), (1024, 8))


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (``proc(5)``'s fields 14 and 15)."""
    fields = stat_fields(pid)
    if not fields:
        raise RuntimeError(f"no process {pid}")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def txn(base: str, first: int, puts: int) -> rpc.TxnRequest:
    keys = [f"{base}{first + k}".encode() for k in range(puts)]
    return rpc.TxnRequest(
        compare=[rpc.Compare(key=keys[0], target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=0)],
        success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=VALUE)) for key in keys])


def measure(kv: rpc_grpc.KVStub, pid: int, *, concurrency: int, puts: int, txns: int) -> tuple[float, float]:
    """Wall and etcd CPU seconds per transaction, ``txns`` of them sent ``concurrency`` at a time."""
    base = f"/proposals/{uuid.uuid4().hex[:8]}/"
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    sent = 0
    while sent < txns:
        batch = [kv.Txn.future(txn(base, (sent + j) * puts, puts), timeout=60) for j in range(concurrency)]
        for future in batch:
            if not future.result().succeeded:
                raise RuntimeError("a create-if-absent put found its key present")
        sent += concurrency
    return (time.perf_counter() - t0) / sent, (cpu_seconds(pid) - cpu0) / sent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--txns", type=int, default=8192, help="transactions per measurement")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    with EtcdServer() as etcd:
        assert etcd.process is not None
        channel = grpc.insecure_channel(etcd.endpoint)
        try:
            kv = rpc_grpc.KVStub(channel)
            for concurrency, puts in SHAPES:
                for _ in range(args.repeat):
                    wall, cpu = measure(kv, etcd.process.pid, concurrency=concurrency, puts=puts, txns=args.txns)
                    for metric, value in (("wall_ms_per_txn", wall), ("etcd_cpu_ms_per_txn", cpu)):
                        print(json.dumps({"bench": "etcd_proposals", "impl": "etcd", "concurrency": concurrency,
                                          "puts_per_txn": puts, "metric": metric, "value": round(value * 1e3, 4)}),
                              flush=True)
        finally:
            channel.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
