"""``stalwart local up|down|status|lose-node|restore-node|partition|heal|kubeconfig --dir DIR``: the local cluster for
development, CI and the demo (a Kubernetes API emulator, a process kubelet and a real etcd; a network namespace per
node where this machine allows, else all on loopback)."""

from __future__ import annotations

import argparse
import json
import sys
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
    for name, field in _SETTINGS_FLAGS.items():
        metavar = "QUANTITY" if field in ("node_cpu", "node_memory") else "MODE" if field == "network" \
            else "SECONDS" if "seconds" in field or "period" in field else "N"
        up.add_argument(name, dest=field, default=None, metavar=metavar, help=_settings_help(field))
    up.set_defaults(func=cmd_up)
    add("down", "stop the local cluster and everything it started").set_defaults(func=cmd_down)
    status = add("status", "show whether the local cluster runs, and where")
    status.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text",
                        help="output format (default text)")
    status.set_defaults(func=cmd_status)
    lose = add("lose-node", "lose a node as a real cluster does: its kubelet stops reporting, its processes are "
                            "killed (or, with --partition, paused)")
    lose.add_argument("node", help="node name, e.g. local-1")
    lose.add_argument("--partition", action="store_true",
                      help="pause the node's processes (SIGSTOP) instead of killing them: they live on, cut off, "
                           "until restore-node resumes them")
    lose.set_defaults(func=cmd_lose)
    config = add("kubeconfig", "print a kubeconfig for a ServiceAccount (a token the API server issues)")
    config.add_argument("--service-account", required=True, metavar="NAMESPACE/NAME",
                        help="the ServiceAccount to authenticate as, e.g. stalwart-system/stalwart-operator")
    config.add_argument("--duration", type=int, default=3600,
                        help="seconds the token is valid (600 to 2^32, default 3600)")
    config.set_defaults(func=cmd_kubeconfig)
    restore = add("restore-node", "bring a lost node back (paused processes resume, its kubelet reports again)")
    restore.add_argument("node", help="node name, e.g. local-1")
    restore.set_defaults(func=cmd_restore)
    part = add("partition", "cut a node's network (its processes run on): from everything, or --from some of "
                            "etcd, api and other nodes (needs the network per node: root)")
    part.add_argument("node", help="node name, e.g. local-1")
    part.add_argument("--from", dest="from_", default=None, metavar="TARGET,...",
                      help="cut only these: etcd, api, node names (default: everything)")
    part.set_defaults(func=cmd_partition)
    heal = add("heal", "end a node's network cut")
    heal.add_argument("node", help="node name, e.g. local-1")
    heal.set_defaults(func=cmd_heal)


#: ``stalwart local up`` flags -> LocalClusterSettings fields.
_SETTINGS_FLAGS = {
    "--node-cpu": "node_cpu", "--node-memory": "node_memory", "--node-gpus": "node_gpus",
    "--node-pods": "node_pods", "--node-monitor-grace-period": "node_monitor_grace_period",
    "--default-not-ready-toleration-seconds": "default_not_ready_toleration_seconds",
    "--default-unreachable-toleration-seconds": "default_unreachable_toleration_seconds",
    "--network": "network",
}


def _settings_help(field: str) -> str:
    from stalwart.local.settings import LocalClusterSettings

    info = LocalClusterSettings.model_fields[field]
    return f"{info.description} (default {info.default})"


def _settings(args: argparse.Namespace) -> Any:
    """The LocalClusterSettings the flags ask for; ValueError naming the flag when one is wrong."""
    from pydantic import ValidationError

    from stalwart.local.settings import LocalClusterSettings

    given = {field: getattr(args, field) for field in _SETTINGS_FLAGS.values() if getattr(args, field) is not None}
    try:
        return LocalClusterSettings.model_validate(given)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else ""
        flag = next((f for f, name in _SETTINGS_FLAGS.items() if name == field), field)
        raise ValueError(f"{flag}: {err['msg']} (got {err.get('input')!r})") from None


def cmd_up(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster

    if args.nodes < 1:
        print("--nodes: expected at least 1", file=sys.stderr)
        return 2
    try:
        settings = _settings(args)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    # Starting takes up to a minute (etcd, the API server, the nodes): say so before waiting.
    print(f"starting a local cluster in {args.dir} ({args.nodes} nodes; waiting up to {args.timeout:g}s for it "
          f"to serve)...", file=sys.stderr, flush=True)
    try:
        c = LocalCluster.up(args.dir, nodes=args.nodes, port=args.port, timeout=args.timeout, settings=settings)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"local cluster is up: API {c.api_url}, etcd {c.etcd_endpoint}, nodes {', '.join(c.nodes)}")
    print(network_line(c.network))
    print("use it with:")
    print(f"  export KUBECONFIG={c.kubeconfig}")
    if c.etcd_endpoint:
        print(f"  export STALWART_ETCD_ENDPOINTS={c.etcd_endpoint}")
    print("  kubectl get nodes")
    print(f"stop it with: stalwart local down --dir {args.dir}")
    return 0


def network_line(network: dict[str, Any]) -> str:
    """What ``up`` says, once, of the cluster's network."""
    if network.get("mode") == "netns":
        return (f"network: a namespace per node on {network.get('subnet')} (bridge {network.get('bridge')}); "
                f"network faults: stalwart local partition/heal")
    return (f"network: loopback, every pod on this machine's 127/8 ({network.get('reason', 'no reason given')}); "
            f"partition/heal need a network per node (root)")


def cmd_down(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import (
        ClusterError,
        LocalCluster,
        kill_leftover_containers,
        remove_leftover_network,
        stop_process,
    )

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
            remove_leftover_network(Path(args.dir))
        print(f"{exc}; nothing to stop")
        return 0
    c.down()
    print(f"local cluster in {c.dir} stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster

    try:
        info = LocalCluster.attach(args.dir).status()
    except ClusterError as exc:
        print(f"not running: {exc}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps(info, indent=2))
    elif args.output == "yaml":
        import yaml

        print(yaml.safe_dump(json.loads(json.dumps(info)), sort_keys=False), end="")
    else:
        print(status_text(info))
    return 0


def status_text(info: dict[str, Any]) -> str:
    """``stalwart local status``'s lines: where the cluster is, then its fields (nested ones flattened)."""
    lines = [f"local cluster in {info.get('dir')}: {'ready' if info.get('ready') else 'not ready'}"]
    for key, value in info.items():
        if key in ("dir", "ready"):
            continue
        if isinstance(value, dict):
            lines += [f"  {key}.{k}: {v}" for k, v in value.items()]
        elif isinstance(value, list):
            lines.append(f"  {key}: {', '.join(str(v) for v in value) or '-'}")
        else:
            lines.append(f"  {key}: {value}")
    return "\n".join(lines)


def cmd_lose(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster

    try:
        cluster = LocalCluster.attach(args.dir)
        pods = cluster.lose_node(args.node, partition=args.partition)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    how = "partitioned (its processes are paused)" if args.partition else "lost (its processes are killed)"
    print(f"node {args.node} {how}; its pods: {', '.join(pods) or 'none'}")
    print(f"the node turns Unknown after {cluster.settings.node_monitor_grace_period:g}s without heartbeats; "
          f"its pods are evicted after their tolerationSeconds; bring it back with: stalwart local restore-node "
          f"--dir {args.dir} {args.node}")
    return 0


def cmd_kubeconfig(args: argparse.Namespace) -> int:
    import yaml

    from stalwart.local.cluster import ClusterError, LocalCluster

    namespace, slash, name = str(args.service_account).partition("/")
    if not slash or not namespace or not name:
        print(f"--service-account: expected NAMESPACE/NAME, got {args.service_account!r}", file=sys.stderr)
        return 2
    try:
        config = LocalCluster.attach(args.dir).service_account_kubeconfig(namespace, name, args.duration)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster

    try:
        LocalCluster.attach(args.dir).restore_node(args.node)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"node {args.node} is back; it reports Ready again")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster

    targets = None if args.from_ is None else [t.strip() for t in str(args.from_).split(",")]
    try:
        cluster = LocalCluster.attach(args.dir)
        pods = cluster.partition(args.node, targets)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    what = "everything" if targets is None else ", ".join(targets)
    print(f"node {args.node} cut from {what}; its processes run on; its pods: {', '.join(pods) or 'none'}")
    if targets is None or "api" in targets:
        print(f"its kubelet no longer reaches the API server: the node turns Unknown after "
              f"{cluster.settings.node_monitor_grace_period:g}s")
    print(f"heal it with: stalwart local heal --dir {args.dir} {args.node}")
    return 0


def cmd_heal(args: argparse.Namespace) -> int:
    from stalwart.local.cluster import ClusterError, LocalCluster

    try:
        was = LocalCluster.attach(args.dir).heal(args.node)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"node {args.node} healed (it was cut from {was})")
    return 0
