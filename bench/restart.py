"""Restart benchmark: stalwart's in-process restart vs ``torchrun --max-restarts=1``, side by side.

The same small DDP script (``bench/restart_ddp.py``) runs on CPU with gloo and a 30 s collective timeout;
rank 1 raises once at a fixed step. Measured: seconds from the raise to the first training step completed
after recovery, on the slowest rank (median of ``--runs`` runs). stalwart runs under ``stalwart agent``
(one pod, ``--ranks`` rank processes, a real etcd server); torchrun runs standalone (its c10d rendezvous).

Also ``step_overhead``: the steady-state per-step time with the wrapper over the plain script, both run by
``stalwart agent`` so that only the wrapper differs (median step time of a fault-free run of each, median
over ``--runs`` alternating pairs of the first quartile of each run's step times, the undisturbed steps;
``value`` is the ratio minus one, as a fraction); ``cpu_overhead``, the same for the process CPU time per
step (every thread, so the monitor thread and the etcd client are counted; far less sensitive to other load
on the machine than wall time); and, for reference, the plain script's step time under torchrun.

``kill``: rank 1's process is SIGKILLed at a fixed step (an OOM kill looks so): seconds from the kill to the
first step at full world on the slowest rank, stalwart with its fork server, stalwart with every process
started fresh (``--no-fork-server``), and torchrun; ``ratio_to_*`` rows carry both raw medians.

``hang``: rank 1 stops itself (SIGSTOP) at a fixed step, the way a hung rank looks from outside. Measured:
seconds from the stop to the first training step completed after recovery on the slowest rank
(``metric: seconds``), and for stalwart also to the fault record that names the stopped rank
(``metric: detect_seconds``, which the soft timeout bounds: it is ``--soft-timeout`` here). stalwart's agent
kills the stopped process at the soft timeout and respawns it while the healthy rank restarts in process;
torchrun has no hang detection: the healthy rank fails at the collective timeout (``--timeout``), then
torchrun stops the group, waiting out its own grace for the stopped process, and starts it again.

Prints one JSON object per line, e.g.
``{"bench": "restart", "impl": "stalwart", "ranks": 2, "metric": "seconds", "value": 0.1}``.
Usage: ``python bench/restart.py [--ranks 2 4] [--runs 5] [--what restart overhead hang kill]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "bench" / "restart_ddp.py")
sys.path.insert(0, str(ROOT))

from stalwart.local.etcd import EtcdServer  # noqa: E402
from stalwart.net import free_port  # noqa: E402


def _results(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _raise_time(markers: Path) -> float:
    return float((markers / "fault-0").read_text())


def run_stalwart(etcd: EtcdServer, ranks: int, script_args: list[str], run_id: str,
                 mode: str = "wrapped", *, agent_args: tuple[str, ...] = ()) -> tuple[list[dict[str, Any]], Path]:
    work = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    out = work / "out.jsonl"
    env = dict(os.environ, STALWART_ETCD_ENDPOINTS=etcd.endpoint, STALWART_JOB="bench/restart",
               STALWART_JOB_UID=run_id, STALWART_NODE_ID="pod-0", STALWART_POD_IP="127.0.0.1",
               STALWART_NPROC_PER_NODE=str(ranks), STALWART_MIN_NODES="1", STALWART_MAX_NODES="1")
    cmd = [sys.executable, "-m", "stalwart", "--log-level", "WARNING", "agent", "--last-call", "0.1", *agent_args, "--",
           sys.executable, SCRIPT, "--mode", mode, "--marker-dir", str(work), "--out", str(out),
           *script_args]
    subprocess.run(cmd, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
    return _results(out), work


def run_torchrun(ranks: int, script_args: list[str]) -> tuple[list[dict[str, Any]], Path]:
    work = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    out = work / "out.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.1",
           SCRIPT, "--mode", "plain", "--marker-dir", str(work), "--out", str(out), *script_args]
    # (the marker and output paths are replaced on a retry)
    for attempt in range(3):
        # torchrun's second attempt sometimes fails to connect its gloo mesh on a loaded machine; retry the
        # whole run (and say so on stderr) rather than report a partial measurement.
        done = subprocess.run(cmd, check=False, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if done.returncode == 0:
            return _results(out), work
        print(f"torchrun run failed (exit {done.returncode}), attempt {attempt + 1}; retrying", file=sys.stderr)
        work = Path(tempfile.mkdtemp(prefix="bench-restart-"))
        out = work / "out.jsonl"
        cmd = [*cmd[:cmd.index("--marker-dir")], "--marker-dir", str(work), "--out", str(out), *script_args]
    raise RuntimeError("torchrun failed three times")


def detect_seconds(etcd: EtcdServer, run_id: str, work: Path) -> float:
    """Seconds from the injected fault to the fault record that names the faulty rank (the earliest record of
    a kind seen at the faulty process; see stalwart.api.restart.DIRECT_KINDS)."""
    from stalwart.api.restart import DIRECT_KINDS, FaultRecord
    from stalwart.etcd.client import connect
    from stalwart.etcd.keys import JobKeys

    prefix = JobKeys("bench", run_id).restart
    values: dict[str, bytes] = {}
    with connect([etcd.endpoint]) as store:
        # From etcd's history: the sealer deletes the keys of old iterations, and under load a run may take one
        # restart more than the one injected.
        _, revision = store.get_prefix(prefix, keys_only=True)
        with store.watch(prefix, prefix=True, start_revision=1) as w:
            while (ev := w.next(timeout=0.5)) is not None and ev.kv.mod_revision <= revision:
                if ev.type == "put" and "/fault/" in ev.kv.key:
                    values[ev.kv.key] = ev.kv.value
    records = [FaultRecord.from_json_bytes(v) for v in values.values()]
    direct = [r.time for r in records if r.kind in DIRECT_KINDS]
    if not direct:
        raise RuntimeError(f"no fault record names the faulty rank: {records}")
    return min(direct) - _raise_time(work)


def recovery_seconds(results: list[dict[str, Any]], work: Path) -> float:
    firsts = [r["first_after_restart"] for r in results if r.get("first_after_restart")]
    if not firsts:
        raise RuntimeError(f"no rank completed a step after the restart: {results}")
    return max(firsts) - _raise_time(work)


def median_step(results: list[dict[str, Any]], skip: int) -> float:
    times = [t for r in results for t in r["step_times"][skip:]]
    return statistics.median(times)


def cpu_per_step(results: list[dict[str, Any]], skip: int) -> float:
    """Process CPU time (all threads: training, gloo, the wrapper's monitor and etcd client) per step."""
    per = [(r["cpu_marks"][-1] - r["cpu_marks"][skip]) / (len(r["cpu_marks"]) - 1 - skip) for r in results]
    return statistics.mean(per)


def quiet_step(results: list[dict[str, Any]], skip: int) -> float:
    """The first quartile of the step times: on a shared machine the steps that other work did not
    disturb, which is what the wrapper's own cost shows in."""
    times = sorted(t for r in results for t in r["step_times"][skip:])
    return times[len(times) // 4]


def bench_hang(etcd: EtcdServer, args: argparse.Namespace, n: int) -> int:
    ranks = args.ranks[0]
    stop = ["--steps", str(args.steps), "--fault", "sigstop", "--fault-rank", "1", "--fault-step",
            str(args.fault_step), "--timeout", str(args.timeout), "--hidden", str(args.hidden)]
    settings = {"soft_timeout": args.soft_timeout, "collective_timeout": args.timeout}
    for impl in ("stalwart", "torchrun"):
        values, detects = [], []
        for _ in range(args.runs):
            n += 1
            if impl == "stalwart":
                res, work = run_stalwart(etcd, ranks, [*stop, "--soft-timeout", str(args.soft_timeout)], f"run-{n}")
                detects.append(detect_seconds(etcd, f"run-{n}", work))
            else:
                res, work = run_torchrun(ranks, stop)
            values.append(recovery_seconds(res, work))
        print(json.dumps({"bench": "hang", "impl": impl, "ranks": ranks, "metric": "seconds",
                          "value": round(statistics.median(values), 4), "runs": [round(v, 4) for v in values],
                          **settings}), flush=True)
        if detects:
            print(json.dumps({"bench": "hang", "impl": impl, "ranks": ranks, "metric": "detect_seconds",
                              "value": round(statistics.median(detects), 4),
                              "runs": [round(v, 4) for v in detects], **settings}), flush=True)
    return n


def bench_kill(etcd: EtcdServer, args: argparse.Namespace, n: int) -> int:
    """Rank 1's process is SIGKILLed (it kills itself) at a fixed step: seconds to the first step at full world
    on the slowest rank, for stalwart with its fork server (the respawn is forked from a process that imported
    torch), stalwart without it (``--no-fork-server``: the respawn imports torch, as every process torchrun
    starts does), and torchrun (which restarts the whole group). The three alternate run by run."""
    ranks = args.ranks[0]
    kill = ["--steps", str(args.steps), "--fault", "sigkill", "--fault-rank", "1", "--fault-step",
            str(args.fault_step), "--timeout", "30", "--hidden", str(args.hidden)]
    values: dict[str, list[float]] = {"stalwart": [], "stalwart-fresh": [], "torchrun": []}
    for _ in range(args.runs):
        for impl, runs in values.items():
            n += 1
            if impl == "torchrun":
                res, work = run_torchrun(ranks, kill)
            else:
                res, work = run_stalwart(etcd, ranks, kill, f"run-{n}",
                                         agent_args=() if impl == "stalwart" else ("--no-fork-server",))
            runs.append(recovery_seconds(res, work))
    medians = {impl: statistics.median(runs) for impl, runs in values.items()}
    for impl, runs in values.items():
        print(json.dumps({"bench": "kill", "impl": impl, "ranks": ranks, "metric": "seconds",
                          "value": round(medians[impl], 4), "runs": [round(v, 4) for v in runs],
                          "fork_server": impl == "stalwart"}), flush=True)
    for anchor in ("stalwart-fresh", "torchrun"):
        print(json.dumps({"bench": "kill", "impl": "stalwart", "ranks": ranks, "metric": f"ratio_to_{anchor}",
                          "value": round(medians[anchor] / medians["stalwart"], 2),
                          "stalwart_seconds": round(medians["stalwart"], 4),
                          f"{anchor}_seconds": round(medians[anchor], 4)}), flush=True)
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fault-step", type=int, default=6)
    p.add_argument("--overhead-steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--what", nargs="+", choices=["restart", "overhead", "hang", "kill"],
                   default=["restart", "overhead"])
    p.add_argument("--soft-timeout", type=float, default=5.0, help="stalwart's soft timeout in the hang case")
    p.add_argument("--timeout", type=float, default=20.0, help="collective timeout in the hang case (both)")
    args = p.parse_args()
    fault = ["--steps", str(args.steps), "--fault", "exception", "--fault-rank", "1",
             "--fault-step", str(args.fault_step), "--timeout", "30", "--hidden", str(args.hidden)]
    with tempfile.TemporaryDirectory() as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd")
        etcd.start()
        try:
            n = 0
            for ranks in args.ranks if "restart" in args.what else []:
                for impl in ("stalwart", "torchrun"):
                    values = []
                    for _ in range(args.runs):
                        n += 1
                        if impl == "stalwart":
                            res, work = run_stalwart(etcd, ranks, fault, f"run-{n}")
                        else:
                            res, work = run_torchrun(ranks, fault)
                        values.append(recovery_seconds(res, work))
                    print(json.dumps({"bench": "restart", "impl": impl, "ranks": ranks, "metric": "seconds",
                                      "value": round(statistics.median(values), 4),
                                      "runs": [round(v, 4) for v in values]}), flush=True)
            if "hang" in args.what:
                n = bench_hang(etcd, args, n)
            if "kill" in args.what:
                n = bench_kill(etcd, args, n)
            if "overhead" not in args.what:
                return 0
            ranks = args.ranks[0]
            plain = ["--steps", str(args.overhead_steps), "--timeout", "30", "--hidden", str(args.hidden)]
            skip = min(20, args.overhead_steps // 4)
            ratios, ws, bs, wc, bc = [], [], [], [], []
            for _ in range(args.runs):
                # The same launcher for both (the agent), alternating, so that only the wrapper differs and
                # load from elsewhere on the machine falls on both alike.
                n += 1
                wrapped_res, _ = run_stalwart(etcd, ranks, plain, f"run-{n}")
                n += 1
                plain_res, _ = run_stalwart(etcd, ranks, plain, f"run-{n}", mode="plain")
                w, b = quiet_step(wrapped_res, skip), quiet_step(plain_res, skip)
                ratios.append(w / b - 1.0)
                ws.append(w)
                bs.append(b)
                wc.append(cpu_per_step(wrapped_res, skip))
                bc.append(cpu_per_step(plain_res, skip))
            print(json.dumps({"bench": "restart", "impl": "stalwart", "ranks": ranks, "metric": "step_overhead",
                              "value": round(statistics.median(ws) / statistics.median(bs) - 1.0, 4),
                              "step_seconds": round(statistics.median(ws), 6),
                              "plain_step_seconds": round(statistics.median(bs), 6),
                              "runs": [round(r, 4) for r in ratios]}), flush=True)
            print(json.dumps({"bench": "restart", "impl": "stalwart", "ranks": ranks, "metric": "cpu_overhead",
                              "value": round(statistics.median(wc) / statistics.median(bc) - 1.0, 4),
                              "cpu_seconds_per_step": round(statistics.median(wc), 6),
                              "plain_cpu_seconds_per_step": round(statistics.median(bc), 6)}), flush=True)
            torchrun_res, _ = run_torchrun(ranks, plain)
            print(json.dumps({"bench": "restart", "impl": "torchrun", "ranks": ranks, "metric": "step_seconds",
                              "value": round(median_step(torchrun_res, skip), 6)}), flush=True)
        finally:
            etcd.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
