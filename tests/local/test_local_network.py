"""The local cluster's network per node (issue 32): each node a network namespace on a bridge, pods with their
own IPs in them, and network faults (``partition``/``heal``) that cut what they say while the processes run on.

The tests of the network per node need root (they make network namespaces); each says so when skipped. The
loopback mode's are run by forcing it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from local_helpers import get_json, phase_is, wait_until

from stalwart.local.cluster import ClusterError, LocalCluster
from stalwart.local.controlplane import make_network
from stalwart.local.netns import left_behind, missing_rights
from stalwart.local.netplan import MTU, NetworkPlan
from stalwart.local.processes import ended
from stalwart.local.settings import LocalClusterSettings
from stalwart.procfs import process_state

NEEDS_ROOT = pytest.mark.skipif(missing_rights() is not None,
                                reason=f"needs root to make network namespaces: {missing_rights()}")
#: The port each test pod's dialer listens on.
DIAL_PORT = 8000
#: A pod that dials for the test: each connection to it names ``host:port``; it answers ``ok`` when a TCP connect
#: from the pod to there succeeds within 1 s, else ``fail <why>``. A connection that names nothing (a peer's dial)
#: is just closed.
DIALER = f"""
import os, socket
server = socket.create_server((os.environ["POD_IP"], {DIAL_PORT}))
while True:
    conn, _ = server.accept()
    with conn:
        conn.settimeout(5.0)
        try:
            target = conn.recv(200).decode().strip()
        except OSError:
            continue
        if not target:
            continue
        host, _, port = target.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            conn.sendall(b"ok")
        except OSError as exc:
            conn.sendall(f"fail {{exc}}".encode())
"""


def dialer_pod(name: str, node: str) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "nodeName": node, "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "dial", "image": "python", "command": [sys.executable, "-c", DIALER],
                        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                        "readinessProbe": {"tcpSocket": {"port": DIAL_PORT}, "periodSeconds": 1}}]}})


def dial(pod_ip: str, target: str) -> str:
    """Ask the dialer at ``pod_ip`` to connect to ``target``; its answer."""
    with socket.create_connection((pod_ip, DIAL_PORT), timeout=5.0) as conn:
        conn.settimeout(10.0)
        conn.sendall(target.encode())
        return conn.recv(500).decode()


def reaches(pod_ip: str, target: str) -> bool:
    return dial(pod_ip, target) == "ok"


def ready_pod(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pod = phase_is(cluster, ns, name, "Running")
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
        return pod if statuses and statuses[0].get("ready") else None

    return wait_until(ready, f"pod {name} to be ready", timeout=60)


def main_pid(pod: dict[str, Any]) -> int:
    return int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))


def ready_condition(cluster: LocalCluster, node: str) -> str:
    conditions = get_json(cluster, "node", node)["status"]["conditions"]
    return str(next(c["status"] for c in conditions if c["type"] == "Ready"))


@pytest.fixture
def netns_cluster(local_cluster: LocalCluster) -> LocalCluster:
    if local_cluster.network.get("mode") != "netns":
        pytest.skip(f"the session cluster runs in loopback mode: {local_cluster.network.get('reason')}")
    return local_cluster


@pytest.fixture
def pods(netns_cluster: LocalCluster, k8s_namespace: str) -> Iterator[dict[str, dict[str, Any]]]:
    """Dialer pods a (local-1), b (local-2), c (local-1), ready; every cut healed afterwards."""
    ns = k8s_namespace
    for name, node in (("a", "local-1"), ("b", "local-2"), ("c", "local-1")):
        netns_cluster.kubectl("-n", ns, "apply", "-f", "-", input=dialer_pod(name, node))
    try:
        yield {name: ready_pod(netns_cluster, ns, name) for name in ("a", "b", "c")}
    finally:
        for node in netns_cluster.nodes:
            try:
                netns_cluster.heal(node)
            except ClusterError as exc:
                assert "is not partitioned" in str(exc)
        netns_cluster.kubectl("-n", ns, "delete", "pod", "--all", "--wait=true", "--timeout=60s", check=False)


@NEEDS_ROOT
def test_a_pod_has_its_own_ip_on_its_node_and_reaches_the_api_server_etcd_and_other_nodes_pods(
        netns_cluster: LocalCluster, pods: dict[str, dict[str, Any]]) -> None:
    c = netns_cluster
    net = c.network
    a, b = (pods[n]["status"] for n in ("a", "b"))
    assert a["podIP"].startswith(".".join(net["api_ip"].split(".")[:2]) + ".2.")  # local-1's /24
    assert b["podIP"].startswith(".".join(net["api_ip"].split(".")[:2]) + ".3.")
    assert a["hostIP"] == a["podIP"].rsplit(".", 1)[0] + ".1"
    internal = {n: next(x["address"] for x in get_json(c, "node", n)["status"]["addresses"]
                        if x["type"] == "InternalIP") for n in c.nodes}
    assert internal["local-1"] == a["hostIP"] and len(set(internal.values())) == len(c.nodes)
    api = c.api_url.removeprefix("https://")
    assert api.startswith(net["api_ip"] + ":") and str(c.etcd_endpoint).startswith(net["etcd_ip"] + ":")
    assert reaches(a["podIP"], api) and reaches(a["podIP"], str(c.etcd_endpoint))
    assert reaches(a["podIP"], f"{b['podIP']}:{DIAL_PORT}") and reaches(b["podIP"], f"{a['podIP']}:{DIAL_PORT}")
    # The pod's processes are in local-1's network namespace, under the pod's hostname.
    pid = main_pid(pods["a"])
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink(f"/proc/{main_pid(pods['c'])}/ns/net")
    assert os.readlink(f"/proc/{pid}/ns/uts") != os.readlink("/proc/self/ns/uts")
    # gloo binds what the hostname resolves to: the pod's IP, which its peers reach.
    resolved = subprocess.run(["nsenter", f"--target={pid}", "--uts", "--mount", "--net", sys.executable, "-c",
                               "import socket; h = socket.gethostname(); print(h, socket.gethostbyname(h))"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.split()
    assert resolved == ["a", a["podIP"]]
    # A connection the pod makes leaves from its node's primary address, not its pod IP (the node's namespace
    # holds both): what the accepting end sees, and what the operator reads as the pod (culprits.at_address).
    with socket.create_server((net["api_ip"], 0)) as server:
        server.settimeout(30.0)
        port = server.getsockname()[1]
        dialer = subprocess.Popen(["nsenter", f"--target={pid}", "--net", sys.executable, "-c",
                                   f"import socket; socket.create_connection(({net['api_ip']!r}, {port}), 10).recv(1)"])
        try:
            conn, (seen, _) = server.accept()
            conn.close()
        finally:
            assert dialer.wait(timeout=30) == 0
    assert seen == a["hostIP"] != a["podIP"]


@NEEDS_ROOT
def test_a_cut_from_etcd_loses_etcd_and_keeps_peers_and_heal_restores(
        netns_cluster: LocalCluster, pods: dict[str, dict[str, Any]]) -> None:
    c = netns_cluster
    a, b = (pods[n]["status"]["podIP"] for n in ("a", "b"))
    etcd, api = str(c.etcd_endpoint), c.api_url.removeprefix("https://")
    assert sorted(c.partition("local-1", ["etcd"])) == sorted(f"{pods['a']['metadata']['namespace']}/{n}"
                                                              for n in ("a", "c"))
    assert dial(a, etcd).startswith("fail timed out")  # lost, not refused: as on a cut link
    assert reaches(a, f"{b}:{DIAL_PORT}") and reaches(b, f"{a}:{DIAL_PORT}") and reaches(a, api)
    assert reaches(b, etcd)  # the other nodes keep etcd
    assert c.heal("local-1") == "etcd"
    assert reaches(a, etcd)


@NEEDS_ROOT
def test_a_cut_from_one_peer_is_cut_on_both_sides(netns_cluster: LocalCluster,
                                                   pods: dict[str, dict[str, Any]]) -> None:
    c = netns_cluster
    a, b = (pods[n]["status"]["podIP"] for n in ("a", "b"))
    c.partition("local-2", ["local-1"])
    assert not reaches(a, f"{b}:{DIAL_PORT}") and not reaches(b, f"{a}:{DIAL_PORT}")
    assert reaches(a, str(c.etcd_endpoint)) and reaches(b, str(c.etcd_endpoint))
    c.heal("local-2")
    assert reaches(a, f"{b}:{DIAL_PORT}") and reaches(b, f"{a}:{DIAL_PORT}")


@NEEDS_ROOT
def test_a_full_cut_loses_everything_and_its_processes_run_on(netns_cluster: LocalCluster,
                                                              pods: dict[str, dict[str, Any]]) -> None:
    c = netns_cluster
    a, b = (pods[n]["status"]["podIP"] for n in ("a", "b"))
    pid = main_pid(pods["a"])
    c.partition("local-1")
    assert not reaches(b, f"{a}:{DIAL_PORT}")
    with pytest.raises(TimeoutError):  # not even this machine reaches it
        socket.create_connection((a, DIAL_PORT), timeout=1.0)
    assert not ended(pid) and process_state(pid) not in ("T", "t")  # running, not paused
    c.heal("local-1")
    assert reaches(a, str(c.etcd_endpoint)) and reaches(a, c.api_url.removeprefix("https://"))
    assert reaches(b, f"{a}:{DIAL_PORT}") and reaches(a, f"{b}:{DIAL_PORT}")


@NEEDS_ROOT
def test_a_node_cut_from_the_api_server_turns_unknown_while_its_containers_run_on(
        netns_cluster: LocalCluster, pods: dict[str, dict[str, Any]]) -> None:
    c = netns_cluster
    a = pods["a"]["status"]["podIP"]
    pid = main_pid(pods["a"])
    c.partition("local-1", ["api"])
    wait_until(lambda: ready_condition(c, "local-1") == "Unknown", "local-1's Ready to turn Unknown", timeout=30)
    node = get_json(c, "node", "local-1")
    assert {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"} in [
        {k: t[k] for k in ("key", "effect")} for t in node["spec"].get("taints") or []]
    assert not ended(pid) and reaches(a, str(c.etcd_endpoint))  # it runs on, and still reaches etcd
    assert not reaches(a, c.api_url.removeprefix("https://"))
    statuses = {s["name"]: s for s in c.status()["nodes"]}
    assert statuses["local-1"] == {"name": "local-1", "state": "cut", "cut_from": "api"}
    c.heal("local-1")
    assert ready_condition(c, "local-1") == "True"
    assert main_pid(get_json(c, "-n", pods["a"]["metadata"]["namespace"], "pod", "a")) == pid


@NEEDS_ROOT
def test_bad_partitions_name_what_is_wrong_and_change_nothing(netns_cluster: LocalCluster,
                                                              pods: dict[str, dict[str, Any]]) -> None:
    c = netns_cluster
    a, b = (pods[n]["status"]["podIP"] for n in ("a", "b"))
    with pytest.raises(ClusterError, match=r"node: no node 'local-9'; nodes are \['local-0', 'local-1', 'local-2'\]"):
        c.partition("local-9")
    with pytest.raises(ClusterError, match=r"--from: 'bogus' is not api, etcd or a node"):
        c.partition("local-1", ["etcd", "bogus"])
    with pytest.raises(ClusterError, match=r"node 'local-1' is not partitioned \(cut nodes: none\)"):
        c.heal("local-1")
    with pytest.raises(ClusterError, match=r"no node 'local-9'"):
        c.heal("local-9")
    # From the command line: exit 1, the reason on stderr, nothing on stdout.
    run = [sys.executable, "-m", "stalwart", "local"]
    for args, said in ((["partition", "local-9"], "node: no node 'local-9'"),
                       (["partition", "local-1", "--from", "etcd,bogus"], "--from: 'bogus' is not api, etcd or a node"),
                       (["heal", "local-1"], "node 'local-1' is not partitioned")):
        res = subprocess.run([*run, args[0], "--dir", str(c.dir), *args[1:]], capture_output=True, text=True,
                             timeout=60, check=False)
        assert (res.returncode, res.stdout) == (1, "") and said in res.stderr, (args, res.stdout, res.stderr)
    assert all("cut_from" not in n and n["state"] == "up" for n in c.status()["nodes"])
    assert reaches(a, str(c.etcd_endpoint)) and reaches(a, f"{b}:{DIAL_PORT}")


def _mtu(link: str, netns: str | None = None) -> int:
    cmd = ["ip", *(["-n", netns] if netns else []), "-j", "link", "show", link]
    return int(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout)[0]["mtu"])


def _netns(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / "state.json").read_text())["network"])


@NEEDS_ROOT
def test_up_makes_a_namespace_per_node_and_down_leaves_nothing_behind(tmp_path: Path) -> None:
    cluster = LocalCluster.up(tmp_path / "c", nodes=2, etcd=False, owner_pid=os.getpid(),
                              settings=LocalClusterSettings(network="netns"))
    try:
        net = _netns(cluster.dir)
        plan = NetworkPlan(int(net["api_ip"].split(".")[1]), tuple(cluster.nodes))
        assert sorted(left_behind(plan)) == sorted(
            [f"netns {plan.netns(n)}" for n in cluster.nodes] + [f"link {plan.host_veth(n)}" for n in cluster.nodes]
            + [f"link {plan.bridge}", f"address {plan.bridge_ip}", f"address {plan.api_ip}", f"address {plan.etcd_ip}"])
        # Every link of the path between two nodes at the MTU of loopback's class, not Ethernet's 1500.
        links = [plan.bridge, *(plan.host_veth(n) for n in cluster.nodes)]
        mtus = [_mtu(link) for link in links] + [_mtu("eth0", plan.netns(n)) for n in cluster.nodes]
        assert mtus == [MTU] * (len(links) + len(cluster.nodes))
    finally:
        cluster.down()
    assert left_behind(plan) == []
    assert not (cluster.dir / "network.json").exists()


@NEEDS_ROOT
def test_down_removes_the_network_of_a_killed_control_plane(tmp_path: Path) -> None:
    cluster = LocalCluster.up(tmp_path / "c", nodes=1, etcd=False, owner_pid=os.getpid(),
                              settings=LocalClusterSettings(network="netns"))
    plan = NetworkPlan(int(_netns(cluster.dir)["api_ip"].split(".")[1]), tuple(cluster.nodes))
    os.kill(cluster.pid, 9)
    wait_until(lambda: ended(cluster.pid), "the killed control plane to end", timeout=10)
    assert left_behind(plan)  # a killed control plane removes nothing ...
    cluster.down()
    assert left_behind(plan) == []  # ... down does


def test_loopback_mode_when_asked(tmp_path: Path) -> None:
    cluster = LocalCluster.up(tmp_path / "c", nodes=1, etcd=False, owner_pid=os.getpid(),
                              settings=LocalClusterSettings(network="loopback"))
    try:
        assert cluster.network == {"mode": "loopback", "reason": "asked for (network: loopback)"}
        assert cluster.api_url.startswith("https://127.0.0.1:")
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "once"}, "spec": {
            "nodeName": "local-0", "restartPolicy": "Never", "containers": [{
                "name": "c", "image": "python", "command": [sys.executable, "-c", "import os; print(os.environ['IP'])"],
                "env": [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}]}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
        done = wait_until(lambda: phase_is(cluster, "default", "once", "Succeeded"), "pod once to succeed")
        ip = done["status"]["podIP"]
        assert ip.startswith("127.") and not ip.startswith("127.0.0.") and done["status"]["hostIP"] == "127.0.0.1"
        assert cluster.kubectl("logs", "once").stdout == f"{ip}\n"
        with pytest.raises(ClusterError, match="network faults need a network per node; this cluster runs in "
                                               "loopback mode"):
            cluster.partition("local-0")
        with pytest.raises(ClusterError, match="network faults need a network per node"):
            cluster.heal("local-0")
    finally:
        cluster.down()


def test_the_namespace_mode_without_rights_names_what_is_missing_and_makes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a user other than root (this process's uid as the rights check reads it)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    target = tmp_path / "never"
    with pytest.raises(ClusterError, match=re.escape(
            "network: netns asked for, but network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); this "
            "process runs as uid 1000; use network loopback (--network loopback) or auto")):
        LocalCluster.up(target, nodes=1, etcd=False, settings=LocalClusterSettings(network="netns"))
    assert not target.exists(), "nothing is made"


def test_without_rights_auto_falls_back_to_loopback_and_says_why(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    network, info = asyncio.run(make_network(tmp_path, ["local-0"], LocalClusterSettings(network="auto")))
    assert network is None
    assert info == {"mode": "loopback", "reason": "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); "
                                                  "this process runs as uid 1000"}
    assert list(tmp_path.iterdir()) == []


def test_up_says_once_which_network_the_cluster_has() -> None:
    from stalwart.cli.local import network_line

    assert network_line({"mode": "netns", "subnet": "10.200.0.0/16", "bridge": "stw200br"}) == (
        "network: a namespace per node on 10.200.0.0/16 (bridge stw200br); network faults: stalwart local "
        "partition/heal")
    assert network_line({"mode": "loopback", "reason": "asked for (network: loopback)"}) == (
        "network: loopback, every pod on this machine's 127/8 (asked for (network: loopback)); partition/heal need "
        "a network per node (root)")


@pytest.mark.parametrize("mode", ["netns", "loopback"])
def test_node_loss_and_the_paused_partition_behave_alike_in_both_network_modes(tmp_path: Path, mode: str) -> None:
    """The node faults that predate the network per node, in each mode on a cluster of its own: a node paused
    (lose-node --partition) stops its pod's process and turns Unknown, and on restore the process runs on; a node
    lost kills it, and the returning kubelet starts it again."""
    if mode == "netns" and missing_rights() is not None:
        pytest.skip(f"needs root to make network namespaces: {missing_rights()}")
    cluster = LocalCluster.up(tmp_path / "c", nodes=2, etcd=False, owner_pid=os.getpid(),
                              settings=LocalClusterSettings(network=mode,
                                                            node_monitor_grace_period=1.0))
    try:
        assert cluster.network["mode"] == mode
        ticks = tmp_path / "ticks"
        script = (f"import pathlib, time\nout = pathlib.Path({str(ticks)!r})\nn = 0\n"
                  "while True:\n    n += 1; out.with_suffix('.tmp').write_text(str(n))\n"
                  "    out.with_suffix('.tmp').replace(out); time.sleep(0.05)\n")
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ticker"}, "spec": {
            "nodeName": "local-1", "containers": [{"name": "c", "image": "python",
                                                   "command": [sys.executable, "-c", script]}]}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
        first = wait_until(lambda: (p := get_json(cluster, "pod", "ticker"))["status"].get("containerStatuses")
                           and p["status"]["phase"] == "Running" and p, "the pod to run")
        pid = main_pid(first)
        wait_until(lambda: ticks.exists() and int(ticks.read_text() or 0) > 0, "the pod to tick")

        assert cluster.lose_node("local-1", partition=True) == ["default/ticker"]
        assert process_state(pid) == "T"  # paused, not killed
        wait_until(lambda: ready_condition(cluster, "local-1") == "Unknown", "local-1 to turn Unknown", timeout=30)
        paused = int(ticks.read_text())
        cluster.restore_node("local-1")
        wait_until(lambda: int(ticks.read_text()) > paused, "the paused process to tick again")
        assert not ended(pid) and ready_condition(cluster, "local-1") == "True"

        assert cluster.lose_node("local-1") == ["default/ticker"]
        wait_until(lambda: ended(pid), "the lost node's process to end", timeout=10)
        cluster.restore_node("local-1")
        again = wait_until(lambda: (p := get_json(cluster, "pod", "ticker"))["status"].get("containerStatuses")
                           and p["status"]["containerStatuses"][0].get("restartCount") == 1 and p,
                           "the returning kubelet to start the container again", timeout=30)
        assert again["status"]["phase"] == "Running"
    finally:
        cluster.down()
