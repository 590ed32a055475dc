"""Sharded pod-loss benchmark: FSDP2 on the local cluster, a worker pod force-deleted, recovered two ways.

The job: ``stalwart.examples.train_fsdp`` (FSDP2 ``fully_shard`` over gloo, Adam), 2 workers of 2 ranks and one
spare pod (4 ranks), a checkpoint every ``--checkpoint-every`` steps in both cases, the fault after
``--warmup`` steps.

* ``stalwart``: peer snapshots after every step (``--snapshot-every 1``; several values, one case each), warm
  spares as a job with spares has them by default: the survivor keeps its processes, the spare's parked
  processes take the lost ranks, each rank's shard comes from its own memory or its buddy's;
* ``checkpoint``: the anchor, what a sharded job does without peer state: no snapshots, warm spares off
  (``warmSpares: false``): every rank process is started again in the new round and loads its shard of the
  last checkpoint, and the steps since are computed again.

Rows per size and implementation (``params``: the model's parameters; Adam's state doubles them):

* ``raw_seconds``: from the fault to the first step completed after it by every rank at full world size;
  ``net_seconds``: that, minus one fault-free step (the step time, also printed as ``step_seconds``, the
  median of the steps before the fault);
* ``steps_recomputed``: steps done before the fault that were done again;
* ``seconds``: what the fault cost, back to where training was: ``net_seconds`` plus a ``step_seconds`` for
  each step recomputed;
* ``snapshot_overhead``: the stalwart run's step time over the checkpoint run's, minus one (the snapshots' cost
  as a fraction of a step; the two runs are consecutive, not interleaved, on this noisy machine);
  the stalwart rows carry ``snapshot_every``;
* ``snapshot_bytes_per_rank``: the snapshots one rank holds at the end (its own shard's two newest and its
  wards').

Usage: ``python bench/sharded.py [--params 25000000 100000000] [--snapshot-every 1 2] [--plot docs/sharded.png]
[--save-events F]``;
``--replot F... --plot PNG`` draws saved runs again.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cluster_job import ClusterJob, Events, operated_cluster  # noqa: E402

from stalwart.examples.train_fsdp import IN_FEATURES, OUT_FEATURES  # noqa: E402
from stalwart.local.cluster import LocalCluster  # noqa: E402

NS = "sharded"
WORLD = 4


def hidden_for(params: int, layers: int = 2) -> int:
    """The hidden width whose model (``layers`` hidden layers) has about ``params`` parameters."""
    h = 1
    while True:
        n = (IN_FEATURES + 1) * h + (layers - 1) * (h + 1) * h + (h + 1) * OUT_FEATURES
        if n >= params:
            return h
        h = max(h + 1, int(h * 1.01))


def case(cluster: LocalCluster, args: argparse.Namespace, impl: str, params: int, every: int) -> tuple[float, Events]:
    name = f"sh-{uuid.uuid4().hex[:6]}"
    script = ["python", "-m", "stalwart.examples.train_fsdp", "--steps", str(args.steps), "--hidden",
              str(hidden_for(params)), "--checkpoint-every", str(args.checkpoint_every), "--log-every", "1",
              "--snapshot-every", str(every) if impl == "stalwart" else "0", "--batch-size", str(args.batch_size)]
    body = {"apiVersion": "stalwart.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"replicas": 2, "spares": 1, "nprocPerNode": 2, "rendezvous": {"lastCallSeconds": 1},
                     "restartPolicy": {"inProcess": {"warmSpares": impl == "stalwart"}},
                     "template": {"spec": {"containers": [{
                         "name": "trainer", "image": "stalwart/trainer", "command": script,
                         "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]}]}}}}
    job = ClusterJob(cluster, NS, body)
    victim = f"{name}-worker-1"
    job.wait_for_step(args.warmup, 1800)
    job.keep_log(victim)
    t_fault = time.time()
    cluster.kubectl("delete", "pod", victim, "-n", NS, "--grace-period=0", "--force", "--wait=false")
    job.finish(3600)
    return t_fault, job.events()


def step_seconds(events: Events, t_fault: float) -> float:
    before = sorted(e["time"] for e in events if e["event"] == "step" and e["time"] < t_fault and e["rank"] == 0)
    gaps = [b - a for a, b in itertools.pairwise(before)]
    return statistics.median(gaps) if gaps else 0.0


def measure(impl: str, params: int, t_fault: float, events: Events) -> list[dict[str, Any]]:
    steps = [e for e in events if e["event"] == "step"]
    step_s = step_seconds(events, t_fault)
    done_before = max((e["step"] for e in steps if e["time"] < t_fault), default=0)
    firsts = []
    for r in range(WORLD):
        resumes = [e["time"] for e in events if e["event"] == "resume" and e["rank"] == r and e["time"] >= t_fault]
        after = [e["time"] for e in steps if e["rank"] == r and resumes and e["time"] > min(resumes)]
        firsts.append(min(after, default=float("nan")))
    resumed = [e for e in events if e["event"] == "resume" and e["time"] >= t_fault]
    restart_from = min((e["step"] for e in resumed), default=done_before)
    raw = max(firsts) - t_fault
    base = {"bench": "sharded", "impl": impl, "params": params}
    sources = sorted({e["source"] for e in resumed})
    recomputed = max(0, done_before - restart_from)
    lost = None if math.isnan(raw) else raw - step_s
    rows: list[dict[str, Any]] = [
        {**base, "metric": "raw_seconds", "value": None if math.isnan(raw) else round(raw, 3)},
        {**base, "metric": "net_seconds", "value": None if lost is None else round(lost, 3), "sources": sources},
        {**base, "metric": "steps_recomputed", "value": recomputed},
        {**base, "metric": "seconds", "value": None if lost is None else round(lost + recomputed * step_s, 3)},
        {**base, "metric": "step_seconds", "value": round(step_s, 4)},
    ]
    held = [e.get("snapshot_bytes", 0) for e in events if e["event"] == "done"]
    if impl == "stalwart":
        rows.append({**base, "metric": "snapshot_bytes_per_rank", "value": max(held, default=0)})
    return rows


def plot(path: Path, runs: dict[tuple[str, int], tuple[float, Events]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({p for _, p in runs})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    for ax, params in zip(axes[0], sizes, strict=True):
        for (impl, p), (t_fault, events) in sorted(runs.items()):
            if p != params:
                continue
            pts = sorted((e["time"] - t_fault, e["step"]) for e in events if e["event"] == "step" and e["rank"] == 0)
            ax.plot([x for x, _ in pts], [y for _, y in pts], ".", ms=3, label=impl)
        ax.axvline(0, color="red", lw=1, label="pod force-deleted")
        ax.set_title(f"{params / 1e6:g} M parameters (FSDP2, 4 ranks, Adam)")
        ax.set_xlabel("seconds from the fault")
        ax.set_ylabel("step (rank 0)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def label(impl: str, every: int) -> str:
    return f"{impl} (snapshot every {every} steps)" if impl == "stalwart" and every != 1 else impl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", nargs="+", type=int, default=[25_000_000, 100_000_000])
    p.add_argument("--impls", nargs="+", default=["stalwart", "checkpoint"], choices=["stalwart", "checkpoint"])
    p.add_argument("--steps", type=int, default=110)
    p.add_argument("--warmup", type=int, default=75, help="steps before the fault")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--snapshot-every", type=int, nargs="+", default=[1],
                   help="steps between peer snapshots in the stalwart case (several: a case each)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--save-events", type=Path, default=None,
                   help="write every case's rank events (and the fault's time) to this file, one JSON line a case")
    p.add_argument("--replot", type=Path, nargs="+", default=None,
                   help="draw --plot from files --save-events wrote, running nothing")
    args = p.parse_args()
    if args.replot:
        saved = [json.loads(line) for path in args.replot for line in path.read_text().splitlines() if line]
        plot(args.plot or ROOT / "docs" / "sharded.png",
             {(label(d["impl"], d.get("snapshot_every", 1)), d["params"]): (d["t_fault"], d["events"]) for d in saved})
        return 0
    runs: dict[tuple[str, int], tuple[float, Events]] = {}
    with operated_cluster(NS, "sharded-cluster-") as cluster:
        for params in args.params:
            steps: dict[tuple[str, int], float] = {}
            cases = [(impl, every) for impl in args.impls
                     for every in (args.snapshot_every if impl == "stalwart" else [0])]
            for impl, every in cases:
                t_fault, events = case(cluster, args, impl, params, every)
                runs[(label(impl, every), params)] = (t_fault, events)
                if args.save_events is not None:
                    with args.save_events.open("a") as f:
                        f.write(json.dumps({"impl": impl, "snapshot_every": every, "params": params,
                                            "t_fault": t_fault, "events": events}) + "\n")
                steps[(impl, every)] = step_seconds(events, t_fault)
                for row in measure(impl, params, t_fault, events):
                    print(json.dumps(row | ({"snapshot_every": every} if impl == "stalwart" else {})), flush=True)
            anchor = steps.get(("checkpoint", 0))
            for (impl, every), step_s in steps.items():
                if anchor and impl == "stalwart":
                    print(json.dumps({"bench": "sharded", "impl": "stalwart", "params": params,
                                      "snapshot_every": every, "metric": "snapshot_overhead",
                                      "value": round(step_s / anchor - 1, 4),
                                      "step_seconds": {"stalwart": round(step_s, 4),
                                                       "checkpoint": round(anchor, 4)}}), flush=True)
    if args.plot is not None and runs:
        plot(args.plot, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
