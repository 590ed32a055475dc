"""State-copy benchmark: ``sync_from_peers`` over each transport, at one and two sources, beside torchft's.

What runs, per ``--params`` size: three processes (gloo on loopback, one torch thread each), every one with
the same model as ``bench/torchft_copy.py`` (four square ``Linear`` layers) and Adam. Ranks 0 and 1 hold the
same trained state (one Adam step: parameters and two moments, about 12 bytes a parameter in float32); rank 2
is a promoted spare: its model built, its optimizer without state. Each round rank 2 calls
``sync_from_peers(step=None)`` and the others ``step=1``; between rounds rank 2 drops its optimizer state
again, so every round makes its Adam slots anew, as torchft's replacement does. Per transport:

* ``group``: the iteration's gloo group, point to point;
* ``streams:K``: a gloo group of its own with K connections per pair (built inside the timed call);
* ``rpc``: stalwart RPC between the same processes, TCP only (``arena_bytes=0``, as between pods), its
  zero-copy tensor path: each source pushes its buckets (the same plan as ``sync_from_peers``) with
  ``rpc_async``, up to two in flight; the receiver's function copies each into its place. Not a
  ``sync_from_peers`` transport: it is here to be measured (``restart`` does not import ``rpc``).

``sources`` 1: rank 0 alone sends (``max_sources=1``); 2: ranks 0 and 1 each send about half. ``landing``
``new``: the receiver's Adam slots are made by the copy (torchft's replacement allocates too); ``warm``: made
before the timed call by ``materialize_optimizer_state``, as a parked spare's ``prepare`` hook does while it
waits (the parameters exist in both).

Rows: ``{"bench": "podloss", "impl": "stalwart", "metric": "copy_gbps", "params", "sources", "transport",
"landing", "value", "seconds", "bytes", "rounds"}``: ``seconds`` is the median over ``--rounds`` (each round runs every
transport and source count once, in turn) of the receiver's whole
call (the step exchange, the layout and its check, building the transport's group, every bucket, the commit);
``value`` is ``bytes`` (the tensors received) over it in 1e9 bytes a second; ``rounds`` each round's GB/s;
``cpu_seconds`` the CPU time (every thread) the receiver and each source spent in the median round: a
receiver whose CPU time is about its wall time was the bound (two cores: the two sources and the receiver
share them). Not
charged: the process group of the iteration (built before), the model's construction, the first step. Then
torchft's rows from ``bench/torchft_copy.py`` (its ``pg`` and ``http`` transports) on the same model and
optimizer, in the same run. Each copy's result is checked: the receiver's state equals the source's bit for bit.

Usage: ``python bench/state_copy.py [--params 25000000 100000000] [--transports group streams:2 streams:4 rpc]
[--rounds 5] [--bucket-mb 8] [--landings new warm] [--no-anchor]``; torchft from ``make bench-anchors``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from torchft_copy import LAYERS, width_for  # noqa: E402

from stalwart.restart.peers import BUCKET_BYTES  # noqa: E402

TOKEN = "bench-copy-token-0123456789abcdef"
WORLD = 3
RECEIVER = 2
RPC_WINDOW = 2
DEADLINE_S = 900.0
#: Where the receiver's optimizer slots come from: made by the copy ("new"), or made while the spare was
#: parked by ``materialize_optimizer_state`` ("warm").
LANDINGS = ("new", "warm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _digest(model: Any, optimizer: Any) -> str:
    """A hash of every byte of the model's and the optimizer's tensors, in order."""
    import hashlib

    import torch

    h = hashlib.blake2b(digest_size=16)
    tensors = list(model.state_dict().values())
    for p in model.parameters():
        tensors += [v for _, v in sorted(optimizer.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _RpcCopy:
    """The bucket copy over stalwart RPC: the receiver's landing places and the function sources call."""

    def __init__(self) -> None:
        self.landings: list[Any] = []
        self.buckets: list[Any] = []
        self.left = 0
        self.done = threading.Event()
        self.lock = threading.Lock()

    def land(self, index: int, data: Any) -> int:
        at = 0
        for p in self.buckets[index].pieces:
            self.landings[p.tensor][p.offset:p.offset + p.length].copy_(data[at:at + p.length])
            at += p.length
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.done.set()
        return at


def _worker(rank: int, port: int, params: int, queues: tuple[Any, Any, Any, Any]) -> None:
    cmd_q, out_q, addr_q, view_q = queues
    import torch
    import torch.distributed as dist
    from torch import nn

    from stalwart.restart import copy_wire, materialize_optimizer_state, sync_from_peers
    from stalwart.restart.copy_plan import assign_sources, plan_buckets, tensor_bytes
    from stalwart.restart.peers import _entries, _receiving
    from stalwart.rpc import REGISTRY, MembershipView, RpcAgent, StaticMembership, Worker
    from stalwart.rpc.streams import StreamTransport

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    width = width_for(params)
    torch.manual_seed(1 if rank < RECEIVER else 2)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if rank < RECEIVER:
        torch.manual_seed(3)
        x, y = torch.randn(8, width), torch.randn(8, width)
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)
    copier = _RpcCopy()
    REGISTRY.register(copier.land, "bench.copy.land")
    agent = RpcAgent(f"w{rank}", rank, token=TOKEN, transport=StreamTransport(TOKEN, arena_bytes=0))
    addr_q.put((rank, agent.start(), agent.incarnation))
    agent.join(StaticMembership(MembershipView.of(1, [Worker(*m) for m in view_q.get()])))
    out_q.put({"rank": rank, "ready": True})
    while True:
        cmd = cmd_q.get()
        if cmd is None:
            break
        transport, sources, bucket_bytes, landing = cmd
        if rank == RECEIVER:
            opt.state.clear()  # a spare's optimizer has no state yet
            if landing == "warm":
                # What a parked spare's prepare hook does while it waits, before the fault: not timed.
                materialize_optimizer_state(opt)
        dist.barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        if transport == "rpc":
            layout = [s for s, _ in _entries(model, opt)] if rank != RECEIVER else None
            # The layout is the sources' (same model); the receiver makes its Adam slots from it, as
            # sync_from_peers does. Rank 0 sends it over gloo so that the receiver's clock covers it.
            box = [layout]
            dist.broadcast_object_list(box, src=0)
            layout = box[0]
            assert layout is not None
            buckets = plan_buckets([tensor_bytes(s.shape, s.dtype) for s in layout], bucket_bytes)
            senders = assign_sources([b.nbytes for b in buckets], tuple(range(sources)))
            received = 0
            if rank == RECEIVER:
                found = _receiving(model, opt, layout)
                copier.buckets = list(buckets)
                copier.landings = [copy_wire.byte_view(t) for t, _ in found]
                copier.left = len(buckets)
                copier.done.clear()
                dist.barrier()
                if not copier.done.wait(DEADLINE_S):
                    raise TimeoutError("rpc copy: not every bucket landed")
                params_list = [p for g in opt.param_groups for p in g["params"]]
                for spec, (t, new) in zip(layout, found, strict=True):
                    if new:
                        _, i, key = spec.name.split(".", 2)
                        opt.state[params_list[int(i)]][key] = t
                received = sum(b.nbytes for b in buckets)
            else:
                dist.barrier()
                if rank < sources:
                    data = [copy_wire.byte_view(t) for _, t in _entries(model, opt)]
                    flight: list[Any] = []
                    for index, bucket in enumerate(buckets):
                        if senders[index] != rank:
                            continue
                        if bucket.direct:
                            p = bucket.pieces[0]
                            payload = data[p.tensor][p.offset:p.offset + p.length]
                        else:
                            payload = torch.cat([data[p.tensor][p.offset:p.offset + p.length]
                                                 for p in bucket.pieces])
                        flight.append(agent.rpc_async(f"w{RECEIVER}", "bench.copy.land", (index, payload)))
                        while len(flight) >= RPC_WINDOW:
                            flight.pop(0).wait(DEADLINE_S)
                    for f in flight:
                        f.wait(DEADLINE_S)
        else:
            kind, _, k = transport.partition(":")
            res = sync_from_peers(model, opt, step=None if rank == RECEIVER else 1, transport=kind,
                                  max_sources=sources, bucket_bytes=bucket_bytes, streams=int(k or 1))
            received = res.bytes
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        digest = _digest(model, opt)
        out_q.put({"rank": rank, "seconds": seconds, "cpu": cpu, "bytes": received, "digest": digest})
    dist.barrier()
    agent.shutdown(graceful=True, timeout=60)
    dist.destroy_process_group()


def _get(out_q: Any, procs: list[Any]) -> dict[str, Any]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        with contextlib.suppress(Exception):
            rec: dict[str, Any] = out_q.get(timeout=1)
            return rec
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"copy bench: a worker failed (exit codes {[p.exitcode for p in procs]}) or "
                               "the deadline passed")


def run_stalwart(params: int, transports: list[str], rounds: int, bucket_bytes: int,
                 landings: tuple[str, ...] = LANDINGS) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    cmd_qs = [ctx.Queue() for _ in range(WORLD)]
    out_q, addr_q, view_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, params, (cmd_qs[r], out_q, addr_q, view_q)))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    rows: list[dict[str, Any]] = []
    try:
        members = sorted(addr_q.get(timeout=DEADLINE_S) for _ in range(WORLD))
        view = [(f"w{r}", r, a, inc) for r, a, inc in members]
        for _ in range(WORLD):
            view_q.put(view)
        for _ in range(WORLD):
            _get(out_q, procs)
        cases = [(t, n, ld) for t in transports for n in (1, 2) for ld in landings]
        per_round: dict[tuple[str, int, str], list[tuple[float, int]]] = {c: [] for c in cases}
        cpu: dict[tuple[str, int, str], list[list[float]]] = {c: [] for c in cases}
        # Rounds outermost: each round runs every case once, so a busy moment of the machine falls on all.
        for _ in range(rounds):
            for case in cases:
                transport, sources, landing = case
                for q in cmd_qs:
                    q.put((transport, sources, bucket_bytes, landing))
                recs = {r["rank"]: r for r in (_get(out_q, procs) for _ in range(WORLD))}
                if recs[RECEIVER]["digest"] != recs[0]["digest"]:
                    raise RuntimeError(f"{transport}, {sources} sources, {landing}: the receiver's state differs")
                per_round[case].append((recs[RECEIVER]["seconds"], recs[RECEIVER]["bytes"]))
                cpu[case].append([recs[r]["cpu"] for r in range(WORLD)])
        for case in cases:
            transport, sources, landing = case
            got = per_round[case]
            seconds = statistics.median(s for s, _ in got)
            mid = cpu[case][sorted(range(rounds), key=lambda i: got[i][0])[rounds // 2]]
            nbytes = got[0][1]
            rows.append({"bench": "podloss", "impl": "stalwart", "metric": "copy_gbps", "params": params,
                         "sources": sources, "transport": transport, "landing": landing,
                         "value": round(nbytes / seconds / 1e9, 3),
                         "seconds": round(seconds, 4), "bytes": nbytes,
                         "rounds": [round(b / s / 1e9, 3) for s, b in got],
                         "cpu_seconds": {"receiver": round(mid[RECEIVER], 4),
                                         "sources": [round(c, 4) for c in mid[:sources]]}})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for q in cmd_qs:
            q.put(None)
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                print(f"copy bench: killed worker pid {p.pid} (no end after 120 s)", file=sys.stderr)
                p.kill()
                p.join(timeout=30)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--params", type=int, nargs="+", default=[25_000_000, 100_000_000])
    parser.add_argument("--transports", nargs="+", default=["group", "streams:2", "streams:4", "rpc"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=BUCKET_BYTES >> 20)
    parser.add_argument("--landings", nargs="+", choices=LANDINGS, default=list(LANDINGS))
    parser.add_argument("--no-anchor", action="store_true", help="leave torchft's rows out")
    args = parser.parse_args(argv)
    for t in args.transports:
        kind, _, k = t.partition(":")
        if kind not in ("group", "streams", "rpc") or (kind == "streams" and not k.isdigit()):
            parser.error(f"--transports: expected group, streams:K or rpc, got {t!r}")
    if args.rounds < 1 or args.bucket_mb < 1:
        parser.error("--rounds and --bucket-mb: expected >= 1")
    if not args.no_anchor and importlib.util.find_spec("torchft") is None:
        parser.error(f"torchft is not installed for {sys.executable}: make bench-anchors (or --no-anchor)")
    for params in args.params:
        run_stalwart(params, args.transports, args.rounds, args.bucket_mb << 20, tuple(args.landings))
        if not args.no_anchor:
            import torchft_copy

            for row in torchft_copy.run(params, ("pg", "http")):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
