"""Pod-loss benchmark: a worker pod lost under a 2-worker DDP job, recovered three ways, side by side.

* ``stalwart``: the local cluster with the operator, 2 workers + 1 spare (``--workers 3``: 3 + 1, so that two
  replicas send the state), ``restartPolicy.inProcess.warmSpares``:
  the survivor keeps its process, the spare's parked process takes the lost rank, the state comes from the
  survivor (``sync_from_peers``);
* ``stalwart-process-restart``: the same job with warm spares off (every rank process of the job is started
  again in the new round; the state comes from the checkpoint);
* ``torchrun``: the anchor users have now: two ``torchrun --max-restarts 3`` "nodes" (c10d rendezvous, its store
  hosted by the surviving node), the lost node's processes killed and a replacement node started at once (as a
  PyTorchJob's new pod would be, without its scheduling and image pull); every worker restarts and loads the
  checkpoint. With torch 2.13 it does not recover: the agents share the rendezvous' TCPStore with their
  workers, the surviving node reuses the store information it built in the first round and never writes the
  new round's ``MASTER_ADDR``, so the replacement and the survivor each wait for the other's keys and time
  out after 60 s (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` it fails too, sooner: the surviving agent
  loses its connection to the rendezvous store, ``RendezvousConnectionError``). Its ``seconds`` row is then
  null with a ``reason`` (the nodes' last errors);
* ``torchft``: the anchor for the state copy, once per size (``bench/torchft_copy.py``'s run, PGTransport, SGD
  with momentum: the same 8 bytes a parameter as this job's state): torchft 0.2.0's replacement replica group
  healing from its survivor, its ``copy_seconds``/``copy_gbps``, ``replacement_first_step_seconds`` (its process
  started to its first step) and ``survivor_step_seconds`` (the survivor's step that sent the state). Not a pod
  loss: nothing is detected and no pod is replaced (see that file for what it leaves out). Without torchft
  installed (``make bench-anchors``) its row is null with the reason.

The script is ``stalwart.examples.train`` (gloo, SGD with momentum 0.9, so the optimizer has state that the
checkpoint and ``sync_from_peers`` carry; ``--hidden`` sets the size: 21 parameters per unit),
one step event per step, a checkpoint every ``--checkpoint-every`` steps. Faults: ``force-delete`` (the pod
deleted with no grace), ``sigkill`` (every process of the pod killed), ``delete`` (graceful deletion; for
torchrun: SIGTERM to the node's torchrun), ``kill-rank`` (the lost pod's rank process alone SIGKILLed, the pod
alive: with warm spares on its agent hands the rank's place to the pod's standby process, parked with the script
imported and its prepare hook run; off, it starts a new one forked from the pod's fork server; torchrun restarts
its worker group). Per case:

* ``raw_seconds``: from the fault to the first step completed at full world size by every rank;
* ``seconds``: the same minus the run's median fault-free step time (also printed, ``step_seconds``);
* ``resume_seconds``: from the fault to the last rank's resumption (its state in place, its first step not
  begun): the raw time without the first step, which needs no median (in a short run the median step counts
  warm-up steps slowed by whatever started beside them, and flatters ``seconds``);
* ``phase_seconds`` (one row per ``phase``: detect, round, group, prepare, copy, first_step) and
  ``copy_gbps`` (with the copy's bytes and sources): the phases of the recovery from the marks the ranks and
  agents recorded (:mod:`stalwart.api.recovery`, read from the agents' progress records before the job is
  deleted; they add up to the fault-to-first-step time of the ranks' own marks, ``total``). A phase no rank
  marked is null with the ``reason`` (after a process restart no state is copied: the checkpoint is read inside
  the training function, in ``first_step``); torchrun's workers record none;
* ``rank_marks`` (one per rank of the new round) and ``agent_marks`` (one per agent): the marks themselves, in
  seconds from the fault, to read which rank was the last at a boundary;
* ``cpu_seconds_by_group`` (stalwart's cases; one per ``window``: ``recovery``, from the fault to the first full
  step, and ``first_step``, from the last rank's resumption to it): the CPU-seconds each group of processes
  used then (``by``: each pod, the control plane, etcd, the operator, the rest; :mod:`cpu_beside`), whatever
  shared the cores with the ranks on this machine;
* ``steps_recomputed``: steps done before the fault that were done again;
* ``survivor_process_starts``: processes started again on the surviving pod (node).

Prints one JSON object per line; with ``--plot PNG`` also draws each rank's step against the time around the
fault, one panel per implementation (of the first fault and size). Usage:
``python bench/podloss.py [--faults force-delete sigkill delete] [--params 1000000] [--plot docs/podloss.png]``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cluster_job import ClusterJob, Events, operated_cluster, parse  # noqa: E402
from cpu_beside import CpuSampler, used  # noqa: E402
from podloss_plots import plot, plot_phases  # noqa: E402

from stalwart.api.recovery import PHASES, RecoveryPhases, from_records  # noqa: E402
from stalwart.api.restart import ProgressRecord  # noqa: E402
from stalwart.examples.train import IN_FEATURES, OUT_FEATURES  # noqa: E402
from stalwart.local.cluster import LocalCluster  # noqa: E402
from stalwart.net import free_port  # noqa: E402

NS = "podloss"


def hidden_for(params: int) -> int:
    return max(1, (params - OUT_FEATURES) // (IN_FEATURES + OUT_FEATURES + 1))


def train_args(args: argparse.Namespace, params: int) -> list[str]:
    return ["--steps", str(args.steps), "--hidden", str(hidden_for(params)), "--checkpoint-every",
            str(args.checkpoint_every), "--log-every", "1", "--step-delay", str(args.step_delay),
            "--momentum", str(args.momentum)]


def pod_pids(pod: str) -> set[int]:
    needle = f"STALWART_NODE_ID={pod}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def is_rank(pid: int) -> bool:
    """Whether ``pid`` runs the training script itself (not the agent, whose command line ends with it, nor the
    pod's fork server)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return args[1:3] == [b"-m", b"stalwart.examples.train"]


def rank_of(job: ClusterJob, pod: str) -> int:
    """The pid of ``pod``'s rank process as its agent reports it (its progress record in etcd): with warm spares
    the pod also runs a standby process, parked, which looks the same from outside."""
    pids = [r.pid for rec in job.progress() if rec.node_id == pod for r in rec.ranks if r.slot >= 0]
    assert len(pids) == 1, f"{pod}: ranks with a slot in its progress record {pids}, expected one"
    return pids[0]


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (torchrun starts its workers in sessions of their own, so a
    signal to its process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def resumed_and_stepped(events: Events, t_fault: float, workers: int) -> tuple[list[float], list[float]]:
    """Per rank, when it resumed after the fault (its first "resume" line) and completed its first step after
    that (NaN where it did not): recovered means every rank did both."""
    steps = [e for e in events if e["event"] == "step"]
    resumed, firsts = [], []
    for r in range(workers):
        resumes = [e["time"] for e in events if e["event"] == "resume" and e["rank"] == r and e["time"] >= t_fault]
        after = [e["time"] for e in steps if e["rank"] == r and resumes and e["time"] > min(resumes)]
        resumed.append(min(resumes, default=float("nan")))
        firsts.append(min(after, default=float("nan")))
    return resumed, firsts


def cpu_rows(impl: str, fault: str, params: int, workers: int, *, t_fault: float, events: Events,
             sampler: CpuSampler) -> list[dict[str, Any]]:
    """The CPU-seconds each group of processes used during the recovery (the fault to the first full step) and
    during its first step (the last rank's resumption to the first full step): on this machine whatever runs
    beside the ranks takes their cores (``bench/cpu_beside.py``)."""
    resumed, firsts = resumed_and_stepped(events, t_fault, workers)
    if any(math.isnan(t) for t in resumed + firsts):
        return []
    base = {"bench": "podloss", "impl": impl, "fault": fault, "params": params, "workers": workers,
            "metric": "cpu_seconds_by_group"}
    out = []
    for window, start in (("recovery", t_fault), ("first_step", max(resumed))):
        by = used(sampler.samples, sampler.groups, start, max(firsts))
        out.append({**base, "window": window, "seconds": round(max(firsts) - start, 3),
                    "value": round(sum(by.values()), 3), "by": {k: round(v, 3) for k, v in by.items()}})
    return out


def _latest(times: list[float]) -> float:
    """The last of ``times``, NaN if any is (``max`` would skip a NaN that is not first)."""
    return float("nan") if any(math.isnan(t) for t in times) else max(times)


def measure(impl: str, fault: str, params: int, *, t_fault: float, events: Events,
            survivor: Events, why: str = "", workers: int = 2) -> list[dict[str, Any]]:
    """The rows of one case. A case that never recovered prints ``seconds`` as null with a ``reason``: ``why``
    (what the run's logs say ended it), or that no rank completed a step after the fault."""
    steps = [e for e in events if e["event"] == "step"]
    before = sorted(e["time"] for e in steps if e["time"] < t_fault and e["rank"] == 0)
    gaps = [b - a for a, b in itertools.pairwise(before)]
    step_s = statistics.median(gaps) if gaps else 0.0
    done_before = max((e["step"] for e in steps if e["time"] < t_fault), default=0)
    back, firsts = resumed_and_stepped(events, t_fault, workers)
    resumed = [e["step"] for e in events if e["event"] == "resume" and e["time"] >= t_fault]
    restart_from = min(resumed) if resumed else done_before
    starts = sum(1 for e in survivor if e["event"] == "start" and e["time"] >= t_fault)
    base = {"bench": "podloss", "impl": impl, "fault": fault, "params": params, "workers": workers}
    raw_s = _latest(firsts) - t_fault
    recovery = raw_s - step_s
    resume_s = _latest(back) - t_fault
    seconds: dict[str, Any] = {**base, "metric": "seconds", "value": round(recovery, 3)}
    raw: dict[str, Any] = {**base, "metric": "raw_seconds", "value": round(raw_s, 3)}
    resume: dict[str, Any] = {**base, "metric": "resume_seconds", "value": round(resume_s, 3)}
    if math.isnan(recovery):
        reason = why or "no step at full world size after the fault"
        seconds = {**base, "metric": "seconds", "value": None, "reason": reason}
        raw = {**base, "metric": "raw_seconds", "value": None, "reason": reason}
    if math.isnan(resume_s):
        resume = {**base, "metric": "resume_seconds", "value": None,
                  "reason": why or "a rank of the new world never resumed after the fault"}
    return [raw, seconds, resume,
            {**base, "metric": "steps_recomputed", "value": max(0, done_before - restart_from)},
            {**base, "metric": "survivor_process_starts", "value": starts},
            {**base, "metric": "step_seconds", "value": round(step_s, 4)}]


# -- stalwart on the local cluster ------------------------------------------------------------------------------


#: Why a phase has no figure when no rank marked its end.
UNMARKED = {
    "detect": "no rank or agent recorded knowing of the fault after it",
    "prepare": "no rank entered a state copy and no prepare hook ran after the fault",
    "copy": "no state copied between ranks: every rank read the checkpoint (inside the training function, so in "
            "first_step)",
}


def phase_rows(impl: str, fault: str, params: int, workers: int, found: RecoveryPhases | None, *,
               why: str) -> list[dict[str, Any]]:
    """The ``phase_seconds`` rows and the ``copy_gbps`` row of one case."""
    base = {"bench": "podloss", "impl": impl, "fault": fault, "params": params, "workers": workers,
            "metric": "phase_seconds"}
    if found is None:
        return [*({**base, "phase": ph, "value": None, "reason": why} for ph in PHASES),
                {**base, "metric": "copy_gbps", "value": None, "reason": why}]
    rows: list[dict[str, Any]] = []
    for ph, s in found.seconds:
        row: dict[str, Any] = {**base, "phase": ph, "value": None if s is None else round(s, 3),
                               "total": round(found.raw, 3)}
        if s is None:
            row["reason"] = UNMARKED.get(ph, "not marked")
        if ph == "detect" and found.first_knower:
            row["first_knower"] = found.first_knower
        if ph == "round" and found.barrier is not None:
            row["barrier"] = round(found.barrier, 3)  # of it: the wrapper's session and barrier
        if ph == "round" and found.leave is not None:
            row["left"] = round(found.leave, 3)  # from the fault: the last survivor out of its training function
        if ph == "copy" and found.copy_bytes:
            row["bytes"] = found.copy_bytes
        rows.append(row)
    gbps = found.copy_gbps
    rows.append({**base, "metric": "copy_gbps", "value": None if gbps is None else round(gbps, 3),
                 "bytes": found.copy_bytes, "sources": found.copy_sources,
                 **({} if gbps is not None else {"reason": UNMARKED["copy"]})})
    return rows


def mark_rows(impl: str, fault: str, params: int, workers: int, records: list[ProgressRecord], *,
              t_fault: float) -> list[dict[str, Any]]:
    """Each rank's marks of the newest round and each agent's, in seconds from the fault: what the phases are
    computed from, for reading where a phase's time went (which rank was the last at each boundary)."""
    base = {"bench": "podloss", "impl": impl, "fault": fault, "params": params, "workers": workers}
    if not any(rec.ranks for rec in records):
        return []
    newest = max(rec.round for rec in records if rec.ranks)
    out: list[dict[str, Any]] = []

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t_fault, 3)

    for rec in records:
        for summary in rec.history[-1:]:
            out.append({**base, "metric": "agent_marks", "node": rec.node_id, "round": summary.round,
                        "joined": rel(summary.joined), "previous_end_seen": rel(summary.previous_end_seen)})
        if rec.round != newest:
            continue
        for r in rec.ranks:
            m = r.recovery
            if m is None:
                continue
            out.append({**base, "metric": "rank_marks", "node": rec.node_id, "rank": r.rank,
                        "iteration": m.iteration, "knew": rel(m.knew), "left": rel(m.left), "entered": rel(m.entered),
                        "sealed": rel(m.sealed), "group": rel(m.group), "prepare_end": rel(m.prepare_end),
                        "prepare_parked": m.prepare_parked, "copy_start": rel(m.copy_start),
                        "copy_end": rel(m.copy_end), "copy_role": m.copy_role, "first_step": rel(r.first_step_time)})
    return out


def stalwart_case(cluster: LocalCluster, args: argparse.Namespace, fault: str, params: int, *,
                  warm: bool, workers: int = 2) -> tuple[float, Events, Events, list[ProgressRecord], CpuSampler]:
    name = f"pl-{uuid.uuid4().hex[:6]}"
    body = {"apiVersion": "stalwart.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"replicas": workers, "spares": 1, "rendezvous": {"lastCallSeconds": 1},
                     "restartPolicy": {"inProcess": {"warmSpares": warm}},
                     "template": {"spec": {"containers": [{
                         "name": "trainer", "image": "stalwart/trainer",
                         "command": ["python", "-m", "stalwart.examples.train", *train_args(args, params)],
                         "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]}]}}}}
    job = ClusterJob(cluster, NS, body)
    survivor, victim = f"{name}-worker-0", f"{name}-worker-1"
    job.wait_for_step(args.warmup, 600)
    job.keep_log(victim)
    with CpuSampler() as sampler:
        t_fault = time.time()
        if fault == "force-delete":
            cluster.kubectl("delete", "pod", victim, "-n", NS, "--grace-period=0", "--force", "--wait=false")
        elif fault == "sigkill":
            for pid in pod_pids(victim):
                os.kill(pid, signal.SIGKILL)
        elif fault == "kill-rank":
            rank = rank_of(job, victim)
            assert rank in pod_pids(victim) and is_rank(rank), rank
            os.kill(rank, signal.SIGKILL)
        else:
            cluster.kubectl("delete", "pod", victim, "-n", NS, "--wait=false")
        job.finish(900)
    return t_fault, job.events(), job.events(survivor), job.records, sampler


# -- torchrun -----------------------------------------------------------------------------------------------------


def torchrun_case(args: argparse.Namespace, fault: str, params: int) -> tuple[float, Events, Events, str]:
    port = free_port("127.0.0.1")
    work = Path(tempfile.mkdtemp(prefix="podloss-torchrun-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STALWART_CHECKPOINT_DIR": str(work / "ckpt")}
    env.pop("STALWART_JOB", None)

    def node(i: int, tag: str) -> tuple[subprocess.Popen[bytes], Path]:
        out = work / f"node-{tag}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "podloss",
               "--max-restarts", "3", "--monitor-interval", "0.1",
               "-m", "stalwart.examples.train", *train_args(args, params)]
        with open(out, "wb") as f:
            return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True), out

    # Node 0 hosts the rendezvous store (the first to bind its port), so the lost node is node 1.
    survivor, survivor_log = node(0, "0")
    time.sleep(2.0)
    victim, victim_log = node(1, "1")
    deadline = time.monotonic() + 600
    while max((e.get("step", 0) for e in parse(survivor_log.read_text()) if e["event"] == "step"),
              default=0) < args.warmup:
        if time.monotonic() > deadline or survivor.poll() is not None:
            raise RuntimeError(f"torchrun did not warm up: {survivor_log.read_text()[-2000:]}")
        time.sleep(0.2)
    t_fault = time.time()
    if fault == "kill-rank":
        # One worker process dies; its torchrun lives on and restarts the worker group (every node's).
        for pid in descendants(victim.pid)[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        replacement, replacement_log = victim, victim_log
    else:
        if fault == "delete":
            victim.terminate()  # torchrun passes SIGTERM on to its workers
        else:
            for pid in descendants(victim.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        victim.wait(timeout=60)
        replacement, replacement_log = node(1, "1b")
    # A killed worker's torchrun restarts the worker group in place; when that does not come back, waiting out
    # every timeout of both agents would take many minutes for the same null row.
    limit = 180 if fault == "kill-rank" else 900
    hung = ""
    try:
        survivor.wait(timeout=limit)
        replacement.wait(timeout=120)
    except subprocess.TimeoutExpired:
        hung = f"torchrun had not ended {limit} s after the fault"
    finally:
        for p in (survivor, replacement):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    # (after a killed rank the victim's log is also the replacement's: read once)
    logs = [parse(p.read_text()) for p in dict.fromkeys((survivor_log, victim_log, replacement_log))]
    why = "; ".join(w for w in (hung, failure(survivor_log, replacement_log)) if w)
    return t_fault, [e for evs in logs for e in evs], logs[0], why


def failure(*logs: Path) -> str:
    """The last error each torchrun node's log ends with (an exception's last line), for a run that failed."""
    out = []
    for path in logs:
        errors = [line.strip() for line in path.read_text(errors="replace").splitlines()
                  if not line.startswith("{") and ("Error:" in line or "Error(" in line) and "[rank" not in line]
        if errors:
            out.append(f"{path.stem}: {errors[-1][:300]}")
    return "; ".join(out)


# -- the picture ----------------------------------------------------------------------------------------------------


def torchft_rows(params: int) -> list[dict[str, Any]]:
    """torchft's live recovery of the same state (8 bytes a parameter), from bench/torchft_copy.py."""
    import torchft_copy

    try:
        return torchft_copy.run(params, ("pg",), optimizer="sgd")
    except (RuntimeError, OSError) as e:  # not installed, its run failed or timed out: said, not hidden
        return [{"bench": "podloss", "impl": "torchft", "params": params, "transport": "pg",
                 "metric": "copy_gbps", "value": None, "reason": str(e)[:500]}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", nargs="+", default=["force-delete", "sigkill", "delete"],
                   choices=["force-delete", "sigkill", "delete", "kill-rank"])
    p.add_argument("--params", nargs="+", type=int, default=[1_000_000])
    p.add_argument("--workers", nargs="+", type=int, default=[2], choices=[2, 3],
                   help="workers of the job (each with 1 spare); torchrun runs with 2 only")
    p.add_argument("--impls", nargs="+", default=["stalwart", "stalwart-process-restart", "torchrun", "torchft"],
                   choices=["stalwart", "stalwart-process-restart", "torchrun", "torchft"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=75, help="steps before the fault")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9, help="the script's SGD momentum (optimizer state)")
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--phases-plot", type=Path, default=None, help="draw the phases of every case to this PNG")
    p.add_argument("--phases-from", type=Path, nargs="+", default=None,
                   help="draw --phases-plot from these JSONL files of earlier runs, run nothing")
    args = p.parse_args()
    if args.phases_from is not None:
        if args.phases_plot is None:
            p.error("--phases-from needs --phases-plot")
        plot_phases(args.phases_plot, [json.loads(line) for f in args.phases_from
                                       for line in f.read_text().splitlines() if line.startswith("{")])
        return 0
    runs: dict[str, tuple[float, Events]] = {}
    printed: list[dict[str, Any]] = []

    def say(row: dict[str, Any]) -> None:
        printed.append(row)
        print(json.dumps(row), flush=True)

    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(operated_cluster(NS, "podloss-cluster-")) \
            if any(i.startswith("stalwart") for i in args.impls) else None
        for params in args.params:
            if "torchft" in args.impls:
                for row in torchft_rows(params):
                    say(row)
            for workers, fault, impl in itertools.product(args.workers, args.faults, args.impls):
                if impl == "torchft" or (impl == "torchrun" and workers != 2):
                    continue
                why = ""
                records: list[ProgressRecord] = []
                if impl == "torchrun":
                    t_fault, events, survivor, why = torchrun_case(args, fault, params)
                else:
                    assert cluster is not None
                    t_fault, events, survivor, records, sampler = stalwart_case(
                        cluster, args, fault, params, warm=impl == "stalwart", workers=workers)
                    for row in cpu_rows(impl, fault, params, workers, t_fault=t_fault, events=events,
                                        sampler=sampler):
                        say(row)
                for row in measure(impl, fault, params, t_fault=t_fault, events=events, survivor=survivor,
                                   why=why, workers=workers):
                    say(row)
                found = from_records(records, t_fault) if records else None
                no_marks = ("torchrun's workers run no restart wrapper: they record no marks" if impl == "torchrun"
                            else "the agents' records held no complete marks of the recovery")
                for row in phase_rows(impl, fault, params, workers, found, why=no_marks):
                    say(row)
                for row in mark_rows(impl, fault, params, workers, records, t_fault=t_fault):
                    say(row)
                if fault == args.faults[0] and params == args.params[0] and workers == args.workers[0]:
                    runs[impl] = (t_fault, events)
    if args.plot is not None and runs:
        plot(args.plot, runs, args.faults[0], args.params[0])
    if args.phases_plot is not None:
        plot_phases(args.phases_plot, printed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
