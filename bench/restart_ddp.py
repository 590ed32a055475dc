"""A small DDP training script, for the restart tests and ``bench/restart.py``.

Runs as a plain torchrun-style script (``--mode plain``) or through ``stalwart.restartable``
(``--mode wrapped``). Training is deterministic: at step ``s`` rank ``r`` feeds a batch drawn from a
generator seeded with ``(s, r)``, and DDP averages the gradients, so the parameters after ``N`` steps do not
depend on which faults happened on the way. The in-memory state survives in-process restarts; at the start
of each iteration the ranks adopt the state of the rank that committed the most steps (a respawned process
has none).

Faults are injected once (a marker file records that it happened): ``--fault exception|sigkill|sigstop|hang``
in rank ``--fault-rank`` at step ``--fault-step``. Stalls for the tests of bounded waits: ``--teardown-hang R``
(rank R blocks for good in the job's final teardown, after the training function returned), ``--finalize-hang``
(after its fault, the rank hangs in its Finalize policy), ``--init-stall`` (in the first iteration the rank
never reaches its process group: a Python loop in its Initialize policy), ``--silence-slot N`` (every etcd
watch stream of slot N's process delivers nothing: a stuck watcher, injected on top of the real etcd; the
process sees changes only by reading again, once it notices the silence). ``--self-init STYLE`` makes the
training function call ``init_process_group`` itself, as a script written for torchrun does. ``--prepare
count`` gives the decorator a ``prepare`` hook that records each of its calls (process, whether it was
parked) in ``<marker-dir>/prepare.jsonl`` and returns that record, which the rank's result carries as
``prepared``; ``--prepare raise`` one that raises, ``--prepare hang`` one that never returns (with
``--prepare-timeout``, the decorator's deadline for it). Each rank
writes a JSON line to ``--out`` at the end: its final step, a checksum of the parameters, its restarts, and
timing marks for the benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STATE: dict[str, Any] = {"step": 0, "params": None, "first_after_restart": None,
                         "atomic": contextlib.nullcontext}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "wrapped"], default="wrapped")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fault", choices=["none", "exception", "sigkill", "sigstop", "hang", "hang-hard", "spin",
                                            "exception-always"],
                   default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--faults", type=int, default=1, help="how many times to inject the fault")
    p.add_argument("--second-fault", choices=["none", "exception", "sigkill"], default="none",
                   help="a second fault during the first restart, before training resumes (another rank)")
    p.add_argument("--leak-report", action="store_true",
                   help="write threads, fds, child processes and etcd keys at the start of every iteration")
    p.add_argument("--marker-dir", default="")
    p.add_argument("--out", default="")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--timeout", type=float, default=30.0, help="collective timeout (seconds)")
    p.add_argument("--max-restarts", type=int, default=10)
    p.add_argument("--soft-timeout", type=float, default=60.0)
    p.add_argument("--barrier-timeout", type=float, default=60.0)
    p.add_argument("--min-world", type=int, default=1)
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--finalize-hang", action="store_true")
    p.add_argument("--teardown-hang", type=int, default=None, metavar="RANK",
                   help="this rank's process blocks for good in the collection that ends the job")
    p.add_argument("--init-stall", action="store_true")
    p.add_argument("--late-rank", type=int, default=None, metavar="RANK",
                   help="once, this rank reaches its first collective --late-seconds after the others (busy "
                        "in Python meanwhile, as a respawned rank building its model is): its peers wait in C")
    p.add_argument("--late-seconds", type=float, default=0.0)
    p.add_argument("--slow-assignment", type=float, default=0.0,
                   help="seconds the rank assignment takes (widens the moment between a seal and the run)")
    p.add_argument("--slow-report", type=float, default=0.0,
                   help="seconds each fault report of this process takes to return after it is written (etcd slow "
                        "to answer under load)")
    p.add_argument("--silence-slot", type=int, default=None,
                   help="every etcd watch of this slot's process delivers nothing")
    p.add_argument("--prepare", choices=["none", "count", "raise", "hang"], default="none",
                   help="pass a prepare hook to the decorator: one that appends a line to "
                        "<marker-dir>/prepare.jsonl (count), one that raises (raise), one that never returns (hang)")
    p.add_argument("--prepare-timeout", type=float, default=1800.0, help="the decorator's prepare_timeout")
    p.add_argument("--self-init", choices=["none", "bare", "env", "timeout", "destroy", "bad-world"],
                   default="none",
                   help="the function calls init_process_group itself: ('gloo'), (init_method='env://'), "
                        "(timeout=20s, another than the wrapper's), ('gloo') and destroy_process_group() at its end, "
                        "(world_size=world+1)")
    return p.parse_args()


def batch(step: int, rank: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(8, hidden, generator=g), torch.randn(8, 1, generator=g)


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().cpu().sum() for p in model.parameters()))


def fault_due(args: argparse.Namespace, name: str, rank: int, step: int, index: int = 0) -> bool:
    """True the first ``--faults`` times rank ``--fault-rank`` reaches ``--fault-step`` (marker files)."""
    if args.fault == "none" or rank != args.fault_rank or step != args.fault_step:
        return False
    if args.fault == "exception-always":
        return True
    for i in range(args.faults):
        marker = os.path.join(args.marker_dir, f"{name}-{i}")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.write(fd, f"{time.time():.6f}".encode())
        os.close(fd)
        return True
    return False


def once(args: argparse.Namespace, name: str) -> bool:
    """True the first time only (a marker file records it), like an injected fault."""
    try:
        fd = os.open(os.path.join(args.marker_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, f"{time.time():.6f}".encode())
    os.close(fd)
    return True


def inject(kind: str) -> None:
    if kind.startswith("exception"):
        raise RuntimeError("injected fault")
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "hang":
        time.sleep(3600)
    if kind == "spin":
        # Busy in Python for good: progress to its own monitor (no soft timeout of its own), a hang to its peers.
        while True:
            time.sleep(0.05)
    if kind == "hang-hard":
        # Blocked in C with the wakeup signal masked: only the agent's hard timeout can end this.
        import ctypes

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        ctypes.CDLL(None).pause()


def leak_report(args: argparse.Namespace, rank: int, restarts: int) -> None:
    import threading

    from stalwart.etcd.client import connect

    endpoints = os.environ["STALWART_ETCD_ENDPOINTS"].split(",")
    uid = os.environ["STALWART_JOB_UID"]
    ns = os.environ["STALWART_JOB"].partition("/")[0]
    prefix = f"/stalwart/v1/{ns}/{uid}/"
    with connect(endpoints) as s:
        kvs, _ = s.get_prefix(prefix, keys_only=True)
    # Which iterations still have keys: restart/<epoch>/<kind>/<iteration>/... and store/<epoch>/<iteration>/...
    iterations: set[int] = set()
    faults: dict[int, int] = {}
    for kv in kvs:
        parts = kv.key[len(prefix):].split("/")
        if parts[0] == "restart" and len(parts) >= 4 and parts[2] in ("arrive", "seal", "fault", "done", "end"):
            iterations.add(int(parts[3]))
            if parts[2] == "fault":
                faults[int(parts[3])] = faults.get(int(parts[3]), 0) + 1
        elif parts[0] == "store" and len(parts) >= 3 and parts[2].isdigit():
            iterations.add(int(parts[2]))
    # The least of a few samples 0.1 s apart: a helper thread or descriptor that is ending (an etcd call's, gloo's
    # teardown on a loaded machine) is not counted; a leaked one is in every sample.
    native_threads, fds = len(os.listdir(f"/proc/{os.getpid()}/task")), len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        time.sleep(0.1)
        native_threads = min(native_threads, len(os.listdir(f"/proc/{os.getpid()}/task")))
        fds = min(fds, len(os.listdir("/proc/self/fd")))
    report = {"leak": True, "rank": rank, "iteration": restarts, "threads": threading.active_count(),
              "thread_names": sorted(t.name for t in threading.enumerate()),
              "native_threads": native_threads, "fds": fds, "etcd_keys": len(kvs),
              "iterations": sorted(iterations), "faults": {str(k): v for k, v in faults.items()},
              "children": _children()}
    with open(args.out, "a") as f:
        f.write(json.dumps(report) + "\n")


def _children() -> int:
    from stalwart.procfs import stat_fields

    me = str(os.getpid())
    n = 0
    for pid in os.listdir("/proc"):
        fields = stat_fields(int(pid)) if pid.isdigit() else []
        if fields[1:2] == [me]:  # field 4: the parent's pid
            n += 1
    return n


def self_init(style: str) -> None:
    """The function initialises its process group itself, as under torchrun."""
    import datetime

    if style == "bare":
        dist.init_process_group("gloo")
    elif style == "env":
        dist.init_process_group(backend="gloo", init_method="env://")
    elif style == "timeout":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    elif style == "destroy":
        dist.init_process_group()
    elif style == "bad-world":
        dist.init_process_group("gloo", world_size=int(os.environ["WORLD_SIZE"]) + 1,
                                rank=int(os.environ["RANK"]))


class SilentStream:
    """A watch's response stream that delivers nothing (a stuck etcd watcher); its creation is let through,
    so that the watch opens."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __iter__(self) -> SilentStream:
        return self

    def __next__(self) -> Any:
        while True:
            resp = next(self.inner)
            if resp.created and not resp.events:
                return resp

    def cancel(self) -> None:
        self.inner.cancel()


def silence_watches() -> None:
    """Fault injection on top of the real etcd: every watch stream of this process delivers nothing."""
    from stalwart.etcd import members

    base = members.rpc_grpc.WatchStub

    class Stub(base):  # type: ignore[misc,valid-type]
        def __init__(self, channel: Any) -> None:
            super().__init__(channel)
            inner = self.Watch
            self.Watch = lambda *a, **kw: SilentStream(inner(*a, **kw))

    members.rpc_grpc.WatchStub = Stub


def slow_reports(seconds: float) -> None:
    """Fault injection on top of the real etcd: each fault report returns ``seconds`` after it was written."""
    from stalwart.restart.coordination import Coordinator

    write = Coordinator.report_fault

    def slow(self: Coordinator, rec: Any) -> bool:
        written = write(self, rec)
        time.sleep(seconds)
        return written

    Coordinator.report_fault = slow  # type: ignore[method-assign]


def train(args: argparse.Namespace, restarts: int = 0) -> dict[str, Any]:
    if args.self_init != "none":
        self_init(args.self_init)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.leak_report:
        leak_report(args, rank, restarts)
    if restarts == 1 and args.second_fault != "none" and rank == (args.fault_rank + 1) % world \
            and fault_due(argparse.Namespace(**{**vars(args), "fault_rank": rank, "fault_step": 0, "faults": 1,
                                                 "fault": args.second_fault}), "second", rank, 0):
        inject(args.second_fault)
    if args.late_rank == rank and once(args, "late"):
        until = time.monotonic() + args.late_seconds
        while time.monotonic() < until:
            time.sleep(0.05)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        model = model.to(device)
    # Agree on the state: the lowest rank among those with the most committed steps is the source.
    have = torch.tensor([STATE["step"] if STATE["params"] is not None else -1, -rank], dtype=torch.int64,
                        device=device)
    best = have.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    src_step = int(best[0])
    cand = torch.tensor([rank if int(have[0]) == src_step else world], dtype=torch.int64, device=device)
    dist.all_reduce(cand, op=dist.ReduceOp.MIN)
    if src_step >= 0:
        if STATE["params"] is not None and int(have[0]) == src_step:
            with torch.no_grad():
                for p, saved in zip(model.parameters(), STATE["params"], strict=True):
                    p.copy_(saved)
        for p in model.parameters():
            dist.broadcast(p.data, src=int(cand[0]))
    step = max(src_step, 0)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    times: list[float] = []
    cpu: list[float] = []  # process CPU time (every thread) at the end of each step
    while step < args.steps:
        t0 = time.perf_counter()
        if fault_due(args, "fault", rank, step):
            inject(args.fault)
        x, y = batch(step, rank, args.hidden)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        # A peer's fault interrupts this thread anywhere: between these lines it would keep one step's count
        # with another's parameters, and the restart would resume from a state no run had.
        with STATE["atomic"]():
            step += 1
            STATE["step"] = step
            STATE["params"] = [p.detach().clone() for p in model.parameters()]
        if restarts >= 1 and STATE["first_after_restart"] is None:
            STATE["first_after_restart"] = time.time()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time())
        ping = STATE.get("ping")
        if ping is not None:
            ping(step)
    result = {"rank": rank, "world": world, "step": step, "checksum": checksum(model), "restarts": restarts,
              "first_after_restart": STATE["first_after_restart"], "step_times": times, "cpu_marks": cpu}
    if args.self_init == "destroy":
        dist.destroy_process_group()
    if args.teardown_hang == rank:
        # Only the collection that ends the job may meet it: an automatic one could come while the wrapper still
        # waits for the others (when depends on what was allocated before, a fork server's imports included).
        gc.disable()
        BlocksWhenCollected()
    return result


class BlocksWhenCollected:
    """An object in a reference cycle whose finaliser never returns: it stands for a destructor that blocks in
    the garbage collector that the job's end runs."""

    def __init__(self) -> None:
        self.me = self
        self.lock = threading.Lock()
        self.lock.acquire()

    def __del__(self) -> None:
        self.lock.acquire()


def write(args: argparse.Namespace, result: dict[str, Any] | None) -> None:
    if args.out and result is not None:
        result["pid"] = os.getpid()
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


def main() -> int:
    args = parse()
    if args.mode == "plain":
        import datetime

        timeout = datetime.timedelta(seconds=args.timeout)
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun 2.13 can hand a restarted attempt the previous attempt's gloo addresses (its workers'
            # store is not scoped by attempt), so the new group connects to dead ports and fails; scope it.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timeout)
            dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{restarts}/", store),
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        result = train(args, restarts)
        # DDP holds the process group in reference cycles. Destroy the group now, from its Python object
        # (torch then releases the GIL while it joins the group's gloo worker threads), after collecting
        # DDP: a worker thread still dropping its last work object while the interpreter finalizes aborts
        # the process ("terminate called without an active exception").
        group = dist.group.WORLD
        dist.destroy_process_group()
        gc.collect()
        del group
        write(args, result)
        return 0

    import stalwart
    from stalwart.restart import FinalizeCallback, InitProcessGroup, IterationContext, RankAssignment

    injected = int(os.environ.get("RANK", "0")) == args.fault_rank

    class StallingInit(InitProcessGroup):
        def __call__(self, ctx: IterationContext) -> None:
            if args.init_stall and injected and once(args, "init-stall"):
                while True:  # busy in Python: progress, but the group is never reached
                    time.sleep(0.05)
            super().__call__(ctx)

    class SlowAssignment(RankAssignment):
        def assign(self, *a: Any, **kw: Any) -> Any:
            time.sleep(args.slow_assignment)
            return super().assign(*a, **kw)

    def finalize(ctx: IterationContext) -> None:
        if args.finalize_hang and injected:
            time.sleep(3600)  # blocked: no progress, no exit

    if args.slow_report:
        slow_reports(args.slow_report)
    if args.silence_slot is not None and int(os.environ.get("RANK", "0")) == args.silence_slot:
        silence_watches()

    def prepare() -> dict[str, Any]:
        if args.prepare == "raise":
            raise ValueError("the model's configuration is invalid (injected in prepare)")
        if args.prepare == "hang":
            threading.Event().wait()  # blocked for good, as in a native call that never returns
        record = {"pid": os.getpid(), "parked": os.environ.get("STALWART_PARKED") == "true", "time": time.time()}
        with open(os.path.join(args.marker_dir, "prepare.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return record

    @stalwart.restartable(max_restarts=args.max_restarts, soft_timeout=args.soft_timeout,
                          hard_timeout=args.soft_timeout * 2, barrier_timeout=args.barrier_timeout,
                          initialize=StallingInit(args.backend, timeout=args.timeout),
                          finalize=FinalizeCallback(finalize),
                          rank_assignment=SlowAssignment(min_world_size=args.min_world),
                          prepare=None if args.prepare == "none" else prepare,
                          prepare_timeout=args.prepare_timeout)
    def run(call_wrapper: stalwart.CallWrapper) -> dict[str, Any]:
        STATE["ping"] = lambda s: call_wrapper.ping(step=s)
        STATE["atomic"] = call_wrapper.atomic
        result = train(args, call_wrapper.iteration)
        if args.prepare != "none":
            result["prepared"] = call_wrapper.prepared
        return result

    write(args, run())
    if args.teardown_hang is not None:
        gc.collect()  # the job's end: blocks for good on the rank given the object
    return 0


if __name__ == "__main__":
    sys.exit(main())
