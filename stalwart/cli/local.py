"""``stalwart local up|down|status|lose-node|restore-node --dir DIR``: the local cluster for development, CI and
the demo (a Kubernetes API emulator, a process kubelet and a real etcd, all on loopback)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DEFAULT_DIR = ".local-cluster"


def register(sub: Any) -> None:
    local = sub.add_parser("local", help="run a local cluster (API emulator + process kubelet + etcd)")
    lsub = local.add_subparsers(dest="local_command", required=True, metavar="ACTION")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = lsub.add_parser(name, help=help_)
        p.add_argument("--dir", type=Path, default=Path(DEFAULT_DIR),
                       help=f"the cluster's state directory (default {DEFAULT_DIR})")
        return p

    up = add("up", "start a local cluster in the background and write DIR/kubeconfig")
    up.add_argument("--nodes", type=int, default=3, help="number of virtual nodes (default 3)")
    up.add_argument("--port", type=int, default=0, help="API port on 127.0.0.1 (default: a free one)")
    up.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to serve (default 60)")
    up.set_defaults(func=cmd_up)
    add("down", "stop the local cluster and everything it started").set_defaults(func=cmd_down)
    add("status", "show whether the local cluster runs, and where").set_defaults(func=cmd_status)
    lose = add("lose-node", "simulate losing a node: kill its processes, fail its pods")
    lose.add_argument("node", help="node name, e.g. local-1")
    lose.set_defaults(func=cmd_lose)
    restore = add("restore-node", "make a lost node Ready again")
    restore.add_argument("node", help="node name, e.g. local-1")
    restore.set_defaults(func=cmd_restore)


def cmd_up(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster

    if args.nodes < 1:
        print("--nodes: expected at least 1")
        return 2
    try:
        c = LocalCluster.up(args.dir, nodes=args.nodes, port=args.port, timeout=args.timeout)
    except ClusterError as exc:
        print(f"error: {exc}")
        return 1
    print(f"local cluster is up: API {c.api_url}, etcd {c.etcd_endpoint}, nodes {', '.join(c.nodes)}")
    print("use it with:")
    print(f"  export KUBECONFIG={c.kubeconfig}")
    if c.etcd_endpoint:
        print(f"  export STALWART_ETCD_ENDPOINTS={c.etcd_endpoint}")
    print("  kubectl get nodes")
    print(f"stop it with: stalwart local down --dir {args.dir}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster, kill_leftover_containers, stop_process

    try:
        c = LocalCluster.attach(args.dir)
    except ClusterError as exc:
        # Nothing serves, but a crashed control plane may have left processes: clean those up too.
        pid_file = Path(args.dir) / "controlplane.pid"
        text = pid_file.read_text().strip() if pid_file.exists() else ""
        if text.isdigit():
            stop_process(int(text), 5.0)
        if Path(args.dir).exists():
            kill_leftover_containers(Path(args.dir))
        print(f"{exc}; nothing to stop")
        return 0
    c.down()
    print(f"local cluster in {c.dir} stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster

    try:
        c = LocalCluster.attach(args.dir)
        print(json.dumps(c.status(), indent=2))
    except ClusterError as exc:
        print(f"not running: {exc}")
        return 1
    return 0


def cmd_lose(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster

    try:
        pods = LocalCluster.attach(args.dir).lose_node(args.node)
    except ClusterError as exc:
        print(f"error: {exc}")
        return 1
    print(f"node {args.node} lost; failed pods: {', '.join(pods) or 'none'}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster

    try:
        LocalCluster.attach(args.dir).restore_node(args.node)
    except ClusterError as exc:
        print(f"error: {exc}")
        return 1
    print(f"node {args.node} is Ready again")
    return 0
