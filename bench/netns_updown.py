"""What a network per node costs a local cluster's ``up`` and ``down``, against the loopback mode (the anchor),
and what starting a pod costs in each (its address on the node's interface, its namespaces entered).

Each round brings a cluster of ``--nodes`` nodes up and down in each mode, in alternating order, and starts
one pod that exits at once; one JSON object per round and mode, then one per mode with the medians and the
ratio of the network mode's to loopback's. ``up`` is from the call to the API serving (etcd, the API server and
the nodes included), ``down`` to every process and the network gone; ``pod`` from ``kubectl apply`` to the pod
Succeeded (scheduling, the kubelet's start, a Python interpreter's start and exit, the status write).

Not charged: the pytest plugin's own work, and the cost each cut and heal adds (a few ``ip neigh`` requests,
one ``ip`` process per namespace touched). Needs root for the network mode.

Run: ``.venv/bin/python bench/netns_updown.py --rounds 5``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from stalwart.local.cluster import LocalCluster
from stalwart.local.settings import LocalClusterSettings

POD = """{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "once"}, "spec": {"nodeName": "local-1",
"restartPolicy": "Never", "containers": [{"name": "c", "image": "python", "command": [%s, "-c", "pass"]}]}}"""


def one(mode: str, nodes: int, directory: Path) -> dict[str, float | str]:
    t0 = time.monotonic()
    cluster = LocalCluster.up(directory, nodes=nodes, timeout=120.0,
                              settings=LocalClusterSettings(network=mode))  # type: ignore[arg-type]
    t1 = time.monotonic()
    try:
        got = cluster.network.get("mode")
        if got != mode:
            raise SystemExit(f"asked for {mode}, got {got}: {cluster.network.get('reason')}")
        cluster.kubectl("apply", "-f", "-", input=POD % json.dumps(sys.executable))
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            phase = cluster.kubectl("get", "pod", "once", "-o", "jsonpath={.status.phase}").stdout
            if phase in ("Succeeded", "Failed"):
                break
            time.sleep(0.02)
        else:
            raise SystemExit(f"{mode}: the pod did not end within 60 s")
        t2 = time.monotonic()
    finally:
        t3 = time.monotonic()
        cluster.down()
        t4 = time.monotonic()
    return {"mode": mode, "up_s": round(t1 - t0, 3), "pod_s": round(t2 - t1, 3), "down_s": round(t4 - t3, 3),
            "pod_phase": phase}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float | str]]] = {"netns": [], "loopback": []}
    with tempfile.TemporaryDirectory(prefix="stalwart-netns-bench-") as tmp:
        for r in range(args.rounds):
            order = ("netns", "loopback") if r % 2 == 0 else ("loopback", "netns")
            for mode in order:
                row = one(mode, args.nodes, Path(tmp) / f"{mode}-{r}")
                rows[mode].append(row)
                print(json.dumps({"round": r, "nodes": args.nodes, **row}), flush=True)
    med = {mode: {k: statistics.median(float(x[k]) for x in rs) for k in ("up_s", "pod_s", "down_s")}
           for mode, rs in rows.items()}
    for mode in ("netns", "loopback"):
        out: dict[str, object] = {"summary": mode, "rounds": args.rounds, "nodes": args.nodes,
                                  **{f"median_{k}": round(v, 3) for k, v in med[mode].items()}}
        if mode == "netns":
            out.update({f"ratio_{k}": round(v / med["loopback"][k], 2) for k, v in med[mode].items()})
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
