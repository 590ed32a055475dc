"""``stalwart operator``: run the TrainingJob operator (kopf) until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
from typing import TYPE_CHECKING, Any

from stalwart import exits

if TYPE_CHECKING:
    from stalwart.operator.pod_defaults import PodSecurity

log = logging.getLogger(__name__)

#: Seconds the operator has from SIGTERM (what a Deployment's rollout sends) to be gone: within the chart's
#: terminationGracePeriodSeconds (30), so that it ends its own way, its streams closed, before the SIGKILL.
OPERATOR_EXIT_BOUND = 20.0

#: Kept here (not imported from the operator package) so that ``stalwart --help`` stays light.
AGENT_COMMAND_DEFAULT = ("stalwart", "agent", "--")


def _endpoints(text: str) -> tuple[str, ...]:
    from stalwart.api.spec import endpoint_problem

    items = tuple(e.strip() for e in text.split(",") if e.strip())
    for item in items:
        problem = endpoint_problem(item)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"--etcd-endpoints: {problem}")
    return items


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1..65535, got {text!r}")
    return int(text)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def register(sub: Any) -> None:
    p = sub.add_parser("operator", help="run the TrainingJob operator",
                       description="Run the TrainingJob operator (kopf) until SIGINT/SIGTERM.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="serve TrainingJobs of this namespace (repeatable); default: all namespaces")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="serve every namespace (default)")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME",
                         help="coordinate with other replicas through the kopf peering object NAME "
                              "(one replica works, the others stand by)")
    peering.add_argument("--standalone", action="store_true",
                         help="run without peering (the only replica; the default)")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority (default: random, so that exactly one replica works)")
    p.add_argument("--etcd-endpoints", type=_endpoints, metavar="HOST:PORT[,...]",
                   default=_endpoints(os.environ.get("STALWART_DEFAULT_ETCD_ENDPOINTS", "")),
                   help="etcd for jobs whose spec.rendezvous.endpoints is empty "
                        "(default: $STALWART_DEFAULT_ETCD_ENDPOINTS)")
    p.add_argument("--etcd-secret-dir", default=os.environ.get("STALWART_ETCD_SECRET_DIR") or None, metavar="DIR",
                   help="the operator's etcd credentials for the default etcd, one file per key: ca.crt, "
                        "tls.crt, tls.key, username, password (default: $STALWART_ETCD_SECRET_DIR)")
    p.add_argument("--etcd-tls", action="store_true",
                   default=os.environ.get("STALWART_ETCD_TLS", "").lower() in ("1", "true"),
                   help="connect to the default etcd over TLS with the CA in --etcd-secret-dir")
    p.add_argument("--job-etcd-users", action="store_true",
                   default=os.environ.get("STALWART_JOB_ETCD_USERS", "").lower() in ("1", "true"),
                   help="give each job on the default etcd an etcd user and role limited to its key prefix "
                        "(etcd authentication on; the operator's login must be an etcd administrator)")
    p.add_argument("--etcd-enable-auth", action="store_true",
                   default=os.environ.get("STALWART_ETCD_ENABLE_AUTH", "").lower() in ("1", "true"),
                   help="when the default etcd's authentication is off, turn it on, creating its root user with "
                        "the root login in --etcd-secret-dir (how the chart secures its bundled etcd)")
    p.add_argument("--adoption-key-file", metavar="FILE",
                   default=os.environ.get("STALWART_ADOPTION_KEY_FILE") or None,
                   help="the key (at least 32 bytes) of the mark the operator puts on each job's Secret; a Secret "
                        "found in place of one it meant to create is adopted only with that mark. The same for "
                        "every replica and across restarts (the chart keeps one in a Secret of its namespace); "
                        "default: $STALWART_ADOPTION_KEY_FILE, else a key drawn for this run only")
    p.add_argument("--kubeconfig", default=None,
                   help="kubeconfig file (default: in-cluster service account, else $KUBECONFIG)")
    p.add_argument("--health-port", type=_port, default=8080,
                   help="port of the health endpoint /healthz for probes (default 8080)")
    p.add_argument("--health-host", default="0.0.0.0", help="address the health endpoint binds (default all)")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="serve Prometheus metrics on this port (default: off)")
    p.add_argument("--agent-metrics-port", type=_port, default=None,
                   help="have every job's agents serve their Prometheus metrics on this port of their pod, a "
                        "container port named agent-metrics (default: off)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="Kubernetes API calls in flight at most (default 16)")
    p.add_argument("--agent-command", default=" ".join(AGENT_COMMAND_DEFAULT), metavar="CMD",
                   help="entrypoint prefix put before the user's command in every pod (default: "
                        f"{' '.join(AGENT_COMMAND_DEFAULT)!r}; an empty string runs the command bare, which only "
                        "tests of the operator itself want)")
    p.add_argument("--gang-scheduler", choices=["volcano", "coscheduling"], default=None,
                   help="create a PodGroup per job (minMember = minReplicas) for this gang scheduler and point "
                        "the job's pods at it (default: none; the operator's own gang start still applies)")
    p.add_argument("--pod-security", choices=["restricted", "baseline", "off"],
                   default=os.environ.get("STALWART_POD_SECURITY") or None,
                   help="the Pod Security Standards level job templates are held to (with the operator's defaults "
                        "filled in): a job whose pods would break it fails with an InvalidSpec condition naming the "
                        "field (default: restricted; $STALWART_POD_SECURITY)")
    p.add_argument("--restrict-pod-security", action=argparse.BooleanOptionalAction, default=None,
                   help="the former switch: --restrict-pod-security is --pod-security=restricted, "
                        "--no-restrict-pod-security is --pod-security=off ($STALWART_RESTRICT_POD_SECURITY)")
    p.add_argument("--status-interval", type=_positive, default=1.0,
                   help="at most one status patch per job per this many seconds (default 1)")
    p.set_defaults(func=run)


def pod_security_level(level: str | None, restrict: bool | None, restrict_env: str | None) -> PodSecurity:
    """The Pod Security Standards level from ``--pod-security`` and the former ``--[no-]restrict-pod-security``
    (or its variable): restricted when neither says; a contradiction is an error."""
    from stalwart.operator.pod_defaults import PodSecurity

    if restrict is None and restrict_env is not None:
        restrict = restrict_env.lower() in ("1", "true")
    legacy = None if restrict is None else PodSecurity.RESTRICTED if restrict else PodSecurity.OFF
    chosen = None if level is None else PodSecurity(level)
    if chosen is not None and legacy is not None and (chosen == PodSecurity.OFF) != (legacy == PodSecurity.OFF):
        raise ValueError(f"--pod-security={chosen.value} contradicts "
                         f"--{'' if restrict else 'no-'}restrict-pod-security")
    return chosen or legacy or PodSecurity.RESTRICTED


def run(args: argparse.Namespace) -> int:
    from stalwart.operator.handlers import OperatorRunConfig, kube_from_config, operate
    from stalwart.operator.model import ReconcileSettings

    if args.concurrency < 1:
        log.error("--concurrency: must be >= 1, got %d", args.concurrency)
        return 2
    from stalwart.etcd.client import CredentialsError, EtcdCredentials

    try:
        credentials = EtcdCredentials.from_dir(args.etcd_secret_dir, tls=args.etcd_tls) \
            if args.etcd_secret_dir else EtcdCredentials(tls=args.etcd_tls)
    except CredentialsError as e:
        log.error("--etcd-secret-dir: %s", e)
        return 2
    from stalwart.operator.job_login import JobClient

    try:  # the jobs' own client certificate, when etcd demands one (never the operator's: job_login)
        job_client = JobClient.from_dir(args.etcd_secret_dir)
    except (OSError, ValueError) as e:
        log.error("--etcd-secret-dir: %s", e)
        return 2
    if args.job_etcd_users and not credentials.user:
        log.error("--job-etcd-users: needs an etcd administrator login (username/password in --etcd-secret-dir)")
        return 2
    try:
        pod_security = pod_security_level(args.pod_security, args.restrict_pod_security,
                                          os.environ.get("STALWART_RESTRICT_POD_SECURITY"))
    except ValueError as e:
        log.error("%s", e)
        return 2
    from stalwart.operator.provenance import load_key

    try:
        adoption_key = load_key(args.adoption_key_file) if args.adoption_key_file else None
    except ValueError as e:
        log.error("%s", e)
        return 2
    config = OperatorRunConfig(
        adoption_key=adoption_key,
        etcd_credentials=credentials,
        job_etcd_users=args.job_etcd_users,
        job_client=job_client,
        etcd_enable_auth=args.etcd_enable_auth,
        namespaces=tuple(sorted(set(args.namespace))),
        default_endpoints=args.etcd_endpoints,
        settings=ReconcileSettings(status_interval=args.status_interval,
                                   pod_security=pod_security),
        concurrency=args.concurrency,
        peering=args.peering,
        priority=args.priority,
        health_endpoint=f"http://{args.health_host}:{args.health_port}/healthz",
        agent_command=tuple(shlex.split(args.agent_command)),
        gang_scheduler=args.gang_scheduler,
        agent_metrics_port=args.agent_metrics_port,
    )
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
        log.info("metrics on :%d/metrics", args.metrics_port)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_stop() -> None:
            exits.decided(0, bound=OPERATOR_EXIT_BOUND)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_stop)
        kube = kube_from_config(args.kubeconfig, args.concurrency)
        try:
            await operate(config, kube, stop_flag=stop)
        finally:
            kube.close()

    asyncio.run(main())
    return 0
