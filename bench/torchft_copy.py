"""Anchor for the state copy of a recovery: torchft 0.2.0's live recovery, measured on this machine.

What runs, per ``--params`` size and transport: torchft's lighthouse (its ``torchft_lighthouse`` binary, the
``torchft.coordination.LighthouseServer`` of a process of its own, whose log stays out of this one's output) and
two replica groups of one process each (separate OS processes), each with its own TCPStore,
a ``torchft.process_group.ProcessGroupGloo``, a ``torchft.manager.Manager`` (``min_replica_size=1``, the default
async quorum), torchft's ``DistributedDataParallel`` and ``OptimizerWrapper`` around a plain MLP of about N
parameters (four square ``Linear`` layers) with Adam (``--optimizer sgd``: SGD with momentum 0.9, one buffer a
parameter, 8 bytes a parameter in all: the state of bench/podloss.py's job of N parameters). Replica group A
trains alone; once it has committed a few
steps (so Adam's two moments exist: about 12 bytes a parameter in float32), replica group B is started as a new
process, joins the quorum at step 0 and heals from A through the Manager's state-dict callbacks and the
checkpoint transport under test:

* ``pg``: ``torchft.checkpointing.pg_transport.PGTransport`` over the replica groups' gloo group (receiving into
  newly allocated tensors: B has no Adam state yet, so an in-place receive would not apply);
* ``http``: ``torchft.checkpointing.HTTPTransport`` (``num_chunks=0``, one streamed ``torch.save``).

Both then train ``EXTRA_STEPS`` more steps together; the run checks that their parameters end identical.

Rows (one JSON object per line, ``{"bench": "podloss", "impl": "torchft", "params", "transport", "metric",
"value"}``):

* ``copy_seconds``: the receiver's ``recv_checkpoint`` call, the boundary at which the Manager hands the
  transport the job (``Manager._async_quorum``): for ``pg`` the metadata and every tensor received over gloo;
  for ``http`` the request, A's streamed ``torch.save`` and B's ``torch.load``. It includes waiting for A to
  stage the checkpoint (A learns of B from the same quorum), but not the quorum itself, the process-group
  reconfiguration, the checkpoint-metadata RPC before it, nor loading the received state into the model and
  optimizer (done later, in ``should_commit``);
* ``copy_bytes``: the bytes of the tensors received (each storage once; the pickled metadata, HTTP and gloo
  framing are not counted); ``copy_gbps``: the two, in 1e9 bytes a second;
* ``replacement_first_step_seconds``: from just before B's process is started (interpreter, imports, model
  construction and Manager start included) to B's first committed step, which is the step it healed in;
* ``survivor_step_seconds``: A's step (``zero_grad`` to ``step``) in which it sent the checkpoint: its
  allreduce waits for B, which joins the collective only after its copy; ``baseline_seconds`` on that row is
  the median of A's later steps with both replica groups.

Not charged: no pod, no scheduler, no failure detection (B is a new replica, not a lost one being replaced:
nothing waits for a heartbeat timeout), no checkpoint on disk. Each worker uses one torch thread: the machine
has two cores for the two replica groups. A process that had to be killed at its deadline is named on stderr
and in a ``killed`` field of its run's rows.

Every listener stays on 127.0.0.1: the Manager's RPC server and HTTPTransport's server bind every interface in
torchft 0.2.0, so the workers hand them a loopback address (a wrapper around ``ManagerServer`` and
HTTPTransport's server class, nothing else of torchft changed); the TCPStore gets a loopback socket of its own
(``master_listen_fd``) and gloo the ``lo`` interface.

Install torchft (not a dependency of stalwart): ``make bench-anchors``, which runs ``pip install --no-deps
torchft==0.2.0`` plus opentelemetry-api, -sdk, -exporter-otlp-proto-http and numpy into the venv (``--no-deps``
keeps the venv's CPU torch). Usage: ``python bench/torchft_copy.py [--params 1000000 25000000]
[--transports pg http]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TRANSPORTS = ("pg", "http")
OPTIMIZERS = ("adam", "sgd")
MIN_PARAMS = 1000
LOOPBACK = "127.0.0.1"
LAYERS = 4
BATCH = 8
# A's committed steps before B starts: Adam's moments exist after the first; a few more give A a steady state.
READY_STEPS = 3
# Steps both groups train after the heal: the survivor's baseline and the end-state comparison.
EXTRA_STEPS = 4

Row = dict[str, Any]


@dataclass(frozen=True)
class WorkerConfig:
    role: str  # "a": the survivor; "b": the replacement
    transport: str
    params: int
    lighthouse: str
    result: str
    ready: str
    deadline_s: float
    timeout_s: float
    optimizer: str = "adam"


def width_for(params: int) -> int:
    """The width d of LAYERS square layers with biases: LAYERS * (d * d + d) parameters, about ``params``."""
    per_layer = params / LAYERS
    return max(1, round((math.sqrt(1 + 4 * per_layer) - 1) / 2))


def deadline_for(params: int) -> float:
    """Seconds a whole run of one transport may take: startup and a dozen steps, generous on two busy cores."""
    return 180.0 + 6.0 * params / 1e6


# --------------------------------------------------------------------------------------------------------------
# Worker side (its own process)


def _loopback_url(url: str) -> str:
    """``url`` with its host replaced by 127.0.0.1 (torchft advertises ``socket.gethostname()``)."""
    parts = urlsplit(url)
    return parts._replace(netloc=f"{LOOPBACK}:{parts.port}").geturl()


def _worker(cfg: WorkerConfig) -> None:
    deadline = time.monotonic() + cfg.deadline_s
    import torch
    import torch.nn.functional as F
    import torchft.checkpointing.http_transport as ft_http  # type: ignore[import-untyped]
    import torchft.manager as ft_manager  # type: ignore[import-untyped]
    from torch import nn
    from torch._C._distributed_c10d import TCPStore
    from torchft.checkpointing import CheckpointTransport, HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport  # type: ignore[import-untyped]
    from torchft.ddp import DistributedDataParallel  # type: ignore[import-untyped]
    from torchft.optim import OptimizerWrapper  # type: ignore[import-untyped]
    from torchft.process_group import ProcessGroupGloo  # type: ignore[import-untyped]

    # Two replica groups share two cores; more threads each would only contend.
    torch.set_num_threads(1)
    timeout = timedelta(seconds=cfg.timeout_s)
    # Wall clock: B's first step is compared with the parent's time of starting B's process.
    now = time.time

    class LoopbackHTTPServer(ThreadingHTTPServer):
        # HTTPTransport asks for ("", 0) on IPv6, every interface; the port stays the OS's pick.
        def __init__(self, _address: Any, handler: type[BaseHTTPRequestHandler]) -> None:
            super().__init__((LOOPBACK, 0), handler)

    real_manager_server = ft_manager.ManagerServer

    def loopback_manager_server(**kwargs: Any) -> Any:
        # Manager builds the bind address as "[::]:port"; keep its port, bind loopback only.
        kwargs["bind"] = f"{LOOPBACK}:{str(kwargs['bind']).rpartition(':')[2]}"
        return real_manager_server(**kwargs)

    ft_manager.ManagerServer = loopback_manager_server
    ft_http._IPv6HTTPServer = LoopbackHTTPServer

    sends: list[dict[str, Any]] = []
    recvs: list[dict[str, Any]] = []
    loads: list[float] = []

    class TimedTransport(CheckpointTransport):  # type: ignore[misc]
        """Delegates to torchft's transport; times the two calls the Manager makes for a heal."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def metadata(self) -> str:
            meta = str(self._inner.metadata())
            return _loopback_url(meta) if meta.startswith("http") else meta

        def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
            t0 = now()
            self._inner.send_checkpoint(dst_ranks, step, state_dict, timeout)
            sends.append({"start": t0, "end": now(), "dst_ranks": list(dst_ranks), "step": step})

        def disallow_checkpoint(self) -> None:
            # For http this is where the sender waits for a transfer still being served.
            t0 = now()
            self._inner.disallow_checkpoint()
            if sends and "disallow_seconds" not in sends[-1]:
                sends[-1]["disallow_seconds"] = now() - t0

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            t0 = now()
            received = self._inner.recv_checkpoint(src_rank, metadata, step, timeout)
            t1 = now()
            recvs.append({"start": t0, "end": t1, "step": step, "bytes": _tensor_bytes(received)})
            return received

        def shutdown(self, wait: bool = True) -> None:
            self._inner.shutdown(wait=wait)

    def _tensor_bytes(tree: Any) -> int:
        from torch.utils._pytree import tree_leaves

        seen: set[int] = set()
        total = 0
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    width = width_for(cfg.params)
    # Different seeds: B's own initial weights must be overwritten by the heal for the end check to pass.
    torch.manual_seed(1 if cfg.role == "a" else 2)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers.append(nn.Linear(width, width))
        if i < LAYERS - 1:
            layers.append(nn.ReLU())
    module = nn.Sequential(*layers)
    opt = (torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9) if cfg.optimizer == "sgd"
           else torch.optim.Adam(module.parameters(), lr=1e-3))

    def state_dict() -> dict[str, Any]:
        return {"model": module.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        t0 = now()
        module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        loads.append(now() - t0)

    # The store's listening socket is ours so that it is bound to loopback (TCPStore alone binds every interface).
    listener = socket.create_server((LOOPBACK, 0), backlog=128)
    store_port = int(listener.getsockname()[1])
    store = TCPStore(LOOPBACK, store_port, is_master=True, wait_for_workers=False, timeout=timeout,
                     master_listen_fd=listener.detach())
    pg = ProcessGroupGloo(timeout=timeout)
    inner = (PGTransport(pg, timeout=timeout, device=torch.device("cpu")) if cfg.transport == "pg"
             else HTTPTransport(timeout=timeout, num_chunks=0))
    manager = ft_manager.Manager(
        pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
        rank=0, world_size=1, store_addr=LOOPBACK, store_port=store_port,
        lighthouse_addr=cfg.lighthouse, replica_id=f"copy_{cfg.role}", hostname=LOOPBACK,
        checkpoint_transport=TimedTransport(inner),
    )
    model = DistributedDataParallel(manager, module)
    optimizer = OptimizerWrapper(manager, opt)
    x = torch.randn(BATCH, width)
    y = torch.randn(BATCH, width)

    steps: list[dict[str, Any]] = []
    end_step: int | None = None
    while end_step is None or manager.current_step() < end_step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica group {cfg.role}: no end after {cfg.deadline_s:.0f} s "
                               f"(step {manager.current_step()}, end step {end_step})")
        before = manager.current_step()
        sent_before = len(sends)
        t0 = now()
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        t1 = now()
        participants = int(manager.num_participants())
        steps.append({"step": before, "start": t0, "end": t1, "participants": participants,
                      "committed": manager.current_step() > before, "sent": len(sends) > sent_before})
        if cfg.role == "a" and manager.current_step() >= READY_STEPS and not Path(cfg.ready).exists():
            Path(cfg.ready).write_text("ready\n")
        # Both groups first see two participants in the same quorum (the one after the heal) at the same
        # step, so both stop after the same commit and neither waits for a quorum the other never joins.
        if end_step is None and participants >= 2:
            end_step = before + EXTRA_STEPS

    checksum = float(sum(p.detach().double().sum().item() for p in module.parameters()))
    result = {"role": cfg.role, "steps": steps, "sends": sends, "recvs": recvs, "load_seconds": loads,
              "checksum": checksum, "final_step": manager.current_step(),
              "state_bytes": _tensor_bytes(state_dict())}
    # Written before the shutdown: a shutdown that hangs is killed by the parent, the measurement stays.
    Path(cfg.result).write_text(json.dumps(result))
    manager.shutdown(wait=False)
    del store


# --------------------------------------------------------------------------------------------------------------
# Parent side


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


def _spawn(cfg: WorkerConfig, log: Path) -> _Proc:
    env = dict(os.environ)
    env.update({"GLOO_SOCKET_IFNAME": "lo", "TORCHFT_USE_OTEL": "false", "PYTHONUNBUFFERED": "1"})
    with log.open("wb") as out:
        # A session of its own, so that a kill reaches anything it started too.
        popen = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(asdict(cfg))],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    return _Proc(f"replica-{cfg.role}", popen, log)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _end(procs: list[_Proc], deadline: float) -> list[str]:
    """Waits for every process until ``deadline``, or until one fails (the others would wait for it in vain),
    then kills those still running; returns the names killed."""
    while time.monotonic() < deadline:
        codes = [p.popen.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.1)
    killed = []
    for proc in procs:
        if proc.popen.poll() is not None:
            continue
        killed.append(proc.name)
        print(f"torchft_copy: killed {proc.name} (pid {proc.popen.pid}): still running at its deadline or after "
              "another process failed", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGKILL)
        try:
            proc.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            print(f"torchft_copy: {proc.name} (pid {proc.popen.pid}) did not end after SIGKILL", file=sys.stderr)
    return killed


def _wait_ready(ready: Path, proc: _Proc, deadline: float) -> None:
    while not ready.exists():
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}) before {READY_STEPS} steps:\n"
                               f"{_tail(proc.log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name}: not {READY_STEPS} steps done by its deadline:\n{_tail(proc.log)}")
        time.sleep(0.05)


def _lighthouse(tmp: Path, deadline: float) -> tuple[_Proc, str]:
    """torchft's lighthouse binary on a loopback port the OS picks, and its address (read from its log)."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    if not binary.exists():
        found = shutil.which("torchft_lighthouse")
        if found is None:
            raise RuntimeError("torchft_lighthouse not found beside the interpreter nor on PATH: make bench-anchors")
        binary = Path(found)
    log = tmp / "lighthouse.log"
    with log.open("wb") as out:
        # min_replicas=1: A trains alone until B arrives. join_timeout bounds a quorum's wait for a replica that
        # heartbeats but has not asked to join yet (B, between its Manager's start and its first step).
        popen = subprocess.Popen(
            [str(binary), "--bind", f"{LOOPBACK}:0", "--min_replicas", "1", "--join_timeout_ms", "10000",
             "--quorum_tick_ms", "10", "--heartbeat_timeout_ms", "5000"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    proc = _Proc("lighthouse", popen, log)
    while True:
        found_addr = re.search(r"Lighthouse listening on: (\S+)", log.read_text(errors="replace"))
        if found_addr:
            return proc, _loopback_url(found_addr.group(1))
        if popen.poll() is not None:
            raise RuntimeError(f"the lighthouse exited ({popen.returncode}):\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the lighthouse printed no address by its deadline:\n{_tail(log)}")
        time.sleep(0.05)


def _run_transport(params: int, transport: str, optimizer: str = "adam") -> list[Row]:
    budget = deadline_for(params)
    deadline = time.monotonic() + budget
    workers: list[_Proc] = []
    killed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="torchft_copy_") as tmp_name:
        tmp = Path(tmp_name)
        lighthouse: _Proc | None = None
        try:
            lighthouse, address = _lighthouse(tmp, deadline)

            def config(role: str) -> WorkerConfig:
                return WorkerConfig(role=role, transport=transport, params=params, lighthouse=address,
                                    result=str(tmp / f"{role}.json"), ready=str(tmp / "a.ready"),
                                    deadline_s=budget, timeout_s=budget / 2, optimizer=optimizer)

            workers.append(_spawn(config("a"), tmp / "a.log"))
            _wait_ready(tmp / "a.ready", workers[0], deadline)
            spawned_b = time.time()
            workers.append(_spawn(config("b"), tmp / "b.log"))
            killed = _end(workers, deadline)
        finally:
            # On an error above: whatever is still running ends now, and says so.
            killed += _end([p for p in workers if p.popen.poll() is None], time.monotonic())
            if lighthouse is not None:
                # The lighthouse serves until told to stop: SIGTERM is its normal end, a kill after it is not.
                lighthouse.popen.terminate()
                killed += _end([lighthouse], time.monotonic() + 10)

        results: dict[str, dict[str, Any]] = {}
        missing = []
        for proc, role in zip(workers, ("a", "b"), strict=True):
            path = tmp / f"{role}.json"
            if path.exists():
                results[role] = json.loads(path.read_text())
            else:
                missing.append(f"{proc.name} left no result (exit {proc.popen.returncode}, killed: "
                               f"{proc.name in killed}):\n{_tail(proc.log)}")
        if missing:
            raise RuntimeError(f"{transport}: " + "\n".join(missing))
    rows = _rows(params, transport, results["a"], results["b"], spawned_b=spawned_b, killed=killed)
    return [{**r, "optimizer": optimizer} for r in rows] if optimizer != "adam" else rows


def _rows(params: int, transport: str, a: dict[str, Any], b: dict[str, Any], *, spawned_b: float,
          killed: list[str]) -> list[Row]:
    if len(b["recvs"]) != 1 or len(a["sends"]) != 1:
        raise RuntimeError(f"{transport}: expected one checkpoint sent by A and one received by B, "
                           f"got {len(a['sends'])} and {len(b['recvs'])}")
    if a["checksum"] != b["checksum"] or a["final_step"] != b["final_step"]:
        raise RuntimeError(f"{transport}: the replica groups ended apart: step {a['final_step']} vs "
                           f"{b['final_step']}, parameter sum {a['checksum']!r} vs {b['checksum']!r}")
    recv = b["recvs"][0]
    copy_s = recv["end"] - recv["start"]
    first_commit = min(s["end"] for s in b["steps"] if s["committed"])
    heal_steps = [s for s in a["steps"] if s["sent"]]
    after = [s["end"] - s["start"] for s in a["steps"]
             if s["participants"] >= 2 and s["start"] > heal_steps[0]["end"]]
    base: Row = {"bench": "podloss", "impl": "torchft", "params": params, "transport": transport}
    if killed:
        base["killed"] = killed
    return [
        {**base, "metric": "copy_seconds", "value": round(copy_s, 4)},
        {**base, "metric": "copy_bytes", "value": recv["bytes"]},
        {**base, "metric": "copy_gbps", "value": round(recv["bytes"] / copy_s / 1e9, 4)},
        {**base, "metric": "replacement_first_step_seconds", "value": round(first_commit - spawned_b, 3)},
        {**base, "metric": "survivor_step_seconds", "value": round(heal_steps[0]["end"] - heal_steps[0]["start"], 4),
         "baseline_seconds": round(statistics.median(after), 4) if after else None},
    ]


def _check(params: int, transports: tuple[str, ...]) -> None:
    if isinstance(params, bool) or not isinstance(params, int) or params < MIN_PARAMS:
        raise ValueError(f"params: must be an integer of at least {MIN_PARAMS}, got {params!r}")
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown or not transports:
        raise ValueError(f"transports: unknown or none {unknown or list(transports)!r}; known: {', '.join(TRANSPORTS)}")


def run(params: int, transports: tuple[str, ...] = TRANSPORTS, optimizer: str = "adam") -> list[dict[str, Any]]:
    """The rows of one size: each transport in turn, with a lighthouse and two replica groups of its own."""
    _check(params, transports)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if importlib.util.find_spec("torchft") is None:
        raise RuntimeError(f"torchft is not installed for {sys.executable}: make bench-anchors")
    rows: list[Row] = []
    for transport in transports:
        rows += _run_transport(params, transport, optimizer)
    return rows


def _params_arg(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < MIN_PARAMS:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_PARAMS}, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--params", type=_params_arg, nargs="+", default=[1_000_000],
                        help="model sizes in parameters (Adam's state adds two moments each)")
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                        help="adam (two moments a parameter) or sgd (momentum 0.9: one buffer a parameter)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(WorkerConfig(**json.loads(args.worker)))
        return
    for params in args.params:
        for row in run(params, tuple(args.transports), args.optimizer):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
