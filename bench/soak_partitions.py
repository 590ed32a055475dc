"""Partition soak: network cuts of a worker's node while its processes run, against one training job on the local
cluster with a network namespace per node (root and ``ip netns``; it refuses to run otherwise), then a check of the
job's parameters against a fault-free run's, bit for bit.

The job: the example trainer (``stalwart.examples.train``, a deterministic model), 2 workers and a warm spare, one
pod a node, ``rendezvous.leaseTTLSeconds`` ``--lease-ttl`` (4 s by default: the default 10 s would only make the
soak longer), the operator (``stalwart operator`` on this machine, as the control plane's neighbour) and real agents.
Faults, one after another, each once the job trains at full world with its third pod registered (a spare, or a
node waiting for the next round): a cut of a member's node from
everything (``full``), from etcd only (``etcd``), from the API server only (``api``), from the other member's node
only (``peer``), each held shorter (``--lease-ttl``/2) and longer (3 x ``--lease-ttl``) than the lease TTL, then
healed. Per fault it prints one JSON object (``impl: stalwart``):

* ``detect_s``: from the cut to the first sign the job acted on it (a new round sealed, or ``lastFailure`` naming
  the cut pod), polled every 0.1 s; ``null`` when the job never had to (a cut shorter than every timeout);
* ``full_world_after_heal_s``: from the heal to the first status showing the job Running at world size 2 with a
  step past the one at the heal (the status lags the ranks by up to its interval, 0.5 s: charged here);
* ``steps_recomputed``: the highest step any rank logged before the round that recovered, minus the step it
  resumed from (0 without a new round);
* ``stale_refused``: the zombie's own log lines saying a write of its was refused (a stale epoch, a fenced
  registration); ``stale_accepted``: writes of the zombie in etcd's history after its fence record (or after the
  round that left it out), which must be 0; ``rejoined``: an unfenced pod's registrations after that round (its
  lease ran out before the operator counted it lost: it rightly joins again, as a node waiting for the next
  round), not counted as stale;
* ``culprit_ok``: where a new round came, ``lastFailure`` names the cut pod;
* ``counters_moved`` / ``counters_expected``, ``phases``, ``problems``: the status after the fault judged as
  ``bench/soak.py`` judges its kinds (:func:`judge`): ``restarts`` moved by one recovery in process and, where
  the operator fenced the pod, one pod replaced (nothing without a new round); the phases seen were Running,
  perhaps Restarting, Running again; ``lastFailure`` names the cut pod where a new round came, and did not
  change otherwise. The exit status is 1 when any fault has a problem.

The last line (``kind: params``) says whether the job's final parameters equal those of the same job run without
faults (two workers, no spare, no delay), bit for bit. Not charged: the cluster's start, the fault-free run, and
the wait for the replacement spare between faults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stalwart.api.rendezvous import Manifest  # noqa: E402
from stalwart.etcd.keys import FENCED, JobKeys  # noqa: E402
from stalwart.etcd.store import Store  # noqa: E402
from stalwart.local.cluster import LocalCluster  # noqa: E402
from stalwart.local.settings import LocalClusterSettings  # noqa: E402

JSON = dict[str, Any]
NS = "default"
KINDS = ("full", "etcd", "api", "peer")
TRAIN = [sys.executable, "-m", "stalwart.examples.train", "--checkpoint-every", "100000", "--log-every", "1"]
#: Lines of a zombie's log that say a write of its was refused.
REFUSED = ("is stale", "fenced by the operator", "StaleEpoch", "stale epoch")


def wait_for(what: str, fn: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            last = fn()
            if last:
                return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")


def counters(status: JSON) -> tuple[int, int, int]:
    r = status.get("restarts") or {}
    return (int(r.get("inProcess", 0)), int(r.get("processRestarts", 0)), int(r.get("podReplacements", 0)))


def expected_moves(new_round: bool, fenced: bool) -> tuple[int, int, int]:
    """What ``restarts`` (inProcess, processRestarts, podReplacements) must move by after one cut: nothing when
    the job never had to act (no new round); else one recovery in process (the warm spare takes the member's
    ranks with its parked processes, the survivor keeps its own), and one pod replaced when the operator counted
    the member lost and fenced it (a member whose lease ran out and came back first is not replaced)."""
    if not new_round:
        return (0, 0, 0)
    return (1, 0, 1 if fenced else 0)


def judge(before: JSON, after: JSON, moves: tuple[int, int, int], phases: list[str],
          culprit: str | None) -> list[str]:
    """What is wrong with the status after one cut (as ``bench/soak.py`` judges its faults): the counters moved
    by ``moves``, ``totalRestarts`` is the recoveries, the phases seen were Running, perhaps Restarting, Running
    again (only Running when nothing had to recover), and ``lastFailure`` names ``culprit`` (None: it did not
    change)."""
    problems = []
    moved = tuple(a - b for a, b in zip(counters(after), counters(before), strict=True))
    if moved != moves:
        problems.append(f"counters moved {moved}, expected {moves}")
    if after.get("totalRestarts") != sum(counters(after)[:2]):
        problems.append(f"totalRestarts {after.get('totalRestarts')} is not the recoveries")
    allowed = [["Running"]] if moves[:2] == (0, 0) else [["Running"], ["Running", "Restarting", "Running"]]
    if phases not in allowed:
        problems.append(f"phases seen {phases}")
    lf, was = after.get("lastFailure") or {}, before.get("lastFailure") or {}
    if culprit is None and lf != was:
        problems.append(f"lastFailure changed without a new round: {lf}")
    if culprit is not None and lf.get("pod") != culprit:
        problems.append(f"lastFailure names {lf.get('pod')}, expected {culprit}")
    return problems


def node_of(pods: list[JSON], name: str) -> str | None:
    return next((p["spec"].get("nodeName") for p in pods if p["metadata"]["name"] == name), None)


class Soak:
    def __init__(self, directory: Path, lease_ttl: int, steps: int) -> None:
        self.dir, self.lease_ttl, self.steps = directory, lease_ttl, steps
        self.cluster: LocalCluster | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.store: Store | None = None
        self.seen: list[tuple[float, str]] = []  # (time, phase) at every look at the status

    # -- the cluster, the operator, the jobs ------------------------------------------------------------------

    def up(self) -> None:
        self.cluster = LocalCluster.up(self.dir / "cluster", nodes=3, timeout=120.0, owner_pid=os.getpid(),
                                       settings=LocalClusterSettings(node_monitor_grace_period=3.0, network="netns"))
        self.kubectl("apply", "-f", str(ROOT / "crds" / "trainingjob.yaml"))
        log = open(self.dir / "operator.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            self.operator = subprocess.Popen(
                [str(Path(sys.executable).parent / "stalwart"), "operator", "--namespace", NS, "--kubeconfig",
                 str(self.cluster.kubeconfig), "--etcd-endpoints", str(self.cluster.etcd_endpoint),
                 "--status-interval", "0.5"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        self.store = Store([str(self.cluster.etcd_endpoint)], timeout=5.0)

    def down(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(timeout=10)
        if self.cluster is not None:
            self.cluster.down()

    def kubectl(self, *args: str) -> str:
        assert self.cluster is not None
        return str(self.cluster.kubectl(*args).stdout)

    def create(self, name: str, spares: int, delay: float) -> JobKeys:
        body = {"apiVersion": "stalwart.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
                "spec": {"replicas": 2, "spares": spares,
                         "rendezvous": {"lastCallSeconds": 1, "leaseTTLSeconds": self.lease_ttl},
                         "restartPolicy": {"inProcess": {"warmSpares": True}},
                         "template": {"spec": {"containers": [{
                             "name": "trainer", "image": "stalwart/trainer",
                             "command": [*TRAIN, "--steps", str(self.steps), "--step-delay", str(delay)],
                             # 5 CPUs a pod on nodes of 8: one pod a node, a replacement too (it waits for
                             # a node to come back rather than share one, so a cut takes one pod).
                             "resources": {"requests": {"cpu": "5"}}}]}}}}
        assert self.cluster is not None
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
        uid = wait_for("the job's uid", lambda: json.loads(self.kubectl("get", "tj", name, "-n", NS, "-o", "json"))[
            "metadata"]["uid"], 60)
        return JobKeys(NS, uid)

    def status(self, name: str) -> JSON:
        """The job's status; every look also keeps the phase it shows (:meth:`phases_since`)."""
        st: JSON = json.loads(self.kubectl("get", "tj", name, "-n", NS, "-o", "json")).get("status") or {}
        self.seen.append((time.time(), str(st.get("phase"))))
        return st

    def phases_since(self, t: float) -> list[str]:
        """The phases seen from ``t`` on, repeats collapsed, starting with the last one seen before ``t``."""
        seen = [p for when, p in self.seen if when < t][-1:] + [p for when, p in self.seen if when >= t]
        return [p for i, p in enumerate(seen) if i == 0 or seen[i - 1] != p]

    def settle(self, name: str, before: JSON, moves: tuple[int, int, int]) -> JSON:
        """The status once its counters moved by ``moves`` and it shows Running (or after a minute, whatever it
        says), and a moment more: a late double count shows up then."""
        want = tuple(b + m for b, m in zip(counters(before), moves, strict=True))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = self.status(name)
            if st.get("phase") == "Running" and all(c >= w for c, w in zip(counters(st), want, strict=True)):
                break
            time.sleep(0.2)
        time.sleep(1.5)
        return self.status(name)

    def pods(self, name: str) -> list[JSON]:
        items: list[JSON] = json.loads(self.kubectl("get", "pods", "-n", NS, "-l", f"stalwart.dev/job-name={name}",
                                                    "-o", "json"))["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def log_events(self, pod: str) -> list[JSON]:
        """The JSON events of every incarnation of ``pod``, from its directories (a zombie's pod is gone)."""
        assert self.cluster is not None
        out = []
        for d in sorted((self.cluster.dir / "pods").glob(f"{NS}_{pod}_*")):
            with contextlib.suppress(OSError):
                out += [json.loads(line) for line in (d / "trainer.log").read_text(errors="replace").splitlines()
                        if line.startswith('{"event"')]
        return out

    def log_text(self, pod: str) -> str:
        assert self.cluster is not None
        logs = [d / "trainer.log" for d in sorted((self.cluster.dir / "pods").glob(f"{NS}_{pod}_*"))]
        return "".join(f.read_text(errors="replace") for f in logs if f.exists())

    def finish(self, name: str, timeout: float) -> str:
        st = wait_for(f"{name} to end", lambda: (s := self.status(name)).get("phase") in ("Succeeded", "Failed") and s,
                      timeout, interval=1.0)
        if st["phase"] != "Succeeded":
            raise RuntimeError(f"job {name} ended {st['phase']}: {st.get('lastFailure')}")
        done = [e for p in {p["metadata"]["name"] for p in self.pods(name)} for e in self.log_events(p)
                if e["event"] == "done"]
        digests = {e["params_sha256"] for e in done}
        if len(digests) != 1:
            raise RuntimeError(f"job {name}: the replicas differ: {digests}")
        return digests.pop()

    # -- one fault ---------------------------------------------------------------------------------------------

    def manifest(self, keys: JobKeys) -> tuple[Manifest | None, int]:
        assert self.store is not None
        kv = self.store.get(keys.manifest)
        return (None, 0) if kv is None else (Manifest.from_json_bytes(kv.value), kv.mod_revision)

    def ready(self, name: str, keys: JobKeys) -> bool:
        """Training at full world, every pod registered (the third a spare of the round or a node waiting for the
        next one: a pod whose lease ran out and that registered again waits so) and a member alone on its node
        (a replacement may share a node: the scheduler placed it while another was cut off)."""
        assert self.store is not None
        m, _ = self.manifest(keys)
        st = self.status(name)
        pods = self.pods(name)
        nodes = [p["spec"].get("nodeName") for p in pods]
        registered = self.store.count_prefix(keys.rendezvous + "nodes/")
        alone = m is not None and any(nodes.count(node_of(pods, x.node_id)) == 1 for x in m.members)
        return (m is not None and len(m.members) == 2 and registered == 3 and st.get("phase") == "Running"
                and st.get("worldSize") == 2 and len(pods) == 3 and alone
                and all(p["status"].get("phase") == "Running" for p in pods))

    def fault(self, name: str, keys: JobKeys, kind: str, hold: float) -> JSON:
        assert self.cluster is not None and self.store is not None
        wait_for("the job at full world, its third pod registered", lambda: self.ready(name, keys), 300,
                 interval=0.5)
        time.sleep(2.0)  # a moment of training in the round
        m, epoch = self.manifest(keys)
        assert m is not None
        node_of = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in self.pods(name)}
        uid_of = {p["metadata"]["name"]: p["metadata"]["uid"] for p in self.pods(name)}
        members = sorted(x.node_id for x in m.members)
        nodes = list(node_of.values())
        victim = next(x for x in reversed(members) if nodes.count(node_of[x]) == 1)
        other = next(x for x in members if x != victim)
        cut = {"full": None, "etcd": ["etcd"], "api": ["api"], "peer": [node_of[other]]}[kind]
        before = self.status(name)
        before_lf = before.get("lastFailure")
        cut_at = time.time()
        self.cluster.partition(node_of[victim], cut)
        detect: float | None = None
        try:
            while time.time() - cut_at < hold:
                detect = detect or self.detected(name, keys, epoch, victim, before_lf)
                time.sleep(0.1)
        finally:
            heal_at = time.time()
            self.cluster.heal(node_of[victim])
        step_at_heal = (self.status(name).get("progress") or {}).get("step", 0)
        full = wait_for("full world after the heal", lambda: (s := self.status(name)).get("phase") == "Running"
                        and s.get("worldSize") == 2 and (s.get("progress") or {}).get("step", 0) > step_at_heal
                        and time.time(), 300, interval=0.1)
        # A detection that comes only after the heal (an etcd-only cut's lease runs out meanwhile) still counts.
        deadline = time.time() + 2 * self.lease_ttl
        while detect is None and time.time() < deadline:
            detect = self.detected(name, keys, epoch, victim, before_lf)
            time.sleep(0.1)
        _, epoch2 = self.manifest(keys)
        new_round = epoch2 != epoch
        fence = self.store.get(keys.fenced(uid_of[victim]))
        since = fence.mod_revision if fence is not None else (epoch2 if new_round else 0)
        written = self.zombie_writes(keys, victim, since) if since else []
        # Unfenced (its lease ran out, the operator had not counted it lost), the pod rightly registers again:
        # a new incarnation, waiting for the next round. Fenced, it may write nothing at all.
        node_key = keys.node(victim)[len(keys.prefix):] + "@"
        rejoined = [w for w in written if fence is None and w.startswith(node_key)]
        accepted = [w for w in written if w not in rejoined]
        moves = expected_moves(new_round, fence is not None)
        after = self.settle(name, before, moves)
        lf = after.get("lastFailure") or {}
        problems = judge(before, after, moves, self.phases_since(cut_at), victim if new_round else None)
        text = self.log_text(victim)
        refused = sum(1 for line in text.splitlines() if any(w in line for w in REFUSED)
                      and line[:19] >= time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(cut_at)))
        return {"bench": "soak_partitions", "impl": "stalwart", "kind": kind, "hold_s": hold,
                "lease_ttl_s": self.lease_ttl, "detect_s": None if detect is None else round(detect - cut_at, 2),
                "full_world_after_heal_s": round(full - heal_at, 2),
                "steps_recomputed": self.recomputed(members, cut_at) if new_round else 0,
                "new_round": new_round, "zombie_fenced": fence is not None,
                "stale_refused": refused, "stale_accepted": len(accepted), "accepted": accepted[:5],
                "rejoined": len(rejoined),
                "culprit_ok": (lf.get("pod") == victim) if new_round else None,
                "last_failure": ({k: lf.get(k) for k in ("pod", "reason", "detectedBy", "message")}
                                 if lf != (before_lf or {}) else None),
                "counters_moved": [a - b for a, b in zip(counters(after), counters(before), strict=True)],
                "counters_expected": list(moves), "phases": self.phases_since(cut_at), "problems": problems}

    def detected(self, name: str, keys: JobKeys, epoch: int, victim: str, before: Any) -> float | None:
        _, now = self.manifest(keys)
        lf = self.status(name).get("lastFailure")
        if now != epoch or (lf and lf != before and lf.get("pod") == victim):
            return time.time()
        return None

    def zombie_writes(self, keys: JobKeys, victim: str, since: int) -> list[str]:
        """Puts after revision ``since`` whose key or value names ``victim`` (see tests/operator/test_partitions.py),
        the operator's own records and manifests that only name it as lost left out."""
        assert self.store is not None
        until = self.store.revision()
        operators = (keys.job, keys.expected, keys.prefix + FENCED)
        found = []
        with self.store.watch(keys.prefix, prefix=True, start_revision=since + 1) as watch:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                ev = watch.next(timeout=2.0)
                if ev is None:
                    break
                kv = ev.kv
                if ev.type == "put" and not kv.key.startswith(operators) and (
                        victim in kv.key or victim.encode() in kv.value):
                    if kv.key == keys.manifest:
                        m = Manifest.from_json_bytes(kv.value)
                        if m.sealed_by != victim and m.member(victim) is None and victim not in m.spares:
                            continue
                    found.append(f"{kv.key[len(keys.prefix):]}@{kv.mod_revision}")
                if kv.mod_revision >= until:
                    break
        return found

    def recomputed(self, members: list[str], cut_at: float) -> int:
        """The highest step logged before the first resume after the cut, minus the step that resume took."""
        events = [e for pod in {*members, *(p["metadata"]["name"] for p in self.pods("soak"))}
                  for e in self.log_events(pod)]
        resumes = sorted((e["time"], e["step"]) for e in events if e["event"] == "resume" and e["time"] > cut_at)
        if not resumes:
            return 0
        at, step = resumes[0]
        done = [e["step"] for e in events if e["event"] == "step" and e["time"] <= at]
        return max(0, max(done, default=step) - step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/stalwart-soak-partitions"))
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds, comma-separated (of {','.join(KINDS)})")
    p.add_argument("--lease-ttl", type=int, default=4)
    p.add_argument("--steps", type=int, default=6000, help="the job's steps (0.05 s each, and their own time)")
    p.add_argument("--fault-free-sha256", default=None,
                   help="the fault-free run's params_sha256 for these --steps, from an earlier run: skips that run")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in KINDS]:
        p.error(f"--kinds: unknown {bad}; expected some of {list(KINDS)}")
    if os.geteuid() != 0:
        p.error("a network per node needs root (ip netns); run as root")
    args.dir.mkdir(parents=True, exist_ok=True)
    soak = Soak(args.dir, args.lease_ttl, args.steps)
    try:
        soak.up()
        expected = args.fault_free_sha256
        if expected is None:
            soak.create("base", spares=0, delay=0.0)
            expected = soak.finish("base", 900)
            soak.kubectl("delete", "tj", "base", "-n", NS, "--wait=true", "--timeout=120s")
        keys = soak.create("soak", spares=1, delay=0.05)
        rows = []
        for kind in kinds:
            for hold in (args.lease_ttl / 2, 3.0 * args.lease_ttl):
                if soak.status("soak").get("phase") != "Running" and rows:
                    print(json.dumps({"bench": "soak_partitions", "kind": kind, "hold_s": hold,
                                      "skipped": "the job ended before this fault"}), flush=True)
                    continue
                row = soak.fault("soak", keys, kind, hold)
                rows.append(row)
                print(json.dumps(row), flush=True)
        got = soak.finish("soak", 1800)
        print(json.dumps({"bench": "soak_partitions", "kind": "params", "faults": len(rows),
                          "params_match": got == expected, "params_sha256": got, "fault_free_sha256": expected}),
              flush=True)
        return 0 if got == expected and all(r["stale_accepted"] == 0 and not r["problems"] for r in rows) else 1
    finally:
        soak.down()


if __name__ == "__main__":
    sys.exit(main())
