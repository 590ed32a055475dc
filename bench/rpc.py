"""RPC benchmark: stalwart's RPC vs torch.distributed.rpc (TensorPipe), side by side, two processes each.

Prints one JSON object per line:

* ``latency_us`` -- mean ``rpc_sync`` round trip of a 1 KiB ``bytes`` payload echoed back;
* ``throughput_mib_s`` -- MiB/s of 1 MiB float32 tensors sent with sequential ``rpc_sync`` calls (the callee
  returns the tensor's element count, so only the request carries the tensor);
* ``scheduler_us_per_op`` -- cost of one schedule + one cancel + its share of firing on stalwart's retry
  heap while 100,000 retries are pending (in process; asyncio's ``call_later`` with the same load is
  printed beside it for reference).

Each is measured twice: as it runs between two processes on one host (stalwart's shared-memory arena,
TensorPipe's shm/cma), and restricted to TCP as between hosts (``-tcp``: stalwart without arenas,
TensorPipe with its ``uv`` transport and ``basic`` channel). All the processes stay up for the whole run
and the sides are measured in alternating rounds; each value is the median over the rounds (the rounds'
own values are printed beside it). With ``--etcd`` (the default), also what etcd's TLS and authentication
cost RPC: its membership join, plain vs secured (``bench/rpc_etcd.py``; calls never touch etcd). Usage:
``python bench/rpc.py [--calls N] [--tensor-calls N] [--rounds N] [--no-tcp] [--no-etcd]``. torch needs numpy
for TensorPipe's start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from typing import Any

TOKEN = "bench-token-0123456789abcdef"
PAYLOAD = b"x" * 1024
TENSOR_ELEMS = 256 * 1024  # 1 MiB of float32


def echo(x: Any) -> Any:
    return x


def numel(t: Any) -> int:
    return int(t.numel())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _measure(call: Any, make_tensor: Any, calls: int, tensor_calls: int) -> dict[str, float]:
    for _ in range(max(50, calls // 10)):
        call(echo, PAYLOAD)
    t0 = time.perf_counter()
    for _ in range(calls):
        call(echo, PAYLOAD)
    latency = (time.perf_counter() - t0) / calls * 1e6
    tensor = make_tensor()
    for _ in range(10):
        call(numel, tensor)
    t0 = time.perf_counter()
    for _ in range(tensor_calls):
        call(numel, tensor)
    mib_s = tensor_calls * tensor.numel() * 4 / (1 << 20) / (time.perf_counter() - t0)
    return {"latency_us": latency, "throughput_mib_s": mib_s}


# -- the two worlds, measured in alternating rounds ----------------------------------------------------------
#
# Both pairs of processes are started first and stay up; the driver then asks each side's caller for one
# round of measurements at a time, alternating which side goes first, so a noisy moment on this shared
# machine falls on both sides alike. The reported value is each side's median over the rounds.

def _serve_rounds(call: Any, make_tensor: Any, cmd_q: Any, out_q: Any) -> None:
    while True:
        cmd = cmd_q.get()
        if cmd is None:
            return
        calls, tensor_calls = cmd
        out_q.put(_measure(call, make_tensor, calls, tensor_calls))


def _stalwart_worker(rank: int, queues: tuple[Any, Any, Any, Any], tcp_only: bool) -> None:
    addr_q, view_q, cmd_q, out_q = queues
    import torch

    from stalwart.rpc import REGISTRY, MembershipView, RpcAgent, StaticMembership, Worker
    from stalwart.rpc.streams import StreamTransport

    REGISTRY.register(echo, "bench.echo", inline=False)
    REGISTRY.register(numel, "bench.numel", inline=False)
    transport = StreamTransport(TOKEN, arena_bytes=0) if tcp_only else StreamTransport(TOKEN)
    agent = RpcAgent(f"w{rank}", rank, token=TOKEN, transport=transport)
    addr_q.put((rank, agent.start(), agent.incarnation))
    members = view_q.get()
    agent.join(StaticMembership(MembershipView.of(1, [Worker(*m) for m in members])))
    if rank == 0:
        _serve_rounds(lambda fn, arg: agent.rpc_sync("w1", fn, (arg,)), lambda: torch.ones(TENSOR_ELEMS),
                      cmd_q, out_q)
    agent.shutdown(graceful=True, timeout=60)


def _torch_worker(rank: int, port: int, cmd_q: Any, out_q: Any, tcp_only: bool) -> None:
    import torch
    from torch.distributed import rpc

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # tcp_only: TensorPipe's TCP transport and basic channel, as between pods on different nodes
    extra: dict[str, Any] = {"_transports": ["uv"], "_channels": ["basic"]} if tcp_only else {}
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, init_method=f"tcp://127.0.0.1:{port}", **extra)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        _serve_rounds(lambda fn, arg: rpc.rpc_sync("w1", fn, args=(arg,)), lambda: torch.ones(TENSOR_ELEMS),
                      cmd_q, out_q)
    rpc.shutdown()


class _Side:
    """One implementation's pair of processes and the queues to its caller."""

    def __init__(self, ctx: Any, procs: list[Any], cmd_q: Any, out_q: Any) -> None:
        self.procs, self.cmd_q, self.out_q = procs, cmd_q, out_q

    def round(self, calls: int, tensor_calls: int) -> dict[str, float]:
        self.cmd_q.put((calls, tensor_calls))
        result: dict[str, float] = self.out_q.get(timeout=600)
        return result

    def stop(self) -> None:
        self.cmd_q.put(None)
        for p in self.procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()


def start_stalwart(ctx: Any, tcp_only: bool = False) -> _Side:
    addr_q, cmd_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    view_qs = [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_stalwart_worker, args=(r, (addr_q, view_qs[r], cmd_q, out_q), tcp_only))
             for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(addr_q.get(timeout=120) for _ in procs)
    members = [(f"w{r}", r, addr, inc) for r, addr, inc in got]
    for q in view_qs:
        q.put(members)
    return _Side(ctx, procs, cmd_q, out_q)


def start_torch(ctx: Any, tcp_only: bool = False) -> _Side:
    cmd_q, out_q = ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_torch_worker, args=(r, port, cmd_q, out_q, tcp_only)) for r in range(2)]
    for p in procs:
        p.start()
    return _Side(ctx, procs, cmd_q, out_q)


# -- the retry scheduler ----------------------------------------------------------------------------------

def bench_scheduler(pending: int = 100_000, ops: int = 100_000) -> dict[str, float]:
    """Per operation: schedule one retry and cancel one (its reply came), with ``pending`` others waiting;
    then fire everything in due order. Both costs are divided over the operations."""
    from stalwart.rpc.timers import TimerHeap

    rng = random.Random(0)
    heap = TimerHeap()
    live = [heap.schedule(rng.uniform(0, 60), lambda: None) for _ in range(pending)]
    t0 = time.perf_counter()
    for _ in range(ops):
        live.append(heap.schedule(rng.uniform(0, 60), lambda: None))
        j = rng.randrange(len(live))
        live[j], live[-1] = live[-1], live[j]
        heap.cancel(live.pop())
    fired = len(heap.pop_due(float("inf")))
    ours = (time.perf_counter() - t0) / (ops + fired) * 1e6

    async def asyncio_anchor() -> float:
        loop = asyncio.get_running_loop()
        handles = [loop.call_later(rng.uniform(100, 160), lambda: None) for _ in range(pending)]
        t0 = time.perf_counter()
        for _ in range(ops):
            handles.append(loop.call_later(rng.uniform(100, 160), lambda: None))
            j = rng.randrange(len(handles))
            handles[j], handles[-1] = handles[-1], handles[j]
            handles.pop().cancel()
        elapsed = time.perf_counter() - t0
        for h in handles:
            h.cancel()
        return elapsed / ops * 1e6

    return {"stalwart": ours, "asyncio-call_later": asyncio.run(asyncio_anchor())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="1 KiB round trips to time per round")
    parser.add_argument("--tensor-calls", type=int, default=100, help="1 MiB tensor calls to time per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating measurement rounds per side")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--tcp", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure both restricted to TCP (as across hosts)")
    parser.add_argument("--etcd", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the RPC membership join on etcd plain vs with TLS and auth")
    args = parser.parse_args()

    def emit(impl: str, metric: str, value: float, **extra: Any) -> None:
        print(json.dumps({"bench": "rpc", "impl": impl, "metric": metric, "value": round(value, 2), **extra}),
              flush=True)

    ctx = mp.get_context("spawn")
    # "-tcp": both restricted to TCP (no shared memory), as between processes on different hosts
    sides = {"stalwart": start_stalwart(ctx)}
    if not args.skip_torch:
        sides["torch-rpc"] = start_torch(ctx)
    if args.tcp:
        sides["stalwart-tcp"] = start_stalwart(ctx, tcp_only=True)
        if not args.skip_torch:
            sides["torch-rpc-tcp"] = start_torch(ctx, tcp_only=True)
    rounds: dict[str, list[dict[str, float]]] = {impl: [] for impl in sides}
    try:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for impl in order:
                rounds[impl].append(sides[impl].round(args.calls, args.tensor_calls))
    finally:
        for side in sides.values():
            side.stop()
    for metric in ("latency_us", "throughput_mib_s"):
        medians = {impl: statistics.median(m[metric] for m in got) for impl, got in rounds.items()}
        for impl, value in medians.items():
            emit(impl, metric, value, rounds=args.rounds,
                 each=[round(m[metric], 1) for m in rounds[impl]])
        for ours, theirs in (("stalwart", "torch-rpc"), ("stalwart-tcp", "torch-rpc-tcp")):
            if ours in medians and theirs in medians:
                emit(f"{ours}/{theirs}", metric + "_ratio", medians[ours] / medians[theirs])
    sched = bench_scheduler()
    for impl, value in sched.items():
        emit(impl, "scheduler_us_per_op", value, pending=100_000)
    if args.etcd:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import rpc_etcd

        for row in rpc_etcd.run(world=8, rounds=args.rounds, puts=500):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
