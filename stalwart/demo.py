"""``stalwart demo``: the whole user path on the local cluster, with two faults, as it happens.

1. start the local cluster (API emulator, process kubelet, real etcd);
2. install the Helm chart with the real Helm library; the local cluster's Deployment controller runs the
   operator pod from the chart's template (its command line, environment and service account);
3. apply ``examples/minimal.yaml`` (2 workers + 1 spare) with fault injection set: one rank raises an
   exception at a step (recovered in process), and later the demo kills one worker pod (its ranks move to the
   spare);
4. print ``kubectl get tj`` whenever it changes, and at the end the measured recovery times, read from the
   training processes' own timestamped log lines;
5. clean up (uninstall, stop the cluster) unless ``keep``.

The pure parts (parsing the training log events, measuring recovery, building the job manifest) are functions
over plain data; :class:`Demo` is the shell that drives the cluster.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from stalwart.api import naming
from stalwart.examples.train import FAIL_AT_STEP_ENV, FAIL_RANK_ENV
from stalwart.net import free_port

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
CHART_DIR = REPO / "helm" / "stalwart"
EXAMPLE = REPO / "examples" / "minimal.yaml"
RELEASE = "stalwart"
OPERATOR_NAMESPACE = "stalwart-system"
JOB_NAMESPACE = "default"

JSON = dict[str, Any]


class DemoError(RuntimeError):
    """The demo could not go on; the message says what was expected and where to look."""


@dataclass(frozen=True)
class DemoOptions:
    """What the demo does. Steps and delays are chosen so the two faults land mid-training."""

    directory: Path
    keep: bool = False
    steps: int = 300
    step_delay: float = 0.05
    fail_at_step: int = 60
    fail_rank: int = 1
    kill_at_step: int = 150
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.steps < 3:
            raise ValueError(f"steps: expected at least 3, got {self.steps}")
        if not 0 < self.fail_at_step < self.kill_at_step < self.steps:
            raise ValueError(f"expected 0 < fail_at_step ({self.fail_at_step}) < kill_at_step "
                             f"({self.kill_at_step}) < steps ({self.steps})")
        if self.fail_rank not in (0, 1):
            raise ValueError(f"fail_rank: the demo job has ranks 0 and 1, got {self.fail_rank}")
        if self.step_delay < 0 or self.timeout <= 0:
            raise ValueError("step_delay must be >= 0 and timeout > 0")


# --- the pure core ---------------------------------------------------------------------------------------------


def demo_job(example: JSON, opts: DemoOptions) -> JSON:
    """The example TrainingJob with the demo's training arguments and fault injection added to its container."""
    job = copy.deepcopy(example)
    job.setdefault("metadata", {})["namespace"] = JOB_NAMESPACE
    (container, *_) = job["spec"]["template"]["spec"]["containers"]
    container["args"] = [*container.get("args", []), "--steps", str(opts.steps), "--step-delay",
                         str(opts.step_delay), "--log-every", "1", "--checkpoint-every", "20"]
    env = [e for e in container.get("env", []) if e.get("name") not in {FAIL_AT_STEP_ENV, FAIL_RANK_ENV}]
    env += [{"name": FAIL_AT_STEP_ENV, "value": str(opts.fail_at_step)},
            {"name": FAIL_RANK_ENV, "value": str(opts.fail_rank)}]
    container["env"] = env
    # The demo runs on one small machine: no CPU/memory requests the local scheduler would have to honour.
    container.pop("resources", None)
    return job


def parse_events(log_text: str, pod: str) -> list[JSON]:
    """The JSON event lines of one pod's training log, each tagged with the pod; other lines are skipped."""
    events: list[JSON] = []
    for raw in log_text.splitlines():
        line = raw.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str) and isinstance(event.get("time"),
                                                                                            int | float):
            events.append({**event, "pod": pod})
    return sorted(events, key=lambda e: float(e["time"]))


@dataclass(frozen=True)
class Recovery:
    """One fault and how long training took to go on: ``seconds`` from the fault to the first step completed
    after the ranks resumed (in process, or as fresh processes of a new round); ``resumed_at_step`` that step."""

    what: str
    fault_time: float
    seconds: float
    resumed_at_step: int


def recovery_after(events: Iterable[JSON], what: str, fault_time: float) -> Recovery | None:
    """Measure recovery from the training processes' own events: the first ``resume`` after ``fault_time``
    (any rank), then the first ``step`` completed after that. None while training has not gone on yet.

    Steps logged between the fault and the resume (a peer finishing the step it was in) do not count.
    """
    ordered = sorted(events, key=lambda e: float(e["time"]))
    resumed = next((e for e in ordered if e["event"] == "resume" and float(e["time"]) > fault_time), None)
    if resumed is None:
        return None
    step = next((e for e in ordered if e["event"] == "step" and float(e["time"]) >= float(resumed["time"])), None)
    if step is None:
        return None
    return Recovery(what, fault_time, round(float(step["time"]) - fault_time, 3), int(step["step"]))


def latest_step(events: Iterable[JSON]) -> int:
    return max((int(e["step"]) for e in events if e["event"] == "step"), default=0)


def finished_by(events: Iterable[JSON], at: float) -> int | None:
    """The step a rank had finished the job at, if one had by ``at`` (its ``done`` event): a fault injected after
    that finds nothing to interrupt."""
    return min((int(e["step"]) for e in events if e["event"] == "done" and float(e["time"]) <= at), default=None)


# --- the shell -------------------------------------------------------------------------------------------------


class Installation:
    """stalwart installed on a local cluster the way a user installs it: ``helm install`` with the real Helm
    library; the local cluster's Deployment controller then runs the operator pod from the chart's template."""

    def __init__(self, cluster: Any, release: str = RELEASE, namespace: str = OPERATOR_NAMESPACE) -> None:
        import helm_python

        self.cluster = cluster
        self.release = release
        self.namespace = namespace
        self.helm = helm_python.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=namespace)
        self.values: JSON = {}

    def install_chart(self, timeout: int = 120) -> JSON:
        """``helm install``; returns Helm's release summary."""
        self.values = {
            "operator": {
                # Pods of the local cluster share one network namespace (each has its own loopback address):
                # a free port, bound on the pod's address, where the kubelet's probes call it.
                "healthPort": free_port(),
                "extraEnv": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                # They have no service account token mounted either: the operator uses the cluster's kubeconfig.
                "extraArgs": [f"--kubeconfig={self.cluster.kubeconfig}", "--health-host=$(POD_IP)"],
            },
            # Jobs naming no endpoints use the local cluster's etcd (on a real cluster: etcd.enabled=true).
            "etcd": {"externalEndpoints": [self.cluster.etcd_endpoint]},
        }
        release: JSON = self.helm.install(CHART_DIR, self.release, self.values, namespace=self.namespace,
                                          create_namespace=True, timeout=timeout)
        return release

    def set_operator_replicas(self, replicas: int, timeout: int = 120) -> JSON:
        """``helm upgrade`` with the install's values and ``operator.replicas``; returns the release summary."""
        self.values["operator"]["replicas"] = replicas
        release: JSON = self.helm.upgrade(CHART_DIR, self.release, self.values, namespace=self.namespace,
                                          timeout=timeout)
        return release

    def operator_pods(self) -> list[JSON]:
        selector = f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component=operator"
        got = json.loads(self.cluster.kubectl("get", "pods", "-n", self.namespace, "-l", selector, "-o",
                                              "json").stdout)
        items: list[JSON] = got["items"]
        return items

    def operator_ready(self, count: int = 1) -> bool:
        """``count`` operator pods are Ready (the kubelet's readiness probe got 200 from their /healthz). An
        operator pod that failed or restarted raises DemoError."""
        pods = self.operator_pods()
        for pod in pods:
            st = pod.get("status") or {}
            crashed = [c for c in st.get("containerStatuses") or [] if (c.get("lastState") or {}).get("terminated")]
            if st.get("phase") == "Failed" or crashed:
                raise DemoError(f"the operator pod failed; see: kubectl logs -n {self.namespace} "
                                f"{pod['metadata']['name']} --previous")
        ready = [p for p in pods if any(c.get("type") == "Ready" and c.get("status") == "True"
                                        for c in (p.get("status") or {}).get("conditions") or [])]
        return len(ready) >= count

    def operator_command(self) -> str:
        pods = self.operator_pods()
        if not pods:
            return ""
        container = pods[0]["spec"]["containers"][0]
        return " ".join([*container.get("command", []), *container.get("args", [])])

    def uninstall(self) -> None:
        """``helm uninstall``: the Deployment goes, and its pods with it (owner references)."""
        try:
            self.helm.uninstall(self.release, ignore_not_found=True, timeout=60)
        finally:
            self.helm.close()


@dataclass
class DemoResult:
    phase: str
    recoveries: list[Recovery] = field(default_factory=list)
    final_status: JSON = field(default_factory=dict)


class Demo:
    """Drives one demo run; every wait has a deadline, every started thing is stopped in :meth:`cleanup`."""

    def __init__(self, opts: DemoOptions, out: TextIO = sys.stdout) -> None:
        self.opts = opts
        self.out = out
        self.start = time.monotonic()
        self.cluster: Any = None
        self.install: Installation | None = None
        self.job_name = ""
        self._last_row = ""
        # Events read so far, by (pod, time, event): a killed pod's log is gone once the pod is.
        self._seen: dict[tuple[str, float, str], JSON] = {}

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {message}", file=self.out, flush=True)

    def deadline_left(self) -> float:
        left = self.opts.timeout - (time.monotonic() - self.start)
        if left <= 0:
            raise DemoError(f"the demo did not finish within {self.opts.timeout:g}s")
        return left

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
        """Poll ``check`` (printing the job's row when it changes) until it returns a truthy value."""
        deadline = time.monotonic() + min(timeout, self.deadline_left())
        while True:
            self.show_job()
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise DemoError(f"timed out waiting for {what}")
            time.sleep(interval)

    # -- steps ------------------------------------------------------------------------------------------------

    def run(self) -> DemoResult:
        from stalwart.local.cluster import LocalCluster

        for path in (CHART_DIR / "Chart.yaml", EXAMPLE):
            if not path.exists():
                raise DemoError(f"{path} is missing: run the demo from a checkout of the stalwart repository")
        self.say(f"starting the local cluster in {self.opts.directory}")
        self.cluster = LocalCluster.up(self.opts.directory, nodes=3, timeout=120.0)
        self.say(f"API {self.cluster.api_url}, etcd {self.cluster.etcd_endpoint}, nodes {self.cluster.nodes}")
        self.install = Installation(self.cluster)
        release = self.install.install_chart()
        self.say(f"helm install {RELEASE} helm/stalwart -n {OPERATOR_NAMESPACE}: {release['status']} "
                 f"(revision {release['revision']})")
        self.wait_for("the operator's health endpoint", self.install.operator_ready, 120)
        self.say(f"operator pod Ready (its readiness probe on /healthz passes): {self.install.operator_command()}")
        job = demo_job(yaml.safe_load(EXAMPLE.read_text()), self.opts)
        self.job_name = job["metadata"]["name"]
        self.say(f"kubectl apply -f {EXAMPLE.relative_to(REPO)}  (+ rank {self.opts.fail_rank} raises at step "
                 f"{self.opts.fail_at_step}; a worker pod is killed at step {self.opts.kill_at_step})")
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(job))
        header = self.cluster.kubectl("get", "tj", self.job_name, "-n", JOB_NAMESPACE).stdout.splitlines()[0]
        self.say("kubectl get tj (each row when it changes; STEP is status.progress.step)")
        print(f"{'':10}{header}  STEP", file=self.out, flush=True)
        self.wait_for("the job to run", lambda: self.phase() == "Running", 240)
        recoveries: list[Recovery] = []

        # Fault 1: the rank exception the job was told to inject.
        fault = self.wait_for("the injected rank exception", self.injected_fault, 240)
        self.say(f"rank {fault['rank']} raised at step {fault['step']} (pod {fault['pod']})")
        rec = self.wait_for("training to go on after the exception", lambda: recovery_after(
            self.events(), "a rank exception", float(fault["time"])), 120)
        self.say(f"training went on {rec.seconds:.2f}s after the exception (step {rec.resumed_at_step})")
        recoveries.append(rec)

        # Fault 2: a worker pod killed outright.
        self.wait_for(f"step {self.opts.kill_at_step}", lambda: latest_step(self.events()) >= self.opts.kill_at_step,
                      240, interval=0.2)
        victim = naming.worker_pod_name(self.job_name, 0)
        step_at_kill = latest_step(self.events())
        killed_at = time.time()
        self.cluster.kubectl("delete", "pod", victim, "-n", JOB_NAMESPACE, "--grace-period=0", "--force",
                             "--wait=false")
        self.say(f"killed worker pod {victim} at step {step_at_kill}")
        rec = self.wait_for("training to go on after the pod loss", lambda: self.recovered_from_kill(victim, killed_at),
                            180)
        self.say(f"training went on {rec.seconds:.2f}s after the pod was killed (step {rec.resumed_at_step})")
        recoveries.append(rec)

        phase = self.wait_for("the job to finish", lambda: self.phase() in {"Succeeded", "Failed"}
                              and self.phase(), 600)
        status = self.job().get("status") or {}
        self.say(f"job {self.job_name}: {phase}")
        print(self.cluster.kubectl("get", "tj", "-n", JOB_NAMESPACE).stdout, file=self.out, flush=True)
        return DemoResult(phase=str(phase), recoveries=recoveries, final_status=status)

    def recovered_from_kill(self, victim: str, killed_at: float) -> Recovery | None:
        events = self.events()
        rec = recovery_after(events, "a worker pod killed", killed_at)
        done = finished_by(events, killed_at)
        if rec is None and done is not None:
            # The job outran the demo's polling: waiting for a recovery that cannot come would only time out.
            raise DemoError(f"the job had finished (step {done}) when worker pod {victim} was killed: nothing to "
                            f"recover from; give it more steps than {self.opts.steps} or a kill_at_step earlier than "
                            f"{self.opts.kill_at_step}")
        return rec

    # -- observations -----------------------------------------------------------------------------------------

    def job(self) -> JSON:
        result = self.cluster.kubectl("get", "tj", self.job_name, "-n", JOB_NAMESPACE, "-o", "json", check=False)
        if result.returncode != 0:
            return {}
        got: JSON = json.loads(result.stdout)
        return got

    def phase(self) -> str:
        return str((self.job().get("status") or {}).get("phase", ""))

    def show_job(self) -> None:
        if not self.job_name:
            return
        got = self.cluster.kubectl("get", "tj", self.job_name, "-n", JOB_NAMESPACE, "--no-headers", check=False)
        if got.returncode != 0 or not got.stdout.strip():
            return
        # AGE changes every second; the row is shown when anything else does.
        columns = got.stdout.split()
        step = ((self.job().get("status") or {}).get("progress") or {}).get("step", "-")
        row = f"{' '.join(columns[:-1])} {step}"
        if row != self._last_row:
            self._last_row = row
            print(f"[{time.monotonic() - self.start:6.1f}s] {got.stdout.rstrip()}  {step}", file=self.out, flush=True)

    def pods(self) -> list[str]:
        result = self.cluster.kubectl("get", "pods", "-n", JOB_NAMESPACE, "-l", naming.selector(self.job_name),
                                      "-o", "name", check=False)
        return [line.removeprefix("pod/") for line in result.stdout.split()]

    def events(self) -> list[JSON]:
        for pod in self.pods():
            logs = self.cluster.kubectl("logs", pod, "-n", JOB_NAMESPACE, check=False).stdout
            for e in parse_events(logs, pod):
                self._seen[(pod, float(e["time"]), str(e["event"]))] = e
        return sorted(self._seen.values(), key=lambda e: float(e["time"]))

    def injected_fault(self) -> JSON | None:
        return next((e for e in self.events() if e["event"] == "fault"), None)

    # -- clean-up ---------------------------------------------------------------------------------------------

    def cleanup(self) -> None:
        if self.cluster is None:
            return
        if self.opts.keep:
            self.say(f"the cluster stays up (--keep): export KUBECONFIG={self.cluster.kubeconfig}; kubectl get tj")
            self.say(f"stop it with: stalwart local down --dir {self.opts.directory}")
            return
        self.say("cleaning up: delete the job, uninstall the chart, stop the cluster")
        with contextlib.suppress(Exception):
            if self.job_name:
                self.cluster.kubectl("delete", "tj", self.job_name, "-n", JOB_NAMESPACE, "--wait=false",
                                     check=False, timeout=30)
        if self.install is not None:
            with contextlib.suppress(Exception):
                self.install.uninstall()
        self.cluster.down()


def format_summary(result: DemoResult) -> str:
    lines = [f"result: {result.phase}"]
    restarts = result.final_status.get("restarts") or {}
    lines.append(f"restarts: {restarts.get('inProcess', 0)} in process, {restarts.get('podReplacements', 0)} "
                 "pod replacements")
    for r in result.recoveries:
        lines.append(f"recovery after {r.what}: {r.seconds:.2f}s (training went on at step {r.resumed_at_step})")
    return "\n".join(lines)


def run_demo(opts: DemoOptions, out: TextIO = sys.stdout) -> DemoResult:
    """Run the demo; always cleans up (unless ``opts.keep``), also on failure or interruption."""
    demo = Demo(opts, out)
    try:
        result = demo.run()
        print(format_summary(result), file=out, flush=True)
        return result
    finally:
        demo.cleanup()
