"""Operator benchmark: creating every pod of a 64-pod job, stalwart vs one-after-another creation.

On the local cluster (API emulator + process kubelet + real etcd), with the same 64 pod manifests:

* ``stalwart``: seconds from creating the TrainingJob to the 64th pod existing in the API (seen by a watch),
  with ``stalwart operator`` running as its own process (kopf, its pod index, the job record in etcd,
  concurrent creation);
* ``stalwart-create``: the operator's creation step alone, in the benchmark's process: the 64 ``create pod``
  calls issued through the operator's Kubernetes adapter (``asyncio.gather``, at most ``--concurrency`` in
  flight), directly comparable with the anchor;
* ``stalwart-operator-batch``: inside the operator process, the time of that reconcile's batch of creations
  (its ``stalwart_operator_pod_batch_seconds`` metric);
* ``sequential``: the anchor: the 64 pods created one after another with the kubernetes client, as a
  controller written the simple way would; seconds from the first call to the 64th pod seen by the watch.

Also the API calls of the operator: those of the first reconcile (Service, Secret, 64 pods, status, Events)
and the average per reconcile until every pod runs (later reconciles mostly make none). The calls of kopf
itself (its watch streams, finalizer patch) are not counted: they are the same for any kopf operator.

With ``--latency-ms`` (default 5), ``stalwart-create`` and ``sequential`` run again through a proxy that adds
that latency to every request: the emulator answers on loopback in about 3 ms of CPU, with nothing to
overlap, while a real API server's round trip (network, admission, an etcd write) is what concurrent creation
hides.

The pods run ``sleep`` without the agent (``agent_command=()``): 64 agents importing torch would measure the
machine, not the operator. Prints one JSON object per line. Usage:
``python bench/operator.py [--pods 64] [--concurrency 16] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kubernetes import client as k8s  # noqa: E402
from kubernetes import watch as k8s_watch  # noqa: E402

from stalwart.api.spec import TrainingJobSpec  # noqa: E402
from stalwart.local.cluster import LocalCluster  # noqa: E402
from stalwart.net import free_port  # noqa: E402
from stalwart.operator.handlers import kube_from_config  # noqa: E402
from stalwart.operator.manifests import pod_manifest  # noqa: E402

GROUP, VERSION, PLURAL = "stalwart.dev", "v1alpha1", "trainingjobs"
COMMAND = ["sleep", "900"]


def emit(impl: str, pods: int, metric: str, value: float, **extra: Any) -> None:
    print(json.dumps({"bench": "operator", "impl": impl, "pods": pods, "metric": metric,
                      "value": round(value, 4), **extra}), flush=True)


class PodCounter:
    """Watches a namespace's pods; ``wait(n)`` returns the monotonic time the n-th distinct pod was seen."""

    def __init__(self, api: k8s.ApiClient, namespace: str) -> None:
        self.core = k8s.CoreV1Api(api)
        self.ns = namespace
        self.seen: dict[str, float] = {}
        self.cond = threading.Condition()
        self.stop = False
        rv = self.core.list_namespaced_pod(namespace).metadata.resource_version
        self.watch = k8s_watch.Watch()
        self.thread = threading.Thread(target=self._run, args=(rv,), daemon=True)
        self.thread.start()

    def _run(self, rv: str) -> None:
        # The stream ends with an error when the namespace goes at the end of a run: nothing to report then.
        with contextlib.suppress(Exception):
            for event in self.watch.stream(self.core.list_namespaced_pod, self.ns, resource_version=rv,
                                           timeout_seconds=600):
                with self.cond:
                    self.seen.setdefault(event["object"].metadata.name, time.monotonic())
                    self.cond.notify_all()
                if self.stop:
                    break

    def wait(self, n: int, timeout: float = 300.0) -> float:
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.seen) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"only {len(self.seen)} of {n} pods appeared in {timeout:g}s")
                self.cond.wait(left)
            return sorted(self.seen.values())[n - 1]

    def close(self) -> None:
        self.stop = True
        self.watch.stop()


def job_body(name: str, pods: int) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"replicas": pods, "template": {"spec": {"containers": [
                {"name": "trainer", "image": "stalwart/trainer", "command": COMMAND}]}},
                "rendezvous": {"lastCallSeconds": 1}}}


def manifests(namespace: str, job: str, pods: int, endpoint: str) -> list[dict[str, Any]]:
    spec = TrainingJobSpec.model_validate(job_body(job, pods)["spec"])
    uid = str(uuid.uuid4())
    return [pod_manifest(job=job, namespace=namespace, uid=uid, spec=spec, name=f"{job}-worker-{i}",
                         role="worker", index=i, endpoints=[endpoint], agent_command=()) for i in range(pods)]


def clear_namespace(cluster: LocalCluster, namespace: str) -> None:
    """Delete the namespace and wait until it is gone, so the kubelet's clean-up of one run (64 processes to
    stop) does not overlap the next measurement. The operator of the run is stopped by now, so nothing would
    remove its finalizer from the TrainingJob: the benchmark removes it, or the namespace waits out the timeout."""
    jobs = cluster.kubectl("get", "trainingjobs", "-n", namespace, "-o", "name", check=False)
    for job in jobs.stdout.split():
        cluster.kubectl("patch", job, "-n", namespace, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                        check=False)
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=180s", "--ignore-not-found",
                    check=False, timeout=200)


def scrape(port: int) -> dict[str, float]:
    """The operator's Prometheus samples (name{labels} -> value) from its metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def api_calls(samples: dict[str, float]) -> dict[str, float]:
    """API calls by ``"verb resource"``."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        if key.startswith("stalwart_operator_api_calls_total{"):
            labels = dict(part.split("=", 1) for part in key.split("{", 1)[1].rstrip("}").split(","))
            out[f"{labels['verb'].strip(chr(34))} {labels['resource'].strip(chr(34))}"] = value
    return out


def start_operator(cluster: LocalCluster, namespace: str, concurrency: int) -> tuple[subprocess.Popen[bytes], int]:
    """``stalwart operator`` as its own process (as in a cluster), serving one namespace; returns it and its
    metrics port once its health endpoint answers."""
    health, metrics = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", "--log-level", "WARNING", "operator", "--standalone",
         "--namespace", namespace, "--kubeconfig", str(cluster.kubeconfig), "--etcd-endpoints",
         str(cluster.etcd_endpoint), "--health-host", "127.0.0.1", "--health-port", str(health),
         "--metrics-port", str(metrics), "--concurrency", str(concurrency), "--agent-command", ""],
        stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz",
                                                                  timeout=2) as r:
            if r.status == 200:
                # kopf answers before its watches run; give them a moment to start.
                time.sleep(2.0)
                return proc, metrics
        if proc.poll() is not None:
            raise RuntimeError(f"the operator exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the operator did not become healthy within 120s")


def run_stalwart(cluster: LocalCluster, api: k8s.ApiClient, pods: int, concurrency: int) -> dict[str, Any]:
    ns = f"bench-op-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    proc, metrics_port = start_operator(cluster, ns, concurrency)
    counter = PodCounter(api, ns)
    try:
        before = scrape(metrics_port)
        custom = k8s.CustomObjectsApi(api)
        t0 = time.monotonic()
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job_body("bench", pods))
        t_all = counter.wait(pods)
        mid = scrape(metrics_port)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            st = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "bench").get("status") or {}
            if (st.get("readyReplicas") or 0) >= pods:
                break
            time.sleep(0.5)
        time.sleep(2.0)  # let the last status patch land
        after = scrape(metrics_port)
    finally:
        counter.close()
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()
        clear_namespace(cluster, ns)
    reconciles_key = "stalwart_operator_reconcile_seconds_count"
    calls_before, calls_mid, calls_after = api_calls(before), api_calls(mid), api_calls(after)
    by_kind = {k: v - calls_before.get(k, 0.0) for k, v in sorted(calls_after.items())}
    batch_sum = "stalwart_operator_pod_batch_seconds_sum"
    return {"seconds": t_all - t0,
            "batch_seconds": mid.get(batch_sum, 0.0) - before.get(batch_sum, 0.0),
            "first_calls": sum(calls_mid.values()) - sum(calls_before.values()),
            "calls": sum(by_kind.values()),
            "reconciles": after.get(reconciles_key, 0.0) - before.get(reconciles_key, 0.0),
            "by_kind": by_kind}


def run_create_only(cluster: LocalCluster, api: k8s.ApiClient, pods: int, concurrency: int,
                    kubeconfig: str) -> float:
    """The operator's creation step alone, in this process: its Kubernetes adapter creating the pods through
    ``kubeconfig`` (the cluster's, or the delaying proxy's)."""
    ns = f"bench-cr-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    counter = PodCounter(api, ns)
    kube = kube_from_config(kubeconfig, concurrency)
    try:
        bodies = manifests(ns, "bench", pods, str(cluster.etcd_endpoint))

        async def create_all() -> float:
            start = time.monotonic()
            await asyncio.gather(*(kube.create_pod(ns, b) for b in bodies))
            return start

        t0 = asyncio.run(create_all())
        return counter.wait(pods) - t0
    finally:
        kube.close()
        counter.close()
        clear_namespace(cluster, ns)


def run_sequential(cluster: LocalCluster, api: k8s.ApiClient, pods: int, kubeconfig: str) -> float:
    """The anchor: one create after another with the kubernetes client, through ``kubeconfig``."""
    ns = f"bench-seq-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    counter = PodCounter(api, ns)
    from kubernetes import config as kconfig

    cfg = k8s.Configuration()
    kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    client = k8s.ApiClient(cfg)
    try:
        core = k8s.CoreV1Api(client)
        bodies = manifests(ns, "bench", pods, str(cluster.etcd_endpoint))
        t0 = time.monotonic()
        for body in bodies:
            core.create_namespaced_pod(ns, body)
        return counter.wait(pods) - t0
    finally:
        client.close()
        counter.close()
        clear_namespace(cluster, ns)


class DelayProxy:
    """A TCP proxy in front of the API emulator that holds every client-to-server chunk for ``delay``
    seconds: the network and API-server latency a real cluster has and a loopback emulator does not (fault
    injection on top of the real emulator; both sides of the comparison go through it)."""

    def __init__(self, upstream: str, delay: float) -> None:
        host, _, port = upstream.removeprefix("https://").removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.delay = delay
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    if delay:
                        await asyncio.sleep(delay)
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, self.delay), pipe(up_reader, writer, 0.0))

    def kubeconfig(self, original: Path, directory: Path) -> str:
        """A copy of ``original`` that points at the proxy."""
        text = original.read_text().replace(f"{self.upstream[0]}:{self.upstream[1]}", f"127.0.0.1:{self.port}")
        path = directory / "kubeconfig-delayed"
        path.write_text(text)
        return str(path)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=5.0,
                        help="also compare through a proxy adding this request latency (0: skip)")
    args = parser.parse_args(argv)
    from kubernetes import config as kconfig

    with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        cluster = LocalCluster.up(Path(tmp) / "cluster", nodes=3, timeout=120.0)
        try:
            cluster.kubectl("apply", "-f", str(ROOT / "crds" / "trainingjob.yaml"))
            cfg = k8s.Configuration()
            kconfig.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
            api = k8s.ApiClient(cfg)
            ours: list[dict[str, Any]] = []
            direct: list[float] = []
            seq: list[float] = []
            for i in range(args.repeat):
                # Alternate the order so that neither side always runs on a machine warmed by the other.
                kc = str(cluster.kubeconfig)
                if i % 2:
                    seq.append(run_sequential(cluster, api, args.pods, kc))
                    direct.append(run_create_only(cluster, api, args.pods, args.concurrency, kc))
                else:
                    direct.append(run_create_only(cluster, api, args.pods, args.concurrency, kc))
                    seq.append(run_sequential(cluster, api, args.pods, kc))
                ours.append(run_stalwart(cluster, api, args.pods, args.concurrency))
            s = statistics.median(r["seconds"] for r in ours)
            c = statistics.median(direct)
            q = statistics.median(seq)
            emit("stalwart", args.pods, "seconds", s, concurrency=args.concurrency, runs=args.repeat,
                 measured="TrainingJob created -> last pod in the API")
            emit("stalwart-operator-batch", args.pods, "seconds",
                 statistics.median(r["batch_seconds"] for r in ours), concurrency=args.concurrency,
                 runs=args.repeat, measured="inside the operator process: its batch of 64 creates, first call "
                 "-> last reply (metric stalwart_operator_pod_batch_seconds)")
            emit("stalwart-create", args.pods, "seconds", c, concurrency=args.concurrency, runs=args.repeat,
                 measured="first create call -> last pod in the API")
            emit("sequential", args.pods, "seconds", q, runs=args.repeat,
                 measured="first create call -> last pod in the API")
            emit("stalwart-create/sequential", args.pods, "ratio", c / q)
            emit("stalwart/sequential", args.pods, "ratio", s / q)
            last = ours[-1]
            emit("stalwart", args.pods, "api_calls_first_reconcile", last["first_calls"],
                 note="Service, Secret, pods, status patch, Events")
            emit("stalwart", args.pods, "api_calls_per_reconcile",
                 last["calls"] / max(1.0, last["reconciles"]), reconciles=last["reconciles"],
                 calls=last["calls"], by_kind=last["by_kind"], until="every pod ready")
            emit("sequential", args.pods, "api_calls", args.pods, note="one create per pod")
            if args.latency_ms > 0:
                proxy = DelayProxy(cluster.api_url, args.latency_ms / 1000)
                try:
                    kc = proxy.kubeconfig(Path(cluster.kubeconfig), Path(tmp))
                    dl = [run_create_only(cluster, api, args.pods, args.concurrency, kc) for _ in range(args.repeat)]
                    sl = [run_sequential(cluster, api, args.pods, kc) for _ in range(args.repeat)]
                finally:
                    proxy.close()
                d, q2 = statistics.median(dl), statistics.median(sl)
                emit("stalwart-create", args.pods, "seconds", d, concurrency=args.concurrency, runs=args.repeat,
                     latency_ms=args.latency_ms)
                emit("sequential", args.pods, "seconds", q2, runs=args.repeat, latency_ms=args.latency_ms)
                emit("stalwart-create/sequential", args.pods, "ratio", d / q2, latency_ms=args.latency_ms)
            api.close()
        finally:
            cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
