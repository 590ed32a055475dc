"""Node loss on the local cluster, as a real cluster shows it, through the real kubernetes client and kubectl:
Ready turns Unknown after the node-monitor grace period (3 s in the session cluster), the node is tainted
unreachable, its pods stay Running with Ready=False, they are evicted only after their tolerationSeconds (300 s
by default, from the DefaultTolerationSeconds admission) and then stay Terminating until force-deleted; a
partitioned node's processes are paused, not killed, and act again when the node comes back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from local_helpers import wait_until

from stalwart.local.cluster import LocalCluster
from stalwart.local.processes import ended
from stalwart.procfs import process_state

pytestmark = pytest.mark.integration
UNREACHABLE = "node.kubernetes.io/unreachable"


def pod_body(name: str, node: str, script: str, *, restart: str = "Always", tolerations: list[Any] | None = None,
             grace: int = 30) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": node, "restartPolicy": restart, "terminationGracePeriodSeconds": grace,
                            "containers": [{"name": "main", "image": "local/python",
                                            "command": ["python3", "-c", script]}]}
    if tolerations is not None:
        spec["tolerations"] = tolerations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def condition(obj: Any, type_: str) -> Any:
    return next((c for c in obj.status.conditions or [] if c.type == type_), None)


def pid_of(pod: Any) -> int:
    return int(pod.status.container_statuses[0].container_id.split("//")[1])


def gone(core: Any, ns: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, ns)
    except k8s.ApiException as e:
        return e.status == 404
    return False


def running(core: Any, ns: str, name: str) -> Any:
    pod = core.read_namespaced_pod(name, ns)
    return pod if pod.status.phase == "Running" and pod.status.container_statuses else None


def unreachable(core: Any, node: str) -> Any:
    obj = core.read_node(node)
    ready = condition(obj, "Ready")
    return obj if ready is not None and ready.status == "Unknown" else None


SLEEPER = "import time\nprint('up', flush=True)\nwhile True: time.sleep(0.1)\n"


def test_a_lost_node_turns_unknown_and_its_pods_stay_running_until_evicted(
        local_cluster: LocalCluster, kube_api: Any, k8s_namespace: str) -> None:
    core, ns = k8s.CoreV1Api(kube_api), k8s_namespace
    victim, survivor = local_cluster.nodes[1], local_cluster.nodes[0]
    quick = [{"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 1}]
    core.create_namespaced_pod(ns, pod_body("stays", victim, SLEEPER))
    core.create_namespaced_pod(ns, pod_body("once", victim, SLEEPER, restart="Never"))
    created = core.create_namespaced_pod(ns, pod_body("quick", victim, SLEEPER, tolerations=quick))
    core.create_namespaced_pod(ns, pod_body("elsewhere", survivor, SLEEPER))
    # DefaultTolerationSeconds: 300 s for both taints, unless the pod tolerates the taint itself.
    stays = wait_until(lambda: running(core, ns, "stays"), "stays to run")
    assert {(t.key, t.effect, t.toleration_seconds) for t in stays.spec.tolerations} == {
        ("node.kubernetes.io/not-ready", "NoExecute", 300), (UNREACHABLE, "NoExecute", 300)}
    assert {(t.key, t.toleration_seconds) for t in created.spec.tolerations} == {
        (UNREACHABLE, 1), ("node.kubernetes.io/not-ready", 300)}
    pids = {name: pid_of(wait_until(lambda name=name: running(core, ns, name), name))
            for name in ("stays", "once", "quick")}
    try:
        assert sorted(local_cluster.lose_node(victim)) == sorted(f"{ns}/{n}" for n in ("once", "quick", "stays"))
        # The node's processes are gone at once; the API learns of the loss only from the missing heartbeats.
        assert all(ended(pid) for pid in pids.values())
        node = wait_until(lambda: unreachable(core, victim), "the node's Ready to turn Unknown", timeout=30)
        ready = condition(node, "Ready")
        assert (ready.reason, ready.message) == ("NodeStatusUnknown", "Kubelet stopped posting node status.")
        taints = {(t.key, t.effect): t for t in node.spec.taints}
        assert set(taints) == {(UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")}
        assert taints[(UNREACHABLE, "NoExecute")].time_added is not None
        assert "NotReady" in local_cluster.kubectl("get", "node", victim).stdout

        # Its pods stay Running with Ready=False ...
        stays = wait_until(lambda: (p := core.read_namespaced_pod("stays", ns)) and condition(
            p, "Ready").status == "False" and p, "stays to be marked not ready")
        assert stays.status.phase == "Running" and stays.metadata.deletion_timestamp is None
        events = core.list_namespaced_event(ns, field_selector="involvedObject.name=stays").items
        assert "NodeNotReady" in {e.reason for e in events}
        # ... until their tolerationSeconds pass: then they are evicted and stay Terminating.
        quick_pod = wait_until(lambda: (p := core.read_namespaced_pod("quick", ns)).metadata.deletion_timestamp
                               and p, "quick to be evicted", timeout=30)
        target = condition(quick_pod, "DisruptionTarget")
        assert (target.status, target.reason) == ("True", "DeletionByTaintManager")
        assert "Terminating" in local_cluster.kubectl("get", "pod", "quick", "-n", ns).stdout
        events = core.list_namespaced_event(ns, field_selector="involvedObject.name=quick").items
        assert "TaintManagerEviction" in {e.reason for e in events}
        # "stays" tolerates the taint for 300 s: when "quick" was evicted, it was not.
        assert core.read_namespaced_pod("stays", ns).metadata.deletion_timestamp is None
        # Nobody confirms a graceful deletion on a lost node: "quick" is still there, until force-deleted.
        local_cluster.kubectl("delete", "pod", "quick", "-n", ns, "--wait=false")
        assert core.read_namespaced_pod("quick", ns).metadata.deletion_timestamp is not None
        local_cluster.kubectl("delete", "pod", "quick", "-n", ns, "--grace-period=0", "--force")
        assert gone(core, ns, "quick")
        # Nothing new is scheduled there meanwhile.
        core.create_namespaced_pod(ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "new"},
                                        "spec": {"containers": [{"name": "main", "image": "local/python",
                                                                 "command": ["python3", "-c", SLEEPER]}]}})
        assert wait_until(lambda: running(core, ns, "new"), "new to run").spec.node_name != victim
        assert core.read_namespaced_pod("elsewhere", ns).status.phase == "Running"
    finally:
        local_cluster.restore_node(victim)
    # Back, and already Ready and untainted when restore_node returns (a pod created next is scheduled as on a
    # healthy cluster); a fresh kubelet restarts the containers that died with the node, and fails a pod whose
    # restartPolicy is Never.
    back = core.read_node(victim)
    assert condition(back, "Ready").status == "True" and not back.spec.taints
    stays = wait_until(lambda: (p := running(core, ns, "stays")) and condition(p, "Ready").status == "True"
                       and p, "stays to run again")
    status = stays.status.container_statuses[0]
    assert status.restart_count == 1 and status.last_state.terminated.reason == "ContainerStatusUnknown"
    once = wait_until(lambda: (p := core.read_namespaced_pod("once", ns)).status.phase == "Failed" and p,
                      "once to fail")
    assert once.status.container_statuses[0].state.terminated.reason == "ContainerStatusUnknown"


def test_a_partitioned_node_pauses_its_processes_and_they_act_again_when_it_returns(
        local_cluster: LocalCluster, kube_api: Any, k8s_namespace: str, tmp_path: Path) -> None:
    core, ns = k8s.CoreV1Api(kube_api), k8s_namespace
    victim = local_cluster.nodes[2]
    # Each pod counts its ticks into a file and notes the SIGTERM it gets. The count is replaced whole (a pause
    # between truncating and writing the file would leave it empty).
    script = ("import pathlib, signal, sys, time\n"
              f"out = pathlib.Path({str(tmp_path)!r}) / sys.argv[1]\n"
              "tmp = out.parent / (out.name + '.tmp')\n"
              "def term(*_):\n    (out.parent / (out.name + '.term')).write_text('yes'); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, term)\nn = 0\n"
              "while True:\n    n += 1; tmp.write_text(str(n)); tmp.replace(out); time.sleep(0.05)\n")
    for name in ("zombie", "graceful"):
        body = pod_body(name, victim, script)
        body["spec"]["containers"][0]["command"] += [name]
        core.create_namespaced_pod(ns, body)
    pids = {name: pid_of(wait_until(lambda name=name: running(core, ns, name), name))
            for name in ("zombie", "graceful")}
    # Both must tick before the partition: a process paused before it set its SIGTERM handler would die of the
    # kubelet's SIGTERM after the resume (exit 143) instead of noting it.
    for name in ("zombie", "graceful"):
        wait_until(lambda name=name: (tmp_path / name).exists() and int((tmp_path / name).read_text() or 0) > 0,
                   f"{name} to tick")
    ticks = tmp_path / "zombie"
    try:
        local_cluster.lose_node(victim, partition=True)
        assert {process_state(pid) for pid in pids.values()} == {"T"}  # paused, not killed
        before = int(ticks.read_text())
        wait_until(lambda: unreachable(core, victim), "the node's Ready to turn Unknown", timeout=30)
        assert int(ticks.read_text()) == before
        # Deleted while cut off: one force-deleted (gone from the API at once), one gracefully (Terminating:
        # no kubelet can confirm it). Both processes live on, paused.
        local_cluster.kubectl("delete", "pod", "zombie", "-n", ns, "--grace-period=0", "--force")
        local_cluster.kubectl("delete", "pod", "graceful", "-n", ns, "--grace-period=60", "--wait=false")
        assert gone(core, ns, "zombie")
        assert core.read_namespaced_pod("graceful", ns).metadata.deletion_timestamp is not None
        assert {process_state(pid) for pid in pids.values()} == {"T"}
        assert not (tmp_path / "zombie.term").exists()
    finally:
        local_cluster.restore_node(victim)
    back = core.read_node(victim)
    assert condition(back, "Ready").status == "True" and not back.spec.taints  # at once, as after a loss
    # Resumed (the handlers below run in them), then stopped by the returning kubelet: SIGTERM first, for the
    # pod the API no longer has as for the one being deleted; then the graceful one leaves the API.
    wait_until(lambda: (tmp_path / "zombie.term").exists() and (tmp_path / "graceful.term").exists(),
               "both processes to get SIGTERM after the resume", timeout=30)
    wait_until(lambda: all(ended(pid) for pid in pids.values()), "both processes to end")
    wait_until(lambda: gone(core, ns, "graceful"), "the graceful deletion to complete")


def test_lose_and_restore_node_from_the_command_line(local_cluster: LocalCluster, tmp_path: Path) -> None:
    import subprocess
    import sys

    run = [sys.executable, "-m", "stalwart", "local"]
    node = local_cluster.nodes[0]
    missing = subprocess.run([*run, "lose-node", "--dir", str(local_cluster.dir), "no-such-node"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode == 1 and "no node 'no-such-node'" in missing.stderr and missing.stdout == ""
    lose = subprocess.run([*run, "lose-node", "--dir", str(local_cluster.dir), "--partition", node],
                          capture_output=True, text=True, timeout=60, check=False)
    try:
        assert lose.returncode == 0 and "partitioned" in lose.stdout, lose.stdout + lose.stderr
        states = {n["name"]: n["state"] for n in local_cluster.status()["nodes"]}
        assert states[node] == "partitioned"
    finally:
        back = subprocess.run([*run, "restore-node", "--dir", str(local_cluster.dir), node],
                              capture_output=True, text=True, timeout=60, check=False)
    assert back.returncode == 0, back.stdout + back.stderr
    assert {n["name"]: n["state"] for n in local_cluster.status()["nodes"]}[node] == "up"


def test_a_pod_bound_to_a_node_that_does_not_exist_is_collected(local_cluster: LocalCluster, kube_api: Any,
                                                                  k8s_namespace: str) -> None:
    core, ns = k8s.CoreV1Api(kube_api), k8s_namespace
    core.create_namespaced_pod(ns, pod_body("ghost", "no-such-node", SLEEPER))
    assert core.read_namespaced_pod("ghost", ns).status.phase in (None, "Pending")
    # Deleting it alone would leave it Terminating for ever (nobody runs it); the pod GC removes it.
    local_cluster.kubectl("delete", "pod", "ghost", "-n", ns, "--wait=false")
    assert core.read_namespaced_pod("ghost", ns).metadata.deletion_timestamp is not None
    wait_until(lambda: gone(core, ns, "ghost"), "the pod GC to remove it", timeout=30)
