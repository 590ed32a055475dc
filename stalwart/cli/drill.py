"""``stalwart drill JOB``: inject faults into a running TrainingJob and show how it recovers (see
:mod:`stalwart.drill`). Exit code: 0 every fault recovered; 1 the job failed or a fault did not recover within
``--timeout``; 2 the drill could not run (bad arguments, no such job, a request refused)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from stalwart.api import pod_env
from stalwart.drill.core import ALL_KINDS, PARTITION_KINDS


def register(sub: Any) -> None:
    p = sub.add_parser(
        "drill", help="inject faults into a running job and show how it recovers",
        description="A fault drill against your own TrainingJob, on any cluster: pod delete and force delete "
                    "through the Kubernetes API; rank exception, SIGKILL and hang through the job's agents "
                    "(only when the job sets spec.faultInjection.enabled: true; requests are signed with the "
                    "job's Secret). After each fault it waits for the next completed step and prints a row: "
                    "fault, target, seconds to recovery, steps recomputed, what the status said.")
    p.add_argument("job", help="the TrainingJob's name")
    p.add_argument("-n", "--namespace", default=None,
                   help="its namespace (default: the kubeconfig's current context's, else default)")
    p.add_argument("--faults", type=int, default=5, help="how many faults, one after another (default 5)")
    p.add_argument("--kinds", default=",".join(ALL_KINDS),
                   help=f"comma-separated fault kinds to draw from (default: all of {', '.join(ALL_KINDS)}); on "
                        f"a `stalwart local` cluster with a network per node also {', '.join(PARTITION_KINDS)} "
                        "(a member's node cut from everything, etcd, the API server or another member's node "
                        "while its processes run on, healed after --heal-after; needs --local-dir)")
    p.add_argument("--local-dir", default=None,
                   help="the directory of the `stalwart local` cluster the job runs on (`stalwart local up --dir`): "
                        "the partition kinds cut its nodes' networks")
    p.add_argument("--heal-after", type=float, default=10.0,
                   help="seconds a partition kind holds its cut before it heals it (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random order and targets (default 0)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a fault may take to recover before the drill fails (default 300)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--etcd-endpoints", default=os.environ.get(pod_env.ETCD_ENDPOINTS, ""),
                   help="the job's etcd, host:port,... (default: the job's spec.rendezvous.endpoints, else "
                        "$STALWART_ETCD_ENDPOINTS)")
    p.add_argument("--etcd-tls", action="store_true",
                   help="speak TLS to etcd even where the job does not say so (the job's tls, an https:// "
                        "endpoint or a ca.crt in its Secret already do); never falls back to plaintext")
    p.set_defaults(func=run)


def context_namespace(kubeconfig: str | None) -> str:
    """The namespace of the kubeconfig's current context, as kubectl takes it; ``default`` where it names none."""
    from kubernetes import config as kconfig

    loader: Any = kconfig
    try:
        _, active = loader.list_kube_config_contexts(config_file=kubeconfig)
    except (loader.ConfigException, OSError):  # run() loaded it first; a context without one is kubectl's default
        return "default"
    return str((active or {}).get("context", {}).get("namespace") or "default")


class LocalPartitioner:
    """The partition kinds' cuts on a `stalwart local` cluster, its errors as the drill's (naming what is
    wrong)."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def partition(self, node: str, from_: list[str] | None = None) -> list[str]:
        from stalwart.drill.session import DrillError
        from stalwart.local.cluster import ClusterError

        try:
            pods: list[str] = self.cluster.partition(node, from_)
        except ClusterError as e:
            raise DrillError(f"partition {node}: {e}") from None
        return pods

    def heal(self, node: str) -> str:
        from stalwart.drill.session import DrillError
        from stalwart.local.cluster import ClusterError

        try:
            return str(self.cluster.heal(node))
        except ClusterError as e:
            raise DrillError(f"heal {node}: {e}") from None


def local_partitioner(directory: str) -> LocalPartitioner:
    """The cuts of the local cluster in ``directory``; ValueError naming ``--local-dir`` when none runs there or
    it has no network per node."""
    from stalwart.local.cluster import ClusterError, LocalCluster

    try:
        cluster = LocalCluster.attach(directory)
    except ClusterError as e:
        raise ValueError(f"--local-dir: {e}") from None
    if cluster.network.get("mode") != "netns":
        raise ValueError(f"--local-dir: the partition kinds need a network per node; the cluster in {directory} "
                         f"runs in {cluster.network.get('mode')} mode ({cluster.network.get('reason', '')})")
    return LocalPartitioner(cluster)


def run(args: argparse.Namespace) -> int:
    from kubernetes import client
    from kubernetes import config as kconfig

    from stalwart.drill.core import check_partitions, parse_kinds, plan
    from stalwart.drill.session import DrillError, DrillOptions, DrillSession

    try:
        kinds = plan(args.faults, parse_kinds(args.kinds), args.seed)
        check_partitions(kinds, args.local_dir, args.heal_after)
        options = DrillOptions(timeout=args.timeout, heal_after=args.heal_after)
        cuts = args.local_dir and any(k in PARTITION_KINDS for k in kinds)
        partitioner = local_partitioner(args.local_dir) if cuts else None
    except ValueError as e:
        print(f"stalwart drill: {e}", file=sys.stderr)
        return 2
    cfg = client.Configuration()
    loader: Any = kconfig
    try:
        loader.load_kube_config(config_file=args.kubeconfig, client_configuration=cfg)
    except Exception as e:
        print(f"stalwart drill: --kubeconfig: cannot load it: {e}", file=sys.stderr)
        return 2
    args.namespace = args.namespace or context_namespace(args.kubeconfig)
    endpoints = [e for e in args.etcd_endpoints.split(",") if e.strip()]
    api = client.ApiClient(cfg)
    session = DrillSession(api, args.namespace, args.job, endpoints, options, etcd_tls=args.etcd_tls,
                           partitioner=partitioner)
    try:
        session.connect()
        print(f"drill of trainingjob {args.namespace}/{args.job}: {args.faults} fault(s) "
              f"({', '.join(dict.fromkeys(kinds))}), seed {args.seed}", flush=True)
        rows = session.run(kinds, args.seed)
    except DrillError as e:
        print(f"stalwart drill: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        session.close()
        api.close()  # type: ignore[no-untyped-call]
    final = session.status() if session.uid else {}
    recovered = [r for r in rows if r.recovery is not None]
    if recovered:
        mean = sum(r.recovery.seconds for r in recovered if r.recovery) / len(recovered)
        print(f"{len(recovered)} of {len(kinds)} fault(s) recovered; mean time to recovery {mean:.1f}s", flush=True)
    if len(recovered) < len(kinds) or final.get("phase") == "Failed":
        print(f"stalwart drill: the job did not recover (it is {final.get('phase', '?')})", file=sys.stderr)
        return 1
    return 0
