"""Exit soak (issue 29): many short fault-free jobs on the local cluster, and for each whether it ended
``Succeeded`` and every agent and rank process of it was gone within 10 s of its last rank returning.

Each job is the demo's, ``examples/minimal.yaml`` as ``stalwart demo`` builds it (2 workers + 1 spare, the
example trainer) with no fault and a few seconds of training (``--steps`` at ``--step-delay``); a few run at once
(``--concurrency``) on one local cluster with the operator installed by its Helm chart. Per pod it measures:

* *returned*: the last ``{"event": "done"}`` line of the pod's log (the example trainer's, written as its training
  function returns, wall-clock to the millisecond); for the spare, whose parked rank never trains, the job's
  last one (its agent hears of the end through the rendezvous);
* *ended*: when the pod's agent process (the container's main process) ended, from the kubelet's book
  (``stalwart/local/containerbook.py``: when its wait on the process returned), with the container's processes
  still alive at that moment (``leftovers``; the kubelet kills them);
* *decided* and *leaving*: the agent's ``every rank returned`` / ``nothing left to run`` line and its
  ``leaving with exit code`` line (``stalwart.exits``), and whether it logged ``had to leave`` (the bound
  ended a clean-up that overran it).

The agent's rank processes end before the agent does (it reports "every rank returned" once their exits are
collected, and stops a spare's parked rank before it leaves), and any that outlived it is a leftover; so the
agent's end bounds every process of the pod. An exit is *late* when it came more than 10 s after *returned*, or
never came, or left processes behind, or when any process carrying the pod's marker is still alive after it
(a scan of ``/proc`` by the kubelet's per-pod marker, so only this cluster's processes). Late exits must be 0.

Prints one JSON object per line: jobs run and succeeded, late exits, the seconds from *returned* to *ended*
(p50, p99, max) and from the ``leaving`` line to *ended* (max), leftovers, ``had to leave`` lines. No timed
assertion here: ``tests/e2e/test_ends.py`` runs a few jobs through the same code and asserts success and no
late exit (the soak's own count, against the bound).

The anchor, in the same run: torchrun ending the same trainer (2 processes, the same steps, no fault) on this
machine, ``--anchor-runs`` times: the seconds from its last rank's ``done`` line to torchrun's own exit
(``impl: torchrun``), beside the pods' figure, and their ratio with both raw medians. It is the time a
torchrun-launched job holds its node after its training ended; it has no etcd, no rendezvous to leave and no
pod around it, so it is the floor of what a launcher's exit costs, not a like-for-like pod.

``python bench/ends.py [--jobs 50] [--concurrency 3] [--steps 40] [--step-delay 0.05] [--anchor-runs 10]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from soak import wait_for  # noqa: E402  (the status soak's, beside this one)

from stalwart.demo import EXAMPLE, JOB_NAMESPACE, DemoOptions, Installation, demo_job  # noqa: E402
from stalwart.examples.train import CHECKPOINT_DIR_ENV  # noqa: E402
from stalwart.local.cluster import LocalCluster  # noqa: E402
from stalwart.local.exitcheck import EXIT_BOUND, ClusterExits, Instance, LogFacts  # noqa: E402
from stalwart.local.processes import POD_MARKER, marked_pids  # noqa: E402
from stalwart.procfs import process_state  # noqa: E402

JSON = dict[str, Any]
#: How long past *returned* an exit is waited for before it is counted as never having come.
GIVE_UP_AFTER = 60.0
HAD_TO_LEAVE = "had to leave"


class ProcessSampler:
    """Every ``interval`` seconds, which processes carry the kubelet's pod marker, and when each was last seen
    (by pod uid and pid): a rank process's end is seen within ``interval`` (the kubelet sees only the end of the
    container's main process). Only the soak's own pods are asked about."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.last_seen: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ends-sampler", daemon=True)
        self._needle = f"{POD_MARKER}=".encode()

    def __enter__(self) -> ProcessSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def pids(self, uid: str) -> dict[int, float]:
        """The processes of pod ``uid`` seen so far and when each was last seen."""
        with self._lock:
            return {pid: t for (u, pid), t in self.last_seen.items() if u == uid}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.time()
            seen: dict[tuple[str, int], float] = {}
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    env = (entry / "environ").read_bytes()
                except OSError:
                    continue
                for var in env.split(b"\0"):
                    if var.startswith(self._needle):
                        uid = var[len(self._needle):].decode(errors="replace")
                        if process_state(int(entry.name)) not in ("", "Z"):
                            seen[(uid, int(entry.name))] = now
                        break
            with self._lock:
                self.last_seen.update(seen)


@dataclass
class PodEnd:
    """One pod of a job and how its processes ended (wall-clock seconds; ``None``: not seen)."""

    pod: str
    uid: str
    returned: float | None = None
    decided: float | None = None
    leaving: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    leftovers: list[int] = field(default_factory=list)
    alive_after: list[int] = field(default_factory=list)  # marked processes alive once it ended
    ranks_last_seen: float | None = None  # the last sight of any of its processes but the agent (the sampler's)
    had_to_leave: bool = False
    tail: tuple[str, ...] = ()

    @property
    def after_return(self) -> float | None:
        return None if self.ended is None or self.returned is None else round(self.ended - self.returned, 3)

    @property
    def ranks_after_return(self) -> float | None:
        """Seconds from *returned* to the last sight of its rank processes (their end is at most the sampler's
        interval later)."""
        if self.ranks_last_seen is None or self.returned is None:
            return None
        return round(self.ranks_last_seen - self.returned, 3)

    @property
    def after_decided(self) -> float | None:
        return None if self.ended is None or self.decided is None else round(self.ended - self.decided, 3)

    @property
    def after_leaving(self) -> float | None:
        return None if self.ended is None or self.leaving is None else round(self.ended - self.leaving, 3)

    def late(self, bound: float = EXIT_BOUND) -> list[str]:
        """Why this pod's exit was late ([] when it was not)."""
        why = []
        if self.ended is None:
            why.append("its agent never ended")
        elif self.returned is None:
            why.append("no rank of its job returned (no done line)")
        elif self.ended - self.returned > bound:
            why.append(f"its agent ended {self.ended - self.returned:.1f}s after its last rank returned")
        if self.ranks_last_seen is not None and self.returned is not None \
                and self.ranks_last_seen - self.returned > bound:
            why.append(f"a rank process was still seen {self.ranks_last_seen - self.returned:.1f}s after its last "
                       f"rank returned")
        if self.leftovers:
            why.append(f"processes {self.leftovers} outlived its agent")
        if self.alive_after:
            why.append(f"processes {self.alive_after} still alive after it ended")
        return why


@dataclass
class JobEnd:
    name: str
    phase: str
    seconds: float  # from apply to the last end seen
    pods: list[PodEnd]
    problem: str = ""

    @property
    def succeeded(self) -> bool:
        return self.phase == "Succeeded"

    def late(self, bound: float = EXIT_BOUND) -> list[str]:
        out = [f"{p.pod}: {why}" for p in self.pods for why in p.late(bound)]
        if len([p for p in self.pods if "-worker-" in p.pod]) < 2:
            out.append(f"pods seen {[p.pod for p in self.pods]}, expected 2 workers (and the spare if it started)")
        return out

    def line(self) -> str:
        figures = " ".join(f"{p.pod.rsplit('-', 2)[-2]}-{p.pod.rsplit('-', 1)[-1]}="
                           f"{p.after_return if p.after_return is not None else '-'}s" for p in self.pods)
        verdict = "ok" if self.succeeded and not self.late() else "; ".join([self.problem or self.phase,
                                                                               *self.late()])
        return f"{self.name:<22} {self.phase:<10} {self.seconds:6.1f}s  {figures}  {verdict}"


class EndsSoak:
    """The soak on its own local cluster in ``directory``; progress lines go to ``out``."""

    def __init__(self, directory: Path, *, steps: int = 40, step_delay: float = 0.05, out: TextIO = sys.stderr,
                 job_timeout: float = 300.0) -> None:
        self.directory = directory
        self.steps = steps
        self.step_delay = step_delay
        self.out = out
        self.job_timeout = job_timeout
        self.cluster: LocalCluster | None = None
        self.install: Installation | None = None
        self.exits: ClusterExits | None = None
        self._lock = threading.Lock()
        self._api: Any = None
        self.sampler = ProcessSampler()

    def say(self, text: str) -> None:
        with self._lock:
            print(text, file=self.out, flush=True)

    # -- set-up and tear-down ------------------------------------------------------------------------------

    def up(self) -> None:
        self.cluster = LocalCluster.up(self.directory / "cluster", nodes=3, timeout=120.0, owner_pid=os.getpid())
        self.exits = ClusterExits(self.cluster.dir)
        self.install = Installation(self.cluster)
        self.install.install_chart()
        wait_for("the operator pod to be ready", self.install.operator_ready, 180)
        from kubernetes import client, config

        cfg = client.Configuration()
        loader: Any = config
        loader.load_kube_config(config_file=str(self.cluster.kubeconfig), client_configuration=cfg)
        self._api = client.ApiClient(cfg)
        self.sampler.__enter__()

    def down(self) -> None:
        self.sampler.__exit__()
        if self._api is not None:
            with contextlib.suppress(Exception):
                self._api.close()
        if self.cluster is not None:
            if self.install is not None:
                with contextlib.suppress(Exception):
                    self.install.uninstall()
            self.cluster.down()

    # -- the jobs ------------------------------------------------------------------------------------------------

    def job_manifest(self, name: str) -> JSON:
        # demo_job wants a fault planned; none is: the fault variables are dropped, as bench/soak.py does.
        job = demo_job(yaml.safe_load(EXAMPLE.read_text()),
                       DemoOptions(directory=self.directory, steps=max(self.steps, 3), step_delay=self.step_delay,
                                   fail_at_step=1, kill_at_step=2))
        job["metadata"]["name"] = name
        container = job["spec"]["template"]["spec"]["containers"][0]
        container["env"] = [e for e in container["env"] if not e["name"].startswith("STALWART_EXAMPLE_FAIL")]
        container["env"].append({"name": CHECKPOINT_DIR_ENV, "value": str(self.directory / "checkpoints" / name)})
        args = container["args"]
        args[args.index("--log-every") + 1] = str(max(self.steps, 1))
        args[args.index("--steps") + 1] = str(self.steps)
        return job

    def _custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self._api)

    def phase(self, name: str) -> str:
        from kubernetes.client.exceptions import ApiException

        try:
            tj = self._custom().get_namespaced_custom_object("stalwart.dev", "v1alpha1", JOB_NAMESPACE,
                                                             "trainingjobs", name)
        except ApiException:
            return ""
        return str((tj.get("status") or {}).get("phase") or "")

    def run_job(self, index: int) -> JobEnd:
        """Apply one job, wait for its end and its processes' ends, measure them, delete it."""
        assert self.cluster is not None
        name = f"ends-{index}-{uuid.uuid4().hex[:5]}"
        start = time.time()
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(self.job_manifest(name)))
        phase, problem = "", ""
        deadline = time.monotonic() + self.job_timeout
        try:
            while time.monotonic() < deadline:
                phase = self.phase(name)
                if phase in ("Succeeded", "Failed"):
                    break
                time.sleep(0.5)
            else:
                problem = f"not ended within {self.job_timeout:g}s (phase {phase or 'none'})"
            pods = self.pod_ends(name)
        finally:
            self.cluster.kubectl("delete", "tj", name, "-n", JOB_NAMESPACE, "--wait=false", "--ignore-not-found",
                                 check=False)
        ends = [p.ended for p in pods if p.ended is not None]
        return JobEnd(name, phase, round((max(ends) if ends else time.time()) - start, 1), pods, problem)

    def pod_ends(self, name: str) -> list[PodEnd]:
        """The end of each pod of job ``name`` whose container started (the kubelet's book says which: a spare
        deleted before its container started ran nothing), waited for until :data:`GIVE_UP_AFTER` past the
        job's last return."""
        assert self.exits is not None
        give_up = time.time() + GIVE_UP_AFTER
        while True:
            with self._lock:
                self.exits.update()
                mine = [i for i in self.exits.instances.values()
                        if i.namespace == JOB_NAMESPACE and i.pod.startswith(f"{name}-")]
            pods = {i.uid: PodEnd(i.pod, i.uid) for i in sorted(mine, key=lambda i: i.pod)}
            instances = {uid: [i for i in mine if i.uid == uid] for uid in pods}
            facts: dict[str, tuple[Instance, LogFacts]] = {}
            for uid, found in instances.items():
                if found:
                    inst = max(found, key=lambda i: i.started)
                    facts[uid] = (inst, inst.facts())
            job_returned = max((f.returned for _, f in facts.values() if f.returned is not None), default=None)
            if job_returned is not None:
                give_up = min(give_up, job_returned + GIVE_UP_AFTER)
            if (pods and all(facts[uid][0].ended is not None for uid in pods)) or time.time() > give_up:
                break
            time.sleep(0.2)
        for uid, p in pods.items():
            inst, f = facts[uid]
            p.returned = f.returned if f.returned is not None else job_returned
            p.decided, p.leaving, p.ended, p.exit_code = f.decided, f.leaving, inst.ended, inst.exit_code
            p.leftovers = list(inst.leftovers)
            p.had_to_leave = HAD_TO_LEAVE in _whole(inst)
            p.tail = f.tail
            ranks = [t for pid, t in self.sampler.pids(uid).items() if pid != inst.pid]
            p.ranks_last_seen = max(ranks) if ranks else None
            if inst.ended is not None:
                p.alive_after = marked_pids(POD_MARKER, uid)
                for pid in p.alive_after:  # every process this soak caused must end
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
        return list(pods.values())

    def run(self, jobs: int, concurrency: int) -> list[JobEnd]:
        """``jobs`` jobs, ``concurrency`` at a time; their ends in the order they were started."""
        results: dict[int, JobEnd] = {}
        next_index = iter(range(jobs))
        take = threading.Lock()

        def worker() -> None:
            while True:
                with take:
                    index = next(next_index, None)
                if index is None:
                    return
                try:
                    end = self.run_job(index)
                except Exception as e:  # one job's trouble is its row, not the soak's end
                    end = JobEnd(f"ends-{index}", "", 0.0, [], f"{type(e).__name__}: {e}")
                results[index] = end
                self.say(f"{index + 1:>3}/{jobs} {end.line()}")
                for p in end.pods:
                    if p.late():
                        self.say("      " + p.pod + " last lines:\n        " + "\n        ".join(p.tail[-12:]))

        threads = [threading.Thread(target=worker, name=f"ends-{i}") for i in range(max(1, concurrency))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [results[i] for i in sorted(results)]


def _whole(inst: Instance) -> str:
    with contextlib.suppress(OSError):
        return inst.log_path().read_text(errors="replace")
    return ""


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def figures(results: Sequence[JobEnd], *, concurrency: int, steps: int) -> list[JSON]:
    """The soak's JSON rows."""
    pods = [p for r in results for p in r.pods]
    after = [p.after_return for p in pods if p.after_return is not None]
    leaving = [p.after_leaving for p in pods if p.after_leaving is not None]
    decided = [p.after_decided for p in pods if p.after_decided is not None]
    ranks = [p.ranks_after_return for p in pods if p.ranks_after_return is not None]
    to_decided = [p.decided - p.returned for p in pods if p.decided is not None and p.returned is not None]
    late = sum(1 for p in pods if p.late()) + sum(1 for r in results if not r.pods)
    common = {"bench": "ends", "impl": "stalwart"}
    rows: list[JSON] = [
        {**common, "metric": "jobs_run", "value": len(results), "concurrency": concurrency, "steps": steps},
        {**common, "metric": "jobs_succeeded", "value": sum(1 for r in results if r.succeeded),
         "of": len(results)},
        {**common, "metric": "late_exits", "value": late, "of": len(pods), "bound_seconds": EXIT_BOUND,
         "pods_per_job": round(len(pods) / len(results), 2) if results else None},
    ]
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        v = quantile(after, q)
        rows.append({**common, "metric": f"exit_after_return_seconds_{name}",
                     "value": None if v is None else round(v, 3), "n": len(after)})
    rows += [
        {**common, "metric": "exit_after_return_seconds_max", "value": round(max(after), 3) if after else None,
         "n": len(after)},
        {**common, "metric": "rank_exit_after_return_seconds_p50",
         "value": round(v, 3) if (v := quantile(ranks, 0.5)) is not None else None, "n": len(ranks),
         "sampled_every_seconds": 0.2},
        {**common, "metric": "rank_exit_after_return_seconds_max", "value": round(max(ranks), 3) if ranks else None,
         "n": len(ranks)},
        # Where the time goes: from the last return to the agent's decision (the ranks' own exits, the agent's
        # notice of them), and from the decision to its end (its clean-up and the bounded exit).
        {**common, "metric": "decided_after_return_seconds_p50",
         "value": round(v, 3) if (v := quantile(to_decided, 0.5)) is not None else None, "n": len(to_decided)},
        {**common, "metric": "exit_after_decided_seconds_p50",
         "value": round(v, 3) if (v := quantile(decided, 0.5)) is not None else None, "n": len(decided)},
        {**common, "metric": "exit_after_decided_seconds_max", "value": round(max(decided), 3) if decided else None,
         "n": len(decided)},
        {**common, "metric": "exit_after_leaving_seconds_max", "value": round(max(leaving), 3) if leaving else None,
         "n": len(leaving)},
        {**common, "metric": "processes_left", "value": sum(len(p.leftovers) + len(p.alive_after) for p in pods)},
        {**common, "metric": "had_to_leave", "value": sum(1 for p in pods if p.had_to_leave), "of": len(pods)},
        {**common, "metric": "mean_job_seconds",
         "value": round(statistics.mean(r.seconds for r in results), 1) if results else None},
    ]
    return rows


def torchrun_exit(steps: int, step_delay: float, directory: Path) -> float | None:
    """One anchor run: seconds from the last rank's ``done`` line to torchrun's exit (``None`` if it failed)."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "stalwart.examples.train", "--steps", str(steps), "--step-delay", str(step_delay)]
    env = {**os.environ, CHECKPOINT_DIR_ENV: str(directory), "PYTHONUNBUFFERED": "1"}
    env.pop("STALWART_JOB", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    ended = time.time()
    done = [json.loads(line)["time"] for line in proc.stdout.splitlines()
            if line.startswith("{") and '"event": "done"' in line]
    if proc.returncode != 0 or len(done) != 2:
        print(f"torchrun anchor run failed ({proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return ended - max(done)


def anchor_rows(after: Sequence[float], runs: int, steps: int, step_delay: float, directory: Path) -> list[JSON]:
    """The torchrun rows and the ratio of the medians (pods' over torchrun's), raw figures beside it."""
    times = [t for i in range(runs) if (t := torchrun_exit(steps, step_delay, directory / f"anchor-{i}")) is not None]
    common = {"bench": "ends", "impl": "torchrun"}
    ours, theirs = quantile(after, 0.5), quantile(times, 0.5)
    return [
        {**common, "metric": "exit_after_return_seconds_p50",
         "value": None if theirs is None else round(theirs, 3), "n": len(times), "of": runs},
        {**common, "metric": "exit_after_return_seconds_max", "value": round(max(times), 3) if times else None,
         "n": len(times)},
        {"bench": "ends", "impl": "stalwart/torchrun", "metric": "exit_after_return_p50_ratio",
         "value": round(ours / theirs, 2) if ours is not None and theirs else None,
         "stalwart_p50": None if ours is None else round(ours, 3), "torchrun_p50": None if theirs is None
         else round(theirs, 3)},
    ]


@contextlib.contextmanager
def soak(directory: Path, **kwargs: Any) -> Iterator[EndsSoak]:
    """An exit soak with its cluster up and the operator ready; everything stopped afterwards."""
    s = EndsSoak(directory, **kwargs)
    try:
        s.up()
        yield s
    finally:
        s.down()


def main(argv: Sequence[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.05)
    parser.add_argument("--anchor-runs", type=int, default=10, help="torchrun runs of the anchor (default 10)")
    parser.add_argument("--dir", type=Path, help="work here and keep the pods' logs (default: a temporary one)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with (contextlib.nullcontext(str(args.dir)) if args.dir else tempfile.TemporaryDirectory(
            prefix="stalwart-ends-")) as tmp, soak(Path(tmp), steps=args.steps, step_delay=args.step_delay) as s:
        results = s.run(args.jobs, args.concurrency)
        for row in figures(results, concurrency=args.concurrency, steps=args.steps):
            print(json.dumps(row), flush=True)
        after = [p.after_return for r in results for p in r.pods if p.after_return is not None]
        for row in anchor_rows(after, args.anchor_runs, args.steps, args.step_delay, Path(tmp)):
            print(json.dumps(row), flush=True)
        print(json.dumps({"bench": "ends", "impl": "stalwart", "metric": "soak_seconds",
                          "value": round(time.monotonic() - started, 1)}), flush=True)
        ok = all(r.succeeded and not r.late() for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
