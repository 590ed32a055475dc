"""Status-oracle soak: random faults of every kind against the demo's job on the local cluster, each checked against
what ``kubectl get tj`` then says, and the parameters at the end checked against a clean run's.

The job is ``examples/minimal.yaml`` as ``stalwart demo`` runs it (2 workers + 1 spare, the example trainer),
with ``spec.faultInjection.enabled`` and ``restartPolicy.inProcess.warmSpares: false``: a lost pod is recovered
by restarting the rank processes, whose counters the oracle predicts (in process, the job's default, is tested
by ``tests/operator/test_warm_spares.py``). Faults, one after another, each once the job runs again:

* through the job's agents (``stalwart drill``'s requests, signed with the job's Secret): ``rank-exception``,
  ``rank-kill`` (SIGKILL), ``rank-hang`` (the process frozen until its heartbeat lease runs out);
* through the Kubernetes API: ``pod-delete``, ``pod-force-delete``;
* to the cluster: ``node-loss`` (the pod's node lost, restored afterwards), ``etcd-restart`` (etcd killed and
  started again on its data), ``operator-restart`` (the operator's pod deleted; its Deployment brings it back).

After each fault the oracle asserts the status: the counters moved by exactly what the fault implies
(``restarts.inProcess``, ``processRestarts``, ``podReplacements``), ``lastFailure`` names the culprit (kind,
rank, pod, signal, exception type), the phases seen were right (Running, perhaps Restarting, Running again;
never anything else; etcd and operator restarts never leave Running), and the Events say the same (one
``Fault`` and one ``Restarted*`` per disruptive fault, none otherwise). For a node loss and a hang it also
checks the culprit from the first word on (``EARLY``): ``lastFailure`` names the lost pod (the hung rank) within
5 s of the fault (of the hang's lease running out), and no status shown until the recovery names a survivor.
After the last fault it takes the next checkpoint rank 0 writes and compares its parameters, bit for bit, with a
clean run of the same script to the same step (two plain ``torch.distributed`` processes, no stalwart, no faults).

As a benchmark (``python bench/soak.py [--faults 20] [--seed 1]``) it prints one JSON object per fault kind: the
mean seconds from the fault to the first completed step after it (``impl: stalwart``), next to its anchor
measured in the same run on the same job: a whole-job restart as Kubeflow's PyTorchJob does on any failure,
every pod deleted and created again and training resumed from the checkpoint (``impl: job-restart``), and a
row with the oracle's verdicts. ``tests/e2e/test_soak.py`` runs it with fewer faults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from bench.log_window import pod_logs_between  # noqa: E402
from stalwart.api.exit_codes import ExitCode  # noqa: E402
from stalwart.demo import EXAMPLE, JOB_NAMESPACE, DemoOptions, Installation, demo_job  # noqa: E402
from stalwart.drill.core import RankPoint, Recovery, standing  # noqa: E402
from stalwart.drill.session import DrillOptions, DrillSession  # noqa: E402
from stalwart.etcd.store import Store, StoreError  # noqa: E402
from stalwart.examples.train import CHECKPOINT_DIR_ENV, CHECKPOINT_NAME  # noqa: E402
from stalwart.local.cluster import LocalCluster  # noqa: E402
from stalwart.local.settings import LocalClusterSettings, network_from_env  # noqa: E402
from stalwart.net import free_port  # noqa: E402

JSON = dict[str, Any]
KINDS = ("rank-exception", "rank-kill", "rank-hang", "pod-delete", "pod-force-delete", "node-loss",
         "etcd-restart", "operator-restart")
#: (inProcess, processRestarts, podReplacements) each fault adds.
DELTAS: dict[str, tuple[int, int, int]] = {
    "rank-exception": (1, 0, 0), "rank-kill": (0, 1, 0), "rank-hang": (1, 0, 0),
    "pod-delete": (0, 1, 1), "pod-force-delete": (0, 1, 1), "node-loss": (0, 1, 1),
    "etcd-restart": (0, 0, 0), "operator-restart": (0, 0, 0),
}
#: What lastFailure must say (reason, detectedBy, extra fields) after each disruptive fault.
CULPRITS: dict[str, tuple[str, str, JSON]] = {
    "rank-exception": ("Exception", "Rank", {"exceptionType": "DrillFault"}),
    "rank-kill": ("ProcessExited", "Process", {"signal": "SIGKILL"}),
    "rank-hang": ("PeerLost", "Heartbeat", {}),  # the frozen rank's lease ended: PeerLost names it, not who noticed
    "pod-delete": ("PodLost", "Pod", {}),
    "pod-force-delete": ("PodLost", "Pod", {}),
    "node-loss": ("NodeLost", "Pod", {}),
}
#: Seconds from the fault by which lastFailure must name its culprit, and every lastFailure shown from the fault
#: to the recovery must name it (never a survivor that noticed): a node loss is known at once (the survivor's
#: collective breaks); a drill's hang only once the frozen rank's heartbeat lease (10 s) has run out.
EARLY: dict[str, float] = {"node-loss": 5.0, "rank-hang": 10.0 + 5.0}
STEP_DELAY = 0.05
CHECKPOINT_EVERY = 20


def counters(status: JSON) -> tuple[int, int, int]:
    r = status.get("restarts") or {}
    return (int(r.get("inProcess", 0)), int(r.get("processRestarts", 0)), int(r.get("podReplacements", 0)))


@dataclass
class Outcome:
    """One fault and what the oracle found."""

    index: int
    kind: str
    target: str
    seconds: float | None
    recomputed: int | None
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        took = f"{self.seconds:.1f}s" if self.seconds is not None else "-"
        verdict = "ok" if not self.problems else "; ".join(self.problems)
        return f"{self.index:>3}  {self.kind:<17} {self.target:<30} {took:>8}  {verdict}"


class PhaseWatch:
    """Polls the job's status (every 0.2s) in a thread and keeps every phase it saw, with the time."""

    def __init__(self, session: DrillSession) -> None:
        self.session = session
        self.seen: list[tuple[float, str, str]] = []  # (time, phase, totalRestarts as text)
        self.failures: list[tuple[float, JSON | None]] = []  # (time, lastFailure) at each change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-phases", daemon=True)

    def __enter__(self) -> PhaseWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                st = self.session.status()
                phase = str(st.get("phase"))
                total = str(st.get("totalRestarts"))
                if not self.seen or self.seen[-1][1:] != (phase, total):
                    self.seen.append((time.time(), phase, total))
                lf = st.get("lastFailure")
                if not self.failures or self.failures[-1][1] != lf:
                    self.failures.append((time.time(), lf))
            self._stop.wait(0.2)

    def since(self, t: float) -> list[str]:
        """The phases seen from ``t`` on, repeats collapsed (starting with the phase at ``t``)."""
        before = [p for (when, p, _) in self.seen if when < t]
        out = before[-1:] + [p for (when, p, _) in self.seen if when >= t]
        collapsed: list[str] = []
        for p in out:
            if not collapsed or collapsed[-1] != p:
                collapsed.append(p)
        return collapsed

    def failures_since(self, t: float, until: float) -> list[tuple[float, JSON]]:
        """The lastFailures shown from ``t`` to ``until``, each with its seconds since ``t``."""
        return [(round(when - t, 2), lf) for when, lf in self.failures if t <= when <= until and lf]

    def blank_restarts(self) -> bool:
        return any(total == "None" and phase not in ("None", "Pending") for _, phase, total in self.seen)


class Soak:
    """The soak on its own local cluster (``directory``), printing progress to ``out``."""

    def __init__(self, directory: Path, *, faults: int, kinds: Sequence[str] = KINDS, seed: int = 1,
                 out: TextIO = sys.stdout, recovery_timeout: float = 240.0) -> None:
        self.directory = directory
        self.faults = faults
        self.kinds = tuple(kinds)
        self.seed = seed
        self.out = out
        self.recovery_timeout = recovery_timeout
        self.cluster: Any = None
        self.install: Installation | None = None
        self.session: DrillSession | None = None
        self.checkpoints = directory / "checkpoints"
        self.etcd: subprocess.Popen[bytes] | None = None  # etcd once the soak restarted it
        self.job = "minimal"
        # The node the last node-loss took, how many of the job's pods and which members were on it.
        self._lost_node = ""
        self._lost_pods = 1
        self._lost_members: set[str] = set()

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    # -- set-up and tear-down ------------------------------------------------------------------------------

    def up(self) -> None:
        # A lost node is noticed after 3 s (a real cluster's node-monitor grace period is 40 s): what is measured
        # is stalwart's recovery, not the wait for Kubernetes to call a node lost.
        # The network mode as the test sessions take it: $STALWART_LOCAL_NETWORK (auto, netns or loopback).
        self.cluster = LocalCluster.up(self.directory / "cluster", nodes=3, timeout=120.0, owner_pid=os.getpid(),
                                       settings=LocalClusterSettings(node_monitor_grace_period=3.0,
                                                                     network=network_from_env()))
        self.install = Installation(self.cluster)
        self.install.install_chart()
        wait_for("the operator pod to be ready", self.install.operator_ready, 180)
        from kubernetes import client, config

        cfg = client.Configuration()
        loader: Any = config
        loader.load_kube_config(config_file=str(self.cluster.kubeconfig), client_configuration=cfg)
        self.session = DrillSession(client.ApiClient(cfg), JOB_NAMESPACE, self.job, [self.cluster.etcd_endpoint],
                                    DrillOptions(timeout=self.recovery_timeout, settle=60.0, ready_timeout=240.0))

    def start_job(self) -> None:
        job = demo_job(yaml.safe_load(EXAMPLE.read_text()),
                       DemoOptions(directory=self.directory, steps=1_000_000, step_delay=STEP_DELAY,
                                   fail_at_step=999_998, kill_at_step=999_999))
        container = job["spec"]["template"]["spec"]["containers"][0]
        container["env"] = [e for e in container["env"] if not e["name"].startswith("STALWART_EXAMPLE_FAIL")]
        container["env"].append({"name": CHECKPOINT_DIR_ENV, "value": str(self.checkpoints)})
        args = container["args"]
        args[args.index("--log-every") + 1] = "50"  # a step line every 50 steps is plenty for the pods' logs
        job["spec"]["faultInjection"] = {"enabled": True}
        # The example trainer's own soft timeout; the operator judges stalls with the same. Warm spares off: the
        # counters DELTAS predicts for a lost pod are those of process restart (the opt-out). In process, the
        # default for this job, a loss's counters depend on whether the replacement spare had parked its
        # processes before the next fault; tests/operator/test_warm_spares.py checks that path.
        job["spec"]["restartPolicy"] = {"inProcess": {"softTimeoutSeconds": 30, "hardTimeoutSeconds": 60,
                                                      "warmSpares": False},
                                        "backoffLimit": 1000}
        self.job = job["metadata"]["name"]
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(job))
        assert self.session is not None
        from stalwart.api import naming
        from stalwart.drill.session import DrillError

        def connected() -> bool:
            try:
                self._session().connect()
            except DrillError:
                return False
            return True

        wait_for(f"the job and its Secret {naming.secret_name(self.job)}", connected, 120)
        self.session.wait_running(300)

    def down(self) -> None:
        with contextlib.suppress(Exception):
            if self.session is not None:
                self.session.close()
                self.session.api.close()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.kubectl("delete", "tj", self.job, "-n", JOB_NAMESPACE, "--wait=false", check=False)
            if self.install is not None:
                with contextlib.suppress(Exception):
                    self.install.uninstall()
            self.cluster.down()
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait(timeout=10)

    # -- faults ------------------------------------------------------------------------------------------------

    def plan(self) -> list[str]:
        """``faults`` kinds: every kind once in a seeded order, then more of them drawn at random."""
        rng = random.Random(self.seed)
        first = list(self.kinds)
        rng.shuffle(first)
        more = [rng.choice(self.kinds) for _ in range(max(0, self.faults - len(first)))]
        return (first + more)[: self.faults]

    def _session(self) -> DrillSession:
        assert self.session is not None
        return self.session

    def events(self) -> list[str]:
        out = self.cluster.kubectl("get", "events", "-n", JOB_NAMESPACE, "--field-selector",
                                   f"involvedObject.name={self.job}", "-o", "json").stdout
        return [str(e.get("reason")) for e in json.loads(out)["items"]]

    def run(self) -> list[Outcome]:
        session = self._session()
        rng = random.Random(self.seed + 1)
        outcomes: list[Outcome] = []
        self.say(f"{'#':>3}  {'FAULT':<17} {'TARGET':<30} {'RECOVERY':>8}  ORACLE")
        with PhaseWatch(session) as phases:
            for index, kind in enumerate(self.plan(), start=1):
                outcome = self.one(index, kind, rng, phases)
                outcomes.append(outcome)
                self.say(outcome.line())
            if phases.blank_restarts():
                outcomes[-1].problems.append("the RESTARTS column was blank at some point")
        return outcomes

    def one(self, index: int, kind: str, rng: random.Random, phases: PhaseWatch) -> Outcome:
        session = self._session()
        session.wait_running(240)
        time.sleep(1.0)  # a moment of training (and a status written) between faults
        before_status = session.status()
        before_events = self.events()
        pts = session.current_points()
        position, step_before = standing(pts)
        chose = time.time()
        target, rank, injected = self.inject(kind, rng, pts)
        if kind in ("etcd-restart", "operator-restart"):
            rec = self.went_on(step_before, injected)
        else:
            rec = session.wait_recovered(position, injected, step_before)
        problems: list[str] = []
        if rec is None:
            return Outcome(index, kind, target, None, None, [f"no step after the fault within "
                                                              f"{self.recovery_timeout:g}s"])
        after = self.settle(before_status, kind)
        if kind == "node-loss":
            self.cluster.restore_node(self._lost_node)
        problems += self.judge(kind, target, rank, before_status, after)
        if kind in EARLY:
            problems += self.judge_early(kind, target, rank, before_status,
                                         phases.failures_since(injected, time.time()))
        seen = phases.since(injected)
        allowed = ([["Running"]] if DELTAS[kind][:2] == (0, 0)
                   else [["Running"], ["Running", "Restarting", "Running"]])
        if seen not in allowed:
            problems.append(f"phases seen {seen}")
        problems += self.judge_events(kind, before_events)
        if problems:  # what the pods said around the fault, for a failure seen once (under load, in CI)
            self.say("\n".join([f"   choosing the target of fault {index} took {injected - chose:.2f}s; the pods' logs "
                                 "from 1 s before the fault to 15 s after it:",
                                 *pod_logs_between(self.directory / "cluster" / "pods", injected - 1.0,
                                                   injected + 15.0)]))
        return Outcome(index, kind, target, rec.seconds, rec.recomputed, problems)

    def deltas(self, kind: str, last_failure: JSON | None = None) -> tuple[int, int, int]:
        """What the counters must move by: a lost node takes every pod of the job on it; a frozen rank that its
        agent had to kill (its hard timeout) was recovered with a new process, not in process."""
        in_process, process, pods = DELTAS[kind]
        if kind == "node-loss":
            return (in_process, process, self._lost_pods)
        if kind == "rank-hang" and (last_failure or {}).get("detectedBy") == "Process":
            return (0, 1, 0)
        return (in_process, process, pods)

    def inject(self, kind: str, rng: random.Random, pts: Sequence[RankPoint]) -> tuple[str, int | None, float]:
        """Inject one fault; the target's name, (for rank faults) its rank, and the time the fault was applied.
        That time is taken just before the call that applies it, after the lookups that choose the target: on a
        loaded machine those (the API, etcd, kubectl) take seconds, which no recovery or detection may be
        charged."""
        session = self._session()
        manifest = session.manifest()
        members = sorted(m.node_id for m in manifest.members) if manifest else []
        if kind in ("rank-exception", "rank-kill", "rank-hang"):
            running = sorted((p for p in pts if p.state == "running"), key=lambda p: (p.node, p.local_rank))
            p = rng.choice(running)
            at = time.time()
            result = session.agent_fault(kind, p.node, p.local_rank)
            return p.node, result.rank, at
        if kind in ("pod-delete", "pod-force-delete"):
            pod = rng.choice(members)
            at = time.time()
            session.pod_fault(kind, pod)
            return pod, None, at
        if kind == "node-loss":
            assert self.install is not None
            operator_nodes = {str((p.get("spec") or {}).get("nodeName")) for p in self.install.operator_pods()}
            job_pods = [p for p in session.core.list_namespaced_pod(JOB_NAMESPACE).items
                        if p.metadata.deletion_timestamp is None and p.status.phase in ("Pending", "Running")]
            node_of = {p.metadata.name: str(p.spec.node_name) for p in job_pods}
            # A node of a member, preferably with no other pod of the job and without the operator on it (losing
            # the operator too is two faults at once).
            alone = [m for m in members if list(node_of.values()).count(node_of.get(m, "")) == 1]
            choices = ([m for m in alone if node_of.get(m) not in operator_nodes]
                       or [m for m in members if node_of.get(m) not in operator_nodes] or members)
            pod = rng.choice(choices)
            self._lost_node = node_of[pod]
            self._lost_pods = sum(1 for node in node_of.values() if node == self._lost_node)
            self._lost_members = {m for m in members if node_of.get(m) == self._lost_node}
            at = time.time()
            self.cluster.lose_node(self._lost_node)
            return pod, None, at
        if kind == "etcd-restart":
            at = time.time()
            self.restart_etcd()
            return "etcd", None, at
        if kind == "operator-restart":
            assert self.install is not None
            (pod_body,) = self.install.operator_pods()
            name = pod_body["metadata"]["name"]
            at = time.time()
            self.cluster.kubectl("delete", "pod", name, "-n", self.install.namespace, "--wait=false")
            wait_for("a new operator pod", lambda: [p for p in self.install.operator_pods()  # type: ignore[union-attr]
                                                    if p["metadata"]["name"] != name], 60)
            return name, None, at
        raise ValueError(f"unknown fault kind {kind!r}")

    def restart_etcd(self) -> None:
        """Kill etcd as a crash would and start it again on its data, as a supervisor would."""
        pid = self.etcd.pid if self.etcd is not None else int(self.cluster.etcd_pid)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        cwd = os.readlink(f"/proc/{pid}/cwd")
        os.kill(pid, signal.SIGKILL)
        if self.etcd is not None:
            self.etcd.wait(timeout=10)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(2.0)
        log = open(self.directory / "etcd-restarted.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            self.etcd = subprocess.Popen([c.decode() for c in cmdline], cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        with Store([self.cluster.etcd_endpoint], timeout=1.0) as store:  # waits for it: connect would refuse now
            wait_for("etcd to serve again", lambda: _serves(store), 60)

    def went_on(self, step_before: int, injected: float) -> Recovery | None:
        """For faults that need no recovery of the ranks: the first step reported after the fault."""
        session = self._session()
        deadline = time.monotonic() + self.recovery_timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreError):
                kvs, _ = session._store().get_prefix(session.keys.progress)
                from stalwart.api.restart import ProgressRecord

                for kv in kvs:
                    rec = ProgressRecord.from_json_bytes(kv.value)
                    if rec.updated > injected and (rec.step or 0) > step_before:
                        st = session.status()
                        prog = st.get("progress") or {}
                        if prog.get("step", 0) > step_before and st.get("phase") == "Running":
                            return Recovery(round(rec.updated - injected, 3), int(rec.step or 0), 0)
            time.sleep(0.2)
        return None

    def settle(self, before: JSON, kind: str) -> JSON:
        """The status once it shows this fault's counters and Running (or after a minute, whatever it says)."""
        session = self._session()
        in_process, process, pods = self.deltas(kind)
        want = (sum(counters(before)[:2]) + in_process + process, counters(before)[2] + pods)  # recoveries, pods
        deadline = time.monotonic() + 60
        while True:
            st = session.status()
            now = (sum(counters(st)[:2]), counters(st)[2])
            reached = now[0] >= want[0] and now[1] >= want[1]
            if (st.get("phase") == "Running" and reached) or time.monotonic() > deadline:
                time.sleep(1.5)  # anything late (a double count) shows up here
                return session.status()
            time.sleep(0.2)

    def judge(self, kind: str, target: str, rank: int | None, before: JSON, after: JSON) -> list[str]:
        problems = []
        moved = tuple(a - b for a, b in zip(counters(after), counters(before), strict=True))
        expected = self.deltas(kind, after.get("lastFailure"))
        if moved != expected:
            problems.append(f"counters moved {moved}, expected {expected}")
        if after.get("totalRestarts") != counters(after)[0] + counters(after)[1]:
            problems.append(f"totalRestarts {after.get('totalRestarts')} is not the recoveries")
        if after.get("phase") != "Running":
            problems.append(f"phase {after.get('phase')} after recovery")
        lf = after.get("lastFailure") or {}
        if kind not in CULPRITS:
            if lf != (before.get("lastFailure") or {}):
                problems.append(f"lastFailure changed: {lf}")
            return problems
        reason, detected, extra = CULPRITS[kind]
        if kind == "rank-hang" and lf.get("detectedBy") == "Process":
            # Thawed but stuck where no interrupt frees it. Either the process ends itself 10 s after its interrupt
            # (exit code ABANDONED), or its agent kills it at its hard timeout: the agent asks for its stacks first
            # (SIGQUIT, on which the process dumps and ends), and kills it (SIGKILL) only if it has not ended a
            # moment later. Both are the hang, a Hang (stalwart/operator/failures.py, exit_facts).
            reason, detected, extra = "Hang", "Process", {}
            if lf.get("signal") not in ("SIGQUIT", "SIGKILL") and lf.get("exitCode") != ExitCode.ABANDONED:
                problems.append(f"lastFailure signal {lf.get('signal')}, exit code {lf.get('exitCode')}: expected "
                                f"SIGQUIT or SIGKILL, or exit code {int(ExitCode.ABANDONED)}")
        want: JSON = {"reason": reason, "detectedBy": detected, "pod": target, **extra}
        if rank is not None:
            want["rank"] = rank
        if kind == "node-loss" and lf.get("pod") in self._lost_members:
            want["pod"] = lf.get("pod")  # the node took more than one member: any of them is the culprit
        wrong = {k: lf.get(k) for k, v in want.items() if lf.get(k) != v}
        if wrong:
            problems.append(f"lastFailure {wrong}, expected {({k: want[k] for k in wrong})}")
        if kind != "rank-exception" and lf.get("exceptionType"):
            problems.append(f"lastFailure mixes in an exception type: {lf}")
        if not kind.startswith("rank") and lf.get("rank") is not None:
            problems.append(f"lastFailure of a pod names a rank: {lf}")
        return problems

    def judge_early(self, kind: str, target: str, rank: int | None, before: JSON,
                    shown: list[tuple[float, JSON]]) -> list[str]:
        """The culprit from the first word on (issue 37): within ``EARLY[kind]`` seconds of the fault lastFailure
        names it, and no lastFailure shown from the fault to the recovery names anyone else (a survivor)."""
        new = [(at, lf) for at, lf in shown if lf != (before.get("lastFailure") or None)]
        if not new or new[0][0] > EARLY[kind]:
            return [f"lastFailure did not name the culprit within {EARLY[kind]:g}s: "
                    f"{new[0] if new else 'nothing new'}"]
        pods = (self._lost_members or {target}) if kind == "node-loss" else {target}
        reasons = {"node-loss": ("PeerLost", "NodeLost"), "rank-hang": ("PeerLost", "Hang")}[kind]
        wrong = [(at, lf) for at, lf in new if lf.get("pod") not in pods or lf.get("reason") not in reasons
                 or (rank is not None and lf.get("rank") != rank)]
        return [f"lastFailure named another culprit {wrong[0][0]}s after the fault: {wrong[0][1]}"] if wrong else []

    def judge_events(self, kind: str, before: list[str]) -> list[str]:
        after = self.events()
        def delta(reason: str) -> int:
            return after.count(reason) - before.count(reason)
        restarted = delta("RestartedInProcess") + delta("RestartedProcesses")
        expected = 0 if DELTAS[kind] == (0, 0, 0) else 1
        problems = []
        if delta("Fault") != expected or restarted != expected:
            problems.append(f"events: {delta('Fault')} Fault and {restarted} Restarted, expected {expected} each")
        return problems

    # -- the end: parameters against a clean run ------------------------------------------------------------

    def final_checkpoint(self, after_step: int, timeout: float = 240.0) -> tuple[int, Any]:
        """The first checkpoint rank 0 writes past ``after_step``: (its step, its state)."""
        import torch

        path = self.checkpoints / CHECKPOINT_NAME

        def read() -> tuple[int, Any] | None:
            try:
                data = torch.load(path, weights_only=True)
            except (OSError, RuntimeError, EOFError):
                return None
            step = int(data["step"])
            return (step, data["model"]) if step > after_step else None

        got: tuple[int, Any] = wait_for(f"a checkpoint past step {after_step}", read, timeout, interval=0.1)
        return got

    def clean_run(self, steps: int) -> Any:
        """The example trainer to ``steps`` in two plain torch.distributed processes (no stalwart, no fault)."""
        import torch

        directory = self.directory / "clean"
        directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                    CHECKPOINT_DIR_ENV: str(directory), "OMP_NUM_THREADS": "1"})
        procs = [subprocess.Popen([sys.executable, "-m", "stalwart.examples.train", "--steps", str(steps),
                                   "--checkpoint-every", str(CHECKPOINT_EVERY), "--log-every", "1000000"],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL)
                 for r in range(2)]
        try:
            for p in procs:
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"the clean run's rank exited {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return torch.load(directory / CHECKPOINT_NAME, weights_only=True)["model"]

    def whole_job_restart(self) -> Recovery | None:
        """The anchor: every pod of the job deleted at once and created again, as a PyTorchJob restarts a job on
        any failure; the time from the deletion to the first step after it (new pods, new processes, the
        checkpoint loaded), on the same cluster with the same job."""
        session = self._session()
        session.wait_running(240)
        time.sleep(1.0)
        before, step_before = standing(session.current_points())
        pods = [p.metadata.name for p in session.core.list_namespaced_pod(
            JOB_NAMESPACE, label_selector=f"stalwart.dev/job-name={self.job}").items
            if p.metadata.deletion_timestamp is None and p.status.phase in ("Pending", "Running")]
        injected = time.time()
        for pod in pods:
            session.pod_fault("pod-delete", pod)
        return session.wait_recovered(before, injected, step_before)

    def parameters_match(self) -> tuple[int, bool]:
        import torch

        session = self._session()
        _, step_now = standing(session.current_points())
        step, state = self.final_checkpoint(step_now)
        clean = self.clean_run(step)
        same = state.keys() == clean.keys() and all(torch.equal(state[k], clean[k]) for k in state)
        return step, same


def _serves(store: Store) -> bool:
    try:
        store.status()
        return True
    except StoreError:
        return False


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def soak(directory: Path, **kwargs: Any) -> Iterator[Soak]:
    """A soak with its cluster up and its job running; everything stopped afterwards."""
    s = Soak(directory, **kwargs)
    try:
        s.up()
        s.start_job()
        yield s
    finally:
        s.down()


def main(argv: Sequence[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    with tempfile.TemporaryDirectory(prefix="stalwart-soak-") as tmp, \
            soak(Path(tmp), faults=args.faults, kinds=kinds, seed=args.seed, out=sys.stderr) as s:
        outcomes = s.run()
        anchor = s.whole_job_restart()
        step, same = s.parameters_match()
        by_kind: dict[str, list[Outcome]] = {}
        for o in outcomes:
            by_kind.setdefault(o.kind, []).append(o)
        for kind, os_ in sorted(by_kind.items()):
            secs = [o.seconds for o in os_ if o.seconds is not None]
            redone = [o.recomputed for o in os_ if o.recomputed is not None]
            print(json.dumps({"bench": "soak", "impl": "stalwart", "fault": kind, "metric": "seconds_to_recovery",
                              "value": round(statistics.mean(secs), 3) if secs else None, "n": len(os_),
                              "steps_recomputed": round(statistics.mean(redone), 1) if redone else None}),
                  flush=True)
        if anchor is not None:
            print(json.dumps({"bench": "soak", "impl": "job-restart", "fault": "any", "metric": "seconds_to_recovery",
                              "value": anchor.seconds, "n": 1, "steps_recomputed": anchor.recomputed}), flush=True)
        ok = sum(1 for o in outcomes if not o.problems)
        print(json.dumps({"bench": "soak", "impl": "stalwart", "metric": "status_correct_after_fault", "value": ok,
                          "of": len(outcomes), "kinds": len(by_kind), "parameters_bit_identical": same,
                          "at_step": step}), flush=True)
        return 0 if ok == len(outcomes) and same else 1


if __name__ == "__main__":
    sys.exit(main())
